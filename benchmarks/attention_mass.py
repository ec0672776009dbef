"""`python -m benchmarks attention-mass`: H2O's attention-mass kernel on its own.

Times `kernels.attention_mass` (`csrc/cpu/attention_mass.cpp`) in the ways the engine calls it:
a prompt's mass alone (one request, every prompt token a causal query: the pass that followed
vLLM's attention before the prefill was fused, `KVPRUNE_FUSED_MASS=0`), a prompt's mass and
attention output in one pass (the fused prefill: vLLM's attention is skipped), vLLM's own CPU
prefill attention on the same cache (what the fused pass replaces), and a decode step's (a batch
of requests, one query each over all their keys, mass and output in one pass). SmolLM2-135M's
attention shape by default (3 KV heads, 3 query heads each, head 64), the cache layout vLLM picks
here for each dtype, block 32. The prefill cases take turns (`--repeats` rounds after one
warm-up round, median); nothing else runs in the process.

Then what a decode step of `--batch` requests does with the mass: each request's victims
(`kernels.lowest_mass_slots_many`, the C++ op request by request, over `--layers` layers of
`--held` slots each) on one thread and on all of them, and the alternative a GPU takes (torch
ranking every request at once, `kernels.victims.lowest_mass_slots_batched`) on CPU tensors.

The kernel's vector code is chosen when the extension is built (AVX-512, AVX2 or portable
loops): the JSON records the build's ISA, so two builds of one machine compare by running
this once with each (`KVPRUNE_CPU_ISA=avx2 pip install --no-build-isolation -e .`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import common
from vllm_kvprune import machine

DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--prompt-tokens", type=int, default=4096, help="prompt length of the prefill case")
    add("--batch", type=int, default=32, help="requests of the decode case")
    add("--keys", type=int, default=1024, help="keys each decoding request attends to")
    add("--kv-heads", type=int, default=3)
    add("--group", type=int, default=3, help="query heads per KV head")
    add("--head-size", type=int, default=64)
    add("--block-size", type=int, default=32)
    add("--repeats", type=int, default=9)
    add("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    add("--layers", type=int, default=30, help="layers of the victim search's mass table")
    add("--held", type=int, default=512, help="slots each request holds in the victim search")
    add("--out", default="results/attention_mass.json", help="JSON path; the plot goes next to it")


def _case(args: argparse.Namespace, dtype_name: str, prefill: bool) -> tuple[dict[str, Any], Any]:
    """The calls of one shape on seeded random inputs, as closures by case name: prefill (mass
    alone, mass and output, vLLM's attention) or decode (mass and output)."""
    import torch

    from vllm_kvprune import kernels
    from vllm_kvprune.kernels.layout import default_isa, probe_layout

    dtype = getattr(torch, dtype_name)
    heads, size, block = args.kv_heads, args.head_size, args.block_size
    rows, keys = (1, args.prompt_tokens) if prefill else (args.batch, args.keys)
    blocks_per_row = -(-keys // block)
    generator = torch.Generator().manual_seed(0)
    layout = probe_layout(dtype, block, size, default_isa(dtype, block, size))
    cache = torch.randn(rows * blocks_per_row + 1, heads, block, 2 * size, generator=generator).to(dtype)
    table = torch.arange(rows * blocks_per_row, dtype=torch.int32).view(rows, blocks_per_row)
    if prefill:
        query_rows = torch.zeros(keys, dtype=torch.int64)
        key_counts = torch.arange(1, keys + 1, dtype=torch.int64)
    else:
        query_rows = torch.arange(rows, dtype=torch.int64)
        key_counts = torch.full((rows,), keys, dtype=torch.int64)
    query = torch.randn(len(key_counts), heads * args.group, size, generator=generator).to(dtype)
    output = torch.empty_like(query)
    mass = torch.zeros(heads, cache.shape[0] * block)

    def call(with_output: bool):
        def run() -> None:
            kernels.attention_mass(query, cache, layout, table, query_rows, key_counts, size**-0.5, mass,
                                   output if with_output else None)
        return run

    if not prefill:
        return {"decode": call(True)}, layout
    return {"prefill, mass": call(False), "prefill, mass and output (fused)": call(True),
            "prefill, vLLM's attention": _vllm_prefill(query, cache, table, layout.isa, size**-0.5)}, layout


def _vllm_prefill(query, cache, table, isa: str, scale: float):
    """vLLM's CPU attention over the same cache and prompt (causal), as the engine calls it."""
    import torch
    from vllm import _custom_ops as ops

    tokens, query_heads, size = query.shape
    heads, block = cache.shape[1], cache.shape[2]
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lengths = torch.tensor([tokens], dtype=torch.int32)
    vllm_isa = isa if isa in ("amx", "vec", "vec16") else "vec"
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=query_heads, num_kv_heads=heads, head_dim=size, seq_lens=lengths, dtype=query.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=vllm_isa, enable_kv_split=False)
    key_cache, value_cache = cache.view(cache.shape[0], heads, 2 * block, size).chunk(2, dim=2)
    output = torch.empty_like(query)

    def run() -> None:
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=starts,
            seq_lens=lengths, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    return run


def _victim_cases(args: argparse.Namespace) -> dict[str, Any]:
    """The victim search of one decode step, three ways, as closures over one table."""
    import numpy as np
    import torch

    from vllm_kvprune import kernels
    from vllm_kvprune.kernels.victims import VictimSearch, lowest_mass_slots_batched

    generator = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    per_request = args.held + args.block_size  # each request's blocks, the table scattered over them
    mass = torch.rand(args.layers, args.kv_heads, args.batch * per_request, generator=generator)
    searches = []
    for row in range(args.batch):
        positions = np.stack([[rng.permutation(args.held + 64)[: args.held] for _ in range(args.kv_heads)]
                              for _ in range(args.layers)])
        slots = torch.arange(row * per_request, row * per_request + args.held)
        searches.append(VictimSearch(slots, positions, 1, args.held + 64, 4, 32))
    threads = torch.get_num_threads()

    def on_threads(count: int):
        def call() -> None:
            torch.set_num_threads(count)
            try:
                kernels.lowest_mass_slots_many(mass, searches)
            finally:
                torch.set_num_threads(threads)
        return call

    cases = {"victims, C++ op per request, 1 thread": on_threads(1)}
    if threads > 1:
        cases[f"victims, C++ op per request, {threads} threads"] = on_threads(threads)
    cases["victims, torch ranking all requests at once"] = lambda: lowest_mass_slots_batched(mass, searches)
    return cases


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and one row per timed case (the printed table and the results page's)."""
    headers = ["case", "dtype", "queries x keys", "cache layout", "median ms", "p25-p75 ms"]
    return headers, [[r["case"], r["dtype"], f"{r['queries']} x {r['keys']}", r["cache_layout"],
                      f"{r['median_ms']:.2f}", f"{r['p25_ms']:.2f}-{r['p75_ms']:.2f}"] for r in results]


def run(args: argparse.Namespace) -> int:
    import torch

    from vllm_kvprune import kernels

    torch.set_num_threads(args.threads or machine.usable_cores())
    results: list[dict[str, Any]] = []
    for dtype_name in DTYPES:
        for prefill in (True, False):
            calls, layout = _case(args, dtype_name, prefill)
            timings = common.time_round_robin(calls, warmup=1, repeats=args.repeats)
            for case, timing in timings.items():
                results.append({"case": case, "dtype": dtype_name,
                                "queries": args.prompt_tokens if prefill else args.batch,
                                "keys": args.prompt_tokens if prefill else args.keys,
                                "cache_layout": layout.isa, "median_ms": timing["median"] / 1000,
                                "p25_ms": timing["p25"] / 1000, "p75_ms": timing["p75"] / 1000})
    for case, call in _victim_cases(args).items():
        timing = common.time_round_robin({"victims": call}, warmup=1, repeats=args.repeats)["victims"]
        results.append({"case": case, "dtype": "float32", "queries": args.batch, "keys": args.held,
                        "cache_layout": f"{args.layers} layers x {args.kv_heads} heads", "median_ms": timing["median"] / 1000,
                        "p25_ms": timing["p25"] / 1000, "p75_ms": timing["p75"] / 1000})
    isa = kernels.extension_isa() or "torch fallback (no extension)"
    common.print_table(*table(results))
    print(f"extension built for: {isa}; {torch.get_num_threads()} threads")
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "run", "command")}
    settings.update(extension_isa=isa, threads=torch.get_num_threads())
    out = Path(args.out)
    common.write_json(out, "attention_mass", settings, results)
    figure, axes = common.new_figure(6, 3)
    labels = [f"{r['case']}\n{r['dtype']}" for r in results]
    axes.bar(labels, [r["median_ms"] for r in results])
    axes.set_ylabel("ms per call (median)")
    axes.set_title(f"attention_mass, extension built for {isa}")
    common.save_figure(figure, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
