"""Tests only: a vLLM engine on this CPU running a GPU wrapper (`VLLM_KVPRUNE_TRITON_ON_CPU`).

Part of `vllm_hooks` (the vLLM internals these reach are named there, in `hook_contracts`),
kept apart because nothing here runs in a user's engine: with `VLLM_KVPRUNE_TRITON_ON_CPU=1`
the plugin registers the TRITON_ATTN wrapper in place of CPU_ATTN and vLLM's Triton kernels
run in Triton's interpreter (`TRITON_INTERPRET=1`); with `=FLASH_ATTN` the FLASH_ATTN wrapper,
vLLM's FlashAttention ops given by torch references (`kernels/flash_reference.py`).
"""

from __future__ import annotations

import importlib
import os

from vllm_kvprune.hook_contracts import _FLASH_ATTN


def prepare(backend: str) -> None:
    """Make vLLM's CPU build able to run `backend`'s classes on CPU tensors."""
    _interpret_vllm_triton_on_cpu()
    if backend == "FLASH_ATTN":
        _flash_attention_by_reference()


def wrapped_backend() -> str | None:
    """Tests only (`VLLM_KVPRUNE_TRITON_ON_CPU`): the GPU backend whose wrapper a CPU engine
    runs (`1`: TRITON_ATTN; `FLASH_ATTN`), None when unset."""
    asked = os.environ.get("VLLM_KVPRUNE_TRITON_ON_CPU", "")
    if asked in ("", "0"):
        return None
    if asked not in ("1", "TRITON_ATTN", "FLASH_ATTN"):
        raise RuntimeError(f"VLLM_KVPRUNE_TRITON_ON_CPU={asked}: expected 1, TRITON_ATTN or FLASH_ATTN")
    return "TRITON_ATTN" if asked == "1" else asked


def active() -> bool:
    """Tests only: a CPU engine runs a GPU wrapper (`wrapped_backend`)."""
    return wrapped_backend() is not None


def _flash_attention_by_reference() -> None:
    """Tests only: vLLM's CPU build has no FlashAttention ops (its FLASH_ATTN module imports
    them only on CUDA/XPU/ROCm) and reports no FA version. Give the module torch references
    of the two ops it calls and FA version 2 (no ahead-of-time schedule, FA3's only), so
    its builder and impl run on CPU tensors as on a GPU."""
    from vllm_kvprune.kernels.flash_reference import (
        flash_attn_varlen_reference,
        reshape_and_cache_flash_reference,
    )

    module = importlib.import_module(_FLASH_ATTN)
    module.flash_attn_varlen_func = flash_attn_varlen_reference
    module.reshape_and_cache_flash = reshape_and_cache_flash_reference
    module.get_flash_attn_version = lambda *args, **kwargs: 2


def _interpret_vllm_triton_on_cpu() -> None:
    """Tests only: vLLM's CPU build swaps Triton for a placeholder (Triton has no CPU
    backend) and its cache write asks CUDA for the device's capability (a tile-size choice).
    Give it the real Triton, which `TRITON_INTERPRET=1` runs on CPU tensors, and capability
    9.0 for CPU tensors."""
    import torch
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("VLLM_KVPRUNE_TRITON_ON_CPU=1 needs TRITON_INTERPRET=1")
    triton_utils = importlib.import_module("vllm.triton_utils")
    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
    real_capability = torch.cuda.get_device_capability

    def capability(device=None):
        if isinstance(device, torch.device) and device.type == "cpu":
            return (9, 0)
        return real_capability(device)

    torch.cuda.get_device_capability = capability
