"""`python -m benchmarks fdc-attention`: decode attention in FDC's reduced space.

One decode step of one layer of SmolLM2-135M's shape (3 KV heads, 9 query heads, head size
64) over a batch of sequences of equal length, attention only (the projections around it are
the engine's business):
- **vLLM** full dims: vLLM's own CPU attention kernel on its cache at head size 64;
- **ours, full**: our reduced-space kernel with every rank at 64 (its cost at no compression);
- **ours, 50% dims**: every head at rank 32 for K and V;
- **ours, adaptive**: the ranks FDC's calibration gives at `--rate` (per layer and head, all
  30 layers' rank sets run one after another), with the longest-first (LPT) schedule and with
  the static one, on sequences of mixed lengths (the same number of tokens in all), and with
  the ranks rounded up to a multiple of 16 or 32 (what aligned widths cost in memory, and
  save in time).
Every case runs all 30 layers, each over its own cache (so the KV bytes come from memory, as
in a real decode step, not from the CPU's caches); times are per layer, the median (and
quartiles) of `--repeats` steps after a warm-up, the cases taking turns in every round.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common

RESULT_STEM = "results/fdc/attention"
HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 32
TARGET_SPEEDUP = 1.6  # ours at 50% dims over full-dimension attention (issue #12)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batch", type=int, default=16, help="sequences decoding together (default 16)")
    add("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add("--rate", type=float, default=0.3, help="removal rate of the adaptive ranks (default 0.3)")
    add("--calibration", type=Path, default=None,
        help="an FDC calibration of SmolLM2 (default: calibrate now, about a minute)")
    add("--repeats", type=int, default=15)
    add("--out", default=RESULT_STEM, help="writes STEM.json and STEM.png")


def _vllm_call(batch: int, seq_len: int, dtype: torch.dtype, generator: torch.Generator,
               layers: int) -> Callable[[], Any]:
    """vLLM's kernel over `layers` caches of its own layout, one after another."""
    from vllm import _custom_ops as ops
    from vllm import envs

    from vllm_kvprune.kernels import default_isa

    blocks_per_seq = seq_len // BLOCK
    caches = [torch.randn(batch * blocks_per_seq, HEADS, BLOCK * 2, HEAD_DIM, generator=generator).to(dtype).chunk(2, dim=2)
              for _ in range(layers)]
    query = torch.randn(batch, HEADS * GROUP, HEAD_DIM, generator=generator).to(dtype)
    output = torch.empty_like(query)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    lengths = torch.full((batch,), seq_len, dtype=torch.int32)
    table = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    isa = default_isa(dtype, BLOCK, HEAD_DIM)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=HEADS * GROUP, num_kv_heads=HEADS, head_dim=HEAD_DIM, seq_lens=lengths,
        dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)

    def call() -> None:
        for key_cache, value_cache in caches:
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=starts,
                seq_lens=lengths, scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=table, softcap=0.0, scheduler_metadata=schedule, s_aux=None)

    return call


def _ours_call(rank_sets: list[tuple[list[int], list[int]]], lengths: list[int], dtype: torch.dtype,
               generator: torch.Generator, balanced: bool) -> Callable[[], Any]:
    """Our kernel over one layer per rank set (K ranks, V ranks), one after another."""
    from vllm_kvprune.kernels.reduced_attention import PackedHeads, reduced_attention

    batch = len(lengths)
    widest = max(lengths)
    blocks_per_seq = -(-widest // BLOCK)
    table = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    layers = []
    for k_ranks, v_ranks in rank_sets:
        heads = PackedHeads.from_ranks(k_ranks, v_ranks)
        cache = torch.randn(batch * blocks_per_seq, BLOCK * heads.row_width, generator=generator).to(dtype)
        query = torch.randn(batch, HEADS * GROUP, max(k_ranks), generator=generator).to(dtype)
        layers.append((heads, cache, query, max(v_ranks)))

    def call() -> None:
        for heads, cache, query, width in layers:
            reduced_attention(query, cache, table, starts, seq_lens, heads, HEAD_DIM ** -0.5, width, balanced)

    return call


def mixed_lengths(batch: int, seq_len: int) -> list[int]:
    """Lengths from about a quarter to 1.75x `seq_len`, summing to `batch * seq_len`."""
    lengths = [max(BLOCK, int(seq_len * (0.25 + 1.5 * i / max(batch - 1, 1)))) for i in range(batch)]
    lengths[-1] += batch * seq_len - sum(lengths)
    return lengths


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells of the bench's table (the results page shows the same)."""
    def spread(row: dict[str, Any]) -> str:  # files before the rounds took turns have no quartiles
        return f"{row['p25_ms']:.3f}-{row['p75_ms']:.3f}" if "p25_ms" in row else "-"

    return (["case", "ms/layer", "p25-p75 ms", "KV kept", "vs vLLM full", "vs ours full"],
            [[row["case"], f"{row['ms_per_layer']:.3f}", spread(row), f"{row['kv_kept']:.1%}",
              f"{row['vs_vllm_full']:.2f}x", f"{row['vs_ours_full']:.2f}x"] for row in rows])


def run(args: argparse.Namespace) -> int:
    from tools import assets
    from vllm_kvprune import kernels
    from vllm_kvprune.fdc import calibration as fdc

    if not kernels.HAS_EXTENSION:
        raise SystemExit("fdc-attention needs the C++ extension (pip install --no-build-isolation -e .)")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    if args.calibration is not None:
        calibration = fdc.load(args.calibration, assets.real_model_dir())
    else:
        calibration = fdc.calibrate(assets.real_model_dir())
    adaptive = calibration.with_rate(args.rate)
    rank_sets = list(zip(adaptive.qk_rank.tolist(), adaptive.v_rank.tolist()))
    layers = len(rank_sets)
    equal = [args.seq_len] * args.batch
    mixed = mixed_lengths(args.batch, args.seq_len)
    cases: dict[str, tuple[Callable[[], Any], float]] = {}  # name -> (one step of every layer, KV kept)

    # Every case runs all of the model's layers, each over its own cache, as a decode step does:
    # the caches are far larger than the CPU's caches, so each byte comes from memory.
    full, half = [([64] * HEADS, [64] * HEADS)] * layers, [([32] * HEADS, [32] * HEADS)] * layers
    cases["vLLM kernel, full dims"] = _vllm_call(args.batch, args.seq_len, dtype, generator, layers), 1.0
    cases["ours, full dims"] = _ours_call(full, equal, dtype, generator, True), 1.0
    cases["ours, 50% dims"] = _ours_call(half, equal, dtype, generator, True), 0.5
    for balanced in (True, False):
        schedule = "LPT" if balanced else "static"
        for lengths, which in ((equal, "equal"), (mixed, "mixed")):
            cases[f"ours, adaptive r={args.rate}, {which} lengths, {schedule}"] = (
                _ours_call(rank_sets, lengths, dtype, generator, balanced), adaptive.kv_fraction())
    for granule in (16, 32):
        aligned = [(fdc.rank_granule(torch.tensor(k), granule, HEAD_DIM).tolist(),
                    fdc.rank_granule(torch.tensor(v), granule, HEAD_DIM).tolist()) for k, v in rank_sets]
        kept = sum(sum(k) + sum(v) for k, v in aligned) / (layers * 2 * HEADS * HEAD_DIM)
        cases[f"ours, adaptive r={args.rate}, ranks up to a multiple of {granule}, equal lengths, LPT"] = (
            _ours_call(aligned, equal, dtype, generator, True), kept)
    # The cases take turns in every round, so the machine's slow spells (a shared VM's are
    # 20-50% here) hit them all alike instead of whichever case was running then.
    timings = common.time_round_robin({name: call for name, (call, _) in cases.items()}, 1, args.repeats)
    rows = [{"case": name, "ms_per_layer": timings[name]["median"] / 1e3 / layers, "kv_kept": kept,
             "p25_ms": timings[name]["p25"] / 1e3 / layers, "p75_ms": timings[name]["p75"] / 1e3 / layers}
            for name, (_, kept) in cases.items()]
    by_case = {row["case"]: row["ms_per_layer"] for row in rows}
    for row in rows:
        row["vs_vllm_full"] = by_case["vLLM kernel, full dims"] / row["ms_per_layer"]
        row["vs_ours_full"] = by_case["ours, full dims"] / row["ms_per_layer"]
    summary = {
        "half_dims_vs_vllm_full": by_case["ours, 50% dims"] and by_case["vLLM kernel, full dims"] / by_case["ours, 50% dims"],
        "half_dims_vs_ours_full": by_case["ours, full dims"] / by_case["ours, 50% dims"],
        "target": TARGET_SPEEDUP,
        "lpt_vs_static_mixed": (by_case[f"ours, adaptive r={args.rate}, mixed lengths, static"]
                                / by_case[f"ours, adaptive r={args.rate}, mixed lengths, LPT"]),
        "lpt_vs_static_equal": (by_case[f"ours, adaptive r={args.rate}, equal lengths, static"]
                                / by_case[f"ours, adaptive r={args.rate}, equal lengths, LPT"]),
    }
    common.print_table(*table(rows))
    print(f"50% dims vs vLLM's full-dimension kernel: {summary['half_dims_vs_vllm_full']:.2f}x "
          f"(goal >= {TARGET_SPEEDUP}x: {'met' if summary['half_dims_vs_vllm_full'] >= TARGET_SPEEDUP else 'NOT met'}); "
          f"vs ours at full dims: {summary['half_dims_vs_ours_full']:.2f}x")
    print(f"LPT vs static schedule: {summary['lpt_vs_static_mixed']:.2f}x (mixed lengths), "
          f"{summary['lpt_vs_static_equal']:.2f}x (equal lengths)")
    stem = Path(args.out)
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                if key not in ("run", "command")}
    common.write_json(stem.with_suffix(".json"), "fdc-attention", settings, rows, summary=summary)
    figure, axes = common.new_figure(7.0, 3.6)
    axes.barh([row["case"] for row in rows][::-1], [row["ms_per_layer"] for row in rows][::-1])
    axes.set_xlabel("ms per layer and decode step")
    axes.set_title(f"decode attention, {args.batch} x {args.seq_len} tokens, {args.dtype}", fontsize=9)
    common.save_figure(figure, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0
