"""Accuracy at equal KV memory: GVote's Fig. 4 (and its Fig. 7/8 sweeps) on our model and tasks.

Budgeted policies are swept over budgets, budget-free `gvote` over its settings; all meet on
one x-axis, the KV memory each request held while answering (`kv_blocks`, read from vLLM's
block pool after every decode step), as a share of what `none` held for the same case. A
`gvote` request holds its fullest layer's count of blocks in every layer (one block table for
all layers) unless each layer has a KV-cache group of its own (issue 42: docs/PER_LAYER.md, as
`gvote` runs now); what its kept lengths need with a block table per layer
(`kv_blocks_per_layer`, the mean over layers, the paper's "mean KV memory") is its second x
position, and `held / need` says how close the pool's count comes to it. At each memory a `gvote`
setting reaches, every budgeted policy's metric is interpolated between its two budgets on
either side (linearly in memory, never extrapolated), and the best of them is what `gvote` is
held against.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks.accuracy.report import BUDGET_FREE, OURS, default_setting, growing
from benchmarks.accuracy.task import Task


@dataclass(frozen=True)
class Point:
    """One method at one budget (or one budget-free setting) on one task."""

    method: str
    budget: int | None
    gvote_p: float | None
    gvote_samples: int | None
    memory: float  # mean over cases of kv_blocks / none's kv_blocks for the case
    memory_per_layer: float  # the same of kv_blocks_per_layer (kv_blocks where layers hold alike)
    memory_full: float  # the same over the full-attention layers (a hybrid model's sliding windows left out)
    blocks: float  # mean kv_blocks
    value: float  # the task's metric
    cases: int

    @property
    def label(self) -> str:
        if self.gvote_p is not None:
            return f"p={self.gvote_p:g} S={self.gvote_samples}"
        return "full cache" if self.budget is None else str(self.budget)


def points(task: Task, records: Sequence[dict[str, Any]]) -> list[Point]:
    """Our methods' points, where `none` ran the same cases (memory is relative to it)."""
    ours = [r for r in records if r["system"] == OURS and "kv_blocks" in r]
    none_blocks = {r["case_id"]: r["kv_blocks"] for r in ours if r["method"] == "none" and r["kv_blocks"]}
    none_full = {r["case_id"]: growing(r, "kv_blocks") for r in ours if r["case_id"] in none_blocks and r["method"] == "none"}
    if not none_blocks:
        return []
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for record in ours:
        groups[(record["method"], record["budget"], record.get("gvote_p"), record.get("gvote_samples"))].append(record)
    found = []
    for (method, budget, p, samples), group in groups.items():
        measured = [r for r in group if r["kv_blocks"] is not None and r["case_id"] in none_blocks]
        if not measured:
            continue
        def share(key: str, measured=measured) -> float:
            return statistics.mean(r.get(key, r["kv_blocks"]) / none_blocks[r["case_id"]] for r in measured)

        full = statistics.mean(growing(r, "kv_blocks") / none_full[r["case_id"]] for r in measured)
        found.append(Point(method, budget, p, samples, share("kv_blocks"), share("kv_blocks_per_layer"), full,
                           statistics.mean(r["kv_blocks"] for r in measured), task.aggregate(group), len(group)))
    return sorted(found, key=lambda point: (point.method, point.memory))


def interpolated(curve: Sequence[Point], memory: float) -> float | None:
    """A budgeted policy's metric at `memory`, between its two nearest budgets; None outside."""
    for low, high in zip(curve, curve[1:]):
        if low.memory <= memory <= high.memory:
            if high.memory == low.memory:
                return max(low.value, high.value)
            weight = (memory - low.memory) / (high.memory - low.memory)
            return low.value + weight * (high.value - low.value)
    return None


def budgeted_curves(found: Sequence[Point]) -> dict[str, list[Point]]:
    curves: dict[str, list[Point]] = defaultdict(list)
    for point in found:
        if point.method != "none" and point.method not in BUDGET_FREE:
            curves[point.method].append(point)
    return {method: sorted(curve, key=lambda p: p.memory) for method, curve in curves.items()}


def memory_table(task: Task, found: Sequence[Point]) -> tuple[list[str], list[list[str]]]:
    """Every point: its memory (blocks held while answering, and as a share of `none`'s) and
    its metric; on a hybrid model also the share over its full-attention layers alone."""
    hybrid = any(abs(p.memory_full - p.memory) > 1e-9 for p in found)
    headers = ["method", "budget / setting", "cases", "KV blocks held", "% of none",
               *(["% of none, full-attention layers"] if hybrid else []),
               "% of none, a block table per layer", "held / need", task.metric]
    rows = [[p.method, p.label, str(p.cases), f"{p.blocks:.1f}", f"{100 * p.memory:.1f}%",
             *([f"{100 * p.memory_full:.1f}%"] if hybrid else []),
             f"{100 * p.memory_per_layer:.1f}%", f"{p.memory / p.memory_per_layer:.3f}",
             task.format(p.value)] for p in found]
    return headers, rows


def equal_memory_table(task: Task, found: Sequence[Point]) -> tuple[list[str], list[list[str]]]:
    """Each budget-free setting against the best budgeted policy at the memory it holds, and
    at the memory it would hold with a block table per layer."""
    curves = budgeted_curves(found)
    headers = ["gvote setting", task.metric, "held, % of none", "best budgeted there", "gvote as good",
               "per layer, % of none", "best budgeted there", "gvote as good"]
    rows = []
    for point in (p for p in found if p.method in BUDGET_FREE):
        row = [point.label, task.format(point.value)]
        for memory in (point.memory, point.memory_per_layer):
            row += [f"{100 * memory:.1f}%", *_against_best(task, curves, point.value, memory)]
        rows.append(row)
    return headers, rows


def allocation_table(task: Task, found: Sequence[Point], allocations: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """Each point of a budget spread by layer or head (`allocations`: variant -> its policy,
    whose `uniform` spread is the baseline) against the uniform one at the same budget and at
    the same memory (uniform's metric interpolated between its budgets there)."""
    curves = budgeted_curves(found)
    headers = ["allocation", "budget", "held, % of none", task.metric, "uniform at the budget: held",
               task.metric, "uniform at equal memory", "as good"]
    rows = []
    for point in (p for p in found if p.method in allocations):
        uniform = curves.get(allocations[point.method], [])
        same_budget = [p for p in uniform if p.budget == point.budget]
        at_memory = interpolated(uniform, point.memory)
        good = "-" if at_memory is None else (
            "yes" if (point.value <= at_memory if task.lower_is_better else point.value >= at_memory) else "no")
        rows.append([point.method, point.label, f"{100 * point.memory:.1f}%", task.format(point.value),
                     f"{100 * same_budget[0].memory:.1f}%" if same_budget else "-",
                     task.format(same_budget[0].value) if same_budget else "-",
                     "outside its budgets" if at_memory is None else task.format(at_memory), good])
    return headers, rows


def _against_best(task: Task, curves: dict[str, list[Point]], value: float, memory: float) -> list[str]:
    """[best budgeted policy and its interpolated metric, "yes"/"no"], or dashes outside every
    policy's range of budgets."""
    rivals = {method: interpolated(curve, memory) for method, curve in curves.items()}
    rivals = {method: rival for method, rival in rivals.items() if rival is not None}
    if not rivals:
        return ["outside the budgets", "-"]
    best = (min if task.lower_is_better else max)(rivals, key=rivals.get)
    better = value <= rivals[best] if task.lower_is_better else value >= rivals[best]
    return [f"{best} {task.format(rivals[best])}", "yes" if better else "no"]


def plot_vs_memory(task: Task, found: Sequence[Point], path: Path) -> None:
    """The metric against KV memory: a line per budgeted policy (one point per budget), the
    full cache, and `gvote`'s settings (the p sweep as a line, the sample sweep as points)."""
    from benchmarks import common

    figure, axes = common.new_figure(6.5, 4.0)
    for method, curve in budgeted_curves(found).items():
        axes.plot([100 * p.memory for p in curve], [p.value for p in curve], marker="o", label=method)
        for p in curve:
            axes.annotate(p.label, (100 * p.memory, p.value), fontsize=6, xytext=(2, 2), textcoords="offset points")
    for p in found:
        if p.method == "none":
            axes.axhline(p.value, linestyle=":", color="black", label="none (full cache)")
    voted = [p for p in found if p.method in BUDGET_FREE]
    default = default_setting()[1]
    p_sweep = sorted((p for p in voted if p.gvote_samples == default), key=lambda p: p.memory)
    if p_sweep:
        axes.plot([100 * p.memory for p in p_sweep], [p.value for p in p_sweep], marker="*", markersize=9,
                  color="crimson", label=f"gvote, p swept (S={default})")
        axes.plot([100 * p.memory_per_layer for p in p_sweep], [p.value for p in p_sweep], marker="*",
                  markersize=9, color="crimson", linestyle="--", markerfacecolor="none",
                  label="gvote, p swept, with a block table per layer")
    others = [p for p in voted if p.gvote_samples != default]
    if others:
        axes.scatter([100 * p.memory for p in others], [p.value for p in others], marker="^", color="crimson",
                     label="gvote, S swept")
    for p in p_sweep:
        axes.annotate(f"p={p.gvote_p:g}", (100 * p.memory_per_layer, p.value), fontsize=6, color="crimson",
                      xytext=(2, -8), textcoords="offset points")
    for p in others:
        axes.annotate(f"S={p.gvote_samples}", (100 * p.memory, p.value), fontsize=6, color="crimson",
                      xytext=(2, -8), textcoords="offset points")
    axes.set_xlim(0, 105)
    axes.set_xlabel("KV memory while answering (% of none's blocks)")
    axes.set_ylabel(task.metric)
    axes.set_title(f"{task.name}: accuracy at equal memory")
    axes.legend(fontsize=7)
    common.save_figure(figure, path)


def swept_tasks(results_by_task: dict[str, list[dict[str, Any]]]) -> dict[str, tuple[Task, list[Point]]]:
    """Task name -> (task, points) for the tasks whose records have `gvote` runs: what the sweeps'
    table and plot show. `results_by_task`: a folder's records, task by task, so that a run of one
    task (`--tasks needle --resume`) keeps the other tasks' sweeps on the plot."""
    from benchmarks.accuracy import TASK_TYPES

    found_by_task = {}
    for name, records in results_by_task.items():
        task = TASK_TYPES[name]()
        found = points(task, records)
        if any(p.method in BUDGET_FREE for p in found):
            found_by_task[name] = (task, found)
    return found_by_task


def sweep_rows(found_by_task: dict[str, tuple[Task, list[Point]]]) -> tuple[list[str], list[list[str]]]:
    """GVote's own sweeps (the paper's Fig. 7: p; Fig. 8: samples): each setting's metric and
    memory on every task that ran it."""
    settings = sorted({(p.gvote_p, p.gvote_samples) for _, found in found_by_task.values() for p in found
                       if p.method in BUDGET_FREE})
    headers = ["p", "S", *(f"{name}: {task.metric} (held / per layer, % of none)"
                           for name, (task, _) in found_by_task.items())]
    rows = []
    for p_nuc, samples in settings:
        cells = []
        for task, found in found_by_task.values():
            match = [p for p in found if p.method in BUDGET_FREE and (p.gvote_p, p.gvote_samples) == (p_nuc, samples)]
            cells.append(f"{task.format(match[0].value)} ({100 * match[0].memory:.0f}% / "
                         f"{100 * match[0].memory_per_layer:.0f}%)" if match else "-")
        rows.append([f"{p_nuc:g}", str(samples), *cells])
    return headers, rows


def plot_sweeps(found_by_task: dict[str, tuple[Task, list[Point]]], path: Path) -> None:
    """Two panels, as the paper's Fig. 7 and 8: metric and memory against p (default S) and
    against S (default p), one line per task."""
    from benchmarks import common

    default_p, default_samples = default_setting()
    figure, (by_p, by_samples) = _two_panels(common)
    for name, (task, found) in found_by_task.items():
        voted = [p for p in found if p.method in BUDGET_FREE]
        swept_p = sorted((p for p in voted if p.gvote_samples == default_samples), key=lambda p: p.gvote_p)
        swept_s = sorted((p for p in voted if p.gvote_p == default_p), key=lambda p: p.gvote_samples)
        for axes, sweep, key in ((by_p, swept_p, "gvote_p"), (by_samples, swept_s, "gvote_samples")):
            if sweep:
                line = axes.plot([getattr(p, key) for p in sweep], [p.value for p in sweep], marker="o",
                                 label=f"{name} ({task.metric})")[0]
                for p in sweep:
                    axes.annotate(f"{100 * p.memory:.0f}%", (getattr(p, key), p.value), fontsize=6,
                                  color=line.get_color(), xytext=(2, 3), textcoords="offset points")
    by_p.set_xlabel(f"p_nuc (S = {default_samples})")
    by_samples.set_xlabel(f"samples S (p = {default_p:g})")
    by_samples.set_xscale("log", base=2)
    for axes in (by_p, by_samples):
        axes.set_ylabel("metric (labels: memory, % of none)")
        axes.legend(fontsize=7)
    common.save_figure(figure, path)


def _two_panels(common: Any):
    figure = common.new_figure(9.0, 3.6)[0]
    figure.clf()
    return figure, tuple(figure.subplots(1, 2))
