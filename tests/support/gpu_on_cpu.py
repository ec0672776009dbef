"""A vLLM engine on this CPU running a GPU wrapper (`KVPRUNE_TRITON_ON_CPU`), for the tests.

`install(backend)` has the plugin register that backend's wrapper in place of CPU_ATTN
(`vllm_hooks.run_gpu_wrapper_on_cpu`), after `prepare` has made vLLM's CPU build able to run the
backend's classes on CPU tensors: with TRITON_ATTN vLLM's Triton kernels and ours run in Triton's
interpreter (`TRITON_INTERPRET=1`); with FLASH_ATTN the FLASH_ATTN wrapper runs over torch
references of vLLM's FlashAttention ops (`flash_reference.py`), ours interpreted. Call it before
the process builds its first engine (tests/gpu_wrapper_run.py: `install_from_environment`); the
plugin runs `prepare` when it registers, once vLLM's front end is imported, as vLLM's CPU build
expects. The vLLM internals reached here are named in the package's `hook_contracts`.
"""

from __future__ import annotations

import importlib
import os

from vllm_kvprune import vllm_hooks
from vllm_kvprune.hook_contracts import _FLASH_ATTN

VARIABLE = "KVPRUNE_TRITON_ON_CPU"


def wrapped_backend() -> str | None:
    """The GPU backend `KVPRUNE_TRITON_ON_CPU` asks a CPU engine to run the wrapper of
    (`1`: TRITON_ATTN; `FLASH_ATTN`), None when unset."""
    asked = os.environ.get(VARIABLE, "")
    if asked in ("", "0"):
        return None
    if asked not in ("1", "TRITON_ATTN", "FLASH_ATTN"):
        raise RuntimeError(f"{VARIABLE}={asked}: expected 1, TRITON_ATTN or FLASH_ATTN")
    return "TRITON_ATTN" if asked == "1" else asked


def install_from_environment() -> str | None:
    """`install` the backend `KVPRUNE_TRITON_ON_CPU` names, if any; returns it."""
    backend = wrapped_backend()
    if backend is not None:
        install(backend)
    return backend


def install(backend: str) -> None:
    """The CPU engines this process builds from now on run `backend`'s GPU wrapper."""
    vllm_hooks.run_gpu_wrapper_on_cpu(backend, lambda: prepare(backend))


def prepare(backend: str) -> None:
    """Make vLLM's CPU build able to run `backend`'s classes on CPU tensors."""
    _interpret_vllm_triton_on_cpu()
    if backend == "FLASH_ATTN":
        _flash_attention_by_reference()


def _flash_attention_by_reference() -> None:
    """vLLM's CPU build has no FlashAttention ops (its FLASH_ATTN module imports them only on
    CUDA/XPU/ROCm) and reports no FA version. Give the module torch references of the two ops
    it calls and FA version 2 (no ahead-of-time schedule, FA3's only), so its builder and impl
    run on CPU tensors as on a GPU."""
    from support.flash_reference import flash_attn_varlen_reference, reshape_and_cache_flash_reference

    module = importlib.import_module(_FLASH_ATTN)
    module.flash_attn_varlen_func = flash_attn_varlen_reference
    module.reshape_and_cache_flash = reshape_and_cache_flash_reference
    module.get_flash_attn_version = lambda *args, **kwargs: 2


def _interpret_vllm_triton_on_cpu() -> None:
    """vLLM's CPU build swaps Triton for a placeholder (Triton has no CPU backend) and its cache
    write asks CUDA for the device's capability (a tile-size choice). Give it the real Triton,
    which `TRITON_INTERPRET=1` runs on CPU tensors, and capability 9.0 for CPU tensors."""
    import torch
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("a GPU wrapper on the CPU needs TRITON_INTERPRET=1 (set before Triton is imported)")
    triton_utils = importlib.import_module("vllm.triton_utils")
    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
    real_capability = torch.cuda.get_device_capability

    def capability(device=None):
        if isinstance(device, torch.device) and device.type == "cpu":
            return (9, 0)
        return real_capability(device)

    torch.cuda.get_device_capability = capability
