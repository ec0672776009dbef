"""`python -m vllm_kvprune.bench gpu-kernels`: the Triton kernels of the GPU path against plain
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
* paged-eviction: token scores at write time and block means vs the torch expressions.
* gvote: the vote (union of synthetic queries' top-budget keys) vs ``GVotePolicy.keep_mask``.

Without a GPU the kernels run in Triton's interpreter (``--tiny`` shapes, ``TRITON_INTERPRET=1``):
that checks this script, not speed, and the JSON says so. Nothing here imports vLLM, so it runs
on a machine with PyTorch and Triton only: ``python -m vllm_kvprune.bench.gpu_kernels``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

NAME = "gpu-kernels"
# Written as results/gpu/kernels_<gpu>.json (kernels_h200.json; kernels_interpreter.json without a GPU).
DEFAULT_OUT_DIR = "results/gpu"


@dataclass(frozen=True)
class Shapes:
    batch: int
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    seq_len: int  # tokens per request (cache tokens for kv-update)
    evict: tuple[int, ...]  # tokens replaced per request and step (kv-update)
    block_size: int
    samples: int  # GVote's synthetic queries
    prompt: int  # GVote's prompt keys
    layers: int  # PagedEviction's block-means rows


FULL = Shapes(32, 8, 4, 128, 4096, (1, 64), 16, 32, 8192, 30)
TINY = Shapes(2, 2, 2, 32, 64, (1, 4), 16, 4, 64, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add("--tiny", action="store_true", help="small shapes (the interpreter run of the tests)")
    add("--cases", nargs="+", default=list(CASES), choices=[*CASES, *SWEEPS],
        help=f"which cases (default: all but the sweeps {', '.join(SWEEPS)})")
    add("--out", default=None, help="writes STEM.json and STEM.png (default: results/gpu/kernels_<gpu>)")


def _device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("gpu-kernels needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 with --tiny to check the script")
    return "cpu"


def _time_ms(call: Callable[[], Any], device: str) -> float:
    """Median time of one call: Triton's do_bench (CUDA events, cache flushed) on a GPU."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median"))
    call()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


class Case:
    """Collects one case's rows: each candidate's time and its deviation from torch."""

    def __init__(self, name: str, device: str, rows: list[dict[str, Any]]) -> None:
        self.name, self.device, self.rows = name, device, rows
        self.baseline_ms: float | None = None

    def time(self, label: str, call: Callable[[], Any], max_error: float | None = None, baseline: bool = False,
             **extra: Any) -> float:
        milliseconds = _time_ms(call, self.device)
        if baseline:
            self.baseline_ms = milliseconds
        row = {"case": self.name, "candidate": label, "ms": milliseconds, "max_abs_error": max_error, **extra}
        row["speedup_vs_torch"] = self.baseline_ms / milliseconds if self.baseline_ms else None
        self.rows.append(row)
        error = "" if max_error is None else f", max |error| vs torch {max_error:.2e}"
        print(f"  {self.name}: {label}: {milliseconds:.4f} ms{error}", flush=True)
        return milliseconds


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


# ---- kv-update --------------------------------------------------------------------------------
def case_kv_update(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    from vllm_kvprune.kernels.triton import cuda_ops, nhd_cache, slot_ops

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
        error = max(_error(paged[blocks, :, offsets, :dim], key), _error(paged[blocks, :, offsets, dim:], value))
        case.time("in place, Triton write_slots (slot range checked: a device sync)",
                  lambda: slot_ops.write_slots(key, value, paged, slots), error)
        # The worker's slots come from its own maps, so the step's hot path skips the check.
        case.time("in place, Triton write_slots", lambda: slot_ops.write_slots(key, value, paged, slots, check_range=False))
        if has_cuda_ops:
            paged[blocks, :, offsets] = 0
            torch.ops.kvprune_cuda.write_slots(key, value, paged, slots)
            error = max(_error(paged[blocks, :, offsets, :dim], key), _error(paged[blocks, :, offsets, dim:], value))
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
    error = max(_error(output, expected_output), _error(got_mass, expected_mass))
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
              _error(output, expected), kv_kept=kept)
    rows_of_query = torch.arange(batch, dtype=torch.int32, device=device)
    padded_counts = lengths.max(dim=1).values
    case.time("Triton padded (every head at its request's longest)",
              lambda: triton_mass.attention_mass(query, paged, block_table, rows_of_query, padded_counts, scale, None, output),
              kv_kept=1.0)


# ---- fdc ----------------------------------------------------------------------------------------
def case_fdc(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    """Batch x seq_len as every case, then few long sequences (batch / 8, 4 x seq_len), where the
    tasks alone leave multiprocessors idle and splitting the keys (flash-decoding) matters."""
    _fdc_case("fdc decode", shapes.batch, shapes.seq_len, shapes, dtype, device, rows, every_rank_set=True)
    _fdc_case("fdc decode, few long", max(1, shapes.batch // 8), 4 * shapes.seq_len, shapes, dtype, device, rows,
              every_rank_set=False)


@dataclass
class _DecodeInputs:
    """One decode step's dense queries, keys and values ``[batch, heads, length, dim]`` on the
    device, the vLLM metadata of its packed caches, and the generator that drew them (cases
    draw their ranks from it next)."""

    query: torch.Tensor
    dense_k: torch.Tensor
    dense_v: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    generator: torch.Generator

    @classmethod
    def draw(cls, batch: int, length: int, shapes: Shapes, dtype: torch.dtype, device: str, seed: int) -> "_DecodeInputs":
        generator = torch.Generator().manual_seed(seed)
        heads, dim = shapes.kv_heads, shapes.head_dim
        query = torch.randn(batch, heads * shapes.group, dim, generator=generator).to(device, dtype)
        dense_k = torch.randn(batch, heads, length, dim, generator=generator).to(device, dtype)
        dense_v = torch.randn(batch, heads, length, dim, generator=generator).to(device, dtype)
        return cls(query, dense_k, dense_v, torch.arange(batch + 1, dtype=torch.int32, device=device),
                   torch.full((batch,), length, dtype=torch.int32, device=device), dim ** -0.5, generator)

    def sdpa(self) -> torch.Tensor:
        """Torch's attention at full width: the baseline and the expected output."""
        return torch.nn.functional.scaled_dot_product_attention(
            self.query[:, :, None, :], self.dense_k, self.dense_v, scale=self.scale, enable_gqa=True)[:, :, 0, :]

    def packed(self, k_ranks: list[int], v_ranks: list[int], block_size: int):
        """(cache, heads on the device, block table): the keys and values cut to the ranks, in a
        packed FDC cache whose blocks are laid out request after request."""
        from vllm_kvprune.kernels.reduced_attention import PackedHeads

        batch, heads, length, _ = self.dense_k.shape
        device, dtype = self.dense_k.device, self.dense_k.dtype
        layout = PackedHeads.from_ranks(k_ranks, v_ranks)
        per_request = length // block_size
        table = torch.arange(batch * per_request, dtype=torch.int32, device=device).view(batch, per_request)
        cache = torch.empty(batch * per_request, block_size * layout.row_width, dtype=dtype, device=device)
        _write_packed(cache, layout, torch.arange(batch * length, device=device),
                      self.dense_k.permute(0, 2, 1, 3).reshape(-1, heads, self.dense_k.shape[-1]),
                      self.dense_v.permute(0, 2, 1, 3).reshape(-1, heads, self.dense_v.shape[-1]), block_size)
        on_device = PackedHeads(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in (
            layout.k_ranks, layout.v_ranks, layout.k_offsets, layout.v_offsets, layout.row_width)))
        return cache, on_device, table


def _fdc_case(name: str, batch: int, length: int, shapes: Shapes, dtype: torch.dtype, device: str, rows: list,
              every_rank_set: bool) -> None:
    from vllm_kvprune.kernels.triton import reduced_attention as triton_fdc

    inputs = _DecodeInputs.draw(batch, length, shapes, dtype, device, seed=3)
    heads, dim, bs = shapes.kv_heads, shapes.head_dim, shapes.block_size
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    chosen = triton_fdc.choose_key_splits(batch * heads, length, multiprocessors)
    case = Case(name, device, rows)
    expected = inputs.sdpa()
    case.time("torch SDPA, full width", inputs.sdpa, baseline=True, kv_kept=1.0)
    adaptive = torch.randint(max(dim // 8, 1), dim + 1, (2, heads), generator=inputs.generator)
    rank_sets = {"full width": ([dim] * heads, [dim] * heads),
                 "50% dims": ([dim // 2] * heads, [dim // 2] * heads)}
    if every_rank_set:
        rank_sets.update({"adaptive ranks": (adaptive[0].tolist(), adaptive[1].tolist()),
                          "adaptive ranks up to a multiple of 8": ((-(-adaptive[0] // 8) * 8).clamp(max=dim).tolist(),
                                                                   (-(-adaptive[1] // 8) * 8).clamp(max=dim).tolist())})
    for label, (k_ranks, v_ranks) in rank_sets.items():
        cache, device_heads, block_table = inputs.packed(k_ranks, v_ranks, bs)
        kept = (sum(k_ranks) + sum(v_ranks)) / (2 * heads * dim)
        # (launch order, key splits, keys token-major): LPT vs natural for adaptive ranks; at full
        # width and 50% every power-of-two split up to 16, the one choose_key_splits picks
        # marked; then the GPU layout (keys token-major) unsplit, split 4 and as chosen.
        variants = [(True, 1, False), (False, 1, False)] if label == "adaptive ranks" else [(True, 1, False)]
        if label in ("full width", "50% dims"):
            variants += [(True, splits, False) for splits in (2, 4, 8, 16) if length >= splits * 64]
            variants += [(True, splits, True) for splits in sorted({1, 4, chosen}) if length >= splits * 64]
        by_token = triton_fdc.keys_by_token(cache, device_heads, bs) if any(v[2] for v in variants) else None
        for balanced, splits, token_major in variants:
            call = lambda balanced=balanced, splits=splits, token_major=token_major: triton_fdc.reduced_attention(  # noqa: E731
                inputs.query, by_token if token_major else cache, block_table, inputs.query_start_loc,
                inputs.seq_lens, device_heads, inputs.scale, dim, balanced, bs, key_splits=splits,
                max_seq_len=length, keys_by_token=token_major)
            error = _error(call().to(dtype), expected) if label == "full width" else None
            schedule = "" if label != "adaptive ranks" else (", LPT order" if balanced else ", natural order")
            split_label = "" if splits == 1 else f", {splits} key splits" + (" (chosen)" if splits == chosen else "")
            layout = ", keys token-major" if token_major else ""
            case.time(f"Triton reduced, {label}{schedule}{split_label}{layout}", call, error, kv_kept=kept,
                      key_splits=splits, keys_by_token=token_major)


def case_fdc_tiles(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    """Not in the default run: a sweep of the fdc decode kernel's tiles (keys per step, warps,
    pipeline stages), key splits and cache block sizes, at 50% dims and full width, for both
    fdc shapes; each row against SDPA at full width on the same inputs."""
    import itertools

    from vllm_kvprune.kernels.triton import reduced_attention as triton_fdc

    heads, dim = shapes.kv_heads, shapes.head_dim
    tiny = shapes is TINY
    # Key splits fixed per shape (none at batch 32, 4 for the few long: the best of the fdc case).
    for batch, length, splits in ((shapes.batch, shapes.seq_len, 1), (max(1, shapes.batch // 8), 4 * shapes.seq_len, 4)):
        inputs = _DecodeInputs.draw(batch, length, shapes, dtype, device, seed=5)
        case = Case(f"fdc tiles, batch {batch} x {length} keys", device, rows)
        expected = inputs.sdpa()
        case.time("torch SDPA, full width", inputs.sdpa, baseline=True)
        for block_size, width in itertools.product((16,) if tiny else (16, 64), (dim, dim // 2)):
            cache, on_device, table = inputs.packed([width] * heads, [width] * heads, block_size)
            token_major = triton_fdc.keys_by_token(cache, on_device, block_size)
            grid = [(block_n, warps, stages, False) for block_n, warps, stages in
                    itertools.product((64, 128), (4, 8), (2, 3, 4))]
            grid += [(block_n, warps, stages, True) for block_n, warps, stages in
                     itertools.product((64, 128), (4, 8), (2, 3))]
            for block_n, warps, stages, by_token in (grid if not tiny else [(32, 4, 2, False), (32, 4, 2, True)]):
                triton_fdc._TILE_OVERRIDE.update(block_n=block_n, num_warps=warps, num_stages=stages)
                try:
                    call = lambda by_token=by_token: triton_fdc.reduced_attention(  # noqa: E731
                        inputs.query, token_major if by_token else cache, table, inputs.query_start_loc,
                        inputs.seq_lens, on_device, inputs.scale, dim, True, block_size, key_splits=splits,
                        max_seq_len=length, keys_by_token=by_token)
                    error = _error(call().to(dtype), expected) if width == dim else None
                    case.time(f"{'full width' if width == dim else '50% dims'}, block {block_size}, "
                              f"{block_n} keys/step, {warps} warps, {stages} stages, {splits} splits"
                              + (", keys token-major" if by_token else ""), call, error,
                              kv_kept=width / dim, block_n=block_n, num_warps=warps, num_stages=stages,
                              key_splits=splits, block_size=block_size, keys_by_token=by_token)
                except Exception as failure:  # noqa: BLE001  (a tile that does not compile: say so, go on)
                    print(f"  skipped {block_n}/{warps}/{stages}/{by_token}: {type(failure).__name__}: {failure}"[:300])
                finally:
                    triton_fdc._TILE_OVERRIDE.clear()


def _write_packed(cache, packed, slots, key, value, block_size) -> None:
    """Keys and values `[n, H, D]` into a packed FDC cache, on the cache's device (the same
    element positions as `PackedHeads.write`, which builds them on CPU)."""
    keys, values, _ = packed._positions(slots.cpu(), block_size, cache.shape[1])
    flat = cache.view(-1)
    flat[keys.reshape(-1).to(cache.device)] = torch.cat(
        [key[:, h, : int(r)] for h, r in enumerate(packed.k_ranks)], 1).reshape(-1).to(cache.dtype)
    flat[values.reshape(-1).to(cache.device)] = torch.cat(
        [value[:, h, : int(r)] for h, r in enumerate(packed.v_ranks)], 1).reshape(-1).to(cache.dtype)


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
              _error(scores_row[slots], expected))
    by_slot = torch.rand(shapes.layers, num_slots, generator=generator).to(device)
    block_ids = torch.randperm(num_slots // bs, generator=generator).to(device)
    divisor = float(bs * heads)
    case = Case("paged-eviction block means", device, rows)

    def torch_means() -> torch.Tensor:
        return by_slot.view(shapes.layers, -1, bs)[:, block_ids].sum(dim=-1) / divisor

    expected = torch_means()
    case.time("torch (gather, sum)", torch_means, baseline=True)
    case.time("Triton", lambda: block_scores.block_means(by_slot, block_ids, bs, divisor, check_range=False),
              _error(block_scores.block_means(by_slot, block_ids, bs, divisor), expected))


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


def machine(device: str, module: str = "vllm_kvprune.bench.gpu_kernels", name: str = NAME) -> dict[str, Any]:
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

    device = _device()
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
    parser = argparse.ArgumentParser(prog="python -m vllm_kvprune.bench.gpu_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
