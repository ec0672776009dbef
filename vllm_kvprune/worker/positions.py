"""`positions: cache` by re-anchoring only the sink keys.

Keys are cached after RoPE at their original positions. In StreamingLLM's cache-position
semantics a query at cache index n attends to a window token at distance equal to the
difference of original positions (the window is contiguous), so only the sinks differ:
sink j must look as if it sat at position j + shift, where shift is the number of tokens
evicted so far. RoPE is a rotation, R(j + shift) = R(shift) R(j), so rotating the sink's
original key forward by `shift` gives exactly that, with no re-rotation of the window.

The rotation is the layer's own: the rotary embedding vLLM built for that layer (its
style, NeoX or GPT-J, its rotary dimension for partial-rotary models, its scaling, and
its base, which differs between a hybrid model's local and global layers), with its
cos/sin table recomputed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_kvprune import vllm_hooks

Rotation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sink_rotation(model: torch.nn.Module, layer_name: str) -> tuple[Rotation | None, str | None]:
    """(rotate(keys [n, H, D], shifts [n]), None) for the attention layer `layer_name`, or
    (None, why) when its RoPE cannot be found or is not a plain rotation."""
    rope = vllm_hooks.layer_rope(model, layer_name)
    if rope is None:
        return None, "no rotary embedding found"
    rotation = vllm_hooks.rope_rotation(rope)
    if rotation is None:
        return None, f"{type(rope).__name__}"
    return rotation, None
