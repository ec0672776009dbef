"""`python -m benchmarks tpot` end to end on the tiny model: every policy timed in an
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
    command = [sys.executable, "-m", "benchmarks", "tpot", "--tiny", "--policies", "paged_eviction", "streaming-shift",
               "--budget", "128", "--prompt-tokens", "320", "--batch", "2", "--tokens", "16", "--repeats", "1", "--pool-gib", "0.25", "--out", str(out)]
    finished = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = {row["policy"]: row for row in document["results"]}
    assert list(rows) == ["paged_eviction", "streaming-shift"]
    for row in rows.values():
        assert row["steps"] == 16 and row["rounds_ms"] == [row["ms"]]
        assert row["vs_none"] is None and row["vs_streaming"] is None  # neither is in this run
    # Over the 17 steps timed (the first one is not in the mean): each 320-token prompt was pruned
    # to 128 tokens (4 full blocks), so the first step evicts a whole block and the next eviction
    # would come 32 tokens later.
    assert rows["paged_eviction"]["prune_events"] == 1
    # The shift-and-append baseline (its engine switch set for that child only): pruned to
    # budget - 1 = 127, it evicts on every step after the first, and every eviction moves the
    # window; paged_eviction's one eviction moved nothing (EQUIP by block).
    shift = rows["streaming-shift"]
    assert shift["prune_events"] == 16 and shift["move_ms_per_step"] > 0
    assert rows["paged_eviction"]["move_ms_per_step"] == 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "paged_eviction" in finished.stdout and "vs none" in finished.stdout
