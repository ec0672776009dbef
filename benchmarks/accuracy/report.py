"""Tables and plots of the accuracy records, shared by every task.

A record is one answer: `task`, `case_id`, `system` (`vllm-kvprune` or `kvpress`), `method`
(our policy or kvpress's press), `budget` (None: full cache, or a budget-free policy), the
task's score fields and, for ours, `kv_blocks` (the blocks the request held while answering)
and a budget-free policy's settings (`gvote_p`, `gvote_samples`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from benchmarks import common
from benchmarks.accuracy.task import Task

OURS = "vllm-kvprune"
KVPRESS = "kvpress"
FULL_CACHE = "full cache"
# Policies with no budget: each request's memory is theirs to choose, so they are compared
# with the others at equal memory, one point per setting.
BUDGET_FREE = common.budget_free()


def method_keys(records: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """(system, method) pairs in the order they first appear."""
    return list(dict.fromkeys((r["system"], r["method"]) for r in records))


def grouped(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, int | None], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, int | None], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(record["system"], record["method"], record["budget"])].append(record)
    return groups


def budget_table(task: Task, records: Sequence[dict[str, Any]],
                 budgets: Sequence[int]) -> tuple[list[str], list[list[str]]]:
    """One row per (system, method): the task's metric at each budget, or under the full cache,
    and how many cases it ran (kvpress runs fewer)."""
    records = [r for r in records if r["method"] not in BUDGET_FREE]
    groups = grouped(records)
    headers = ["system", "method", "cases", FULL_CACHE, *map(str, budgets)]
    rows = []
    for system, method in method_keys(records):
        cells = [groups.get((system, method, budget)) for budget in (None, *budgets)]
        cases = len({r["case_id"] for r in records if (r["system"], r["method"]) == (system, method)})
        rows.append([system, method, str(cases), *("-" if not c else task.format(task.aggregate(c)) for c in cells)])
    return headers, rows


@dataclass
class PairPoint:
    """Our policy and its kvpress press at one budget (None: full cache), on exactly the cases
    both ran: each side's metric, memory (ours: blocks held, share of `none`'s on the case;
    kvpress: prompt tokens its cache stores, share of the prompt; both over the full-attention
    layers, `growing`) and wall time per run."""

    budget: int | None
    policy: str
    press: str
    ours: float
    ours_memory: float | None
    ours_seconds: float | None
    theirs: float
    their_memory: float | None
    their_seconds: float | None
    same_answers: int
    cases: int


def side_by_side_points(task: Task, records: Sequence[dict[str, Any]], pairs: dict[str, str],
                        timings: Sequence[dict[str, Any]]) -> list[PairPoint]:
    """Every (policy, press, budget) both sides ran, on their shared cases, with each side's
    wall time per run over kvpress's runs of this task (prompt and answer)."""
    groups = grouped(records)
    seconds = {(t["system"], t["method"]): t["seconds"] / max(t["runs"], 1) for t in timings
               if t["task"] == task.name and t.get("cases") == "kvpress"}
    none_blocks = {r["case_id"]: growing(r, "kv_blocks") for r in records
                   if (r["system"], r["method"]) == (OURS, "none") and r.get("kv_blocks")}
    found = []
    for policy, press in [("none", "none"), *pairs.items()]:
        budgets = sorted({b for (s, m, b) in groups if (s, m) == (KVPRESS, press)}, key=lambda b: -1 if b is None else b)
        for budget in budgets:
            theirs = groups[(KVPRESS, press, budget)]
            shared = {r["case_id"] for r in theirs}
            ours = [r for r in groups.get((OURS, policy, budget), []) if r["case_id"] in shared]
            if not ours:
                continue
            theirs = [r for r in theirs if r["case_id"] in {r["case_id"] for r in ours}]
            their_answer = {r["case_id"]: r.get("answer", "").strip() for r in theirs}
            found.append(PairPoint(
                budget, policy, press, task.aggregate(ours),
                _mean_share([growing(r, "kv_blocks") for r in ours], [none_blocks.get(r["case_id"]) for r in ours]),
                seconds.get((OURS, policy)), task.aggregate(theirs),
                _mean_share([growing(r, "kv_stored") for r in theirs], [r.get("prompt_tokens") for r in theirs]),
                seconds.get((KVPRESS, press)),
                sum(r.get("answer", "").strip() == their_answer[r["case_id"]] for r in ours), len(ours)))
    return found


def side_by_side(task: Task, records: Sequence[dict[str, Any]], pairs: dict[str, str],
                 timings: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Our policy next to its kvpress press on exactly the cases both ran at each budget
    (`side_by_side_points`), and in how many of those cases both gave the same answer text."""
    headers = ["budget", "ours", task.metric, "s/run", "memory, % of full", "kvpress", task.metric, "s/run",
               "memory, % of full (stored)", "same answer"]
    rows = [[FULL_CACHE if p.budget is None else str(p.budget), p.policy, task.format(p.ours),
             _seconds(p.ours_seconds), _percent(p.ours_memory), p.press, task.format(p.theirs),
             _seconds(p.their_seconds), _percent(p.their_memory), f"{p.same_answers}/{p.cases}"]
            for p in side_by_side_points(task, records, pairs, timings)]
    return headers, rows


def plot_side_by_side(task: Task, found: Sequence[PairPoint], path: Path) -> None:
    """The metric against the memory each side really holds, on the cases kvpress ran: our
    policy (solid, blocks held) and its press (dashed, prompt tokens stored: a masking press
    stores the whole prompt), one colour per pair; the full cache as a line."""
    figure, axes = common.new_figure(6.5, 4.0)
    for index, (policy, press) in enumerate(dict.fromkeys((p.policy, p.press) for p in found if p.budget is not None)):
        curve = [p for p in found if (p.policy, p.press) == (policy, press) and p.budget is not None]
        colour = f"C{index % 10}"
        for memory_of, value_of, style, label in (
                (lambda p: p.ours_memory, lambda p: p.ours, "-", policy),
                (lambda p: p.their_memory, lambda p: p.theirs, "--", f"kvpress {press}")):
            shown = [p for p in curve if memory_of(p) is not None]
            if shown:
                axes.plot([100 * memory_of(p) for p in shown], [value_of(p) for p in shown], style, marker="o",
                          color=colour, label=label)
                for p in shown:
                    axes.annotate(str(p.budget), (100 * memory_of(p), value_of(p)), fontsize=6, xytext=(2, 2),
                                  textcoords="offset points")
    for p in found:
        if p.budget is None:
            axes.axhline(p.ours, linestyle=":", color="black", label="none (full cache)")
    axes.set_xlim(0, 105)
    axes.set_xlabel("KV memory held (ours: blocks, % of none's; kvpress: prompt tokens stored, %)")
    axes.set_ylabel(task.metric)
    cases = max((p.cases for p in found), default=0)
    axes.set_title(f"{task.name}: ours and kvpress by the memory each holds ({cases} cases)")
    axes.legend(fontsize=6)
    common.save_figure(figure, path)


def growing(record: dict[str, Any], key: str) -> float | None:
    """A record's memory (`kv_blocks` of ours, `kv_stored` of kvpress's) over the full-attention
    layers only (`key` + "_full"), where the record has it: the memory that grows with the context.
    On a hybrid model (Gemma-3) ours leave the sliding-window layers to vLLM, bounded by their
    window, where kvpress's presses also cut them (and its full cache holds the whole prompt in
    them); over the full-attention layers the two sides are on the same footing. Without
    sliding layers both readings are the same."""
    full = record.get(key + "_full")
    return record.get(key) if full is None else full


def _mean_share(parts: Sequence[float | None], wholes: Sequence[float | None]) -> float | None:
    """The mean of part / whole where both are known (None where none is): our blocks held
    against `none`'s on the case, kvpress's prompt tokens stored against the prompt's."""
    shares = [part / whole for part, whole in zip(parts, wholes) if part is not None and whole]
    return sum(shares) / len(shares) if shares else None


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_vs_budget(task: Task, records: Sequence[dict[str, Any]], path: Path) -> None:
    """The metric against the budget, one line per method; full-cache runs as flat lines."""
    from benchmarks import common

    groups = grouped(r for r in records if r["method"] not in BUDGET_FREE)
    figure, axes = common.new_figure(6.5, 4.0)
    for system, method in method_keys(records):
        style = "-" if system == OURS else "--"
        label = method if system == OURS else f"kvpress {method}"
        budgets = sorted(b for (s, m, b) in groups if (s, m) == (system, method) and b is not None)
        if budgets:
            values = [task.aggregate(groups[(system, method, b)]) for b in budgets]
            axes.plot(budgets, values, style, marker="o", label=label)
        elif (system, method, None) in groups:
            axes.axhline(task.aggregate(groups[(system, method, None)]), linestyle=":" if system == OURS else "-.",
                         color="black" if system == OURS else "gray", label=f"{label} (full cache)")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("KV budget (tokens)")
    axes.set_ylabel(task.metric)
    axes.set_title(task.name)
    axes.legend(fontsize=7)
    common.save_figure(figure, path)


def plot_heat_maps(records: Sequence[dict[str, Any]], contexts: Sequence[int], depths: Sequence[int],
                   path: Path) -> None:
    """The usual needle picture: hit (green) or miss (red) by context length and depth, one
    panel per method and budget (ours only; a budget-free policy at its default setting)."""
    from benchmarks import common

    default = default_setting()
    groups = grouped(r for r in records if r["system"] == OURS and (
        r["method"] not in BUDGET_FREE or (r.get("gvote_p"), r.get("gvote_samples")) == default))
    panels = heat_map_panels(groups)
    rows = 1 + max(row for row, _, _ in panels.values())
    columns = 1 + max(column for _, column, _ in panels.values())
    figure, _ = common.new_figure(2.6 * columns, 2.2 * rows + 0.4)
    figure.clf()
    for key, (row, column, title) in panels.items():
        hit = {(r["facts"]["context"], r["facts"]["depth"]): r["hit"] for r in groups[key]}
        grid = [[float(hit.get((c, d), float("nan"))) for c in contexts] for d in depths]
        panel = figure.add_subplot(rows, columns, row * columns + column + 1)
        panel.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        panel.set_title(title, fontsize=8)
        panel.set_xticks(range(len(contexts)), [f"{c / 1024:g}K" for c in contexts], fontsize=6)
        panel.set_yticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=6)
    figure.supxlabel("context length")
    figure.supylabel("needle depth")
    common.save_figure(figure, path)


def heat_map_panels(groups: dict[tuple[str, str, int | None], list[dict[str, Any]]]) -> dict[tuple, tuple[int, int, str]]:
    """(row, column, title) of each (system, method, budget) group's panel: the full cache and
    each budget-free policy (its records at the default setting) on the first row, then one
    row per budgeted policy, one column per budget."""
    p_nuc, samples = default_setting()
    budgets = sorted({k[2] for k in groups if k[2] is not None})
    policies = list(dict.fromkeys(k[1] for k in groups if k[2] is not None))
    free = list(dict.fromkeys(k[1] for k in groups if k[1] in BUDGET_FREE))
    panels = {}
    for key in groups:
        if key[1] in BUDGET_FREE:
            panels[key] = (0, 1 + free.index(key[1]), f"{key[1]} p={p_nuc:g} S={samples}")
        elif key[2] is None:
            panels[key] = (0, 0, key[1])
        else:
            panels[key] = (1 + policies.index(key[1]), budgets.index(key[2]), f"{key[1]} {key[2]}")
    return panels


def default_setting() -> tuple[float, int]:
    """`gvote`'s default (p, S): the setting a budget-free policy is shown at by itself."""
    from vllm_kvprune.config import KVPolicyConfig

    defaults = KVPolicyConfig(name="gvote")
    return defaults.gvote_p, defaults.gvote_samples
