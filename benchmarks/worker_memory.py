"""`python -m benchmarks worker-memory`: what a worker holds per request, per policy.

32 requests at 8K context (prompts of 8,000 essay tokens, 64 generated) run at once on a pool
that holds them all; each policy in its own process (in-process engine), sampled after every
step: the process's RSS, and the bytes of the worker's per-request state (slot maps, sink
keys) read off its objects. The state must follow each request's cap, not the longest
sequence it ever held nor `max_model_len`. The same run reports, for `h2o` with lazy pruning
(R = 8), the share of the decode steps (all 32 requests decoding) spent planning.

The model is SmolLM2-135M's shape where the worker's state scales (30 layers, 3 KV heads,
GQA 3) with narrow heads (head_dim 32, hidden 288): the per-request maps are the real model's
size while the 8K-token prefills take minutes, not an hour. `--code DIR` runs the children
on another checkout of the package (e.g. a `git worktree` of an older commit, with its C++
extension built in place), for before/after tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

RESULT_STEM = "results/worker_memory"
POLICIES = {
    "none": None,
    "streaming": {"name": "streaming", "budget": 1024, "sinks": 4},
    "h2o": {"name": "h2o", "budget": 1024, "sinks": 4, "prune_interval": 8},
    "paged_eviction": {"name": "paged_eviction", "budget": 1024, "sinks": 4},
}
MODEL_SHAPE = dict(num_hidden_layers=30, hidden_size=288, num_attention_heads=9, num_key_value_heads=3,
                   head_dim=32, intermediate_size=768)
BLOCK_SIZE = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    add("--requests", type=int, default=32)
    add("--prompt-tokens", type=int, default=8000)
    add("--gen-tokens", type=int, default=64)
    add("--code", type=Path, default=None, help="run the children on the vllm_kvprune package under DIR")
    add("--label", default="after", help="name of this run in the JSON (e.g. before / after)")
    add("--out", type=Path, default=Path(RESULT_STEM + ".json"))
    add("--child", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child is not None:
        common.print_child_result(measure(args.child, args.requests, args.prompt_tokens, args.gen_tokens))
        return 0
    rows = []
    for policy in args.policies:
        print(f"[worker-memory] {args.label}: {policy} ...", flush=True)
        rows.append({"label": args.label, "policy": policy, "command": [sys.executable, *sys.argv],
                     **_run_child(policy, args)})
    _merge_into(args.out, rows, vars(args))
    _report(args.out)
    return 0


def _run_child(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    # `--code`'s package first; this tree's `benchmarks` and `tools` after it.
    env = common.child_env({**os.environ, **common.ENGINE_ENV}, *([args.code] if args.code is not None else []))
    command = [sys.executable, __file__, "--child", policy, "--requests", str(args.requests),
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    return common.run_child(command, env, policy)


# ---- one policy, in its own process ---------------------------------------------------------
def measure(policy_name: str, num_requests: int, prompt_tokens: int, gen_tokens: int) -> dict[str, Any]:
    import vllm_kvprune
    from vllm import LLM, SamplingParams
    from tools import assets

    model = str(assets.tiny_model_dir(assets.TinyModelSpec(**MODEL_SHAPE)))
    context = prompt_tokens + gen_tokens
    pool_blocks = num_requests * -(-context // BLOCK_SIZE) + 64
    page = 2 * BLOCK_SIZE * MODEL_SHAPE["num_key_value_heads"] * MODEL_SHAPE["head_dim"] * 2 * MODEL_SHAPE["num_hidden_layers"]
    policy = POLICIES[policy_name]
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=context + 64,
              max_num_seqs=num_requests, enable_prefix_caching=False, kv_cache_memory_bytes=pool_blocks * page,
              **({"additional_config": {"kv_policy": policy}} if policy else {}))
    runner = common.model_runner(llm)
    state = getattr(runner, "kv_state", None)
    text_ids = llm.get_tokenizer()(assets.essays_text())["input_ids"]
    started_rss = _rss_mib()
    core = llm.llm_engine
    for i in range(num_requests):
        start = (i * 997) % (len(text_ids) - prompt_tokens)
        core.add_request(str(i), {"prompt_token_ids": text_ids[start:start + prompt_tokens]},
                         SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True))
    scheduler = common.engine_scheduler(llm)
    peak_state, decode_seconds, decode_plan_seconds, decode_steps, started = 0, 0.0, 0.0, 0, time.perf_counter()
    while core.has_unfinished_requests():
        all_decoding = len(scheduler.running) == num_requests and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
        plan_before, step_started = (state.plan_seconds if state else 0.0), time.perf_counter()
        core.step()
        if all_decoding:
            decode_seconds += time.perf_counter() - step_started
            decode_plan_seconds += (state.plan_seconds if state else 0.0) - plan_before
            decode_steps += 1
        if state is not None:
            peak_state = max(peak_state, sum(_state_bytes(s) for s in state.requests.values()))
    return {
        "peak_rss_mib": _peak_rss_mib(), "start_rss_mib": started_rss, "end_rss_mib": _rss_mib(),
        "peak_state_mib": peak_state / 2**20, "seconds": time.perf_counter() - started,
        "decode_steps": decode_steps, "decode_step_ms": 1e3 * decode_seconds / max(decode_steps, 1),
        "decode_plan_share": decode_plan_seconds / decode_seconds if decode_seconds else None,
        "pool_blocks": pool_blocks, "policy_settings": policy, "package": str(Path(vllm_kvprune.__file__).parent),
    }


def _state_bytes(request_state: Any) -> int:
    """Bytes of the arrays a request's worker state holds (works on older checkouts too)."""
    import numpy as np
    import torch

    def size(value: Any, depth: int = 0) -> int:
        if isinstance(value, np.ndarray):
            return value.nbytes if value.base is None else 0  # views share their base's bytes
        if isinstance(value, torch.Tensor):
            return value.untyped_storage().nbytes()
        if isinstance(value, (list, tuple)):
            return sum(size(item, depth) for item in value)
        if isinstance(value, dict):
            return sum(size(item, depth) for item in value.values())
        if depth < 2 and hasattr(value, "__dict__"):
            return sum(size(item, depth + 1) for item in vars(value).values())
        return 0

    return size(request_state)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _peak_rss_mib() -> float:
    return _status_mib("VmHWM")


# ---- the table ------------------------------------------------------------------------------
def _merge_into(path: Path, rows: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    """Runs with other labels (before / after) in the same file are kept side by side."""
    kept = []
    if path.exists():
        kept = [row for row in json.loads(path.read_text())["results"]
                if (row["label"], row["policy"]) not in {(r["label"], r["policy"]) for r in rows}]
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()
                if k not in ("child", "run", "command")}
    common.write_json(path, "worker-memory", settings, kept + rows, model_shape=MODEL_SHAPE)


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the results, as printed and as on the results page: grouped by run,
    in the order the runs first appear, policies in their usual order."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    results = sorted(results, key=lambda r: (labels.index(r["label"]), list(POLICIES).index(r["policy"])))
    headers = ["run", "policy", "peak RSS MiB", "RSS growth MiB", "worker state MiB", "decode step ms",
               "plan share"]
    rows = [[r["label"], r["policy"], f"{r['peak_rss_mib']:.0f}", f"{r['peak_rss_mib'] - r['start_rss_mib']:.0f}",
             f"{r['peak_state_mib']:.1f}", f"{r['decode_step_ms']:.1f}",
             "-" if r["decode_plan_share"] is None else f"{100 * r['decode_plan_share']:.1f}%"] for r in results]
    return headers, rows


def _report(path: Path) -> None:
    results = json.loads(path.read_text())["results"]
    common.print_table(*table(results))
    figure, axis = common.new_figure(7, 3.5)
    labels = sorted({r["label"] for r in results})
    policies = list(dict.fromkeys(r["policy"] for r in results))
    width = 0.8 / max(len(labels), 1)
    for index, label in enumerate(labels):
        values = [next((r["peak_state_mib"] for r in results if r["label"] == label and r["policy"] == p), 0)
                  for p in policies]
        axis.bar([x + index * width for x in range(len(policies))], values, width, label=label)
    axis.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(policies))], policies)
    axis.set_ylabel("peak worker state (MiB)")
    axis.set_title("Per-request worker state, 32 requests at 8K context")
    axis.legend()
    common.save_figure(figure, path.with_suffix(".png"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
