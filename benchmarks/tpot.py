"""`python -m benchmarks tpot`: time per output token of each policy against `none`
at a long context, in a pool that holds every request (PagedEviction's Fig. 3d).

The paper (Llama 1B/3B/8B on a GPU, vLLM, budget 1024) reports PagedEviction's decode step
10-12% shorter than the full cache's, and as short as StreamingLLM's or a little shorter.
Here: `--batch` requests of `--prompt-tokens` essay tokens (each its own window) decode
together; the budgeted policies prune each prompt to `--budget` after its prefill (`prefill:
full`), so a step attends `budget` cached tokens per request instead of the whole context.
Time per output token is the mean decode step over `--tokens` steps (`decode_steps.py`).
`streaming-shift` and `h2o-gather` are `streaming` and `h2o` whose evictions shift (gather) the
survivors and append, as the methods' own caches do, instead of EQUIP's in-place write (EQUIP's
Fig. 7a compares the two end to end). Each policy runs in an engine of its own (a child process, in-process engine, eager, float32 by
default: see `--dtype`); the policies take turns `--repeats` times and the median round is shown.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks import common

POLICIES = ("none", "streaming", "paged_eviction", "h2o", "streaming-shift", "h2o-gather")
# Baselines: a policy run with a benchmark switch of the engine's (`KVPRUNE_SHIFT_APPEND=1`),
# whose decode evictions move the survivors as the methods' own contiguous caches do instead
# of EQUIP's in-place write (EQUIP's Fig. 7a): `streaming-shift` shifts the window down and
# appends (StreamingLLM), `h2o-gather` gathers each head's survivors and appends (H2O).
SHIFT_APPEND = {"KVPRUNE_SHIFT_APPEND": "1"}
BASELINES = {"streaming-shift": ("streaming", SHIFT_APPEND), "h2o-gather": ("h2o", SHIFT_APPEND)}
BLOCK_SIZE = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--policies", nargs="+", default=["none", "streaming", "paged_eviction"], choices=POLICIES)
    add("--budget", type=int, default=1024, help="the budgeted policies' cap (the paper's Fig. 3d: 1024)")
    add("--sinks", type=int, default=4)
    add("--prompt-tokens", type=int, default=4096, help="essay tokens per request")
    add("--batch", type=int, default=8, help="requests decoding together")
    add("--tokens", type=int, default=128, help="timed decode steps")
    add("--repeats", type=int, default=2, help="rounds, the policies taking turns in each")
    add("--pool-gib", type=float, default=4.0,
        help="KV pool: it must hold every request's whole context under `none` (fp32 SmolLM2: 45 KiB a token), "
             "so that no policy is memory-bound")
    add("--tiny", action="store_true", help="the tiny random model (a smoke run)")
    add("--dtype", default="float32", choices=("bfloat16", "float32"),
        help="float32 by default: bf16 matmuls are emulated, and slow, on CPUs without bf16 instructions")
    add("--out", type=Path, default=Path("results/tpot.json"))
    add("--child", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child is not None:
        common.print_child_result(measure(args, args.child))
        return 0
    started = time.time()
    rounds = common.child_rounds("tpot", args.policies, child_flags(args), args.repeats,
                                 lambda policy: BASELINES[policy][1] if policy in BASELINES else {})
    rows = []
    for policy, found in rounds.items():  # the round with the median mean step, every round's mean kept
        middle, rounds_ms = common.median_round(found, "ms")
        rows.append({"policy": policy, **middle, "rounds_ms": rounds_ms})
    add_ratios(rows)
    common.print_table(*table(rows))
    settings = {key: getattr(args, key) for key in ("policies", "budget", "sinks", "prompt_tokens", "batch", "tokens",
                                                    "repeats", "dtype")}
    settings.update(model="tiny" if args.tiny else "smollm2-135m-instruct", block_size=BLOCK_SIZE,
                    run_s=round(time.time() - started, 1))
    common.write_json(args.out, "tpot", settings, rows)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")
    return 0


def child_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--budget", str(args.budget), "--sinks", str(args.sinks), "--prompt-tokens", str(args.prompt_tokens),
             "--batch", str(args.batch), "--tokens", str(args.tokens), "--dtype", args.dtype, "--pool-gib", str(args.pool_gib)]
    return flags + ["--tiny"] * args.tiny


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each policy's TPOT change against `none` and against `streaming` (negative: shorter)."""
    by_policy = {row["policy"]: row["ms"] for row in rows}
    for row in rows:
        for base in ("none", "streaming"):
            row[f"vs_{base}"] = row["ms"] / by_policy[base] - 1 if base in by_policy else None


# ---- a child: one engine -------------------------------------------------------------
def measure(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    from vllm import LLM

    from benchmarks.decode_steps import time_decode_steps
    from benchmarks.ttft import essay_tokens
    from tools import assets

    model = str(assets.tiny_model_dir() if args.tiny else assets.real_model_dir())
    tokens = essay_tokens(model, args.tiny, args.prompt_tokens * args.batch)
    prompts = [tokens[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.batch)]
    context = args.prompt_tokens + args.tokens + 64 * args.batch  # early requests decode during later prefills
    options: dict[str, Any] = dict(model=model, dtype=args.dtype, block_size=BLOCK_SIZE, enforce_eager=True,
                                   enable_prefix_caching=False, seed=0, max_model_len=context,
                                   max_num_seqs=args.batch, kv_cache_memory_bytes=int(args.pool_gib * 2**30))
    name = BASELINES[policy][0] if policy in BASELINES else policy
    if name != "none":
        options["additional_config"] = {"kv_policy": {"name": name, "budget": args.budget, "sinks": args.sinks}}
    llm = LLM(**options)
    try:
        found = time_decode_steps(llm, prompts, args.tokens, name=policy)
        found["pool_blocks"] = common.engine_scheduler(llm).kv_cache_manager.block_pool.num_gpu_blocks
        return found
    finally:
        common.shutdown(llm)


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    def change(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:+.1f}%"

    headers = ["policy", "TPOT (ms)", "rounds (ms)", "vs none", "vs streaming", "moves / step (ms)"]
    return headers, [[row["policy"], f"{row['ms']:.1f}", " / ".join(f"{ms:.1f}" for ms in row["rounds_ms"]),
                      change(row["vs_none"]), change(row["vs_streaming"]),
                      f"{row['move_ms_per_step']:.2f}" if "move_ms_per_step" in row else "-"] for row in rows]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axes = common.new_figure(5, 3.2)
    names = [row["policy"] for row in rows]
    axes.bar(names, [row["ms"] for row in rows], color="tab:blue")
    for index, row in enumerate(rows):
        axes.plot([index] * len(row["rounds_ms"]), row["rounds_ms"], "k.", markersize=4)
    axes.set_ylabel("time per output token (ms)")
    axes.set_title("decode step at a long context (dots: rounds)")
    common.save_figure(figure, path)
