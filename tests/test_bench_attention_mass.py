"""`python -m benchmarks attention-mass` end to end on small shapes: every case (the prefill's
mass alone, mass and output, vLLM's attention; decode) and both dtypes are timed, the JSON names the build the times belong to, the plot is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_kvprune import kernels


def test_every_case_is_timed_and_the_build_is_named(tmp_path: Path) -> None:
    out = tmp_path / "attention_mass.json"
    finished = subprocess.run([sys.executable, "-m", "benchmarks", "attention-mass", "--prompt-tokens", "96",
                               "--batch", "3", "--keys", "80", "--repeats", "2", "--threads", "1", "--layers", "2",
                               "--held", "40", "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    document = json.loads(out.read_text())
    cases = {(row["case"], row["dtype"]): row for row in document["results"]}
    victims = {"victims, C++ op per request, 1 thread", "victims, torch ranking all requests at once"}
    kernel_cases = ("prefill, mass", "prefill, mass and output (fused)", "prefill, vLLM's attention", "decode")
    assert set(cases) == {(case, dtype) for case in kernel_cases for dtype in ("float32", "bfloat16")} | {
        (case, "float32") for case in victims}
    assert cases[("prefill, mass", "float32")]["queries"] == 96 and cases[("decode", "bfloat16")]["queries"] == 3
    assert all(row["median_ms"] > 0 for row in document["results"])
    assert document["settings"]["extension_isa"] == (kernels.extension_isa() or "torch fallback (no extension)")
    assert out.with_suffix(".png").stat().st_size > 0
