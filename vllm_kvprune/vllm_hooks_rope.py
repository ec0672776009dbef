"""The reads of vLLM's rotary embeddings, part of `vllm_hooks` (which re-exports them; read them
through it): the rotary embedding a layer applies, a rotation of cached keys by a shift of
positions (sink re-anchoring), and a rotation at positions' averaged angles (GVote's synthetic
queries). Each recomputes the layer's table in fp32 and applies it with vLLM's own
`RotaryEmbedding.forward_static`, so every RoPE style vLLM implements there is honoured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def layer_rope(model: Any, layer_name: str) -> Any | None:
    """The rotary embedding the layer's attention applies (the `rotary_emb` of the module
    that owns the attention layer, as vLLM's model files name it), or None."""
    parent = layer_name.rsplit(".", 1)[0]
    try:
        owner = model.get_submodule(parent)
    except AttributeError:
        return None
    return getattr(owner, "rotary_emb", None)


def rope_rotation(rope: Any) -> Callable[[Any, Any], Any] | None:
    """`rotate(keys [n, H, D], shifts [n])`: keys rotated forward by `shifts` positions with
    `rope`'s own table recomputed in fp32; None when `rope` is not a plain rotary embedding
    (a subclass that changes how positions apply, e.g. multimodal RoPE)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if not isinstance(rope, RotaryEmbedding) or type(rope).forward_native is not RotaryEmbedding.forward_native:
        return None
    table = rope._compute_cos_sin_cache().to(torch.float32)
    cos, sin = table.chunk(2, dim=-1)
    magnitude = torch.sqrt(cos * cos + sin * sin)
    if not torch.allclose(magnitude, torch.ones_like(magnitude), atol=1e-6):
        # YaRN scales its table by mscale, which the cached keys already carry once; moving a
        # key from position j to j + shift is the pure rotation R(shift).
        table = torch.cat([cos / magnitude, sin / magnitude], dim=-1)

    longest = table.shape[0] - 1
    tables = {table.device: table}  # the table on each device keys arrive on (a GPU's, once)

    def rotate(keys, shifts):
        on_device = tables.get(keys.device)
        if on_device is None:
            on_device = tables[keys.device] = table.to(keys.device)
        flat, shifts = keys.float().reshape(keys.shape[0], -1), shifts.to(keys.device, torch.int64)
        # A shift past the table (a stream longer than the model's positions: `positions: cache`
        # re-anchors sinks next to the window) is applied in parts within it; every RoPE here
        # has angles linear in the position, so rotations compose. Within the table: one part.
        while True:
            part = shifts.clamp(max=longest)
            flat, _ = RotaryEmbedding.forward_static(part, flat, None, rope.head_size, rope.rotary_dim, on_device,
                                                     rope.is_neox_style)
            shifts = shifts - part
            if not bool((shifts > 0).any()):
                return flat.view_as(keys).to(keys.dtype)

    return rotate


def rope_at_average(rope: Any, query: Any, first_position: int, count: int) -> Any:
    """`query [n, Hq, D]` rotated with `rope`'s cos and sin averaged over positions
    `first_position .. first_position + count - 1` (GVote's synthetic future queries), in
    the layer's own style; the table is recomputed in fp32 (scaled tables keep their scale,
    as real queries get it)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    table = rope._compute_cos_sin_cache().to(torch.float32)
    rows = torch.arange(first_position, first_position + count).clamp(max=table.shape[0] - 1)
    averaged = table[rows].mean(dim=0, keepdim=True)
    flat = query.float().reshape(query.shape[0], -1)
    rotated, _ = RotaryEmbedding.forward_static(torch.zeros(query.shape[0], dtype=torch.int64), flat, None,
                                                rope.head_size, rope.rotary_dim, averaged, rope.is_neox_style)
    return rotated.view_as(query)
