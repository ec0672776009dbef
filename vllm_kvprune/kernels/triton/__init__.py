"""Triton kernels of the GPU path, one module per hot path, each tested against the torch
reference the CPU path uses (`vllm_kvprune.kernels.reference`, the policies' own scorers,
`reduced_attention_reference`).

The cache they address is what vLLM 0.32's GPU backends (``TRITON_ATTN``, ``FLASH_ATTN``) hand a
layer: logical shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, K in the first
``head_size`` of the last dimension and V in the second, with either HND strides (contiguous)
or NHD strides (block, slot, head); kernels read the strides, so both work. Slot ``s`` is
offset ``s % block_size`` of block ``s // block_size``, as in vLLM's ``slot_mapping``; a
head-page ``p`` (budget-free policies) is KV head ``p % H`` of block ``p // H``.

Nothing here imports vLLM, so the kernels run and are timed on a machine with only PyTorch and
Triton. Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests run them on CPU: compute is done in fp32 after each load (the interpreter's bf16
arithmetic is not reliable), which is also what the kernels do on a GPU.
"""

from __future__ import annotations

import os

import torch


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (set ``TRITON_INTERPRET=1`` before the
    kernel modules are imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, num_kv_heads, block_size, head_size)`` of a GPU-layout layer cache whose
    innermost dimension is contiguous (HND or NHD strides)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2 or kv_cache.stride(-1) != 1:
        raise ValueError(
            "kv_cache must be [num_blocks, num_kv_heads, block_size, 2*head_size] with a contiguous "
            f"last dimension, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    num_blocks, num_heads, block_size, two_head_size = kv_cache.shape
    return num_blocks, num_heads, block_size, two_head_size // 2


def nhd_cache(num_blocks: int, num_heads: int, block_size: int, head_size: int, dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """An empty layer cache with NHD physical strides (block, slot, head), logical HND shape, as
    vLLM's GPU backends may allocate it."""
    physical = torch.empty(num_blocks, block_size, num_heads, 2 * head_size, dtype=dtype, device=device)
    return physical.transpose(1, 2)
