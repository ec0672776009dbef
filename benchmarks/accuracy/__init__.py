"""`python -m benchmarks accuracy`: what each policy keeps is worth, on the real model.

Tasks (one file each): streaming perplexity over essays (`perplexity.py`), needle in a
haystack over 1K-7K contexts and 0-100% depths (`needle.py`), key-value retrieval
(`kv_retrieval.py`) and arithmetic word problems (`arithmetic.py`), all built from `--seed`.
Every budgeted policy runs at every budget; `none` (the full cache) is the ceiling; budget-free
`gvote` runs at each of its settings (the paper's sweeps over p and S) and meets the others at
equal KV memory (`memory.py`: blocks held while answering, read from vLLM's block pool).
kvpress's matching presses (each policy's `kvpress` trait: StreamingLLM, ObservedAttention,
KNorm, SnapKV) run the prompt tasks on
the same prompts at matched kept-token counts, in their own venv (`scripts/setup_kvpress.sh`);
`--reuse-kvpress` takes their records from the files of an earlier run with the same cases;
`--resume` takes every method's records found there (ours and kvpress's, method by method) and
runs only the methods missing, so a run can be extended by a policy or a press, or `gvote` by a
setting (`gvote` then runs only the settings missing; everything else is reused).

Each task prints its tables and writes `accuracy_<task>.json` and its plots to `--out-dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.accuracy.arithmetic import Arithmetic
from benchmarks.accuracy.kv_retrieval import KVRetrieval
from benchmarks.accuracy.needle import Needle
from benchmarks.accuracy.perplexity import Perplexity
from benchmarks.accuracy.report import KVPRESS, OURS
from benchmarks.accuracy.task import Answer, Case, Task
from benchmarks.accuracy.variants import ALLOCATIONS, VARIANTS

NAME = "accuracy"
TASK_TYPES: dict[str, type[Task]] = {"perplexity": Perplexity, "needle": Needle, "kv_retrieval": KVRetrieval,
                                     "arithmetic": Arithmetic}
TASK_NAMES = tuple(TASK_TYPES)
# Every registered policy but `none` (the ceiling, always run) and FDC (`benchmarks fdc-accuracy`).
POLICIES = common.policies(none=False, fdc=False)
CHOICES = (*POLICIES, *VARIANTS)  # ablations, on request
# The real models (`--model`): the `tools.assets` function that builds (or finds) each offline.
MODELS = {"SmolLM2-135M-Instruct": "real_model_dir", "Gemma-3-270M": "gemma_model_dir"}
MODEL_NAMES = tuple(MODELS)
# Settings that decide which cases a task builds and how kvpress ran them: an earlier run's
# kvpress records are reused only where all of these match.
KVPRESS_REUSE_KEYS = ("model", "tiny", "seed", "sinks", "dtype", "ppl_segments", "ppl_tokens", "needle_contexts", "needle_depths",
                      "kv_cases", "arith_cases", "kvpress_max_prompt", "kvpress_cases")
# `--resume` also reuses our records, a method's where they hold every run it would make, gvote's
# setting by setting (`gvote_run_key`), so a new sweep point runs that point alone.
RESUME_KEYS = KVPRESS_REUSE_KEYS


def gvote_run_key(settings: dict[str, Any]) -> tuple[Any, Any]:
    """A run's or a record's gvote setting ((None, None) for every other method): a record keeps
    the run's `kv_gvote_*` settings without the prefix."""
    return (settings.get("kv_gvote_p", settings.get("gvote_p")),
            settings.get("kv_gvote_samples", settings.get("gvote_samples")))


def resumed_labels(records: list[dict[str, Any]]) -> list[str]:
    """What `--resume` took from the earlier run, for the results page: `system:method`, and
    gvote's settings each (`vllm-kvprune:gvote p=0.9 S=8`), which are taken one by one."""
    def label(record: dict[str, Any]) -> str:
        p, samples = gvote_run_key(record)
        return f"{record['system']}:{record['method']}" + ("" if p is None else f" p={p:g} S={samples}")

    return sorted({label(r) for r in records if r.get("resumed")})


def build_tasks(args: argparse.Namespace) -> list[Task]:
    made = {
        "perplexity": lambda: Perplexity(args.ppl_segments, args.ppl_tokens),
        "needle": lambda: Needle(args.needle_contexts, args.needle_depths, args.needle_budgets),
        "kv_retrieval": lambda: KVRetrieval(args.kv_cases),
        "arithmetic": lambda: Arithmetic(args.arith_cases),
    }
    tasks = [made[name]() for name in args.tasks]
    for task in tasks:  # resolved once here: a task's own budgets, else the suite's
        task.budgets = task.budgets or list(args.budgets)
    return tasks


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="accuracy of every policy and budget, with kvpress side by side",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASK_NAMES), choices=TASK_NAMES)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=CHOICES,
                        help="also ablations: paged_eviction_paper (paged_eviction by the paper's own rule, kv_sinks 0, "
                             "kv_recent 0: no protected sinks or newest block); snapkv_pool15 (snapkv with "
                             "kv_snapkv_kernel 15, beside kvpress's SnapKVPress(kernel_size=15))")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ppl-segments", type=int, default=4, help="essay segments for perplexity")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="tokens per perplexity segment")
    parser.add_argument("--needle-contexts", type=int, nargs="+", default=[1024, 3072, 5120, 7168])
    parser.add_argument("--needle-depths", type=int, nargs="+", default=[0, 25, 50, 75, 100], help="percent")
    parser.add_argument("--needle-budgets", type=int, nargs="+", default=[256, 1024, 2048],
                        help="budgets of the needle task (its long prompts make it the slowest)")
    parser.add_argument("--gvote-p", type=float, nargs="+", default=[0.85, 0.9, 0.95, 0.99],
                        help="gvote's p_nuc values, each at the default sample count (the paper's Fig. 7)")
    parser.add_argument("--gvote-samples", type=int, nargs="+", default=[1, 4, 8, 16],
                        help="gvote's sample counts, each at the default p (the paper's Fig. 8)")
    parser.add_argument("--kv-cases", type=int, default=40)
    parser.add_argument("--arith-cases", type=int, default=40)
    parser.add_argument("--pool-gib", type=float, default=2.0, help="KV pool of each engine")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="model dtype on both sides (float32 is faster on CPUs without bf16 instructions)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run our engines eagerly (skips vLLM's compilation: quicker for a small run)")
    parser.add_argument("--kvpress", action=argparse.BooleanOptionalAction, default=True,
                        help="run kvpress's presses side by side (needs scripts/setup_kvpress.sh)")
    parser.add_argument("--reuse-kvpress", action="store_true",
                        help="take kvpress's records from --out-dir's files of an earlier run with the same cases "
                             "instead of running kvpress again")
    parser.add_argument("--resume", action="store_true",
                        help="take every method's records (ours and kvpress's) from --out-dir's files of an earlier "
                             "run with the same cases, where they cover this run's cases and budgets; run only the "
                             "methods missing there")
    parser.add_argument("--report-partial", action="store_true",
                        help="run nothing: write the reports from --out-dir's accuracy_partial.json, the records of "
                             "a run stopped before its end (the same flags as that run); its kvpress side has the "
                             "presses that finished")
    parser.add_argument("--kvpress-max-prompt", type=int, default=2200,
                        help="longest prompt kvpress runs (its ObservedAttention needs eager attention, "
                             "about 45 s for a 4K prompt here)")
    parser.add_argument("--kvpress-cases", type=int, default=16,
                        help="kvpress runs the first N cases of each task (its decoding is slow)")
    parser.add_argument("--kvpress-threads", type=int, default=2)
    parser.add_argument("--kvpress-timeout", type=float, default=1800, help="seconds per kvpress job")
    parser.add_argument("--model", default=MODEL_NAMES[0], choices=MODEL_NAMES,
                        help="the real model: SmolLM2-135M-Instruct (chat prompts) or Gemma-3-270M (base: plain "
                             "prompts with the question after the context); write each to its own --out-dir")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny random Llama instead of SmolLM2 (SmolLM2's tokenizer; a smoke run of the "
                             "whole pipeline, its scores mean nothing)")
    parser.add_argument("--out-dir", default="results")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from benchmarks import common

    for name, value in common.ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in this process, one at a time
    if args.report_partial:
        return report_partial(args)
    reused = load_kvpress_records(args) if args.kvpress and args.reuse_kvpress else None
    earlier = Earlier(args) if args.resume else None
    if args.kvpress and reused is None:
        from benchmarks.kvpress_runner import kvpress_python

        kvpress_python()  # fails now, naming the setup script, rather than after the engines ran
    from transformers import AutoTokenizer

    from benchmarks.accuracy import kvpress_side, ours
    from tools import assets

    model = str(assets.tiny_model_dir() if args.tiny else getattr(assets, MODELS[args.model])())
    tokenizer = AutoTokenizer.from_pretrained(model)
    tasks = build_tasks(args)
    work: list[tuple[Task, list[Case]]] = [(t, t.build(tokenizer, random.Random(f"{args.seed}-{t.name}"))) for t in tasks]
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    press_work = [(t, [c for c in cases if len(c.prompt_ids) <= args.kvpress_max_prompt][:args.kvpress_cases])
                  for t, cases in work if t.kvpress_can_run and args.kvpress]
    gvote = ours.gvote_settings(args.gvote_p, args.gvote_samples)
    partial = Path(args.out_dir) / "accuracy_partial.json"  # what a crash later in the run would lose
    for policy in ("none", *args.policies):
        settings_left = gvote
        if earlier:
            found, settings_left = earlier.take_policy(policy, work, gvote)
            records += found[0]
            timings += found[1]
            if settings_left is None:
                continue
        found, timed = ours.run_policy(model, policy, work, args.sinks, args.pool_gib, press_work, settings_left,
                                       dtype=args.dtype, enforce_eager=args.enforce_eager)
        records += found
        timings += timed
        common.write_json(partial, f"{NAME}-partial", {"policies_done": policy}, records, timings=timings)
    specs = kvpress_side.press_specs(args.policies, args.sinks)
    pairs = {policy: spec.get("label", spec["name"]) for policy, spec in specs.items()}
    if reused is not None:
        wanted = {"none", *pairs.values()}
        records += [r for r in reused[0] if r["method"] in wanted]
        timings += [t for t in reused[1] if t["method"] in wanted]
    elif args.kvpress:
        full_cache: dict = {}
        for spec in ({"name": "none"}, *specs.values()):
            press = spec.get("label", spec["name"])
            found = earlier and earlier.take(KVPRESS, press, [(t, [(case, budget, {}) for case, budget in kvpress_side.matched_runs(
                cases, None if press == "none" else t.budgets)]) for t, cases in press_work])
            if found:
                records += found[0]
                timings += found[1]
                if press == "none":  # what budgets that keep the whole prompt answer
                    full_cache.update({(r["task"], r["case_id"]): Answer([], r["answer"]) for r in found[0]})
                else:  # those budgets' records, made from it as a run of the press makes them
                    records += [{**r, "resumed": True} for t, cases in press_work
                                for r in kvpress_side.whole_prompt_records(t, cases, press, full_cache)]
                continue
            found, timed = kvpress_side.run_press(model, spec, press_work, tokenizer, args.kvpress_threads, full_cache,
                                                  args.kvpress_timeout, args.dtype)
            records += found
            timings += timed
            common.write_json(partial, f"{NAME}-partial", {"presses_done": spec["name"]}, records, timings=timings)
    write_reports(args, tasks, records, timings, pairs, time.perf_counter() - started)
    partial.unlink(missing_ok=True)
    return 0


def write_reports(args: argparse.Namespace, tasks: list[Task], records: list[dict[str, Any]],
                  timings: list[dict[str, Any]], pairs: dict[str, str], run_seconds: float) -> None:
    from benchmarks import common
    from benchmarks.accuracy import memory, report
    from benchmarks.accuracy.ours import ENGINE_OPTIONS

    settings = {key: getattr(args, key) for key in (
        "tasks", "policies", "budgets", "sinks", "seed", "ppl_segments", "ppl_tokens", "needle_contexts",
        "needle_depths", "needle_budgets", "kv_cases", "arith_cases", "kvpress", "kvpress_max_prompt", "kvpress_cases",
        "kvpress_threads", "dtype", "gvote_p", "gvote_samples", "reuse_kvpress", "resume", "tiny", "report_partial")}
    if args.resume:  # which methods came from the earlier run, for the results page
        settings["resumed"] = resumed_labels(records)
    settings.update(model=run_model(args), engine=dict(ENGINE_OPTIONS, dtype=args.dtype,
                                                                enforce_eager=args.enforce_eager), run_s=run_seconds,
                    press_of_policy=pairs)
    for task in tasks:
        mine = [r for r in records if r["task"] == task.name]
        headers, rows = report.budget_table(task, mine, task.budgets)
        print(f"\n{task.name} ({task.metric}{', lower is better' if task.lower_is_better else ''})")
        common.print_table(headers, rows)
        extra: dict[str, Any] = {"table": {"headers": headers, "rows": rows}, "metric": task.metric,
                                 "timings": [t for t in timings if t["task"] == task.name]}
        if args.kvpress and task.kvpress_can_run:
            side_headers, side_rows = report.side_by_side(task, mine, pairs, timings)
            print(f"\n{task.name}: ours and kvpress on the same cases")
            common.print_table(side_headers, side_rows)
            extra["side_by_side"] = {"headers": side_headers, "rows": side_rows}
            report.plot_side_by_side(task, report.side_by_side_points(task, mine, pairs, timings),
                                     Path(args.out_dir) / f"accuracy_{task.name}_kvpress_memory.png")
        found = memory.points(task, mine)
        out = Path(args.out_dir) / f"accuracy_{task.name}.json"
        voted = any(p.method in report.BUDGET_FREE for p in found)
        spread = [p for p in found if p.method in ALLOCATIONS]
        if voted or spread:
            print(f"\n{task.name} at equal KV memory")
            common.print_table(*memory.memory_table(task, found))
            memory.plot_vs_memory(task, found, out.with_name(out.stem + "_memory.png"))
        if voted:
            common.print_table(*memory.equal_memory_table(task, found))
        if spread:
            allocation_headers, allocation_rows = memory.allocation_table(task, found, ALLOCATIONS)
            print(f"\n{task.name}: budgets spread by layer or head against uniform")
            common.print_table(allocation_headers, allocation_rows)
            extra["allocations"] = {"headers": allocation_headers, "rows": allocation_rows}
        common.write_json(out, f"{NAME}-{task.name}", settings, mine, **extra)
        task.plot(mine, out.with_suffix(".png"))
        print(f"wrote {out} and its plots")
    # Every task file in the folder, this run's just written: a run of some tasks keeps the others' sweeps.
    found_by_task = memory.swept_tasks({name: json.loads(path.read_text())["results"] for name in TASK_NAMES
                                        if (path := Path(args.out_dir) / f"accuracy_{name}.json").is_file()})
    if found_by_task:
        print("\ngvote's sweeps (the paper's Fig. 7 and 8)")
        common.print_table(*memory.sweep_rows(found_by_task))
        memory.plot_sweeps(found_by_task, Path(args.out_dir) / "accuracy_gvote_sweeps.png")


def report_partial(args: argparse.Namespace) -> int:
    """`--report-partial`: the reports of a run stopped before its end, from the records it saved
    after each method (`accuracy_partial.json`); kvpress's side pairs only the presses found there."""
    from benchmarks.accuracy import kvpress_side

    document = json.loads((Path(args.out_dir) / "accuracy_partial.json").read_text())
    records, timings = document["results"], document.get("timings", [])
    done = {r["method"] for r in records if r["system"] == KVPRESS}
    pairs = {policy: press for policy, spec in kvpress_side.press_specs(args.policies, args.sinks).items()
             if (press := spec.get("label", spec["name"])) in done}
    policies_run = {r["method"] for r in records if r["system"] == OURS}
    args.policies = [policy for policy in args.policies if policy in policies_run]
    print(f"partial run: ours {sorted(policies_run)}, kvpress {sorted(done)}", flush=True)
    write_reports(args, build_tasks(args), records, timings, pairs,
                  sum(t.get("wall_seconds", t["seconds"]) for t in timings if t.get("cases") == "all"
                      or t["system"] == KVPRESS))
    return 0


def run_model(args: argparse.Namespace) -> str:
    """The model a run answers with, as its files name it."""
    return "tiny" if args.tiny else args.model


def earlier_document(args: argparse.Namespace, task: str, flag: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """`--out-dir`'s file of `task` from an earlier run whose `keys` settings are this run's; an
    error naming `flag` and the first setting that differs otherwise."""
    path = Path(args.out_dir) / f"accuracy_{task}.json"
    if not path.is_file():
        raise SystemExit(f"{flag}: {path} does not exist (run once without {flag})")
    document = json.loads(path.read_text())
    earlier = document.get("settings", {})
    earlier.setdefault("tiny", earlier.get("model") == "tiny")  # files from before `tiny` was saved
    for key in keys:
        mine = run_model(args) if key == "model" else getattr(args, key)
        if earlier.get(key) != mine:
            raise SystemExit(f"{flag}: {path} was run with {key}={earlier.get(key)!r}, this run has {mine!r}")
    return document


class Earlier:
    """`--resume`: an earlier run's records, handed out method by method where they cover what
    this run would run (every (case, budget) pair of every task), gvote's setting by setting
    (`take_policy`), each marked `resumed`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.documents = {name: earlier_document(args, name, "--resume", RESUME_KEYS) for name in args.tasks}

    def take(self, system: str, method: str,
             runs: list[tuple[Task, list[tuple[Case, int | None, dict[str, Any]]]]],
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        """`runs`: per task, (case, budget, per-request settings) of every run the method would make."""
        records, timings = [], []
        for task, wanted in runs:
            document = self.documents[task.name]
            mine = [r for r in document["results"] if r["system"] == system and r["method"] == method]
            keys = {(case.case_id, budget, *gvote_run_key(settings)) for case, budget, settings in wanted}
            if not keys <= {(r["case_id"], r["budget"], *gvote_run_key(r)) for r in mine}:
                return None
            records += [{**r, "resumed": True} for r in mine if (r["case_id"], r["budget"], *gvote_run_key(r)) in keys]
            timings += [t for t in document.get("timings", []) if t["system"] == system and t["method"] == method]
        print(f"[{system} {method}] records of the earlier run (--resume)", flush=True)
        return records, timings

    def take_policy(self, policy: str, work: list[tuple[Task, list[Case]]], gvote: list[dict[str, Any]],
                    ) -> tuple[tuple[list[dict[str, Any]], list[dict[str, Any]]], list[dict[str, Any]] | None]:
        """One of our policies: the earlier records and timings it has, and the gvote settings
        still to run (None: nothing is left to run). A budget-free policy is taken setting by
        setting; its earlier timings are kept only when every setting is taken (each covers one
        run's settings together, so they would not time what a partial rerun adds)."""
        from benchmarks.accuracy import ours

        def wanted(settings: list[dict[str, Any]]) -> list:
            return [(t, [(r.case, r.budget, r.settings) for r in ours.policy_runs(policy, t, cases, settings)])
                    for t, cases in work]

        found = self.take(OURS, policy, wanted(gvote))
        if found:
            return found, None
        if policy not in ours.BUDGET_FREE:
            return ([], []), gvote
        records, left = [], []
        for setting in gvote:
            taken = self.take(OURS, policy, wanted([setting]))
            if taken:
                records += taken[0]
            else:
                left.append(setting)
        return (records, []), left


def load_kvpress_records(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """kvpress's records and timings from `--out-dir`'s files of an earlier run whose cases and
    kvpress settings are this run's; an error naming the first that differs otherwise."""
    records, timings = [], []
    for name in args.tasks:
        if not TASK_TYPES[name].kvpress_can_run:
            continue
        document = earlier_document(args, name, "--reuse-kvpress", KVPRESS_REUSE_KEYS)
        budgets = {None, *(args.needle_budgets if name == "needle" else args.budgets)}
        records += [r for r in document["results"] if r["system"] == KVPRESS and r["budget"] in budgets]
        timings += [t for t in document.get("timings", []) if t["system"] == KVPRESS]
    return records, timings

