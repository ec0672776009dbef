"""Where CUTLASS's C++ headers are, for `setup.py`, the JIT build and the compile check.

Standard library only: `setup.py` loads this file by path, before the package (or torch) is
importable.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ENV_VARIABLE = "CUTLASS_INCLUDE_DIR"
HINT = f"pip install 'vllm-kvprune[gpu]' (the nvidia-cutlass package), or set {ENV_VARIABLE}"


def cutlass_include_dir() -> tuple[Path | None, str]:
    """(the folder holding ``cutlass/cutlass.h``, or None; where it was looked for)."""
    configured = os.environ.get(ENV_VARIABLE)
    if configured:
        folder = Path(configured)
        if (folder / "cutlass" / "cutlass.h").is_file():
            return folder, f"{ENV_VARIABLE}={configured}"
        return None, f"{ENV_VARIABLE}={configured} holds no cutlass/cutlass.h"
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        return None, f"CUTLASS's headers were not found ({HINT})"
    # nvidia-cutlass ships the C++ tree inside its cutlass_library package.
    folder = Path(spec.origin).parent / "source" / "include"
    if (folder / "cutlass" / "cutlass.h").is_file():
        return folder, f"nvidia-cutlass's {folder}"
    return None, f"the cutlass_library package has no {folder / 'cutlass' / 'cutlass.h'} ({HINT})"
