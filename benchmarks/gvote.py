"""`python -m benchmarks gvote`: what `gvote` keeps, what it holds, what it costs.

On the real model (SmolLM2-135M-Instruct, bf16 unless `--dtype float32`) with essay prompts of several lengths:
- **memory**: after each request's vote, the mean kept fraction over (layer, KV head), the
  blocks the request holds (read from vLLM's block pool), the blocks a max-over-heads layout
  would hold (every head padded to the longest) and what `none` holds;
- **prefill**: the vote's share of the prompt's step (one request at a time): gathering the
  hidden-state statistics on every layer, the synthetic queries, the votes and the packing;
- **decode**: the step time with every request voted but keeping everything
  (`kv_gvote_p = 1`, so the same tokens as `none`), head-page attention vs vLLM's uniform
  layout, in alternating rounds on fresh engines.
Each engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), eager, as `gvote` runs.
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

RESULT_STEM = "results/gvote"
BLOCK_SIZE = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--prompt-tokens", type=int, nargs="+", default=[1000, 2000, 4000, 7000])
    add("--prompts-per-length", type=int, default=2)
    add("--decode-requests", type=int, default=8)
    add("--decode-prompt", type=int, default=2000)
    add("--decode-steps", type=int, default=24)
    add("--decode-rounds", type=int, default=3, help="alternating none / gvote decode rounds (fresh engines each)")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
        help="model dtype (float32 is faster on CPUs without bf16 instructions)")
    add("--out", type=Path, default=Path(RESULT_STEM + ".json"))


def run(args: argparse.Namespace) -> int:
    for key, value in common.ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from transformers import AutoTokenizer

    from benchmarks.accuracy.task import essay_token_ids
    from tools import assets

    model = str(assets.real_model_dir())
    essay = essay_token_ids(AutoTokenizer.from_pretrained(model))
    prompts = {length: [essay[i * 9000 + 500: i * 9000 + 500 + length] for i in range(args.prompts_per_length)]
               for length in args.prompt_tokens}
    memory = _memory_and_prefill(model, prompts, max(args.prompt_tokens), args.dtype)
    decode = _decode(model, [essay[20000 + i * 3000:][: args.decode_prompt] for i in range(args.decode_requests)],
                     args.decode_steps, args.dtype, args.decode_rounds)
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                if key not in ("run", "command")}
    common.write_json(args.out, "gvote", settings, memory, decode=decode)
    _report(memory, decode)
    _plot(memory, args.out.with_suffix(".png"))
    return 0


def _engine(model: str, policy: dict | None, longest: int, dtype: str):
    from vllm import LLM

    options = dict(dtype=dtype, enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=longest + 256,
                   enable_prefix_caching=False, max_num_batched_tokens=max(longest + 256, 4096),
                   kv_cache_memory_bytes=2 * 2**30)
    if policy is not None:
        options["additional_config"] = {"kv_policy": policy}
    return LLM(model=model, **options)


def _greedy(max_tokens: int, **extra_args):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None)


def _memory_and_prefill(model: str, prompts: dict[int, list[list[int]]], longest: int,
                        dtype: str) -> list[dict[str, Any]]:
    """One request at a time: its prompt step's time and the vote's share of it, then what it
    keeps and holds once voted."""
    from vllm_kvprune.engine.scheduler import held_model_blocks

    llm = _engine(model, {"name": "gvote"}, longest, dtype)
    engine, scheduler = llm.llm_engine, common.engine_scheduler(llm)
    kv_state = common.model_runner(llm).kv_state
    rows = []
    for length, group in prompts.items():
        for index, prompt in enumerate(group):
            request_id = f"m{length}-{index}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, _greedy(2))
            vote_before = kv_state.score_seconds
            started = time.perf_counter()
            engine.step()  # the whole prompt in one step (max_num_batched_tokens)
            prompt_seconds = time.perf_counter() - started
            vote_seconds = kv_state.score_seconds - vote_before
            [(internal, state)] = [(rid, st) for rid, st in kv_state.requests.items() if rid.startswith(request_id)]
            lengths = state.map.lengths
            held = held_model_blocks(scheduler, internal)  # a group per layer: layer pages / layers
            rows.append({
                "prompt_tokens": length, "prompt": index,
                "mean_kept": float(lengths.mean()), "min_kept": int(lengths.min()), "max_kept": int(lengths.max()),
                "kept_fraction": float(lengths.mean() / length),
                "blocks_held": held, "blocks_needed": state.map.mean_layer_blocks(),
                "blocks_max_over_heads": -(-int(lengths.max()) // BLOCK_SIZE),
                "blocks_none": -(-length // BLOCK_SIZE),
                "prompt_step_s": prompt_seconds, "vote_s": vote_seconds,
                "vote_share": vote_seconds / prompt_seconds,
            })
            print(f"[gvote] {length} tokens #{index}: kept {rows[-1]['kept_fraction']:.0%}, blocks {held:.1f} "
                  f"(max-over-heads {rows[-1]['blocks_max_over_heads']}, none {rows[-1]['blocks_none']}), "
                  f"vote {vote_seconds * 1000:.0f} ms of {prompt_seconds:.2f} s", flush=True)
            while engine.has_unfinished_requests():
                engine.step()
    _shutdown(llm)
    return rows


def _decode(model: str, prompts: list[list[int]], steps: int, dtype: str, rounds: int) -> dict[str, Any]:
    """Median decode step with every request past its prompt: `none` (vLLM's layout) vs
    `gvote` keeping everything (head-pages, the same keys). The two alternate, `rounds` times,
    each round on fresh engines, so a slow spell of the machine hits both; the ratio is the
    median of the rounds' ratios."""
    result: dict[str, Any] = {"none": {"round_ms": []}, "gvote_keep_all": {"round_ms": []}}
    for round_index in range(rounds):
        for name, policy, extra in (("none", None, {}), ("gvote_keep_all", {"name": "gvote"}, {"kv_gvote_p": 1.0})):
            llm = _engine(model, policy, len(prompts[0]) + steps, dtype)
            median_ms = _median_decode_step_ms(llm, prompts, steps, extra)
            result[name]["round_ms"].append(median_ms)
            print(f"[gvote] decode round {round_index + 1}/{rounds} {name}: {median_ms:.1f} ms per step", flush=True)
            _shutdown(llm)
    ratios = [g / n for g, n in zip(result["gvote_keep_all"]["round_ms"], result["none"]["round_ms"])]
    for name in ("none", "gvote_keep_all"):
        result[name]["median_step_ms"] = statistics.median(result[name]["round_ms"])
    result["round_ratios"], result["ratio"] = ratios, statistics.median(ratios)
    result["requests"], result["prompt_tokens"], result["rounds"] = len(prompts), len(prompts[0]), rounds
    return result


def _median_decode_step_ms(llm, prompts: list[list[int]], steps: int, extra: dict[str, Any]) -> float:
    engine, scheduler = llm.llm_engine, common.engine_scheduler(llm)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"d{index}", {"prompt_token_ids": prompt}, _greedy(steps + 4, **extra))
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        if all(request.num_computed_tokens > request.num_prompt_tokens for request in scheduler.running) and outputs:
            times.append(elapsed)
    return 1000 * statistics.median(times[1:-1])


def _shutdown(llm) -> None:
    import gc

    common.shutdown(llm)
    del llm
    gc.collect()


def table(memory: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) per prompt length, means over its prompts; as printed and on the
    results page."""
    headers = ["prompt tokens", "kept (mean over layer, KV head)", "blocks held", "max-over-heads layout",
               "none", "held / none", "vote ms", "vote / prompt step"]
    rows = []
    for length in sorted({row["prompt_tokens"] for row in memory}):
        group = [row for row in memory if row["prompt_tokens"] == length]

        def mean(key: str, group=group) -> float:
            return statistics.mean(row[key] for row in group)

        rows.append([str(length), f"{mean('kept_fraction'):.0%}", f"{mean('blocks_held'):.1f}",
                     f"{mean('blocks_max_over_heads'):.1f}", f"{mean('blocks_none'):.1f}",
                     f"{mean('blocks_held') / mean('blocks_none'):.2f}", f"{1000 * mean('vote_s'):.0f}",
                     f"{mean('vote_share'):.1%}"])
    return headers, rows


def decode_line(decode: dict[str, Any]) -> str:
    rounds = decode.get("rounds", 1)
    spread = ""
    if rounds > 1:
        spread = f"; {rounds} alternating rounds, ratios " + ", ".join(f"{r:.2f}" for r in decode["round_ratios"])
    return (f"decode, {decode['requests']} requests of {decode['prompt_tokens']} tokens, everything kept: "
            f"head-pages {decode['gvote_keep_all']['median_step_ms']:.1f} ms vs vLLM's uniform layout "
            f"{decode['none']['median_step_ms']:.1f} ms per step ({decode['ratio']:.2f}x, median{spread})")


def _report(memory: list[dict[str, Any]], decode: dict[str, Any]) -> None:
    common.print_table(*table(memory))
    print(decode_line(decode))


def _plot(memory: list[dict[str, Any]], path: Path) -> None:
    figure, axis = common.new_figure(6, 3.5)
    lengths = sorted({row["prompt_tokens"] for row in memory})
    for key, label in (("blocks_none", "none"), ("blocks_max_over_heads", "max over heads"),
                       ("blocks_held", "gvote (head-pages)")):
        axis.plot(lengths, [statistics.mean(r[key] for r in memory if r["prompt_tokens"] == n) for n in lengths],
                  marker="o", label=label)
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("KV blocks held after the vote")
    axis.legend()
    common.save_figure(figure, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
