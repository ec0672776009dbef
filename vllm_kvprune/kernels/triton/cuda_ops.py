"""The CUDA slot ops (``csrc/cuda/slot_ops.cu``, ``torch.ops.kvprune_cuda.*``): loading them, and
validating wrappers with the Triton ops' signatures and checks.

:func:`load_cuda_ops` makes the ops available: from the installed extension
``vllm_kvprune._cuda_C`` when ``setup.py`` built it, else (on a machine with a CUDA device,
a CUDA build of torch and nvcc, e.g. a GPU box with a source checkout and no installed
package) by JIT-compiling the source with ``torch.utils.cpp_extension.load``. The outcome is
remembered for the process; :func:`load_error` says why the ops are not available.
"""

from __future__ import annotations

import importlib
import logging
import shutil
from pathlib import Path

import torch

from vllm_kvprune.kernels.triton import slot_ops

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parents[3] / "csrc" / "cuda" / "slot_ops.cu"
_JIT_NAME = "kvprune_cuda_slot_ops"

_loaded: bool | None = None  # None until the first load_cuda_ops()
_load_error: str | None = None


def load_cuda_ops(build_dir: str | Path | None = None) -> bool:
    """Whether ``torch.ops.kvprune_cuda.{write_slots, read_slots, copy_slots}`` are available,
    loading or building them on the first call. ``build_dir`` is the JIT build directory
    (default: torch's extension cache). Never raises: a failed build returns False and its
    message is kept for :func:`load_error`."""
    global _loaded, _load_error
    if _loaded is not None:
        return _loaded
    _loaded, _load_error = _load(build_dir)
    if not _loaded:
        logger.info("CUDA slot ops unavailable: %s", _load_error)
    return _loaded


def load_error() -> str | None:
    """Why the last :func:`load_cuda_ops` found no ops (None if they loaded or it never ran)."""
    return _load_error


def can_jit_build() -> bool:
    """Whether this machine can JIT-build the ops: a CUDA device, a CUDA build of torch, nvcc,
    and the source file of a checkout."""
    return (torch.cuda.is_available() and torch.version.cuda is not None and _nvcc() is not None
            and _SOURCE.is_file())


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
        raise RuntimeError(f"the CUDA slot ops are not available: {_load_error}")
    return torch.ops.kvprune_cuda


def _registered() -> bool:
    try:
        torch.ops.kvprune_cuda.write_slots  # noqa: B018  (raises if the library is not loaded)
    except (AttributeError, RuntimeError):
        return False
    return True


def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _load(build_dir: str | Path | None) -> tuple[bool, str | None]:
    """(available, why not)."""
    if _registered():
        return True, None
    try:
        importlib.import_module("vllm_kvprune._cuda_C")
        return True, None
    except ImportError as error:
        installed = f"vllm_kvprune._cuda_C is not built ({error})"
    if not torch.cuda.is_available():
        return False, f"{installed}; no CUDA device to JIT-build for"
    if not can_jit_build():
        return False, f"{installed}; cannot JIT-build (needs a CUDA torch, nvcc and {_SOURCE})"
    from torch.utils.cpp_extension import load

    if build_dir is not None:
        Path(build_dir).mkdir(parents=True, exist_ok=True)
    try:
        load(name=_JIT_NAME, sources=[str(_SOURCE)], build_directory=None if build_dir is None else str(build_dir),
             extra_cuda_cflags=["-O3"], is_python_module=False, verbose=False)
    except Exception as error:  # a compiler error: report it, the caller falls back
        return False, f"JIT build of {_SOURCE} failed: {error}"
    if not _registered():
        return False, f"JIT build of {_SOURCE} loaded but registered no torch.ops.kvprune_cuda ops"
    return True, None
