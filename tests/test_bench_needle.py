"""Smoke test of `python -m vllm_kvprune.bench needle` on one short context (real model).

Checks what the bench reports, not how well the model retrieves: one answer per prompt and
engine, hits counted from the answers, the table and the plot written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_needle_bench_reports_every_answer(tmp_path):
    out = tmp_path / "needle.json"
    command = [sys.executable, "-m", "vllm_kvprune.bench", "needle", "--contexts", "1024", "--depths", "20", "80",
               "--budgets", "256", "--policies", "streaming", "paged_eviction", "--out", str(out)]
    finished = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document = json.loads(out.read_text())
    answers = document["results"]
    engines = {(a["policy"], a["budget"]) for a in answers}
    assert engines == {("none", None), ("streaming", 256), ("paged_eviction", 256)}
    assert len(answers) == 3 * 2
    for answer in answers:
        assert answer["hit"] == (str(answer["number"]) in answer["answer"])
        assert 900 < answer["prompt_tokens"] <= 1024
    assert document["table"]["rows"] and out.with_suffix(".png").stat().st_size > 0
