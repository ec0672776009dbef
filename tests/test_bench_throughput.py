"""Smoke test of `python -m benchmarks throughput --quick` (tiny model).

Checks what the bench reports, never how fast anything ran: every configuration is
present with positive tokens/s and all of its tokens, and in the memory-bound setting
each policy keeps more requests running at once than `none`, within its block cap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MEMORY_BOUND, OVERHEAD = "memory-bound", "overhead"


def run_quick_bench(out_stem: Path) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    command = [sys.executable, "-m", "benchmarks", "throughput", "--quick", "--out", str(out_stem)]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return json.loads(out_stem.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    stem = tmp_path_factory.mktemp("bench") / "throughput"
    return run_quick_bench(stem), stem


def rows_by_key(document: dict) -> dict[tuple[str, str, int | None], dict]:
    return {(row["setting"], row["policy"], row["budget"]): row for row in document["results"]}


@pytest.mark.slow
def test_quick_bench_reports_every_configuration(quick_results: tuple[dict, Path]) -> None:
    document, stem = quick_results
    rows = rows_by_key(document)
    expected = {(MEMORY_BOUND, "none", None), (OVERHEAD, "none", None)}
    expected |= {(MEMORY_BOUND, policy, budget) for budget in document["settings"]["budgets"]
                 for policy in ("streaming", "h2o", "paged_eviction")}
    assert expected <= set(rows)
    assert any(setting == OVERHEAD and policy == "streaming" for setting, policy, _ in rows)
    for row in document["results"]:
        assert row["tokens_per_s"] > 0, row
        assert row["output_tokens"] == row["requests"] * row["gen_tokens"], row
    assert "--quick" in document["machine"]["command"]
    assert document["summary"]["overhead_ratio"] > 0
    assert stem.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["streaming", "h2o", "paged_eviction"])
def test_policies_run_more_requests_at_once_when_memory_bound(quick_results: tuple[dict, Path], policy: str) -> None:
    document = quick_results[0]
    rows = rows_by_key(document)
    none = rows[(MEMORY_BOUND, "none", None)]
    for budget in document["settings"]["budgets"]:
        bounded = rows[(MEMORY_BOUND, policy, budget)]
        assert bounded["peak_running"] > none["peak_running"], (bounded, none)
        assert bounded["peak_request_blocks"] <= bounded["cap_blocks"], bounded
        assert bounded["peak_blocks"] <= bounded["pool_blocks"], bounded


def test_budget_free_policy_is_matched_and_summarised() -> None:
    """A budget-free policy's row: `h2o` gets the budget whose cap is its measured mean blocks,
    and the summary (and the page) state both ratios and the memory share."""
    from benchmarks import results_sections, throughput, throughput_report
    from vllm_kvprune.config import KVPolicyConfig

    for mean_blocks in (1.2, 17.0, 65.4, 65.6):
        budget = throughput.matched_budget(mean_blocks, 32)
        cap = KVPolicyConfig(name="h2o", budget=budget, sinks=4).cap_blocks(32)
        assert cap == max(1, round(mean_blocks)), (mean_blocks, budget, cap)

    def row(policy, budget, tokens_per_s, mean_blocks, matched_to=None):
        return {"setting": MEMORY_BOUND, "policy": policy, "budget": budget, "tokens_per_s": tokens_per_s,
                "mean_request_blocks": mean_blocks, "matched_to": matched_to}

    rows = throughput_report.with_ratios([row("none", None, 60.0, 68.0), row("gvote", None, 66.0, 51.0),
                                          row("h2o", 1631, 54.0, 51.0, matched_to="gvote")])
    found = throughput_report.summary(rows)["budget_free"]["gvote"]
    assert found["ratio_vs_none"] == pytest.approx(1.1)
    assert found["blocks_vs_none"] == pytest.approx(0.75)
    assert (found["matched_policy"], found["matched_budget"]) == ("h2o", 1631)
    assert found["matched_ratio_vs_none"] == pytest.approx(0.9)
    lines = results_sections.throughput_targets(throughput_report.summary(rows))
    assert lines == ["memory-bound, gvote vs none: 1.10x at 75% of none's mean blocks per request; "
                     "h2o at that memory (budget 1631): 0.90x"]
    headers, body = throughput_report.table_cells(rows)
    assert [cells[headers.index("at the memory of")] for cells in body] == ["-", "-", "gvote"]


def test_none_requests_times_whole_waves_only() -> None:
    """`--none-requests`: `none` runs fewer of the same requests, in whole waves of those that
    fit at once, while every policy runs them all; a part wave is refused, naming the flag."""
    from benchmarks import throughput, throughput_report

    argv = ["--requests", "32", "--gen-tokens", "4096", "--pool-blocks", "576", "--budgets", "512",
            "--policies", "streaming", "--overhead-requests", "0"]
    plan = throughput.build_plan(throughput.parse_args([*argv, "--none-requests", "8"]))
    none, streaming = plan.cases
    # 132 blocks per whole request: 4 fit in 575, so 8 requests are two whole waves.
    assert (none.policy, none.workload.num_requests, none.max_num_seqs) == ("none", 8, 4)
    assert (streaming.policy, streaming.workload.num_requests) == ("streaming", 32)
    assert throughput.memory_bound_workload(plan).num_requests == 32
    # The page reads it from the rows (each row records the requests it ran).
    rows = [{"setting": MEMORY_BOUND, "policy": "none", "requests": 8, "max_num_seqs": 4},
            {"setting": MEMORY_BOUND, "policy": "streaming", "requests": 32, "max_num_seqs": 32}]
    assert "8 of them" in throughput_report.none_fewer_text(rows)
    assert throughput_report.none_fewer_text([{**rows[0], "requests": 32}, rows[1]]) == ""
    for wrong in (["--none-requests", "6"], ["--none-requests", "0"], ["--none-requests", "8", "--none-max-seqs", "4"]):
        with pytest.raises(SystemExit, match="--none-requests"):
            throughput.build_plan(throughput.parse_args([*argv, *wrong]))
