"""`positions: cache` by re-anchoring only the sink keys.

Keys are cached after RoPE at their original positions. In StreamingLLM's cache-position
semantics a query at cache index n attends to a window token at distance equal to the
difference of original positions (the window is contiguous), so only the sinks differ:
sink j must look as if it sat at position j + shift, where shift is the number of tokens
evicted so far. RoPE is a rotation, R(j + shift) = R(shift) R(j), so rotating the sink's
original key forward by `shift` gives exactly that, with no re-rotation of the window.
"""

from __future__ import annotations

from functools import lru_cache

import torch


class SinkRotator:
    """Rotates cached post-RoPE keys forward by a number of positions, with the model's RoPE."""

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict | None,
                 is_neox_style: bool = True) -> None:
        from vllm.model_executor.layers.rotary_embedding import get_rope

        self.rope = get_rope(head_size, max_position=max_position, rope_parameters=rope_parameters,
                             is_neox_style=is_neox_style, dtype=torch.float32)

    def rotate(self, keys: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
        """keys [n, H, D] rotated by shifts [n] positions (computed in fp32)."""
        num_tokens = keys.shape[0]
        rotated, _ = self.rope.forward_native(shifts.to(torch.int64), keys.float().reshape(num_tokens, -1).clone())
        return rotated.view_as(keys).to(keys.dtype)


@lru_cache(maxsize=4)
def rotator_for(head_size: int, max_position: int, rope_key: tuple | None) -> SinkRotator:
    rope_parameters = dict(rope_key) if rope_key is not None else None
    return SinkRotator(head_size, max_position, rope_parameters)


def rotator_from_model_config(model_config, head_size: int) -> SinkRotator:
    """The rotator matching the served model's RoPE (Llama-style neox rotation)."""
    hf_config = model_config.hf_text_config
    rope_parameters = getattr(hf_config, "rope_parameters", None)
    rope_key = None
    if rope_parameters:
        rope_key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope_parameters.items()))
    # Shifts never exceed the logical length, which vLLM bounds by max_model_len.
    max_position = max(getattr(hf_config, "max_position_embeddings", 0), model_config.max_model_len)
    return rotator_for(head_size, max_position, rope_key)
