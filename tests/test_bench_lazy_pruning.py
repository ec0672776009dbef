"""`bench lazy-pruning` on the tiny model, each case's engine in this process: the prune events
and the cache's peak follow each request's R (`kv_prune_interval`), the two perplexity paths
(teacher-forced decode steps, strided prompt windows) agree where they must compute the same
thing, and every stream token is scored once; then the parent's ratios and table."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks import lazy_pruning

BUDGET, STREAM = 64, 200


def args(**overrides) -> argparse.Namespace:
    values = dict(budget=BUDGET, sinks=4, stream_tokens=STREAM, tpot_tokens=12, repeats=2, recompute_tokens=2,
                  recompute_stride=32, tiny=True, dtype="float32", pool_gib=0.5)
    return argparse.Namespace(**{**values, **overrides})


def stream_rows(intervals, budget: int = BUDGET) -> dict[int, dict]:
    rows = lazy_pruning.measure(args(budget=budget), {"kind": "stream", "positions": "cache", "intervals": intervals})
    return {row["R"]: row for row in rows}


def one(case: dict, **overrides) -> dict:
    [row] = lazy_pruning.measure(args(**overrides), case)
    return row


@pytest.fixture(scope="module")
def rows() -> dict:
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    try:
        streams = stream_rows([1, 8])
        timed = lazy_pruning.measure(args(), {"kind": "tpot", "intervals": [1, 8], "batches": [1, 3]})
        found = {"R1": streams[1], "R8": streams[8], "tpot1": timed[0], "tpot8": timed[1],
                 "recompute": one({"kind": lazy_pruning.RECOMPUTE})}
    finally:
        mp.undo()
    return found


@pytest.mark.slow
def test_prune_events_and_peak_follow_the_interval(rows) -> None:
    strict, lazy = rows["R1"], rows["R8"]
    assert strict["peak_kept"] == BUDGET and lazy["peak_kept"] == BUDGET + 7
    # Strict: one prune per step once the cache is full; lazy: one per 8 steps.
    assert strict["prune_events"] == STREAM - BUDGET  # STREAM tokens written (the last sampled one never is)
    assert abs(lazy["prune_events"] - strict["prune_events"] / 8) <= 1
    assert strict["scored_tokens"] == lazy["scored_tokens"] == STREAM
    assert math.isfinite(strict["perplexity"]) and strict["perplexity"] != lazy["perplexity"]


@pytest.mark.slow
def test_timed_steps_decode_every_request(rows) -> None:
    for row, r in ((rows["tpot1"], 1), (rows["tpot8"], 8)):
        assert row["R"] == r and set(row["tpot"]) == {"1", "3"}
        for entry in row["tpot"].values():
            assert entry["steps"] == args().tpot_tokens and entry["ms"] > 0 and entry["move_ms_per_step"] >= 0
            assert len(entry["repeats_ms"]) == 2 and entry["ms"] in entry["repeats_ms"]
            # 13 decode steps from a prompt at the cap: a prune in (nearly) each at R = 1, one or two at R = 8.
            assert entry["prune_events"] >= 12 if r == 1 else entry["prune_events"] in (1, 2)
    assert rows["recompute"]["tpot"]["1"]["steps"] == 2 and rows["recompute"]["tpot"]["1"]["ms"] > 0


@pytest.mark.slow
def test_both_perplexity_paths_agree_when_nothing_is_evicted(rows) -> None:
    """A budget past the stream evicts nothing, and one window holding the whole stream is the
    full context: the decode-step and prompt-logprob perplexities must then be the same number."""
    recompute = rows["recompute"]
    assert recompute["scored_tokens"] == STREAM  # every token once, the last short window included
    unbounded = stream_rows([1], budget=STREAM + 8)[1]
    assert unbounded["prune_events"] == 0
    whole = one({"kind": lazy_pruning.RECOMPUTE}, budget=STREAM + 8, recompute_stride=STREAM + 8, recompute_tokens=0)
    assert whole["perplexity"] == pytest.approx(unbounded["perplexity"], rel=1e-3)


@pytest.mark.slow
def test_ratios_and_table(rows) -> None:
    found = lazy_pruning.merge([rows["R1"], rows["R8"], rows["tpot1"], rows["tpot8"], rows["recompute"]])
    lazy_pruning.add_ratios(found)
    strict, lazy, recompute = found
    assert (strict["R"], lazy["R"], recompute["method"]) == (1, 8, lazy_pruning.RECOMPUTE)
    assert strict["perplexity"] == rows["R1"]["perplexity"] and strict["tpot"] == rows["tpot1"]["tpot"]
    assert strict["tpot"]["1"]["speedup_vs_r1"] == 1.0 and strict["ppl_vs_r1"] == 1.0
    assert lazy["tpot"]["1"]["speedup_vs_recompute"] == pytest.approx(recompute["tpot"]["1"]["ms"]
                                                                     / lazy["tpot"]["1"]["ms"])
    headers, body = lazy_pruning.table(found)
    assert len(body) == 3 and body[0][0] == "streaming R=1" and len(headers) == len(body[0])


@pytest.mark.slow
def test_the_command_writes_its_file_after_every_engine(tmp_path) -> None:
    """The parent end to end (one child per engine): the file holds every case's rows, says how
    many engines ran, and the shorter `positions: original` stream meets R = 1 on its tokens."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "lazy.json"
    command = [sys.executable, "-m", "benchmarks", "lazy-pruning", "--tiny", "--batches", "--intervals", "1",
               "--budget", str(BUDGET), "--stream-tokens", "256", "--original-tokens", "128", "--recompute-tokens", "0",
               "--recompute-stride", "0", "--pool-gib", "0.5", "--out", str(out)]
    finished = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["settings"]["cases_done"] == "2 of 2" and out.with_suffix(".png").stat().st_size > 0
    rows = {row["positions"]: row for row in document["results"]}
    assert rows["cache"]["scored_tokens"] == 256 and rows["original"]["scored_tokens"] == 128
    # Compared with R = 1's first 128 tokens, which is not its whole stream: a chunk of 1024 would
    # be needed, so no ratio rather than a wrong one.
    assert "ppl_vs_r1" not in rows["original"] and rows["cache"]["ppl_vs_r1"] == 1.0
