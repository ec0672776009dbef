"""`python -m benchmarks ttft`: time to first token of every policy against `none`.

One prompt at a time (batch 1), essay tokens, prompts of `--prompt-tokens` lengths; each request
asks for one token, so its wall time is the prefill and one sampling step. Every policy runs in
its own process (one in-process engine, prefix caching off, the same pool); one warm-up request,
then `--repeats` requests per length, each on its own essay window; the median is reported, and
its ratio to `none`'s at the same length.

What a policy adds to a prefill, with the default `prefill: full`: `streaming` and
`paged_eviction` compact the prompt to the budget after it has attended (`paged_eviction` also
scores each token's ||V||/||K|| as it is written); `h2o` sums each prompt token's causal
attention column (its heavy-hitter mass) in an extra pass over the prompt's keys, then
compacts per KV head; `gvote` votes on each layer after the prompt's last chunk and packs the
kept tokens into head-pages; `fdc` runs its own kernel over the narrowed heads; `snapkv`
scores the prompt by its last `snapkv_window` queries (a window x prompt product per layer and
KV head, on the keys read back from the cache), then compacts per KV head.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

RESULT_STEM = "results/ttft"
POLICIES = common.policies()  # the registry's


def policy_config(policy: str, budget: int, fdc: str | None) -> dict[str, Any] | None:
    return common.engine_policy(policy, budget, fdc=fdc)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--policies", nargs="+", default=list(common.policies(fdc=False)), choices=POLICIES,
        help="fdc needs --fdc FILE (vllm-kvprune calibrate fdc MODEL --out FILE)")
    add("--prompt-tokens", type=int, nargs="+", default=[1024, 4096, 7168])
    add("--budget", type=int, default=512, help="budget of the budgeted policies")
    add("--repeats", type=int, default=3)
    add("--fdc", default=None, metavar="FILE")
    add("--tiny", action="store_true", help="the tiny random model (a smoke run)")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add("--enforce-eager", action="store_true")
    add("--out", type=Path, default=Path(RESULT_STEM + ".json"))
    add("--note", default=None, help="a line the results page shows with this run (e.g. which build ran it)")
    add("--child", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if "fdc" in args.policies and not args.fdc:
        raise SystemExit("ttft: --policies fdc needs --fdc FILE (vllm-kvprune calibrate fdc MODEL --out FILE)")
    if args.child is not None:
        common.print_child_result(measure(args, args.child))
        return 0
    if not args.out.suffix:  # `--out results/ttft_x` writes results/ttft_x.json (and .png)
        args.out = args.out.with_suffix(".json")
    started = time.time()
    rows: list[dict[str, Any]] = []
    for policy in args.policies:
        print(f"[ttft] {policy} ...", flush=True)
        command = [sys.executable, "-m", "benchmarks", "ttft", "--child", policy, *child_flags(args)]
        try:
            rows += common.run_child(command, common.child_env({**os.environ, **common.ENGINE_ENV}), f"the {policy} run")
        except RuntimeError as error:
            raise SystemExit(f"ttft: {error}") from None
    add_ratios(rows)
    common.print_table(*table(rows))
    settings = {"policies": args.policies, "prompt_tokens": args.prompt_tokens, "budget": args.budget,
                "repeats": args.repeats, "model": "tiny" if args.tiny else "smollm2-135m-instruct",
                "dtype": args.dtype, "enforce_eager": args.enforce_eager, "run_s": round(time.time() - started, 1),
                "note": args.note, "fused_mass": os.environ.get("KVPRUNE_FUSED_MASS", "1") == "1"}
    common.write_json(args.out, "ttft", settings, rows)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")
    return 0


def child_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--prompt-tokens", *map(str, args.prompt_tokens), "--budget", str(args.budget),
             "--repeats", str(args.repeats), "--dtype", args.dtype, "--out", str(args.out)]
    flags += ["--fdc", args.fdc] if args.fdc else []
    return flags + ["--tiny"] * args.tiny + ["--enforce-eager"] * args.enforce_eager


def measure(args: argparse.Namespace, policy: str) -> list[dict[str, Any]]:
    """One engine for `policy`; per prompt length, the median wall time of a one-token request."""
    from vllm import LLM, SamplingParams

    from tools import assets

    model = str(assets.tiny_model_dir() if args.tiny else assets.real_model_dir())
    longest = max(args.prompt_tokens)
    config = policy_config(policy, args.budget, args.fdc)
    llm = LLM(model=model, dtype=args.dtype, block_size=32, max_model_len=longest + 32, max_num_seqs=1,
              enforce_eager=args.tiny or args.enforce_eager, enable_prefix_caching=False, seed=0,
              kv_cache_memory_bytes=1 << 30, **({"additional_config": {"kv_policy": config}} if config else {}))
    tokens = essay_tokens(model, args.tiny, longest * (args.repeats + 1))  # a window per repeat, one to warm up
    params = SamplingParams(temperature=0, max_tokens=1)
    # One warm-up request (the shortest length, its own window), then every timed one.
    llm.generate([{"prompt_token_ids": tokens[-min(args.prompt_tokens):]}], params, use_tqdm=False)
    rows = []
    for length in args.prompt_tokens:
        seconds = []
        for repeat in range(args.repeats):
            began = time.perf_counter()
            llm.generate([{"prompt_token_ids": tokens[repeat * longest: repeat * longest + length]}], params,
                         use_tqdm=False)
            seconds.append(time.perf_counter() - began)
        rows.append({"policy": policy, "budget": (common.engine_policy(policy, args.budget) or {}).get("budget"),
                     "prompt_tokens": length,
                     "ttft_ms": 1000 * statistics.median(seconds), "ttft_ms_all": [1000 * s for s in seconds]})
        print(f"[ttft] {policy} {length} tokens: {rows[-1]['ttft_ms']:.0f} ms", file=sys.stderr, flush=True)
    common.shutdown(llm)
    return rows


def essay_tokens(model: str, tiny: bool, count: int) -> list[int]:
    """`count` essay tokens (repeated if the essays are shorter); the tiny model takes ids."""
    if tiny:
        return [3 + i % 30000 for i in range(count)]
    from transformers import AutoTokenizer

    from benchmarks.accuracy.task import essay_token_ids

    essay = essay_token_ids(AutoTokenizer.from_pretrained(model))
    return (essay * (count // len(essay) + 1))[:count]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    none = {row["prompt_tokens"]: row["ttft_ms"] for row in rows if row["policy"] == "none"}
    for row in rows:
        base = none.get(row["prompt_tokens"])
        row["vs_none"] = row["ttft_ms"] / base if base else None


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["policy", "budget", "prompt tokens", "TTFT ms (median)", "vs none"]
    body = [[row["policy"], "-" if row["budget"] is None else str(row["budget"]), str(row["prompt_tokens"]),
             f"{row['ttft_ms']:.0f}", "-" if row.get("vs_none") is None else f"{row['vs_none']:.2f}x"]
            for row in rows]
    return headers, body


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axes = common.new_figure(6.5, 4)
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = [row for row in rows if row["policy"] == policy]
        axes.plot([row["prompt_tokens"] for row in mine], [row["ttft_ms"] for row in mine], marker="o", label=policy)
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("time to first token, ms (median)")
    axes.set_title("TTFT at batch 1")
    axes.legend()
    common.save_figure(figure, path)
