"""Per-head variable-length decode attention over head-pages (budget-free policies, GVote).

The layer cache ``[num_blocks, H, block_size, 2D]`` (GPU layout, HND or NHD strides) is read as
head-pages: head-page ``p`` is KV head ``p % H`` of block ``p // H``, ``block_size`` tokens of
one head (see :mod:`vllm_kvprune.worker.head_page_map`). Each (request n, KV head h) is its own
sequence: it holds ``lengths[n, h]`` tokens, token ``j`` at offset ``j % block_size`` of
head-page ``pages[n, h, j // block_size]`` (global ids, -1 padding past the used pages). The
head-page's own KV head index ``p % H`` need not be ``h``: packing puts any head anywhere.
Request n's one query token (decode) attends, with query heads ``h * G .. h * G + G - 1``
(``G = Hq / H``), exactly the tokens of head (n, h). A length of 0 gives a zero output.

One program per (request, KV head), the whole query group at once, online softmax over the
head's tokens a key tile at a time (each token gathers its own head-page id); same tiles and precision as :mod:`vllm_kvprune.kernels.triton.attention_mass`.
The torch oracle is :func:`vllm_kvprune.kernels.reference.head_page_attention_reference`.

Not checked (no device sync): ``0 <= lengths[n, h] <= max_pages * block_size`` and that the
head-pages those lengths reach are valid ids ``0 .. num_blocks * H - 1``. Shapes, dtypes and
devices are checked (``ValueError``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvprune.kernels.triton import check_cache, device_limits, dot_precision
from vllm_kvprune.kernels.triton.attention_mass import (
    SUPPORTED_CACHE_DTYPES,
    check_device,
    check_output,
    check_query,
    group_logits,
    group_pad,
    key_tile,
    softmax_step,
    tile_size,
)


@triton.jit
def _head_page_attention_kernel(
    query_ptr, cache_ptr, pages_ptr, lengths_ptr, output_ptr,
    scale, softcap, group, num_heads, head_size, block_size,
    query_stride_n, query_stride_h,
    output_stride_n, output_stride_h,
    cache_stride_block, cache_stride_head, cache_stride_offset,
    pages_stride_n, pages_stride_h, pages_stride_page,
    lengths_stride_n, lengths_stride_h,
    GROUP_PAD: tl.constexpr, KEY_TILE: tl.constexpr, D_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (n, h): request n's query group of KV head h over head (n, h)'s head-pages."""
    request = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    rows_in_group = tl.arange(0, GROUP_PAD)
    keys = tl.arange(0, KEY_TILE)
    dims = tl.arange(0, D_PAD)
    row_ok = rows_in_group < group
    dim_ok = dims < head_size
    query_heads = kv_head * group + rows_in_group
    group_mask = row_ok[:, None] & dim_ok[None, :]

    query = tl.load(query_ptr + request * query_stride_n + query_heads[:, None] * query_stride_h + dims[None, :],
                    mask=group_mask, other=0.0).to(tl.float32)
    length = tl.load(lengths_ptr + request * lengths_stride_n + kv_head * lengths_stride_h).to(tl.int32)
    pages_at = pages_ptr + request * pages_stride_n + kv_head * pages_stride_h

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    accumulator = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for tile_start in range(0, length, KEY_TILE):
        tokens = tile_start + keys
        key_ok = tokens < length
        head_page = tl.load(pages_at + (tokens // block_size) * pages_stride_page, mask=key_ok, other=0).to(tl.int64)
        token_at = (head_page // num_heads) * cache_stride_block + (head_page % num_heads) * cache_stride_head \
            + (tokens % block_size) * cache_stride_offset
        tile_at = cache_ptr + token_at[:, None] + dims[None, :]
        tile_mask = key_ok[:, None] & dim_ok[None, :]
        key = tl.load(tile_at, mask=tile_mask, other=0.0).to(tl.float32)
        logits = group_logits(query, key, scale, softcap, SOFTCAP, DOT_PRECISION)
        logits = tl.where(key_ok[None, :], logits, float("-inf"))
        probs, rescale, running_max, running_sum = softmax_step(logits, running_max, running_sum)
        value = tl.load(tile_at + head_size, mask=tile_mask, other=0.0).to(tl.float32)
        accumulator = accumulator * rescale[:, None] + tl.dot(probs, value, input_precision=DOT_PRECISION)

    out = accumulator / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # length 0: zeros
    tl.store(output_ptr + request * output_stride_n + query_heads[:, None] * output_stride_h + dims[None, :],
             out.to(output_ptr.dtype.element_ty), mask=group_mask)


def head_page_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    softcap: float = 0.0,
) -> None:
    """Decode attention of ``query [N, Hq, D]`` (one token per request) where each (request n,
    KV head h) attends its own ``lengths[n, h]`` tokens stored in head-pages
    ``pages[n, h, :]`` (int32 ``[N, H, max_pages]``, global head-page ids, -1 padding;
    ``lengths`` int32 ``[N, H]``). Writes ``output [N, Hq, D]`` (any float dtype); a head of
    length 0 gets zeros. ``softcap > 0`` caps the scaled logits to ``softcap * tanh(x / softcap)``.
    """
    num_blocks, num_heads, block_size, head_size = check_cache(kv_cache)
    if kv_cache.dtype not in SUPPORTED_CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not one of {SUPPORTED_CACHE_DTYPES}")
    group = check_query(query, kv_cache, num_heads, head_size)
    num_requests = query.shape[0]
    check_output(output, query, kv_cache)
    if pages.dim() != 3 or tuple(pages.shape[:2]) != (num_requests, num_heads) or pages.dtype != torch.int32:
        raise ValueError(
            f"pages must be int32 [{num_requests}, {num_heads}, max_pages], got {pages.dtype} {list(pages.shape)}"
        )
    if tuple(lengths.shape) != (num_requests, num_heads) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{num_requests}, {num_heads}], got {lengths.dtype} {list(lengths.shape)}")
    check_device(pages, "pages", kv_cache)
    check_device(lengths, "lengths", kv_cache)
    if num_requests == 0:
        return
    limits = device_limits(kv_cache.device)
    _head_page_attention_kernel[(num_requests, num_heads)](
        query, kv_cache, pages, lengths, output,
        float(scale), float(softcap), group, num_heads, head_size, block_size,
        query.stride(0), query.stride(1),
        output.stride(0), output.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        pages.stride(0), pages.stride(1), pages.stride(2),
        lengths.stride(0), lengths.stride(1),
        GROUP_PAD=group_pad(group), KEY_TILE=key_tile(kv_cache.dtype, head_size, group, limits),
        D_PAD=tile_size(head_size), SOFTCAP=softcap > 0, DOT_PRECISION=dot_precision(kv_cache.dtype, limits),
    )
