"""`python -m vllm_kvprune.bench tpot` end to end on the tiny model: every policy timed in an
engine of its own, over exactly the steps asked for (`decode_steps` refuses a timed step that
does not decode one token of each request)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_every_policy_is_timed_and_compared_with_none(tmp_path):
    out = tmp_path / "tpot.json"
    command = [sys.executable, "-m", "vllm_kvprune.bench", "tpot", "--tiny", "--policies", "none", "paged_eviction",
               "--budget", "128", "--prompt-tokens", "320", "--batch", "2", "--tokens", "16", "--repeats", "1", "--pool-gib", "0.25", "--out", str(out)]
    finished = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = {row["policy"]: row for row in document["results"]}
    assert list(rows) == ["none", "paged_eviction"]
    for policy, row in rows.items():
        assert row["steps"] == 16 and row["rounds_ms"] == [row["ms"]]
        assert row["vs_none"] == pytest.approx(row["ms"] / rows["none"]["ms"] - 1)
        assert row["vs_streaming"] is None  # not in this run
        assert ("prune_events" in row) == (policy != "none")  # the worker's counters, where a policy is on
    # Over the 17 steps timed (the first one is not in the mean): each 320-token prompt was pruned
    # to 128 tokens (4 full blocks), so the first step evicts a whole block and the next eviction
    # would come 32 tokens later.
    assert rows["paged_eviction"]["prune_events"] == 1
    assert out.with_suffix(".png").stat().st_size > 0
    assert "paged_eviction" in finished.stdout and "vs none" in finished.stdout
