"""`python -m benchmarks gpu-kernels`: the Triton kernels of the GPU path against plain
torch on one GPU, at decode shapes (batch 32), each case checked against torch before it is timed.

* kv-update: EQUIP's in-place write of E new tokens per request into victim slots of vLLM's
  paged GPU cache (Triton, the CUDA op when built, torch ``index_put_``) vs shift-and-append
  of a contiguous ``[B, H, L, D]`` cache (``torch.cat``, how Hugging Face StreamingLLM code does it).
* h2o: one decode step's attention output and attention mass, fused in one kernel vs two
  passes of the same kernel (output, then mass) vs dense torch (einsum, softmax, einsum, sum).
* head-pages: decode over per-head lengths (GVote's kept sets, each (request, KV head) its own
  length) vs the padded alternative (every head of a request at its longest head's length, the
  paged kernel) vs dense torch with a mask.
* fdc: reduced-dimension decode attention at 50% and adaptive ranks vs the same kernel at full
  width vs torch's ``scaled_dot_product_attention`` at full width; LPT vs natural task order;
  the keys of each task split over 2-16 programs (flash-decoding), at batch 32 and for a few
  long sequences (batch / 8 at 4 x the length).
* fdc-layer: one layer's FDC decode step as the GPU wrapper runs it, part by part (the narrow
  write, torch indexing vs the Triton writer; the four projections; the reduced attention) and
  whole: where its time goes (`gpu_kernels_fdc.py`, with the fdc cases).
* paged-eviction: token scores at write time and block means vs the torch expressions.
* gvote: the vote (union of synthetic queries' top-budget keys) vs ``GVotePolicy.keep_mask``.

Without a GPU the kernels run in Triton's interpreter (``--tiny`` shapes, ``TRITON_INTERPRET=1``):
that checks this script, not speed, and the JSON says so. Nothing here imports vLLM, so it runs
on a machine with PyTorch and Triton only: ``python -m benchmarks.gpu_kernels``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.gpu_kernels_fdc import case_fdc, case_fdc_layer, case_fdc_tiles
from benchmarks.gpu_timing import FULL, TINY, Case, Shapes, bench_device, max_abs_error

NAME = "gpu-kernels"
# Written as results/gpu/kernels_<gpu>.json (kernels_h200.json; kernels_interpreter.json without a GPU).
DEFAULT_OUT_DIR = "results/gpu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add("--tiny", action="store_true", help="small shapes (the interpreter run of the tests)")
    add("--cases", nargs="+", default=list(CASES), choices=[*CASES, *SWEEPS],
        help=f"which cases (default: all but the sweeps {', '.join(SWEEPS)})")
    add("--out", default=None, help="writes STEM.json and STEM.png (default: results/gpu/kernels_<gpu>)")


# ---- kv-update --------------------------------------------------------------------------------
def case_kv_update(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    from benchmarks import cuda_ops
    from vllm_kvprune.kernels.triton import nhd_cache, slot_ops

    batch, heads, dim, cache_tokens, bs = shapes.batch, shapes.kv_heads, shapes.head_dim, shapes.seq_len, shapes.block_size
    sinks = 4
    blocks_per_request = cache_tokens // bs
    paged = nhd_cache(batch * blocks_per_request, heads, bs, dim, dtype, device).normal_()
    has_cuda_ops = device == "cuda" and cuda_ops.load_cuda_ops()
    for evict in shapes.evict:
        case = Case(f"kv-update E={evict}", device, rows)
        dense_k = torch.randn(batch, heads, cache_tokens, dim, dtype=dtype, device=device)
        dense_v = torch.randn_like(dense_k)
        new_k = torch.randn(batch, heads, evict, dim, dtype=dtype, device=device)
        new_v = torch.randn_like(new_k)

        def shift() -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.cat([dense_k[:, :, :sinks], dense_k[:, :, sinks + evict:], new_k], dim=2),
                    torch.cat([dense_v[:, :, :sinks], dense_v[:, :, sinks + evict:], new_v], dim=2))

        case.time("shift-and-append (torch.cat)", shift, baseline=True)
        # The E victims of every request: ring positions after the sinks, in its own blocks.
        victims = sinks + torch.arange(evict, device=device)
        slots = (torch.arange(batch, device=device)[:, None] * blocks_per_request * bs + victims[None, :]).reshape(-1)
        key = new_k.permute(0, 2, 1, 3).reshape(batch * evict, heads, dim).contiguous()
        value = new_v.permute(0, 2, 1, 3).reshape(batch * evict, heads, dim).contiguous()
        blocks, offsets = slots // bs, slots % bs

        def torch_in_place() -> None:
            paged[blocks, :, offsets, :dim] = key
            paged[blocks, :, offsets, dim:] = value

        case.time("in place, torch index_put_", torch_in_place)
        paged[blocks, :, offsets] = 0
        slot_ops.write_slots(key, value, paged, slots)
        error = max(max_abs_error(paged[blocks, :, offsets, :dim], key), max_abs_error(paged[blocks, :, offsets, dim:], value))
        case.time("in place, Triton write_slots (slot range checked: a device sync)",
                  lambda: slot_ops.write_slots(key, value, paged, slots), error)
        # The worker's slots come from its own maps, so the step's hot path skips the check.
        case.time("in place, Triton write_slots", lambda: slot_ops.write_slots(key, value, paged, slots, check_range=False))
        if has_cuda_ops:
            paged[blocks, :, offsets] = 0
            torch.ops.kvprune_cuda.write_slots(key, value, paged, slots)
            error = max(max_abs_error(paged[blocks, :, offsets, :dim], key), max_abs_error(paged[blocks, :, offsets, dim:], value))
            case.time("in place, CUDA write_slots", lambda: torch.ops.kvprune_cuda.write_slots(key, value, paged, slots),
                      error)


# ---- decode attention over per-request blocks ---------------------------------------------------
def _paged_requests(shapes: Shapes, dtype: torch.dtype, device: str, generator: torch.Generator):
    """A paged cache holding `batch` requests of `seq_len` tokens in shuffled blocks, and the same
    tokens as dense `[B, H, L, D]` K and V."""
    from vllm_kvprune.kernels.triton import nhd_cache

    batch, heads, dim, length, bs = shapes.batch, shapes.kv_heads, shapes.head_dim, shapes.seq_len, shapes.block_size
    per_request = length // bs
    paged = nhd_cache(batch * per_request, heads, bs, dim, dtype, device)
    block_table = torch.randperm(batch * per_request, generator=generator).view(batch, per_request).to(device)
    dense_k = torch.randn(batch, heads, length, dim, generator=generator).to(device, dtype)
    dense_v = torch.randn(batch, heads, length, dim, generator=generator).to(device, dtype)
    # Token p of request b sits at offset p % bs of block block_table[b, p // bs].
    by_block = lambda dense: dense.view(batch, heads, per_request, bs, dim).permute(0, 2, 1, 3, 4)  # noqa: E731
    paged[block_table.reshape(-1), :, :, :dim] = by_block(dense_k).reshape(-1, heads, bs, dim)
    paged[block_table.reshape(-1), :, :, dim:] = by_block(dense_v).reshape(-1, heads, bs, dim)
    return paged, block_table.to(torch.int32), dense_k, dense_v


def _dense_attention(query, dense_k, dense_v, scale, mask=None):
    """Dense torch decode attention with GQA: query `[B, Hq, D]`, K/V `[B, H, L, D]`; returns
    the output `[B, Hq, D]` and the probabilities `[B, H, G, L]`."""
    batch, query_heads, dim = query.shape
    heads = dense_k.shape[1]
    grouped = query.float().view(batch, heads, query_heads // heads, dim)
    logits = torch.einsum("bhgd,bhld->bhgl", grouped, dense_k.float()) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    output = torch.einsum("bhgl,bhld->bhgd", probs, dense_v.float()).reshape(batch, query_heads, dim)
    return output, probs


def case_h2o(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    from vllm_kvprune.kernels.triton import attention_mass as triton_mass

    generator = torch.Generator().manual_seed(1)
    paged, block_table, dense_k, dense_v = _paged_requests(shapes, dtype, device, generator)
    batch, heads, length = shapes.batch, shapes.kv_heads, shapes.seq_len
    query = torch.randn(batch, heads * shapes.group, shapes.head_dim, generator=generator).to(device, dtype)
    scale = shapes.head_dim ** -0.5
    rows_of_query = torch.arange(batch, dtype=torch.int32, device=device)
    counts = torch.full((batch,), length, dtype=torch.int32, device=device)
    mass = torch.zeros(heads, paged.shape[0] * shapes.block_size, dtype=torch.float32, device=device)
    output = torch.empty_like(query)
    case = Case("h2o decode + mass", device, rows)

    def dense() -> tuple[torch.Tensor, torch.Tensor]:
        out, probs = _dense_attention(query, dense_k, dense_v, scale)
        return out.to(dtype), probs.sum(dim=2)  # mass [B, H, L]

    expected_output, expected_mass = dense()
    case.time("torch dense (einsum, softmax, einsum, sum)", dense, baseline=True)

    def fused() -> None:
        triton_mass.attention_mass(query, paged, block_table, rows_of_query, counts, scale, mass, output)

    mass.zero_()
    fused()
    slots = (block_table.long()[:, :, None] * shapes.block_size + torch.arange(shapes.block_size, device=device)).reshape(batch, -1)
    got_mass = mass[:, slots].permute(1, 0, 2)  # [B, H, L]
    error = max(max_abs_error(output, expected_output), max_abs_error(got_mass, expected_mass))
    case.time("Triton fused (output + mass, one launch)", fused, error)

    def separate() -> None:
        triton_mass.attention_mass(query, paged, block_table, rows_of_query, counts, scale, None, output)
        triton_mass.attention_mass(query, paged, block_table, rows_of_query, counts, scale, mass, None)

    case.time("Triton separate (output, then mass)", separate)
    case.time("Triton output only (no mass)",
              lambda: triton_mass.attention_mass(query, paged, block_table, rows_of_query, counts, scale, None, output))


def case_head_pages(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    from vllm_kvprune.kernels.triton import attention_mass as triton_mass
    from vllm_kvprune.kernels.triton import head_pages

    generator = torch.Generator().manual_seed(2)
    paged, block_table, dense_k, dense_v = _paged_requests(shapes, dtype, device, generator)
    batch, heads, length, bs = shapes.batch, shapes.kv_heads, shapes.seq_len, shapes.block_size
    query = torch.randn(batch, heads * shapes.group, shapes.head_dim, generator=generator).to(device, dtype)
    scale = shapes.head_dim ** -0.5
    # GVote-like kept lengths: each (request, KV head) keeps 10%..100% of its tokens, the first ones.
    lengths = (length * (0.1 + 0.9 * torch.rand(batch, heads, generator=generator))).long().clamp(min=1)
    lengths[:, 0] = length  # one head of each request keeps everything: the padded case's length
    # Head-pages: head h of request b uses the pages of its own blocks, (block * H + h).
    max_pages = length // bs
    pages = (block_table.long()[:, None, :] * heads + torch.arange(heads, device=device)[None, :, None])
    pages = torch.where(torch.arange(max_pages, device=device)[None, None, :] < ((lengths.to(device) + bs - 1) // bs)[:, :, None],
                        pages, -1).to(torch.int32)
    lengths = lengths.to(device, torch.int32)
    mask = torch.arange(length, device=device)[None, None, :] < lengths[:, :, None]
    output = torch.empty_like(query)
    case = Case("head-pages decode", device, rows)
    kept = float(lengths.float().mean() / length)

    def dense() -> torch.Tensor:
        return _dense_attention(query, dense_k, dense_v, scale, mask)[0].to(dtype)

    expected = dense()
    case.time("torch dense, masked", dense, baseline=True, kv_kept=1.0)
    head_pages.head_page_attention(query, paged, pages, lengths, scale, output)
    case.time("Triton head-pages (per-head lengths)",
              lambda: head_pages.head_page_attention(query, paged, pages, lengths, scale, output),
              max_abs_error(output, expected), kv_kept=kept)
    rows_of_query = torch.arange(batch, dtype=torch.int32, device=device)
    padded_counts = lengths.max(dim=1).values
    case.time("Triton padded (every head at its request's longest)",
              lambda: triton_mass.attention_mass(query, paged, block_table, rows_of_query, padded_counts, scale, None, output),
              kv_kept=1.0)


# ---- paged_eviction, gvote -------------------------------------------------------------------------
def case_paged_eviction(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    from vllm_kvprune.kernels.triton import block_scores

    generator = torch.Generator().manual_seed(4)
    batch, heads, dim, length, bs = shapes.batch, shapes.kv_heads, shapes.head_dim, shapes.seq_len, shapes.block_size
    num_slots = batch * length
    key = torch.randn(batch, heads, dim, generator=generator).to(device, dtype)
    value = torch.randn(batch, heads, dim, generator=generator).to(device, dtype)
    slots = torch.randperm(num_slots, generator=generator)[:batch].to(device)
    scores_row = torch.zeros(num_slots, dtype=torch.float32, device=device)
    case = Case("paged-eviction token scores", device, rows)

    def torch_scores() -> None:
        scores_row[slots] = (value.float().norm(dim=-1) / key.float().norm(dim=-1)).sum(dim=-1)

    torch_scores()
    expected = scores_row[slots].clone()
    case.time("torch (norms, divide, sum, index_put_)", torch_scores, baseline=True)
    scores_row.zero_()
    block_scores.store_token_scores(key, value, scores_row, slots)
    case.time("Triton fused", lambda: block_scores.store_token_scores(key, value, scores_row, slots, check_range=False),
              max_abs_error(scores_row[slots], expected))
    by_slot = torch.rand(shapes.layers, num_slots, generator=generator).to(device)
    block_ids = torch.randperm(num_slots // bs, generator=generator).to(device)
    divisor = float(bs * heads)
    case = Case("paged-eviction block means", device, rows)

    def torch_means() -> torch.Tensor:
        return by_slot.view(shapes.layers, -1, bs)[:, block_ids].sum(dim=-1) / divisor

    expected = torch_means()
    case.time("torch (gather, sum)", torch_means, baseline=True)
    case.time("Triton", lambda: block_scores.block_means(by_slot, block_ids, bs, divisor, check_range=False),
              max_abs_error(block_scores.block_means(by_slot, block_ids, bs, divisor), expected))


def case_gvote(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    from vllm_kvprune.kernels.triton import vote
    from vllm_kvprune.policies.gvote import GVotePolicy

    generator = torch.Generator().manual_seed(5)
    heads, group, dim, prompt = shapes.kv_heads, shapes.group, shapes.head_dim, shapes.prompt
    synthetic = torch.randn(shapes.samples, heads * group, dim, generator=generator).to(device)
    keys = torch.randn(heads, prompt, dim, generator=generator).to(device)
    budgets = torch.randint(1, prompt // 4, (heads * group,), generator=generator).to(device)
    scale = dim ** -0.5
    case = Case("gvote vote", device, rows)
    expected = GVotePolicy.keep_mask(synthetic, keys, budgets, scale)
    case.time("torch (GVotePolicy.keep_mask)", lambda: GVotePolicy.keep_mask(synthetic, keys, budgets, scale),
              baseline=True)
    got = vote.keep_mask(synthetic, keys, budgets, scale)
    case.time("Triton", lambda: vote.keep_mask(synthetic, keys, budgets, scale),
              float((got != expected).sum()), mismatched_keys=int((got != expected).sum()))


CASES: dict[str, Callable[..., None]] = {
    "kv-update": case_kv_update,
    "h2o": case_h2o,
    "head-pages": case_head_pages,
    "fdc": case_fdc,
    "fdc-layer": case_fdc_layer,
    "paged-eviction": case_paged_eviction,
    "gvote": case_gvote,
}
# Sweeps: named with --cases, never run by default.
SWEEPS: dict[str, Callable[..., None]] = {"fdc-tiles": case_fdc_tiles}


def gpu_slug(device: str) -> str:
    """A file-name tag for the GPU: its model number ("NVIDIA H100 80GB HBM3" -> "h100"), the
    whole name made safe where it has none, "interpreter" without a GPU."""
    import re

    if device != "cuda":
        return "interpreter"
    name = torch.cuda.get_device_properties(0).name
    model = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name)
    return (model.group(1) if model else re.sub(r"[^A-Za-z0-9]+", "_", name)).lower()


def machine(device: str, module: str = "benchmarks.gpu_kernels", name: str = NAME) -> dict[str, Any]:
    import platform

    import triton

    info = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "interpreter": device == "cpu",
            "command": ["python3", "-m", module, *[arg for arg in sys.argv[1:] if arg != name]],
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        info.update(gpu=properties.name, gpu_memory_gib=round(properties.total_memory / 2**30, 1),
                    multiprocessors=properties.multi_processor_count, cuda=torch.version.cuda, hip=torch.version.hip)
    return info


def run(args: argparse.Namespace) -> int:
    import json

    device = bench_device()
    shapes = TINY if args.tiny or device == "cpu" else FULL
    dtype = getattr(torch, args.dtype)
    rows: list[dict[str, Any]] = []
    for name in args.cases:
        print(f"{name} ({shapes}):", flush=True)
        {**CASES, **SWEEPS}[name](shapes, dtype, device, rows)
    _print_table(rows)
    stem = Path(args.out) if args.out else Path(DEFAULT_OUT_DIR) / f"kernels_{gpu_slug(device)}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": NAME, "machine": machine(device), "dtype": args.dtype, "shapes": dataclasses.asdict(shapes),
                "results": rows}
    stem.with_suffix(".json").write_text(json.dumps(document, indent=1, default=str))
    _plot(rows, stem.with_suffix(".png"), document["machine"])
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    table = [[row["case"], row["candidate"], f"{row['ms']:.4f}",
              "" if row["speedup_vs_torch"] is None else f"{row['speedup_vs_torch']:.2f}x",
              "" if row["max_abs_error"] is None else f"{row['max_abs_error']:.1e}"] for row in rows]
    headers = ["case", "candidate", "ms", "vs torch", "max |err|"]
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *table)]
    for line in [headers, ["-" * w for w in widths], *table]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)))


def _plot(rows: list[dict[str, Any]], path: Path, info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8.0, 0.32 * len(rows) + 1.2))
    labels = [f"{row['case']}: {row['candidate']}" for row in rows][::-1]
    axes.barh(labels, [row["speedup_vs_torch"] or 0.0 for row in rows][::-1])
    axes.axvline(1.0, color="gray", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("speed-up over the case's torch baseline (log)")
    axes.tick_params(axis="y", labelsize=7)
    axes.set_title(f"{info.get('gpu', 'Triton interpreter (not a timing)')}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
