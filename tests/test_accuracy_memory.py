"""Accuracy at equal KV memory (`benchmarks/accuracy/memory.py`) and the runs the suite makes of a
budget-free policy (`benchmarks/accuracy/ours.py`), on records and cases made up here."""

from __future__ import annotations

import pytest

from benchmarks.accuracy import memory, ours
from benchmarks.accuracy.arithmetic import Arithmetic
from benchmarks.accuracy.perplexity import Perplexity
from benchmarks.accuracy.task import Case


def record(case: str, method: str, budget: int | None, hit: bool, blocks: float, per_layer: float | None = None,
           **settings) -> dict:
    found = {"task": "arithmetic", "case_id": case, "system": "vllm-kvprune", "method": method, "budget": budget,
             "hit": hit, "kv_blocks": blocks, **settings}
    if per_layer is not None:
        found["kv_blocks_per_layer"] = per_layer
    return found


RECORDS = [
    record("a", "none", None, True, 10), record("b", "none", None, True, 20),
    record("a", "streaming", 128, False, 2), record("b", "streaming", 128, False, 2),  # 15% of none
    record("a", "streaming", 512, True, 6), record("b", "streaming", 512, False, 12),  # 60%
    record("a", "gvote", None, True, 9, 4, gvote_p=0.95, gvote_samples=8),  # held 90%, per layer 40%
    record("b", "gvote", None, True, 18, 8, gvote_p=0.95, gvote_samples=8),
    {"task": "arithmetic", "case_id": "a", "system": "kvpress", "method": "none", "budget": None, "hit": True},
]


def test_points_are_shares_of_nones_blocks_case_by_case():
    found = {(p.method, p.budget): p for p in memory.points(Arithmetic(), RECORDS)}
    assert set(found) == {("none", None), ("streaming", 128), ("streaming", 512), ("gvote", None)}
    assert found[("streaming", 128)].memory == pytest.approx((2 / 10 + 2 / 20) / 2)
    assert found[("streaming", 512)].memory == pytest.approx(0.6)
    voted = found[("gvote", None)]
    assert (voted.memory, voted.memory_per_layer, voted.value) == (pytest.approx(0.9), pytest.approx(0.4), 1.0)
    assert found[("streaming", 512)].memory_per_layer == found[("streaming", 512)].memory  # one count per layer
    assert voted.label == "p=0.95 S=8" and found[("streaming", 128)].label == "128"


def test_budgeted_policies_are_interpolated_never_extrapolated():
    curve = memory.budgeted_curves(memory.points(Arithmetic(), RECORDS))["streaming"]
    assert [p.value for p in curve] == [0.0, 0.5]
    assert memory.interpolated(curve, curve[0].memory) == 0.0
    assert memory.interpolated(curve, 0.375) == pytest.approx(0.25)
    assert memory.interpolated(curve, 0.9) is None and memory.interpolated(curve, 0.1) is None


def test_gvote_is_held_against_the_best_budgeted_policy_at_each_of_its_memories():
    headers, rows = memory.equal_memory_table(Arithmetic(), memory.points(Arithmetic(), RECORDS))
    (row,) = rows
    cell = dict(zip(headers[:3], row[:3]))
    assert cell == {"gvote setting": "p=0.95 S=8", "accuracy": "100%", "held, % of none": "90.0%"}
    assert row[3:5] == ["outside the budgets", "-"]  # 90% is past streaming's largest budget
    # per layer, 40%: streaming interpolated between 15% (0) and 60% (0.5) is 0.28
    assert row[5:] == ["40.0%", "streaming 28%", "yes"]


def test_lower_is_better_metrics_pick_the_lowest_rival():
    task = Perplexity(1, 16)

    def scored(case, method, budget, nll, blocks, per_layer=None, **settings):
        found = record(case, method, budget, False, blocks, per_layer, **settings)
        return {**found, "nll_sum": nll, "scored_tokens": 1}

    records = [scored("a", "none", None, 1.0, 10), scored("a", "h2o", 128, 3.0, 2), scored("a", "h2o", 512, 2.0, 8),
               scored("a", "streaming", 128, 2.5, 2), scored("a", "streaming", 512, 1.5, 8),
               scored("a", "gvote", None, 2.3, 9, 5, gvote_p=0.9, gvote_samples=8)]
    _, (row,) = memory.equal_memory_table(task, memory.points(task, records))
    # at 50% (per layer): streaming halfway from exp(2.5) to exp(1.5) = 8.33, h2o 13.7; gvote exp(2.3) = 9.97
    assert row[6] == "streaming 8.33" and row[-1] == "no"


def test_gvote_settings_are_the_papers_two_sweeps_with_the_default_once():
    settings = ours.gvote_settings([0.9, 0.95], [1, 8])
    assert settings == [{"kv_gvote_p": 0.9, "kv_gvote_samples": 8}, {"kv_gvote_p": 0.95, "kv_gvote_samples": 8},
                        {"kv_gvote_p": 0.95, "kv_gvote_samples": 1}]


def test_budget_free_policies_run_settings_and_skip_teacher_forced_tasks():
    prompt = Case("arithmetic", "q0", [1, 2, 3], 4)
    forced = Case("perplexity", "s0", [1], 3, forced_ids=[2, 3, 4])
    task = Arithmetic(1)
    task.budgets = [128, 256]
    settings = ours.gvote_settings([0.9], [])
    runs = ours.policy_runs("gvote", task, [prompt], settings)
    assert [(r.budget, r.settings) for r in runs] == [(None, {"kv_gvote_p": 0.9, "kv_gvote_samples": 8}),
                                                     (None, {"kv_gvote_p": 0.95, "kv_gvote_samples": 8})]
    assert ours.policy_runs("gvote", Perplexity(1, 4), [forced], settings) == []
    assert [(r.budget, r.settings) for r in ours.policy_runs("h2o", task, [prompt], settings)] == [
        (128, {"kv_budget": 128}), (256, {"kv_budget": 256})]
    assert [(r.budget, r.settings) for r in ours.policy_runs("none", task, [prompt], settings)] == [(None, {})]
    # An ablation: the policy's own budgets, with its per-request settings on each.
    assert [(r.budget, r.settings) for r in ours.policy_runs("paged_eviction_paper", task, [prompt], settings)] == [
        (128, {"kv_budget": 128, "kv_sinks": 0, "kv_recent": 0}), (256, {"kv_budget": 256, "kv_sinks": 0,
                                                                        "kv_recent": 0})]


def test_an_ablation_runs_its_policys_press_at_its_own_settings_under_a_label_of_its_own():
    from benchmarks.accuracy import kvpress_side

    specs = kvpress_side.press_specs(["snapkv", "snapkv_pool15", "paged_eviction_paper", "gvote"], sinks=4)
    assert specs["snapkv"] == {"name": "SnapKVPress", "window_size": 64, "kernel_size": 5}
    # The same press, its kernel the ablation's, and a label its records carry beside the policy's.
    assert specs["snapkv_pool15"] == {"name": "SnapKVPress", "window_size": 64, "kernel_size": 15,
                                      "label": "SnapKVPress(kernel_size=15)"}
    # An ablation without a press of its settings, and a policy without a press, run none.
    assert "paged_eviction_paper" not in specs and "gvote" not in specs


def test_needle_heat_map_gives_the_full_cache_and_gvote_panels_of_their_own():
    from benchmarks.accuracy import report

    records = [record("a", "none", None, True, 10), record("a", "h2o", 256, False, 9),
               record("a", "h2o", 1024, True, 33), record("a", "streaming", 256, False, 9),
               record("a", "gvote", None, False, 9, 4, gvote_p=0.95, gvote_samples=8)]
    panels = report.heat_map_panels(report.grouped(records))
    assert sorted(panels.values()) == [(0, 0, "none"), (0, 1, "gvote p=0.95 S=8"), (1, 0, "h2o 256"),
                                       (1, 1, "h2o 1024"), (2, 0, "streaming 256")]
