"""`python -m benchmarks throughput`: output tokens/s of memory-bound serving.

Many requests with long generations share a KV pool too small for all of their full
caches. `none` can keep only a few whole caches at once (vLLM admits more and then
preempts them, recomputing their caches later), while `streaming` and `h2o` bound each
request at `ceil((budget + 1) / block_size)` blocks after its prompt and `paged_eviction` at
`ceil(budget / block_size)`, so many run together.

Cases, each in its own subprocess (in-process engine, `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
so the scheduler can be sampled after every step and no engine shares a process):
- memory-bound: `none`, and each of `--policies` (`streaming`, `h2o`, `paged_eviction`) at each
  budget, on the same small pool;
- overhead: `streaming` with a budget above every request's length (nothing is evicted)
  against `none`, both on a pool that holds every request whole.

Defaults (about 30 minutes on 2 idle cores): SmolLM2-135M in bf16, 8 requests of 128
essay tokens + 4096 generated (`ignore_eos`), blocks of 32 tokens, `max_model_len` 8192,
`max_num_seqs` 32, and a memory-bound pool of 288 blocks (9216 tokens; one block is vLLM's
null block, and `none` needs 257 to admit `max_model_len` at all). A whole request needs
132 blocks, so `none` holds 2 at once; it runs with `max_num_seqs` 2 (`--none-max-seqs
fit`), its best setting: with 32, vLLM admits all 8, then preempts and recomputes them over
and over and runs several times slower. Streaming keeps 9 / 17 / 33 / 65 blocks at budgets
256 / 512 / 1024 / 2048 (paged_eviction 8 / 16 / 32 / 64), so all 8 run at once up to 1024. Overhead: 8 requests of 128 + 512 tokens, budget
672, a pool that holds them all, best of 3 batches per engine. `--quick`: the tiny random
Llama, 8 requests of 160 + 96 tokens on 33 blocks with stock `none` (which admits 6: the
prompts fill the pool; at budget 96 `streaming` keeps 4 blocks each and `paged_eviction` 3),
a few minutes.

Per case: one warm-up request, then the whole batch is added to the engine and stepped
to completion; tokens/s is output tokens over the wall clock of that loop. After every
step the bench samples the running requests, the blocks in use and the blocks held by
each request, and reads preemptions from the requests themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from benchmarks import common
# What a case is and how one is measured live with the child that runs it.
from benchmarks.throughput_case import BUDGET_FREE, BUDGETED, KEEP_ALL, WITH_FDC, Case, EngineSettings, Workload
# The table, the plot, the ratios and the target lines (shared with the results page).
from benchmarks.throughput_report import (
    MATCHED_POLICY, MEMORY_BOUND, OVERHEAD, plot_throughput, summary, table_cells, target_lines, with_ratios,
)

CHILD_ENV = common.ENGINE_ENV
RESULT_STEM = "results/throughput"


# ---- the parent: plan, run each case in a subprocess, report -----------------------------
@dataclass(frozen=True)
class Plan:
    """Every case of a run and the engine settings they share."""

    engine: EngineSettings
    cases: tuple[Case, ...]


QUICK_DEFAULTS = dict(
    model="tiny", requests=8, prompt_tokens=160, gen_tokens=96, budgets=[96], pool_blocks=33,
    max_model_len=1024, max_num_seqs=8, none_max_seqs="stock", overhead_requests=4, overhead_gen_tokens=64,
    overhead_repeats=1,
)
FULL_DEFAULTS = dict(
    model="real", requests=8, prompt_tokens=128, gen_tokens=4096, budgets=[256, 512, 1024, 2048],
    pool_blocks=288, max_model_len=8192, max_num_seqs=32, none_max_seqs="fit", overhead_requests=8,
    overhead_gen_tokens=512, overhead_repeats=3,
)


def overhead_budget(prompt_tokens: int, gen_tokens: int, block_size: int) -> int:
    """The smallest whole-block budget above a request's full length: nothing is evicted."""
    return math.ceil((prompt_tokens + gen_tokens + 1) / block_size) * block_size


def min_pool_blocks(max_model_len: int, block_size: int) -> int:
    """vLLM admits `none` only if one max_model_len request fits, plus its null block."""
    return math.ceil(max_model_len / block_size) + 1


def overhead_pool_blocks(workload: Workload, max_model_len: int, block_size: int) -> int:
    """A pool that holds every request whole (and one max_model_len request)."""
    per_request = math.ceil((workload.request_tokens + 1) / block_size)
    return max(workload.num_requests * per_request + 1, min_pool_blocks(max_model_len, block_size))


def whole_requests_that_fit(workload: Workload, block_size: int) -> int:
    """Requests whose full cache the pool holds at once (one block is vLLM's null block)."""
    return max(1, (workload.pool_blocks - 1) // math.ceil(workload.request_tokens / block_size))


def none_max_num_seqs(choice: str, workload: Workload, engine: EngineSettings) -> int:
    """`fit`: as many as fit whole (no preemption); `stock`: the engine's max_num_seqs."""
    if choice == "fit":
        return min(engine.max_num_seqs, whole_requests_that_fit(workload, engine.block_size))
    if choice == "stock":
        return engine.max_num_seqs
    return int(choice)


def fdc_pool_blocks(engine: EngineSettings, pool_blocks: int) -> int:
    """Blocks of FDC's narrowed specs that the bytes of `pool_blocks` full-width blocks hold
    (a block is as wide as the sum of the layers' own padded widths)."""
    from vllm_kvprune.worker.fdc_layers import FdcLayers

    layers = FdcLayers(engine.fdc, None)
    full_width = 2 * layers.num_kv_heads * layers.head_dim * len(layers.layer_widths)
    return pool_blocks * full_width // sum(layers.layer_widths)


def none_case(args: argparse.Namespace, bound: Workload, engine: EngineSettings) -> Case:
    """`none`'s memory-bound case. With --none-requests it runs fewer of the same requests, in
    whole waves of those it runs at once (its help says why that is fair); a part wave is refused."""
    wave = none_max_num_seqs(args.none_max_seqs, bound, engine)
    if args.none_requests is None:
        return Case(MEMORY_BOUND, "none", None, bound, wave)
    if args.none_max_seqs != "fit" or args.none_requests <= 0 or args.none_requests % wave:
        raise SystemExit(
            f"--none-requests {args.none_requests}: needs --none-max-seqs fit and a positive multiple "
            f"of the {wave} requests `none` runs at once here (a part wave would understate it)"
        )
    fewer = dataclasses.replace(bound, num_requests=min(args.none_requests, bound.num_requests))
    return Case(MEMORY_BOUND, "none", None, fewer, wave)


def plan_cases(args: argparse.Namespace, engine: EngineSettings) -> tuple[Case, ...]:
    bound = Workload(args.requests, args.prompt_tokens, args.gen_tokens, args.pool_blocks)
    cases = [none_case(args, bound, engine)]
    for policy in args.policies:
        if policy in KEEP_ALL:
            # Every token kept, like `none`, so it runs as many requests as fit whole (its best,
            # see --none-max-seqs), in the narrower blocks the same bytes hold.
            narrow = dataclasses.replace(bound, pool_blocks=fdc_pool_blocks(engine, bound.pool_blocks))
            cases.append(Case(MEMORY_BOUND, policy, None, bound, none_max_num_seqs(args.none_max_seqs, narrow, engine)))
            continue
        budgets = [None] if policy in BUDGET_FREE else args.budgets
        # With FDC the same bytes (`pool_blocks` full-width blocks) hold more, narrower blocks.
        cases += [Case(MEMORY_BOUND, policy, budget, bound) for budget in budgets]
    if args.overhead_requests == 0:  # asked for the memory-bound cases only
        return tuple(cases)
    free = Workload(args.overhead_requests, args.prompt_tokens, args.overhead_gen_tokens, 0, args.overhead_repeats)
    free = dataclasses.replace(free, pool_blocks=overhead_pool_blocks(free, engine.max_model_len, engine.block_size))
    budget = overhead_budget(free.prompt_tokens, free.gen_tokens, engine.block_size)
    cases += [Case(OVERHEAD, "none", None, free), Case(OVERHEAD, "streaming", budget, free)]
    return tuple(cases)


def resolve_model(model: str) -> str:
    from tools import assets

    if model == "real":
        return str(assets.real_model_dir())
    if model == "tiny":
        return str(assets.tiny_model_dir())
    return model


def build_plan(args: argparse.Namespace) -> Plan:
    engine = EngineSettings(
        model=resolve_model(args.model), dtype=args.dtype, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, sinks=args.sinks, fdc=args.fdc,
    )
    if any(policy in (*KEEP_ALL, *WITH_FDC) for policy in args.policies) and not args.fdc:
        raise SystemExit("--policies fdc / POLICY+fdc need --fdc FILE (vllm-kvprune calibrate fdc MODEL --out FILE)")
    needed = min_pool_blocks(engine.max_model_len, engine.block_size)
    if args.pool_blocks < needed:
        raise SystemExit(
            f"--pool-blocks {args.pool_blocks} cannot admit `none` at --max-model-len "
            f"{engine.max_model_len}: it needs at least {needed} blocks of {engine.block_size} tokens"
        )
    return Plan(engine, plan_cases(args, engine))


def child_env(verbose: bool, omp_wait_policy: str) -> dict[str, str]:
    env = {**os.environ}
    for name, value in CHILD_ENV.items():
        env.setdefault(name, value)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["OMP_WAIT_POLICY"] = omp_wait_policy
    if verbose:
        env["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    return common.child_env(env)


def run_in_subprocess(engine: EngineSettings, case: Case, env: dict[str, str], verbose: bool, bar: tqdm) -> dict[str, Any]:
    """Run one case in a fresh interpreter, following its progress on `bar`.

    The child's log is shown only if it fails (or with --verbose).
    """
    with tempfile.TemporaryDirectory(prefix="kvprune-throughput-") as folder:
        files = {name: Path(folder, name) for name in ("spec.json", "result.json", "progress", "child.log")}
        spec = {"engine": dataclasses.asdict(engine), "case": dataclasses.asdict(case),
                "progress": str(files["progress"])}
        files["spec.json"].write_text(json.dumps(spec))
        command = [sys.executable, "-m", "benchmarks.throughput_case",
                   str(files["spec.json"]), str(files["result.json"])]
        with files["child.log"].open("w") as log:
            output = None if verbose else log
            child = subprocess.Popen(command, env=env, stdout=output, stderr=output)
            try:
                follow_progress(child, files["progress"], bar)
            finally:
                stop_child(child)
        if child.returncode != 0 or not files["result.json"].is_file():
            tail = "".join(files["child.log"].read_text().splitlines(keepends=True)[-40:])
            raise RuntimeError(f"{case.label} failed (exit {child.returncode}):\n{tail}")
        return json.loads(files["result.json"].read_text())


def stop_child(child: subprocess.Popen) -> None:
    """Leave no engine behind when the bench is interrupted."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def follow_progress(child: subprocess.Popen, progress: Path, bar: tqdm) -> None:
    """Wait for the child, moving the bar to the token count it reports."""
    while child.poll() is None:
        time.sleep(1.0)
        try:
            done = int(progress.read_text())
        except (OSError, ValueError):
            continue
        bar.update(done - bar.n)


def case_row(engine: EngineSettings, case: Case, measured: dict[str, Any]) -> dict[str, Any]:
    return {
        "setting": case.setting,
        "policy": case.policy,
        "budget": case.budget,
        "cap_blocks": case.cap_blocks(engine.block_size, engine.sinks),
        "requests": case.workload.num_requests,
        "prompt_tokens": case.workload.prompt_tokens,
        "gen_tokens": case.workload.gen_tokens,
        "pool_blocks": measured["usable_pool_blocks"],
        "max_num_seqs": case.max_num_seqs or engine.max_num_seqs,
        "matched_to": case.matched_to,
        **measured,
    }


def matched_budget(mean_request_blocks: float, block_size: int) -> int:
    """The budget whose cap (`ceil((budget + 1) / block_size)` blocks) is the nearest whole
    number of blocks to a measured mean, at least one."""
    return max(1, round(mean_request_blocks)) * block_size - 1


def run_plan(plan: Plan, env: dict[str, str], verbose: bool) -> list[dict[str, Any]]:
    """Run every case; after each budget-free one, `MATCHED_POLICY` at the memory it measured."""
    rows = []
    pending = list(plan.cases)
    while pending:
        case = pending.pop(0)
        workload = case.workload
        total = workload.num_requests * workload.gen_tokens * workload.repeats
        description = f"[{len(rows) + 1}/{len(rows) + 1 + len(pending)}] {case.label}"
        with tqdm(total=total, desc=description, unit="tok", leave=False, dynamic_ncols=True) as bar:
            measured = run_in_subprocess(plan.engine, case, env, verbose, bar)
        rows.append(case_row(plan.engine, case, measured))
        tqdm.write(f"{description}: {measured['tokens_per_s']:.1f} tok/s, {measured['wall_s']:.0f} s timed, "
                   f"mean running {measured['mean_running']:.1f}, preemptions {measured['preemptions']}, "
                   f"mean blocks/request {measured['mean_request_blocks']:.1f}")
        if case.policy in BUDGET_FREE and measured["request_samples"]:
            budget = matched_budget(measured["mean_request_blocks"], plan.engine.block_size)
            pending.insert(0, dataclasses.replace(case, policy=MATCHED_POLICY, budget=budget, matched_to=case.policy))
    return with_ratios(rows)


# ---- command line ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `throughput` flags; unset sizes take the full or the --quick defaults."""
    full = FULL_DEFAULTS
    add = parser.add_argument
    add("--quick", action="store_true",
        help="smoke run: tiny model, 8 short requests, one budget (a few minutes)")
    add("--model", default=None, help=f"real | tiny | a model folder (default {full['model']})")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add("--requests", type=int, default=None, help=f"requests in the memory-bound batch ({full['requests']})")
    add("--prompt-tokens", type=int, default=None, help=f"essay tokens per prompt ({full['prompt_tokens']})")
    add("--gen-tokens", type=int, default=None, help=f"generated tokens per request ({full['gen_tokens']})")
    add("--budgets", type=int, nargs="+", default=None, help=f"budgets of each policy ({full['budgets']})")
    add("--policies", nargs="+", default=["streaming", "h2o", "paged_eviction"],
        choices=(*BUDGETED, *BUDGET_FREE, *KEEP_ALL, *WITH_FDC),
        help="policies of the memory-bound cases (default: three budgeted ones); a budget-free "
             f"one ({', '.join(BUDGET_FREE)}) runs once, then {MATCHED_POLICY} runs at the mean "
             "blocks per request it measured (equal memory)")
    add("--pool-blocks", type=int, default=None,
        help=f"KV pool of the memory-bound cases, in blocks ({full['pool_blocks']})")
    add("--max-model-len", type=int, default=None, help=f"({full['max_model_len']})")
    add("--max-num-seqs", type=int, default=None, help=f"({full['max_num_seqs']})")
    add("--none-max-seqs", type=seqs_choice, default=None, metavar="fit|stock|N",
        help="max_num_seqs of the memory-bound `none` engine: fit = as many requests as the pool "
             "holds whole, so none never preempts (default); stock = --max-num-seqs, where vLLM "
             "admits everyone, then preempts and recomputes over and over (slow; --quick uses it)")
    add("--none-requests", type=int, default=None, metavar="N",
        help="run the memory-bound `none` case on only N of the requests (default: all). With "
             "--none-max-seqs fit, `none` runs the requests in waves of as many as fit whole, each "
             "wave the same work, so one wave's tokens/s is its rate over them all: a whole wave "
             "(N = the fit count) measures `none` at a fraction of the time")
    add("--block-size", type=int, default=32)
    add("--fdc", default=None, metavar="FILE",
        help="FDC calibration of the model, for --policies fdc, streaming+fdc and paged_eviction+fdc "
             "(vllm-kvprune calibrate fdc MODEL --out FILE)")
    add("--sinks", type=int, default=4)
    add("--overhead-requests", type=int, default=None,
        help=f"requests of the overhead cases; 0 leaves them out ({full['overhead_requests']})")
    add("--overhead-gen-tokens", type=int, default=None, help=f"({full['overhead_gen_tokens']})")
    add("--overhead-repeats", type=int, default=None,
        help=f"timed batches per overhead engine, best kept ({full['overhead_repeats']})")
    add("--out", default=RESULT_STEM, help="results stem: writes STEM.json and STEM.png")
    add("--omp-wait-policy", type=str.upper, choices=("PASSIVE", "ACTIVE"),
        default=os.environ.get("OMP_WAIT_POLICY", "PASSIVE").upper(),
        help="OMP_WAIT_POLICY of the engines (default PASSIVE, or the environment's): on a "
             "shared box, spinning OpenMP barriers stall whenever another process takes a "
             "core, which in one measurement here made a batch-2 decode 17x slower (2.4 vs 40 tok/s)")
    add("--verbose", action="store_true", help="show the engines' logs")


def seqs_choice(text: str) -> str:
    if text in ("fit", "stock") or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"expected fit, stock or a positive integer, got {text!r}")


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks throughput", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return with_defaults(parser.parse_args(argv))


def run_settings(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    overhead = [case for case in plan.cases if case.setting == OVERHEAD]
    return {
        "engine": dataclasses.asdict(plan.engine),
        "quick": args.quick,
        "memory_bound": dataclasses.asdict(memory_bound_workload(plan)),
        "overhead": dataclasses.asdict(overhead[-1].workload) if overhead else None,
        "overhead_budget": overhead[-1].budget if overhead else None,
        "budgets": list(args.budgets),
        "policies": list(args.policies),
        "none_max_seqs": args.none_max_seqs,
        "engine_env": {name: child_env(args.verbose, args.omp_wait_policy).get(name)
                       for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_WAIT_POLICY")},
    }


def memory_bound_workload(plan: Plan) -> Workload:
    """The memory-bound batch every policy runs (`none` may run fewer of it: --none-requests)."""
    return max((case.workload for case in plan.cases if case.setting == MEMORY_BOUND),
               key=lambda workload: workload.num_requests)


def plot_title(plan: Plan) -> str:
    workload = memory_bound_workload(plan)
    return (
        f"{Path(plan.engine.model).name}, {workload.num_requests} requests x "
        f"{workload.prompt_tokens}+{workload.gen_tokens} tokens, pool {workload.pool_blocks} "
        f"blocks of {plan.engine.block_size}"
    )


def report(args: argparse.Namespace, plan: Plan, rows: list[dict[str, Any]], timing: dict[str, Any]) -> None:
    """Print the table and the target check; write STEM.json and STEM.png."""
    common.print_table(*table_cells(rows))
    totals = summary(rows)
    print(target_lines(totals, timing))
    stem = Path(args.out)
    common.write_json(stem.with_suffix(".json"), "throughput", run_settings(args, plan), rows,
                      summary=totals, timing=timing)
    plot_throughput(rows, stem.with_suffix(".png"), plot_title(plan), plan.engine.block_size)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run every case, print the table, write the JSON and the plot."""
    plan = build_plan(with_defaults(args))
    # A terminated bench unwinds (and so stops its engine child) instead of dying at once.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = run_plan(plan, child_env(args.verbose, args.omp_wait_policy), args.verbose)
    elapsed = time.perf_counter() - started
    report(args, plan, rows, {"run_s": elapsed, "load_before": load_before, "load_after": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
