"""`python -m benchmarks metrics-overhead`: what our metrics (or, with `--switch checks`,
the debug invariant checks of `KVPRUNE_CHECK=1`) cost a serving engine.

One in-process engine with a policy and vLLM's stats on (`disable_log_stats=False`); the same
batch runs again and again with our metrics on and off in turn (off: the scheduler keeps no
totals and the worker reports no kept tokens, `KVPRUNE_METRICS=0`), the order swapped every
round so drift hits both alike. Tokens/s is output tokens over the wall time of `generate`; the
overhead is 1 - (median on / median off). vLLM's own stats are on in both: they are the user's
choice (`--disable-log-stats`), ours come on top of them.

The rounds of a 2-core machine spread by far more than 1%, so the metrics' cost is also measured
directly: during the "on" rounds a stopwatch runs around every piece of our metrics code (the
scheduler's counting, gauges and snapshot writes, the worker's count of kept tokens), outermost
calls only, and its time is divided by the round's wall time. The stopwatch's own cost is
inside that figure: it is an upper bound.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

NAME = "metrics-overhead"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="our metrics on vs off, same engine, same batch", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="streaming", choices=("streaming", "h2o", "paged_eviction", "gvote"))
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the tiny random Llama (seconds; for tests)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="model dtype (float32: bf16 is emulated, and slow, on CPUs without AVX-512)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vLLM's eager mode for the real model too (the tiny model always runs eager)")
    parser.add_argument("--switch", choices=("metrics", "checks"), default="metrics",
                        help="what is turned on and off: our metrics, or the debug invariant checks")
    parser.add_argument("--prometheus-multiprocess", action="store_true",
                        help="count into Prometheus' multiprocess files too, as every engine does under several "
                             "API servers (a fresh PROMETHEUS_MULTIPROC_DIR; vllm_kvprune/metrics/multiprocess.py)")
    parser.add_argument("--out", default="results/metrics_overhead")
    parser.set_defaults(run=run)


class Stopwatch:
    """Wall time spent inside the callables it wraps, counted for outermost calls only (a
    wrapped function that calls another wrapped one is timed once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, owner: Any, name: str) -> None:
        """Replace `owner.name` (an instance's or a class's attribute) by a timed call of it."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - started
                    self.calls += 1

        setattr(owner, name, timed)


def time_metrics_code(scheduler: Any, stats: Any) -> Stopwatch:
    """A stopwatch around our metrics code in an in-process engine: everything the engine does
    for the metrics only when they are on."""
    from vllm_kvprune.worker.state import RequestKVState

    watch = Stopwatch()
    for name in ("step", "returned", "preempted", "failed", "finished", "rejected"):
        watch.wrap(stats, name)
    for name in ("_write_stats", "_policy_blocks", "_unpruned_blocks"):
        watch.wrap(scheduler, name)
    watch.wrap(RequestKVState, "kept_tokens")  # the worker's report of kept tokens
    return watch


def _switch(what: str, scheduler: Any, saved: Any, on: bool) -> None:
    from vllm_kvprune import metrics
    from vllm_kvprune.engine import checks

    if what == "checks":
        os.environ[checks.CHECK_ENV] = "1" if on else "0"  # the worker reads it every step
        scheduler._checking = on
        return
    os.environ[metrics.SWITCH_ENV] = "1" if on else "0"
    scheduler.kvprune_stats = saved if on else None


def run(args: argparse.Namespace) -> int:
    from benchmarks import common

    for name, value in common.ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.prometheus_multiprocess:
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvprune-prometheus-")
    from vllm import LLM, SamplingParams

    from benchmarks.accuracy.task import essay_token_ids
    from tools import assets

    model = str(assets.tiny_model_dir() if args.tiny else assets.real_model_dir())
    policy: dict[str, Any] = {"name": args.policy}
    if args.policy != "gvote":
        policy.update(budget=args.budget, sinks=4)
    llm = LLM(model=model, dtype=args.dtype, block_size=32, max_model_len=4096,
              enforce_eager=args.tiny or args.enforce_eager, enable_prefix_caching=False, disable_log_stats=False,
              seed=0, kv_cache_memory_bytes=1 << 30, additional_config={"kv_policy": policy})
    from transformers import AutoTokenizer

    essay = essay_token_ids(AutoTokenizer.from_pretrained(model)) if not args.tiny else list(range(3, 3000))
    prompts = [{"prompt_token_ids": essay[i * 97: i * 97 + args.prompt_tokens]} for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    scheduler = common.engine_scheduler(llm)
    saved = scheduler.kvprune_stats
    if saved is None:
        raise SystemExit("metrics-overhead: the engine counts no metrics (is KVPRUNE_METRICS=0 set?)")
    if args.prometheus_multiprocess and saved._mirror is None:
        raise SystemExit("metrics-overhead: the engine does not count into Prometheus' multiprocess files")
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: the same batch once
    watch = time_metrics_code(scheduler, saved) if args.switch == "metrics" else None
    rates: dict[str, list[float]] = {"on": [], "off": []}
    shares: list[float] = []  # per "on" round: time inside our metrics code / wall time
    for round_index in range(args.rounds):
        for mode in (("on", "off") if round_index % 2 == 0 else ("off", "on")):
            _switch(args.switch, scheduler, saved, mode == "on")
            inside = watch.seconds if watch is not None else 0.0
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            rates[mode].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
            if watch is not None and mode == "on":
                shares.append((watch.seconds - inside) / seconds)
    _switch(args.switch, scheduler, saved, args.switch == "metrics")
    common.shutdown(llm)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    overhead = 1 - on / off
    headers = [args.switch, "tokens/s (median)", "runs"]
    rows = [["on", f"{on:.1f}", " ".join(f"{r:.1f}" for r in rates["on"])],
            ["off", f"{off:.1f}", " ".join(f"{r:.1f}" for r in rates["off"])]]
    common.print_table(headers, rows)
    print(f"overhead of our {args.switch}: {overhead:+.2%}" + (" (goal <= 1%)" if args.switch == "metrics" else ""))
    direct = statistics.median(shares) if shares else None
    if direct is not None:
        print(f"time inside our metrics code: {direct:.3%} of the wall time (median of {len(shares)} rounds, "
              f"max {max(shares):.3%}, {watch.calls} timed calls)")
    out = Path(args.out)
    settings = {key: getattr(args, key) for key in ("policy", "budget", "requests", "prompt_tokens", "gen_tokens",
                                                    "rounds", "tiny", "switch", "dtype", "enforce_eager",
                                                    "prometheus_multiprocess")}
    common.write_json(out.with_suffix(".json"), NAME, settings, [{"metrics": k, "tokens_per_s": v}
                                                                for k, v in rates.items()],
                      median_on=on, median_off=off, overhead=overhead,
                      metrics_code_share=direct, metrics_code_shares=shares)
    figure, axes = common.new_figure(4.0, 3.0)
    axes.bar(["on", "off"], [on, off], color=["tab:blue", "tab:gray"])
    axes.set_ylabel("output tokens/s (median)")
    axes.set_title(f"our {args.switch}: {overhead:+.2%}")
    common.save_figure(figure, out.with_suffix(".png"))
    return 0
