"""What `python -m benchmarks throughput` reports: each row's ratio to `none`, the
targets, the table and the plot. The results page renders its throughput sections with these
same functions, so the page shows exactly what the bench printed."""

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.throughput_case import BUDGET_FREE, KEEP_ALL
from vllm_kvprune import machine

MEMORY_BOUND = "memory-bound"
MATCHED_POLICY = "h2o"  # also run at each budget-free policy's measured mean memory
OVERHEAD = "overhead"
TARGET_MEMORY_BOUND_RATIO = 2.0  # streaming (budget 512) over none, memory-bound
TARGET_OVERHEAD_RATIO = 0.97  # streaming (nothing evicted) over none, not memory-bound
TARGET_BUDGET = 512


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's tokens/s over `none`'s in the same setting."""
    baseline = {row["setting"]: row["tokens_per_s"] for row in rows if row["policy"] == "none"}
    for row in rows:
        base = baseline.get(row["setting"])
        row["ratio_vs_none"] = row["tokens_per_s"] / base if base else None
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The two ratios the targets are stated in, and whether each target is met."""
    def ratio_of(setting: str, budget: int | None = None, policy: str = "streaming") -> float | None:
        for row in rows:
            if row["setting"] == setting and row["policy"] == policy and (budget is None or row["budget"] == budget):
                return row["ratio_vs_none"]
        return None

    bound = ratio_of(MEMORY_BOUND, TARGET_BUDGET)
    overhead = ratio_of(OVERHEAD)
    return {
        "memory_bound_ratio_budget_512": bound,
        "memory_bound_target": TARGET_MEMORY_BOUND_RATIO,
        "memory_bound_target_met": None if bound is None else bound >= TARGET_MEMORY_BOUND_RATIO,
        "overhead_ratio": overhead,
        "overhead_target": TARGET_OVERHEAD_RATIO,
        "overhead_target_met": None if overhead is None else overhead >= TARGET_OVERHEAD_RATIO,
        "budget_free": budget_free_summary(rows),
        "memory_bound_ratios": {
            f"{row['policy']}" + ("" if row["budget"] is None else f" {row['budget']}"): row["ratio_vs_none"]
            for row in rows if row["setting"] == MEMORY_BOUND and row["policy"] != "none"
        },
    }


def budget_free_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per budget-free policy: its ratio to `none`, its mean blocks per request over `none`'s,
    and `MATCHED_POLICY`'s ratio at the same memory."""
    bound = [row for row in rows if row["setting"] == MEMORY_BOUND]
    none = next((row for row in bound if row["policy"] == "none"), None)
    found = {}
    for row in (row for row in bound if row["policy"] in BUDGET_FREE):
        matched = next((other for other in bound if other.get("matched_to") == row["policy"]), None)
        found[row["policy"]] = {
            "ratio_vs_none": row["ratio_vs_none"],
            "blocks_vs_none": (row["mean_request_blocks"] / none["mean_request_blocks"]
                               if none and none.get("mean_request_blocks") else None),
            "matched_policy": matched and matched["policy"],
            "matched_budget": matched and matched["budget"],
            "matched_ratio_vs_none": matched and matched["ratio_vs_none"],
        }
    return found


def budget_free_lines(found: dict[str, Any]) -> list[str]:
    lines = []
    for policy, numbers in found.items():
        line = f"memory-bound, {policy} vs none: {numbers['ratio_vs_none']:.2f}x"
        if numbers["blocks_vs_none"] is not None:
            line += f" at {numbers['blocks_vs_none']:.0%} of none's mean blocks per request"
        if numbers["matched_policy"]:
            line += (f"; {numbers['matched_policy']} at that memory (budget {numbers['matched_budget']}): "
                     f"{numbers['matched_ratio_vs_none']:.2f}x")
        lines.append(line)
    return lines


# ---- reporting ----------------------------------------------------------------------------
TABLE_COLUMNS = (
    ("setting", "setting", "{}"),
    ("policy", "policy", "{}"),
    ("budget", "budget", "{}"),
    ("at the memory of", "matched_to", "{}"),  # a budget set from a budget-free policy's measured memory
    ("max seqs", "max_num_seqs", "{}"),
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("vs none", "ratio_vs_none", "{:.2f}x"),
    ("peak running", "peak_running", "{}"),
    ("mean running", "mean_running", "{:.1f}"),
    ("peak blocks", "peak_blocks", "{:.0f}"),
    ("blocks/req", "peak_request_blocks", "{:.0f}"),
    ("mean blocks/req", "mean_request_blocks", "{:.1f}"),
    ("preemptions", "preemptions", "{}"),
    ("plan share", "plan_share", "{:.1%}"),
    ("score share", "score_share", "{:.1%}"),
    ("wall s", "wall_s", "{:.1f}"),
)


def none_fewer_text(rows: list[dict[str, Any]]) -> str:
    """Where `none`'s memory-bound row ran fewer of the requests than the policies' rows
    (`throughput --none-requests`): how many, and that they were whole waves."""
    bound = [row for row in rows if row.get("setting") == MEMORY_BOUND]
    none = next((row for row in bound if row.get("policy") == "none"), None)
    most = max((row.get("requests", 0) for row in bound), default=0)
    if none is None or none.get("requests", most) >= most:
        return ""
    return (f" (`none` timed on {none['requests']} of them: whole waves of the {none.get('max_num_seqs')} "
            "that fit at once)")


def table_cells(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = [header for header, _, _ in TABLE_COLUMNS]
    body = [
        ["-" if row.get(key) is None else shape.format(row[key]) for _, key, shape in TABLE_COLUMNS]
        for row in rows
    ]
    return headers, body


def plot_throughput(rows: list[dict[str, Any]], path: Path, title: str, block_size: int) -> None:
    """Each policy's tokens/s by budget, with `none` as a horizontal line (memory-bound); a
    budget-free policy is one point at the tokens its requests held on average."""
    figure, axes = common.new_figure(6.4, 4.2)
    bound = [row for row in rows if row["setting"] == MEMORY_BOUND]
    ticks: set[int] = set()
    for policy in sorted({row["policy"] for row in bound} - {"none"}):
        if policy in BUDGET_FREE:
            for row in (row for row in bound if row["policy"] == policy):
                held = row["mean_request_blocks"] * block_size
                axes.plot([held], [row["tokens_per_s"]], marker="*", markersize=12, linestyle="none",
                          label=f"{policy} (at the tokens it held)")
            continue
        if policy in KEEP_ALL:  # no budget: a horizontal line, like `none`
            for row in (row for row in bound if row["policy"] == policy):
                axes.axhline(row["tokens_per_s"], color="tab:green", linestyle=":", label=f"{policy} (every token)")
            continue
        points = sorted((row["budget"], row["tokens_per_s"]) for row in bound if row["policy"] == policy)
        budgets, speeds = zip(*points)
        axes.plot(budgets, speeds, marker="o", label=policy)
        ticks |= set(budgets)
    if ticks:
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted(ticks), [str(budget) for budget in sorted(ticks)])
    for row in bound:
        if row["policy"] == "none":
            axes.axhline(row["tokens_per_s"], color="gray", linestyle="--", label="none")
    axes.set_xlabel("budget (tokens kept per request)")
    axes.set_ylabel("output tokens/s")
    axes.set_ylim(bottom=0)
    axes.set_title(title, fontsize=9)
    axes.legend()
    common.save_figure(figure, path)


def target_lines(totals: dict[str, Any], timing: dict[str, Any]) -> str:
    def shown(ratio: float | None, target: float) -> str:
        if ratio is None:
            return "not measured"
        return f"{ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"

    targets = [
        f"memory-bound, streaming budget {TARGET_BUDGET} vs none: "
        + shown(totals["memory_bound_ratio_budget_512"], TARGET_MEMORY_BOUND_RATIO),
        "nothing evicted, streaming vs none: " + shown(totals["overhead_ratio"], TARGET_OVERHEAD_RATIO),
    ]
    return "\n".join([
        *(line for line in targets if not line.endswith("not measured")),
        *budget_free_lines(totals["budget_free"]),
        f"run {timing['run_s'] / 60:.1f} min; load average before {timing['load_before'][0]:.1f}, "
        f"after {timing['load_after'][0]:.1f} on {machine.usable_cores()} cores",
    ])
