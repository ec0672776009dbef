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

import functools
import os
from dataclasses import dataclass

import torch


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (set ``TRITON_INTERPRET=1`` before the
    kernel modules are imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class DeviceLimits:
    """What the GPU the kernels are compiled for allows them, where their tiles are chosen."""

    max_shared_bytes: int | None  # one block's shared memory (LDS on AMD); None: no limit known
    dot_precisions: tuple[str, ...]  # `tl.dot` input precisions its Triton backend accepts


# The interpreter without a named target: NVIDIA's precisions, no shared-memory limit (the
# choices the kernels had before the limits were read, tuned on an H100).
_INTERPRETER_LIMITS = DeviceLimits(None, ("ieee", "tf32", "tf32x3"))
# A GPU that is not here whose limits the kernels choose for instead (`set_target_gpu`).
_target_limits: DeviceLimits | None = None


def device_limits(device: torch.device | str | None = None) -> DeviceLimits:
    """The limits of the GPU `device`'s kernels compile for: those of the GPU `set_target_gpu`
    named, where it was called, else the running driver's (Triton's own answers: its backend's
    accepted precisions, the device's `max_shared_mem`), else none in the interpreter."""
    if _target_limits is not None:
        return _target_limits
    if interpreted():
        return _INTERPRETER_LIMITS
    index = torch.device(device).index if device is not None else None
    return _driver_limits(torch.cuda.current_device() if index is None else index)


def set_target_gpu(backend: str, arch: int | str, warp_size: int, max_shared_bytes: int) -> None:
    """From now on in this process, choose tiles and precisions as on this GPU (Triton's
    `backend` and `arch`, its warp size, one block's shared memory) instead of the running
    device's: how the compile check (tools/triton_targets.py) records, in the interpreter, the
    launches a GPU that is not here would get."""
    global _target_limits
    _target_limits = DeviceLimits(max_shared_bytes, _precisions(backend, arch, warp_size))


@functools.cache
def _driver_limits(index: int) -> DeviceLimits:
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    shared = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return DeviceLimits(int(shared), _precisions(target.backend, target.arch, target.warp_size))


def _precisions(backend: str, arch: int | str, warp_size: int) -> tuple[str, ...]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return tuple(make_backend(GPUTarget(backend, arch, warp_size)).parse_options({}).allowed_dot_input_precisions)


def dot_precision(cache_dtype: torch.dtype, limits: DeviceLimits) -> str:
    """``tl.dot``'s input precision: TF32 is exact for 16-bit cache values where the GPU has it
    (not AMD's CDNA2, gfx90a); fp32 caches, and GPUs without TF32, take IEEE."""
    return "tf32" if cache_dtype != torch.float32 and "tf32" in limits.dot_precisions else "ieee"


def fit_shared(tile: int, bytes_per_step: int, limits: DeviceLimits, least: int = 16) -> int:
    """`tile` (a power of two) halved until `tile * bytes_per_step` fits the GPU's shared
    memory (and no lower than `least`): a launch needing more shared memory than a block has
    fails on that GPU (Triton's OutOfResources), as fp32 key tiles did on AMD's 64 KiB."""
    if limits.max_shared_bytes is None:
        return tile
    while tile > least and tile * bytes_per_step > limits.max_shared_bytes:
        tile //= 2
    return tile


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
