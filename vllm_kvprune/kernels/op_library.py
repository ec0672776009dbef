"""A CUDA op library of ours (``csrc/cuda``, ``csrc/cutlass``): the extension ``setup.py`` built,
else JIT-built from its sources with ``torch.utils.cpp_extension.load`` where this machine can
(a CUDA device, a CUDA build of torch, nvcc; e.g. a GPU box with a source checkout and no
installed package). Loaded once a process; never raises: :attr:`OpLibrary.error` says why not.
"""

from __future__ import annotations

import importlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

REPOSITORY = Path(__file__).resolve().parents[2]


def find_nvcc() -> str | None:
    """torch's CUDA_HOME's nvcc, else the first on PATH."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


@dataclass
class OpLibrary:
    """One library: ``module`` (what setup.py builds) registers ``probe`` (``namespace.op``);
    ``sources`` JIT-build the same ops under ``jit_name``. ``include_dirs`` answers the extra
    include folders the build needs, or None and why they are missing."""

    what: str  # for messages: "CUDA slot ops"
    module: str
    probe: str
    jit_name: str
    sources: list[Path]
    extra_cuda_cflags: list[str] = field(default_factory=lambda: ["-O3"])
    include_dirs: Callable[[], tuple[list[str] | None, str]] = lambda: ([], "")
    loaded: bool | None = field(default=None, init=False)  # None until the first load()
    error: str | None = field(default=None, init=False)

    def load(self, build_dir: str | Path | None = None) -> bool:
        """Whether the ops are available, loading or building them on the first call
        (``build_dir``: the JIT build folder, default torch's extension cache)."""
        if self.loaded is None:
            self.loaded, self.error = self._load(build_dir)
            if not self.loaded:
                logger.info("%s unavailable: %s", self.what, self.error)
        return self.loaded

    def can_jit_build(self) -> bool:
        """A CUDA device, a CUDA build of torch, nvcc, and the sources of a checkout."""
        return self.jit_missing() is None

    def jit_missing(self) -> str | None:
        """What this machine lacks to JIT-build the library (None: nothing)."""
        if not self.sources or not all(path.is_file() for path in self.sources):
            return (f"its sources are not beside the package ({self._where()}): "
                    "install from a checkout (pip install --no-build-isolation -e .)")
        if not torch.cuda.is_available():
            return "no CUDA device to JIT-build for"
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is not a CUDA build"
        if find_nvcc() is None:
            return "no nvcc (CUDA_HOME or PATH)"
        return None

    def registered(self) -> bool:
        namespace, name = self.probe.split(".")
        try:
            getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            return False
        return True

    def _load(self, build_dir: str | Path | None) -> tuple[bool, str | None]:
        if self.registered():
            return True, None
        try:
            importlib.import_module(self.module)
            return True, None
        except ImportError as error:
            installed = f"{self.module} is not built ({error})"
        if (missing := self.jit_missing()) is not None:
            return False, f"{installed}; cannot JIT-build it: {missing}"
        includes, missing = self.include_dirs()
        if includes is None:
            return False, f"{installed}; {missing}"
        from torch.utils.cpp_extension import load

        if build_dir is not None:
            Path(build_dir).mkdir(parents=True, exist_ok=True)
        try:
            load(name=self.jit_name, sources=[str(path) for path in self.sources], extra_include_paths=includes,
                 build_directory=None if build_dir is None else str(build_dir),
                 extra_cuda_cflags=self.extra_cuda_cflags, is_python_module=False, verbose=False)
        except Exception as error:  # a compiler error: report it, the caller keeps its torch path
            return False, f"JIT build of {self._where()} failed: {error}"
        if not self.registered():
            return False, f"JIT build of {self._where()} loaded but registered no torch.ops.{self.probe}"
        return True, None

    def _where(self) -> str:
        """The source file, or the folders of several."""
        if len(self.sources) == 1:
            return str(self.sources[0])
        return ", ".join(sorted({str(path.parent) for path in self.sources}))
