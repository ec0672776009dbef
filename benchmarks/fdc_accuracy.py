"""`python -m benchmarks fdc-accuracy`: FDC's accuracy against its compression, served.

One calibration (the real model, fp32, on essay text that no task uses); per setting a served
engine (`--kv-policy fdc`) runs the accuracy suite's tasks on the same cases as `bench accuracy`
with the same seed: perplexity through the cache, needle in a haystack, key-value retrieval,
arithmetic. The settings: each removal rate of `--rates` with per-head (adaptive) ranks, FDC
Eq. 1; at the rates of `--uniform-at`, every head at the adaptive ranks' mean (the paper's
"without adaptive rates" ablation, the same compression); at the rates of `--qk-only-at`, Q/K cut
at that rate and V kept whole (our measurements put most of the damage in V).

Per setting: the cache a token keeps (packed, mean over the layers FDC narrows), the tokens the
pool holds in the full-attention layers against `none`'s for the same bytes (each layer's row
rounded up to a head size of its own, see `worker/fdc_layers.py`; on a hybrid model, `--model
Gemma-3-270M`, only the full-attention layers are narrowed and their blocks hold more tokens in
the sliding layers' page, in steps of 32 tokens: `--block-size` sets how fine), every task's
score and its ratio to `none`. The 99% point is
the setting with the most tokens in the pool whose mean hit rate over needle, key-value
retrieval and arithmetic is at least 99% of `none`'s (FDC's constraint is on average task
accuracy); perplexity is shown beside.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

NAME = "fdc-accuracy"
HIT_TASKS = ("needle", "kv_retrieval", "arithmetic")  # the tasks the 99% point averages
ACCURACY_SHARE = 0.99


@dataclass(frozen=True)
class Setting:
    """One served FDC configuration: its label and how its ranks come from the calibration."""

    label: str
    kind: str  # "adaptive", "uniform" or "qk-only"
    rate: float

    def ranks(self, calibration: Any) -> Any:
        adaptive = calibration.with_rate(self.rate)
        if self.kind == "uniform":
            return calibration.with_uniform_ranks_like(adaptive)
        if self.kind == "qk-only":
            return calibration.with_rate(self.rate, v_rate=0.0)
        return adaptive


def settings_of(rates: Sequence[float], uniform_at: Sequence[float], qk_only_at: Sequence[float]) -> list[Setting]:
    found = [Setting(f"r={rate:g}", "adaptive", rate) for rate in rates]
    found += [Setting(f"r={rate:g} uniform", "uniform", rate) for rate in uniform_at]
    found += [Setting(f"r={rate:g} Q/K only", "qk-only", rate) for rate in qk_only_at]
    return found


def free_window(length: int, used: Sequence[tuple[int, int]], total: int) -> int:
    """The first start of `length` tokens in [0, total) that overlaps none of the `used`
    half-open ranges; ValueError if there is none."""
    start = 0
    for begin, end in sorted(used):
        if begin - start >= length:
            return start
        start = max(start, end)
    if total - start >= length:
        return start
    raise ValueError(f"no {length} essay tokens are left outside the tasks' text")


def calibration_sequences(essay: Sequence[int], work: Sequence[tuple[Any, Sequence[Any]]], tokens: int,
                          seq_len: int) -> tuple[list[list[int]], int]:
    """Essay text for the calibration that no case of `work` reads (needle haystacks start at
    token 0; perplexity segments record their start), cut into sequences; and where it starts."""
    used = []
    for task, cases in work:
        for case in cases:
            if "start" in case.facts:
                used.append((case.facts["start"], case.facts["start"] + case.facts["tokens"]))
            elif "context" in case.facts:
                used.append((0, case.facts["context"]))
    start = free_window(tokens, used, len(essay))
    window = list(essay[start:start + tokens])
    return [window[i:i + seq_len] for i in range(0, len(window), seq_len)], start


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from benchmarks import accuracy

    parser = subparsers.add_parser(NAME, help="fdc's accuracy against its compression (served, the accuracy suite)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--rates", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.05, 0.1],
        help="removal rates r with per-head ranks")
    add("--uniform-at", type=float, nargs="*", default=[0.01, 0.05],
        help="rates also run with uniform ranks at the same compression")
    add("--qk-only-at", type=float, nargs="*", default=[0.05, 0.2],
        help="rates also run with V uncut (Q/K only)")
    add("--calibration-tokens", type=int, default=8192)
    add("--tasks", nargs="+", default=list(accuracy.TASK_NAMES), choices=accuracy.TASK_NAMES)
    add("--seed", type=int, default=0)
    add("--ppl-segments", type=int, default=4)
    add("--ppl-tokens", type=int, default=2048)
    add("--needle-contexts", type=int, nargs="+", default=[1024, 3072, 5120, 7168])
    add("--needle-depths", type=int, nargs="+", default=[0, 25, 50, 75, 100])
    add("--kv-cases", type=int, default=40)
    add("--arith-cases", type=int, default=40)
    add("--pool-gib", type=float, default=2.0, help="KV pool of each engine (the same bytes for every setting)")
    add("--model", default=accuracy.MODEL_NAMES[0], choices=accuracy.MODEL_NAMES,
        help="the real model (Gemma-3-270M: a base model, plain prompts; FDC narrows its full-attention layers)")
    add("--block-size", type=int, default=None,
        help="tokens per KV block of every engine (default the accuracy suite's 32); on a hybrid model FDC's "
             "narrowed blocks hold a multiple of 32 tokens in the same page, so larger blocks follow the width finer")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add("--enforce-eager", action="store_true")
    add("--out-dir", default="results/fdc")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from benchmarks import accuracy, common

    for name, value in common.ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from benchmarks.accuracy import ours
    from benchmarks.accuracy.task import essay_token_ids
    from tools import assets
    from vllm_kvprune.fdc import calibration as fdc

    model = str(getattr(assets, accuracy.MODELS[args.model])())
    tokenizer = AutoTokenizer.from_pretrained(model)
    suite = argparse.Namespace(**vars(args), needle_budgets=None, budgets=[])
    tasks = accuracy.build_tasks(suite)
    work = [(t, t.build(tokenizer, random.Random(f"{args.seed}-{t.name}"))) for t in tasks]
    started = time.perf_counter()
    sequences, calibration_start = calibration_sequences(essay_token_ids(tokenizer), work,
                                                         args.calibration_tokens, fdc.DEFAULT_SEQ_LEN)
    with tqdm(total=args.calibration_tokens, desc="calibrating", unit="tok") as bar:
        calibration = fdc.calibrate(model, sequences=sequences, source="essays", seed=args.seed, progress=bar.update)
    calibration.settings["essay_offset"] = calibration_start
    engine = dict(dtype=args.dtype, enforce_eager=args.enforce_eager)
    if args.block_size is not None:
        engine["block_size"] = args.block_size
    records, timings = ours.run_policy(model, "none", work, 0, args.pool_gib, **engine)
    points = []
    with tempfile.TemporaryDirectory() as folder:
        for index, setting in enumerate(settings_of(args.rates, args.uniform_at, args.qk_only_at)):
            ranked = setting.ranks(calibration)
            path = Path(folder) / f"setting{index}.safetensors"
            ranked.save(path)
            found, timed = ours.run_policy(model, "fdc", work, 0, args.pool_gib,
                                           policy_config={"name": "fdc", "fdc": str(path)}, **engine)
            for record in found:
                record.update(setting=setting.label, kind=setting.kind, rate=setting.rate)
            for timing in timed:
                timing.update(setting=setting.label)
            records += found
            timings += timed
            points.append({"setting": setting.label, "kind": setting.kind, "rate": setting.rate,
                           "kv_kept": ranked.kv_fraction(), "mean_qk_rank": float(ranked.qk_rank.double().mean()),
                           "mean_v_rank": float(ranked.v_rank.double().mean())})
    summary = summarize(tasks, records, timings, points)
    report(args, tasks, records, timings, summary, calibration.settings, time.perf_counter() - started)
    return 0


def summarize(tasks: Sequence[Any], records: Sequence[dict[str, Any]], timings: Sequence[dict[str, Any]],
              points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: each task's score and its ratio to `none`'s, the pool's tokens against
    `none`'s, the mean hit-rate ratio; and the 99% point."""
    def score(task: Any, label: str | None) -> float | None:
        mine = [r for r in records if r["task"] == task.name and r.get("setting") == label]
        return task.aggregate(mine) if mine else None

    def pool(label: str | None) -> int:
        """Tokens of the full-attention layers the pool holds (blocks, in runs that did not count them)."""
        timing = next(t for t in timings if t.get("setting") == label and t["system"] == "vllm-kvprune")
        return timing.get("pool_full_tokens", timing["pool_blocks"])

    none = {task.name: score(task, None) for task in tasks}
    none_pool = pool(None)
    for point in points:
        point["pool_tokens_vs_none"] = pool(point["setting"]) / none_pool
        point["scores"] = {task.name: score(task, point["setting"]) for task in tasks}
        ratios = [point["scores"][name] / none[name] for name in HIT_TASKS if none.get(name)]
        point["hit_ratio"] = sum(ratios) / len(ratios) if ratios else None
    meeting = [p for p in points if p["hit_ratio"] is not None and p["hit_ratio"] >= ACCURACY_SHARE]
    best = max(meeting, key=lambda p: p["pool_tokens_vs_none"], default=None)
    return {"none": none, "none_pool": none_pool, "points": points,
            "at_99_percent": None if best is None else best["setting"]}


def table(tasks: Sequence[Any], summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["setting", "KV kept", "pool tokens vs none", *[t.name for t in tasks], "hit rates vs none"]
    rows = [["none", "100%", "1.00x", *[t.format(summary["none"][t.name]) for t in tasks], "1.000"]]
    for point in summary["points"]:
        cells = [tasks[i].format(point["scores"][t.name]) for i, t in enumerate(tasks)]
        ratio = "-" if point["hit_ratio"] is None else f"{point['hit_ratio']:.3f}"
        rows.append([point["setting"], f"{point['kv_kept']:.1%}", f"{point['pool_tokens_vs_none']:.2f}x", *cells, ratio])
    return headers, rows


def report(args: argparse.Namespace, tasks: Sequence[Any], records: list[dict[str, Any]],
           timings: list[dict[str, Any]], summary: dict[str, Any], calibration_settings: dict[str, Any],
           run_seconds: float) -> None:
    from benchmarks import common

    headers, rows = table(tasks, summary)
    common.print_table(headers, rows)
    chosen = summary["at_99_percent"]
    print(f"largest compression at >= {ACCURACY_SHARE:.0%} of none's mean hit rate: "
          f"{chosen if chosen is not None else 'none of the settings'}")
    settings = {key: getattr(args, key) for key in (
        "rates", "uniform_at", "qk_only_at", "calibration_tokens", "tasks", "seed", "ppl_segments", "ppl_tokens",
        "needle_contexts", "needle_depths", "kv_cases", "arith_cases", "pool_gib", "block_size", "dtype",
        "enforce_eager")}
    settings.update(model=args.model, calibration=calibration_settings, run_s=run_seconds)
    out = Path(args.out_dir) / "accuracy.json"
    common.write_json(out, NAME, settings, records, timings=timings, summary=summary,
                      table={"headers": headers, "rows": rows})
    plot(tasks, summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(tasks: Sequence[Any], summary: dict[str, Any], path: Path) -> None:
    """Each task's score over the pool's tokens against `none`, one marker per kind of ranks."""
    from benchmarks import common

    figure, axes = common.new_figure(4.0 * len(tasks), 3.4)
    figure.clf()
    markers = {"adaptive": "o-", "uniform": "s", "qk-only": "^"}
    for index, task in enumerate(tasks):
        panel = figure.add_subplot(1, len(tasks), index + 1)
        for kind, marker in markers.items():
            chosen = sorted((p for p in summary["points"] if p["kind"] == kind), key=lambda p: p["pool_tokens_vs_none"])
            if chosen:
                panel.plot([1.0] + [p["pool_tokens_vs_none"] for p in chosen] if kind == "adaptive" else
                           [p["pool_tokens_vs_none"] for p in chosen],
                           ([summary["none"][task.name]] if kind == "adaptive" else []) +
                           [p["scores"][task.name] for p in chosen], marker, label=kind)
        panel.axhline(summary["none"][task.name], color="black", linestyle=":", label="none")
        panel.set_title(task.name, fontsize=9)
        panel.set_xlabel("tokens in the pool vs none")
        panel.set_ylabel(task.metric)
    figure.axes[0].legend(fontsize=7)
    common.save_figure(figure, path)
