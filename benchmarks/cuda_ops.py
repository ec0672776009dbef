"""The CUDA slot ops (``csrc/cuda/slot_ops.cu``, ``torch.ops.kvprune_cuda.*``): loading them, and
validating wrappers with the Triton ops' signatures and checks.

Serving never runs them (the GPU path writes, reads and copies slots with its Triton ops,
``vllm_kvprune/kernels/triton/slot_ops.py``): ``bench gpu-kernels`` times them against those,
and ``tests/test_triton_slot_ops.py`` checks them on a GPU. :func:`load_cuda_ops` makes the ops
available: from the extension ``vllm_kvprune._cuda_C`` when ``setup.py`` built it (only when
asked: ``KVPRUNE_CUDA_SLOT_OPS=1``), else (on a machine with a CUDA device, a CUDA build of
torch and nvcc) by JIT-compiling the source with ``torch.utils.cpp_extension.load``. The
outcome is remembered for the process; :func:`load_error` says why the ops are not available.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_kvprune.kernels.op_library import REPOSITORY, OpLibrary
from vllm_kvprune.kernels.triton import slot_ops

LIBRARY = OpLibrary("CUDA slot ops", module="vllm_kvprune._cuda_C", probe="kvprune_cuda.write_slots",
                    jit_name="kvprune_cuda_slot_ops", sources=[REPOSITORY / "csrc" / "cuda" / "slot_ops.cu"])


def load_cuda_ops(build_dir: str | Path | None = None) -> bool:
    """Whether ``torch.ops.kvprune_cuda.{write_slots, read_slots, copy_slots}`` are available,
    loading or building them on the first call. ``build_dir`` is the JIT build directory
    (default: torch's extension cache). Never raises: a failed build returns False and its
    message is kept for :func:`load_error`."""
    return LIBRARY.load(build_dir)


def load_error() -> str | None:
    """Why the last :func:`load_cuda_ops` found no ops (None if they loaded or it never ran)."""
    return LIBRARY.error


def can_jit_build() -> bool:
    """Whether this machine can JIT-build the ops: a CUDA device, a CUDA build of torch, nvcc,
    and the source file of a checkout."""
    return LIBRARY.can_jit_build()


def write_slots(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                *, check_range: bool = True) -> None:
    """:func:`slot_ops.write_slots` through the CUDA op (key/value may have any strides)."""
    slots = _checked(kv_cache, slots, "slots", check_range)
    for name, tokens in (("key", key), ("value", value)):
        slot_ops.check_tokens(tokens, name, kv_cache, slots.shape[0])
    _ops().write_slots(key, value, kv_cache, slots)


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, *,
               check_range: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`slot_ops.read_slots` through the CUDA op."""
    slots = _checked(kv_cache, slots, "slots", check_range)
    key, value = _ops().read_slots(kv_cache, slots)
    return key, value


def copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, *,
               check_range: bool = True) -> None:
    """:func:`slot_ops.copy_slots` through the CUDA op (staged: overlapping sets are safe)."""
    slot_ops.check_copy_pairs(src_slots, dst_slots)
    src_slots = _checked(kv_cache, src_slots, "src_slots", check_range)
    dst_slots = _checked(kv_cache, dst_slots, "dst_slots", check_range)
    _ops().copy_slots(kv_cache, src_slots, dst_slots)


def _checked(kv_cache: torch.Tensor, slots: torch.Tensor, name: str, check_range: bool) -> torch.Tensor:
    slot_ops.check_supported_cache(kv_cache)
    return slot_ops.checked_slots(slots, kv_cache, name, check_range)


def _ops():
    if not load_cuda_ops():
        raise RuntimeError(f"the CUDA slot ops are not available: {LIBRARY.error}")
    return torch.ops.kvprune_cuda
