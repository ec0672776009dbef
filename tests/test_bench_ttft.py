"""`python -m benchmarks ttft` end to end on the tiny model: every (policy, length) row
is there, measured (positive, one time per repeat), `none` is each length's 1.00x, and the
results page renders the table from the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

POLICIES = ("none", "h2o")  # h2o: the policy whose prefill does the most extra work
LENGTHS = (64, 200)


@pytest.mark.slow
def test_every_policy_and_length_is_timed(tmp_path) -> None:
    out = tmp_path / "ttft.json"
    command = [sys.executable, "-m", "benchmarks", "ttft", "--tiny", "--dtype", "float32",
               "--policies", *POLICIES, "--prompt-tokens", *map(str, LENGTHS), "--budget", "96", "--repeats", "2",
               "--out", str(out)]
    finished = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = {(row["policy"], row["prompt_tokens"]): row for row in document["results"]}
    assert set(rows) == {(policy, length) for policy in POLICIES for length in LENGTHS}
    for (policy, length), row in rows.items():
        assert len(row["ttft_ms_all"]) == 2 and all(ms > 0 for ms in row["ttft_ms_all"])
        assert row["vs_none"] == pytest.approx(row["ttft_ms"] / rows[("none", length)]["ttft_ms"])
        assert row["budget"] == (None if policy == "none" else 96)
    assert out.with_suffix(".png").stat().st_size > 0

    from benchmarks import results_papers, ttft

    section = results_papers.ttft_section(out, tmp_path)
    for line in ttft.table(document["results"])[1]:
        assert "| " + " | ".join(line) + " |" in section


def test_fdc_without_a_calibration_is_refused() -> None:
    finished = subprocess.run([sys.executable, "-m", "benchmarks", "ttft", "--policies", "fdc"],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0 and "--fdc FILE" in finished.stderr
