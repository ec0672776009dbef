"""`python -m benchmarks lazy-pruning`: Lazy Pruning's tables (prune interval R) on our engine.

The paper (Pythia-2.8B on a GPU, HuggingFace cache) decodes PG19 under a cap of 2048 tokens
with `streaming` (sinks + recent) and prunes only when the overflow reaches R: its TPOT falls
from 19.57 ms (R = 1) to 14.37 ms (R = 64) at +0.68% perplexity, 6.81x faster than re-running
the last 2048 tokens for every output token (Table 1); its Table A2 splits the step into
forward and cache-update time.

Here, on SmolLM2 and essays, `streaming` with `positions: cache` (each engine in a child
process of its own, in-process, so the worker's counters can be read):
- time per output token, per R (`kv_prune_interval`, one engine, the R values taking turns
  `--repeats` times): `--batches` requests of `--budget` essay tokens decoding together for
  `--tpot-tokens` steps (the mean step after the first; the median of the repeats), the
  worker's time in moves and planning (`WorkerKVState.move_seconds`, `plan_seconds`) per step,
  prune events;
- perplexity: one engine, one request per R (`kv_prune_interval`), all in one batch, each fed
  `--stream-tokens` essay tokens teacher-forced one per decode step through its bounded cache
  (the accuracy suite's `forced.py`), far past the model's 8192-token context; `max_model_len`
  is raised past it (`VLLM_ALLOW_LONG_MAX_MODEL_LEN`) and so is RoPE's table (`hf_overrides`):
  our `positions: cache` re-anchors the sinks next to the window, so their rotation angles
  follow the stream (the attention sees StreamingLLM's in-cache distances, but the table is
  indexed by absolute angles; past it the engine stops with an IndexError). Prune events:
  steps after which a request holds fewer tokens than before plus the new one.
`--original` adds a stream at R = 1 with `positions: original`: StreamingLLM's point that positions must stay inside the trained
context. The baseline (`recompute`, policy `none`): each output token is a fresh one-token
request on the last `budget` tokens (the paper's sliding window without a KV cache), timed over
`--recompute-tokens` tokens; its perplexity is the strided sliding window (`prompt_logprobs` of
windows of `budget` tokens, each scoring its last `--recompute-stride`), so each scored token
sees between budget - stride and budget tokens of context.

The whole run takes hours on 2 cores (a 20K-token stream is ~23 min per request at cap 2048,
fp32); its halves run apart write a file each, which the results page merges
(`lazy_pruning*.json`): `--stream-tokens 0` the TPOT table, `--batches` (empty) the perplexity.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

RESULT_STEM = "results/lazy_pruning"
RECOMPUTE = "recompute"
BLOCK_SIZE = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--intervals", type=int, nargs="+", default=[1, 8, 32, 64, 128], help="prune intervals R")
    add("--budget", type=int, default=2048, help="the cap C (sinks + window); the paper's 2048")
    add("--sinks", type=int, default=4)
    add("--stream-tokens", type=int, default=20480, help="teacher-forced tokens of the perplexity stream (0: none)")
    add("--ppl-intervals", type=int, nargs="*", default=None,
        help="the R values whose perplexity streams run, in one batch (default: every one; none: only "
             "--original's)")
    add("--batches", type=int, nargs="*", default=[1, 16], help="batch sizes of the TPOT runs (none: no TPOT run)")
    add("--tpot-tokens", type=int, default=256, help="generated tokens per request of a TPOT run")
    add("--repeats", type=int, default=3, help="timed runs of each (R, batch), R values taking turns")
    add("--original", action=argparse.BooleanOptionalAction, default=True,
        help="also the stream with positions: original at R = 1")
    add("--original-tokens", type=int, default=10240,
        help="length of that stream (0: --stream-tokens); 2K past SmolLM2's 8K context shows what StreamingLLM "
             "warns of, and the full stream costs another half hour")
    add("--recompute-tokens", type=int, default=8, help="output tokens the recompute baseline is timed over (0: skip)")
    add("--recompute-stride", type=int, default=512, help="scored tokens per window of its perplexity (0: skip)")
    add("--pool-gib", type=float, default=6.0,
        help="KV pool; every TPOT batch's prompts must fit at once (fp32 SmolLM2: 45 KiB a token)")
    add("--tiny", action="store_true", help="the tiny random model (a smoke run)")
    add("--dtype", default="float32", choices=("bfloat16", "float32"))
    add("--out", type=Path, default=Path(RESULT_STEM + ".json"))
    add("--child", default=None, help=argparse.SUPPRESS)


# ---- the parent: one child per engine ------------------------------------------------
def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One engine each: the TPOT runs of every R (taking turns, `kv_prune_interval` per
    request), the perplexity streams of every R in one batch, the stream with original
    positions, the recompute baseline."""
    stream = args.stream_tokens
    out: list[dict[str, Any]] = [{"kind": "tpot", "intervals": args.intervals, "batches": args.batches}] \
        if args.batches else []
    if stream:
        ppl = args.intervals if args.ppl_intervals is None else args.ppl_intervals
        if ppl:
            out.append({"kind": "stream", "positions": "cache", "intervals": sorted(set(ppl))})
        if args.original:
            out.append({"kind": "stream", "positions": "original", "intervals": [1]})
    if args.recompute_tokens or (args.recompute_stride and stream):
        out.append({"kind": RECOMPUTE})
    return out


def merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting (method, R, positions): a TPOT run's and a stream's fields together."""
    merged: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = (row["method"], row["R"], row["positions"])
        merged.setdefault(key, {"tpot": {}}).update({k: v for k, v in row.items() if k != "tpot"})
        merged[key]["tpot"].update(row.get("tpot", {}))
    return sorted(merged.values(), key=lambda row: (row["method"] == RECOMPUTE, row["positions"] != "cache",
                                                    row["R"] or 0))


def run(args: argparse.Namespace) -> int:
    if args.child is not None:
        common.print_child_result(measure(args, json.loads(args.child)))
        return 0
    started = time.time()
    env = common.child_env({**os.environ, **common.ENGINE_ENV, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    settings = {key: getattr(args, key) for key in ("intervals", "budget", "sinks", "stream_tokens", "original_tokens",
                                                    "batches", "tpot_tokens", "repeats", "recompute_tokens",
                                                    "recompute_stride", "dtype")}
    settings["model"] = "tiny" if args.tiny else "smollm2-135m-instruct"
    found: list[dict[str, Any]] = []
    all_cases = cases(args)
    if not all_cases:
        raise SystemExit("lazy-pruning: nothing to run (--stream-tokens 0 and no --batches)")
    for done, case in enumerate(all_cases, 1):
        label = " ".join(f"{key} {value}" for key, value in case.items())
        print(f"[lazy-pruning] {label} ...", flush=True)
        command = [sys.executable, "-m", "benchmarks", "lazy-pruning", "--child", json.dumps(case),
                   *child_flags(args)]
        try:
            found += common.run_child(command, env, label)
        except RuntimeError as error:
            raise SystemExit(f"lazy-pruning: {error}") from None
        # Written after every engine: a run of hours stopped half-way keeps what it measured.
        rows = merge(found)
        add_ratios(rows)
        common.write_json(args.out, "lazy_pruning", {**settings, "run_s": round(time.time() - started, 1),
                                                     "cases_done": f"{done} of {len(all_cases)}"}, rows)
    common.print_table(*table(rows))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")
    return 0


def child_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--budget", str(args.budget), "--sinks", str(args.sinks), "--tpot-tokens", str(args.tpot_tokens),
             "--repeats", str(args.repeats), "--stream-tokens", str(args.stream_tokens),
             "--recompute-tokens", str(args.recompute_tokens), "--recompute-stride", str(args.recompute_stride),
             "--original-tokens", str(args.original_tokens),
             "--dtype", args.dtype, "--pool-gib", str(args.pool_gib)]
    return flags + ["--tiny"] * args.tiny


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """TPOT speed-up over the recompute baseline and over R = 1; perplexity against R = 1's."""
    recompute = next((row for row in rows if row["method"] == RECOMPUTE), None)
    strict = next((row for row in rows if row["R"] == 1 and row["positions"] == "cache"), None)
    for row in rows:
        for batch, entry in row.get("tpot", {}).items():
            base = recompute["tpot"].get("1") if recompute else None
            entry["speedup_vs_recompute"] = base["ms"] / entry["ms"] if base and batch == "1" else None
            first = strict["tpot"].get(batch) if strict else None
            entry["speedup_vs_r1"] = first["ms"] / entry["ms"] if first else None
        base = prefix_perplexity(strict, row.get("scored_tokens")) if strict and row.get("perplexity") else None
        if base:
            row["ppl_vs_r1"] = row["perplexity"] / base


def prefix_perplexity(row: dict[str, Any], scored: int | None) -> float | None:
    """The perplexity of `row`'s stream over its first `scored` tokens: all of it, or whole
    1024-token chunks of it (`nll_by_1024`), so that a shorter stream (`--original-tokens`)
    meets R = 1 on the same tokens; None where that is not possible."""
    if not row.get("perplexity") or not scored:
        return None
    if row.get("scored_tokens") == scored:
        return row["perplexity"]
    chunks = row.get("nll_by_1024") or []
    if scored % 1024 or scored // 1024 > len(chunks) or scored > row.get("scored_tokens", 0):
        return None
    return math.exp(sum(chunks[:scored // 1024]) / (scored // 1024))


# ---- a child: one engine -------------------------------------------------------------
def measure(args: argparse.Namespace, case: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one case (`cases`), from one engine."""
    from vllm import LLM

    from benchmarks.accuracy.forced import ForcedTokens
    from benchmarks.ttft import essay_tokens
    from tools import assets

    model = str(assets.tiny_model_dir() if args.tiny else assets.real_model_dir())
    kind, stream = case["kind"], args.stream_tokens
    if case.get("positions") == "original" and args.original_tokens:
        stream = min(stream, args.original_tokens)
    tokens = essay_tokens(model, args.tiny, max(stream + 1, args.budget * (max(case.get("batches", [1])) + 1)))
    options: dict[str, Any] = dict(model=model, dtype=args.dtype, block_size=BLOCK_SIZE, enforce_eager=True,
                                   enable_prefix_caching=False, seed=0, logits_processors=[ForcedTokens],
                                   kv_cache_memory_bytes=int(args.pool_gib * 2**30))
    if kind == RECOMPUTE:
        options.update(max_model_len=args.budget + BLOCK_SIZE, max_num_seqs=1)
    else:
        positions = case.get("positions", "cache")
        longest = stream + 1 if kind == "stream" else args.budget + args.tpot_tokens + 2048  # decodes during prefills
        options.update(max_model_len=longest,
                       max_num_seqs=max(case["batches"] if kind == "tpot" else case["intervals"]),
                       additional_config={"kv_policy": {"name": "streaming", "budget": args.budget, "sinks": args.sinks,
                                                        "positions": positions}})
        # RoPE's table up to the stream's last position, in both modes: with `positions: cache`
        # the keys keep their rotations and the sinks are re-anchored next to the window, so the
        # sinks' rotation angles grow with the stream too (attention sees only the differences).
        from transformers import AutoConfig

        own = AutoConfig.from_pretrained(model).max_position_embeddings
        if longest > own:
            options["hf_overrides"] = {"max_position_embeddings": longest}
    llm = LLM(**options)
    try:
        if kind == RECOMPUTE:
            return [{"method": RECOMPUTE, "R": None, "positions": None, **recompute(llm, tokens, args)}]
        if kind == "stream":
            return [{"method": "streaming", "R": r, "positions": case["positions"], **found}
                    for r, found in zip(case["intervals"], forced_streams(llm, tokens[:stream + 1], case["intervals"]))]
        return tpot_rows(llm, tokens, case["intervals"], case["batches"], args)
    finally:
        common.shutdown(llm)


def forced_streams(llm: Any, tokens: list[int], intervals: list[int]) -> list[dict[str, Any]]:
    """One request per R (`kv_prune_interval`), all in one batch: the perplexity of `tokens[1:]`
    fed one per decode step after the one-token prompt `tokens[0]`, with each request's prune
    events (steps after which it holds fewer tokens than before plus the new one) and peak."""
    from vllm import SamplingParams
    from tqdm import tqdm

    from benchmarks.accuracy.forced import FORCED_KEY
    from benchmarks.accuracy.ours import answer_of

    forced = tokens[1:]
    engine, kv_state = llm.llm_engine, common.model_runner(llm).kv_state
    names = [f"stream-R{r}" for r in intervals]  # outputs carry these; the worker knows the internal ids
    ids = [engine.add_request(name, {"prompt_token_ids": tokens[:1]},
                              SamplingParams(temperature=0, max_tokens=len(forced), logprobs=0, ignore_eos=True,
                                             extra_args={FORCED_KEY: forced, "kv_prune_interval": r}))
           for name, r in zip(names, intervals)]
    held, events, peak = dict.fromkeys(ids, 0), dict.fromkeys(ids, 0), dict.fromkeys(ids, 0)
    outputs: dict[str, Any] = {}
    began = time.perf_counter()
    with tqdm(total=len(forced), desc=f"stream of {len(ids)}", mininterval=10) as bar:
        while engine.has_unfinished_requests():
            for step_output in engine.step():
                if step_output.finished:
                    outputs[step_output.request_id] = step_output
            for request_id in ids:
                state = kv_state.requests.get(request_id)
                if state is None:
                    continue
                kept = state.kept_tokens()[1]
                events[request_id] += 0 < held[request_id] and kept < held[request_id] + 1
                held[request_id], peak[request_id] = kept, max(peak[request_id], kept)
            bar.update()
    seconds = time.perf_counter() - began
    found = []
    for name, request_id in zip(names, ids):
        answer = answer_of(outputs[name])
        if answer.token_ids != forced:
            raise RuntimeError(f"{request_id}: the engine did not follow the forced tokens")
        nll = [-logprob for logprob in answer.logprobs]
        found.append({"perplexity": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll),
                      "nll_by_1024": [sum(nll[i:i + 1024]) / len(nll[i:i + 1024]) for i in range(0, len(nll), 1024)],
                      "prune_events": events[request_id], "peak_kept": peak[request_id],
                      "stream_s": seconds, "streams_in_batch": len(ids)})
    return found


def tpot_rows(llm: Any, tokens: list[int], intervals: list[int], batches: list[int],
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each (R, batch) timed `--repeats` times in one engine, the R values taking turns (this box
    is shared: a neighbour's busy minute then lands on every R alike). Per (R, batch): the
    median over repeats of the mean step, each repeat's figures kept."""
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for batch in batches:
            for r in intervals:
                runs.setdefault((r, batch), []).append(decode_timing(llm, tokens, batch, r, args))
    rows = []
    for r in intervals:
        tpot = {}
        for batch in batches:
            middle, repeats_ms = common.median_round(runs[(r, batch)], "ms")
            tpot[str(batch)] = {**middle, "repeats_ms": repeats_ms}
        rows.append({"method": "streaming", "R": r, "positions": "cache", "tpot": tpot})
    return rows


def decode_timing(llm: Any, tokens: list[int], batch: int, r: int, args: argparse.Namespace) -> dict[str, Any]:
    """`batch` requests of `budget` essay tokens (each its own window) at prune interval `r`
    (`kv_prune_interval`) decoding together for `tpot_tokens` steps (`decode_steps`: the mean
    step after the first, prune steps included: that is what R amortizes; the worker's move
    and planning time per step; the prune events of the first request)."""
    from benchmarks.decode_steps import time_decode_steps

    prompts = [tokens[i * args.budget:(i + 1) * args.budget] for i in range(batch)]
    return time_decode_steps(llm, prompts, args.tpot_tokens, {"kv_prune_interval": r}, name=f"tpot{batch}-R{r}")


def recompute(llm: Any, tokens: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """The sliding-window baseline on a `none` engine: every output token a fresh request on the
    last `budget` tokens; perplexity from strided windows of `budget` tokens."""
    from vllm import SamplingParams

    row: dict[str, Any] = {"tpot": {}}
    if args.recompute_tokens:
        context = list(tokens[:args.budget])
        one = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([{"prompt_token_ids": context}], one, use_tqdm=False)  # warm-up
        began = time.perf_counter()
        for _ in range(args.recompute_tokens):
            output = llm.generate([{"prompt_token_ids": context[-args.budget:]}], one, use_tqdm=False)
            context.append(output[0].outputs[0].token_ids[0])
        row["tpot"]["1"] = {"ms": 1000 * (time.perf_counter() - began) / args.recompute_tokens,
                            "steps": args.recompute_tokens, "prune_events": None, "move_ms_per_step": None}
    stream, stride = tokens[:args.stream_tokens + 1] if args.stream_tokens else [], args.recompute_stride
    if stream and stride:
        scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        nll: list[float] = []
        began = time.perf_counter()
        # Each window ends `stride` tokens after the last one (the final one at the stream's end)
        # and scores the tokens it adds; its first token has no log-probability.
        ends = [*range(stride, len(stream), stride), len(stream)]
        for previous, end in zip([0, *ends], ends):
            window = stream[max(0, end - args.budget):end]
            logprobs = llm.generate([{"prompt_token_ids": window}], scored, use_tqdm=False)[0].prompt_logprobs
            nll += [-logprobs[i][window[i]].logprob for i in range(max(1, len(window) - (end - previous)), len(window))]
        row.update(perplexity=math.exp(sum(nll) / len(nll)), scored_tokens=len(nll),
                   stream_s=time.perf_counter() - began)
    return row


# ---- output -------------------------------------------------------------------------
def label(row: dict[str, Any]) -> str:
    if row["method"] == RECOMPUTE:
        return "recompute (sliding window, no cache)"
    return f"streaming R={row['R']}" + (" positions original" if row["positions"] == "original" else "")


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    batches = sorted({int(b) for row in rows for b in row.get("tpot", {})})
    headers = ["setting", *[f"TPOT ms b{b}" for b in batches], "vs recompute b1", "move ms/step b1",
               "plan ms/step b1", "prune events b1", "perplexity", "scored tokens", "vs R=1 (same tokens)",
               "stream prune events"]

    def number(value: Any, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    body = []
    for row in rows:
        tpot = row.get("tpot", {})
        first = tpot.get("1", {})
        speed = first.get("speedup_vs_recompute")
        body.append([label(row), *[number(tpot.get(str(b), {}).get("ms"), 1) for b in batches],
                     "-" if speed is None else f"{speed:.2f}x", number(first.get("move_ms_per_step"), 2),
                     number(first.get("plan_ms_per_step"), 2),
                     "-" if first.get("prune_events") is None else f"{first['prune_events']} / {first['steps']}",
                     number(row.get("perplexity"), 3), str(row.get("scored_tokens") or "-"),
                     f"{100 * (row['ppl_vs_r1'] - 1):+.2f}%" if row.get("ppl_vs_r1") else "-",
                     "-" if row.get("prune_events") is None else str(row["prune_events"])])
    return headers, body


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, (left, right) = common.new_figure(11, 4, columns=2)
    lazy = [row for row in rows if row["method"] == "streaming" and row["positions"] == "cache"]
    for batch in sorted({b for row in lazy for b in row["tpot"]}, key=int):
        mine = [row for row in lazy if batch in row["tpot"]]
        left.plot([row["R"] for row in mine], [row["tpot"][batch]["ms"] for row in mine], marker="o",
                  label=f"batch {batch}")
    left.set_xscale("log", base=2)
    left.set_xlabel("prune interval R")
    left.set_ylabel("time per output token, ms")
    if left.lines:
        left.legend()
    for row in rows:
        if row.get("nll_by_1024"):
            right.plot([1024 * (i + 1) for i in range(len(row["nll_by_1024"]))],
                       [math.exp(v) for v in row["nll_by_1024"]], label=label(row))
    right.set_xlabel("stream position (tokens)")
    right.set_ylabel("perplexity per 1024 tokens")
    right.set_yscale("log")
    if right.lines:
        right.legend(fontsize=7)
    common.save_figure(figure, path)
