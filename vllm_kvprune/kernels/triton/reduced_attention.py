"""FDC's reduced-space attention on the GPU, over the packed cache of unequal-width heads.

Same inputs, semantics and result as :func:`vllm_kvprune.kernels.reduced_attention.reduced_attention`
(the C++ op) and its oracle ``reduced_attention_reference``: queries ``[T, Hq, QW]``, query head
``q`` uses the first ``k_rank`` dims of KV head ``q // G``; the cache is ``[num_blocks, >=
block_size * row_width]`` laid out by :class:`PackedHeads` (per block, head ``h``'s keys
dims-major at ``block_size * (k_offsets[h] + d) + t``, its values token-major at
``block_size * v_offsets[h] + t * v_ranks[h] + d``); the output is ``[T, Hq, output_width]``
fp32, each head's first ``v_rank`` dims, the rest zero; causal within each sequence (query
``i`` of a sequence with ``n`` new tokens sees positions ``<= seq_len - n + i``).

Work decomposition. A *tile* is up to ``BLOCK_M`` consecutive queries of one sequence; a
*task* is (tile, KV head) and takes the head's whole query group, so one program holds
``BLOCK_M * BLOCK_G`` query rows (``BLOCK_G = next_power_of_2(G)``), row ``r`` being query
``r // BLOCK_G`` of the tile, group member ``r % BLOCK_G``. The program walks the cache blocks
of its sequence up to the last key its last query sees, ``BLOCK_N`` key positions per step
(each through its own block-table entry, so any ``block_size`` works and a step may span
blocks; ``block_size`` is a compile-time constant so Triton sees the slots' contiguity: one
compilation per block size), with an online softmax in fp32; ranks are masks (``d < k_rank``, ``d < v_rank``)
over power-of-two tiles as wide as the widest head.

Schedule. ``balanced=True`` launches the tasks longest first, cost = keys read x
``(k_rank + v_rank)``: the GPU hands programs to its multiprocessors roughly in launch order,
so this is the greedy longest-processing-time deal of FDC §5.3 (the CPU op deals to threads
explicitly). ``balanced=False`` launches them in natural order (sequence, tile, KV head).

Decode (one query per sequence, ``T == S``) needs no task list: program ``p`` is (sequence
``p // H``, KV head ``p % H``), or the ``p``-th longest of them when balanced, and the query
group alone is the program's rows, padded to ``tl.dot``'s 16 (tensor cores make the masked
rows cheaper than the broadcast path). With ``key_splits = N`` a decode task's keys are split over
N programs (grid ``[tasks, N]``, flash-decoding) whose partials a second, small launch combines
(:func:`choose_key_splits` picks N from host-side values). Otherwise the task list is built on the device with
torch ops and the grid is an upper bound known on the host (``min(T, S + T // BLOCK_M)`` tiles x ``H`` heads; surplus programs have no rows
and exit after their loads), so a launch never synchronises with the GPU. The
:class:`PackedHeads` tensors are copied to the device and their rank maxima read once per
(heads, device) and kept on ``heads``. Dots run in TF32 over 16-bit caches (exact for 16-bit
keys and queries) and in IEEE fp32 over fp32 caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_kvprune.kernels.reduced_attention import PackedHeads
from vllm_kvprune.kernels.triton import device_limits, dot_precision, fit_shared

# Query rows one prefill program holds (BLOCK_M * BLOCK_G), when the group allows.
_PREFILL_ROWS = 64
# tl.dot needs every dimension >= 16 on a GPU; smaller row tiles use broadcast-multiply + sum.
_MIN_DOT = 16
# Keys per step of the keys loop: with tl.dot; and the most elements of the broadcast path's
# [rows, dims, keys] product (registers), which sets its step between 16 and 64 keys.
_DOT_KEYS = 64
_MAX_PRODUCT = 8192
# Tuning hook for the benchmark's tile sweep: {"block_n", "num_warps", "num_stages"}; empty in use.
_TILE_OVERRIDE: dict[str, int] = {}
# Fields of one task row: sequence, KV head, first query's token index, queries in the tile,
# position of the tile's first query.
_TASK_FIELDS = 5


@triton.jit
def _reduced_attention_kernel(
    query_ptr, cache_ptr, block_table_ptr, tasks_ptr, out_ptr,
    k_ranks_ptr, v_ranks_ptr, k_offsets_ptr, v_offsets_ptr,
    group, scale,
    query_stride_t, query_stride_h, cache_stride_block, table_stride_seq,
    out_stride_t, out_stride_h,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, USE_DOT: tl.constexpr, TASK_FIELDS: tl.constexpr,
    block_size: tl.constexpr, KEY_RUNS: tl.constexpr, V_ALIGN: tl.constexpr, DECODE: tl.constexpr, ORDERED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    seq_lens_ptr, num_heads,
    partial_acc_ptr, partial_stats_ptr, split_keys, SPLITS: tl.constexpr,
    KEYS_BY_TOKEN: tl.constexpr, K_ALIGN: tl.constexpr,
):
    """Program p: task p of ``tasks`` (int32 rows of _TASK_FIELDS). A task with 0 queries reads
    no keys and stores nothing. Invariant: the rows stored are exactly the tile's queries x the
    group, columns ``d < v_rank``; every stored row saw key 0, so its softmax sum is > 0.

    ``SPLITS > 1`` (decode only): program (p, j) reads keys ``[j * split_keys, (j + 1) *
    split_keys)`` of task p and stores its unnormalised partial (acc, running max, running sum)
    for :func:`_combine_splits_kernel`; a split past the task's keys stores an empty partial."""
    ROWS: tl.constexpr = BLOCK_M * BLOCK_G
    if DECODE:
        # One query per sequence: task t is (sequence t // H, KV head t % H); `tasks` is only
        # the launch order (longest first) when ORDERED.
        task_id = tl.program_id(0)
        if ORDERED:
            task_id = tl.load(tasks_ptr + task_id)
        seq = (task_id // num_heads).to(tl.int64)
        head = (task_id % num_heads).to(tl.int64)
        first_token = seq
        num_queries = 1
        first_position = tl.load(seq_lens_ptr + seq) - 1
    else:
        task = tl.program_id(0).to(tl.int64) * TASK_FIELDS
        seq = tl.load(tasks_ptr + task).to(tl.int64)
        head = tl.load(tasks_ptr + task + 1).to(tl.int64)
        first_token = tl.load(tasks_ptr + task + 2).to(tl.int64)
        num_queries = tl.load(tasks_ptr + task + 3)
        first_position = tl.load(tasks_ptr + task + 4)
    # Keys the tile's last query sees (0 for an empty task).
    num_keys = tl.where(num_queries > 0, first_position + num_queries, 0)
    first_read = 0
    if SPLITS > 1:
        split = tl.program_id(1)
        first_read = split * split_keys
        num_keys = tl.minimum(num_keys, first_read + split_keys)

    k_rank = tl.multiple_of(tl.load(k_ranks_ptr + head), K_ALIGN)
    # Every head's v_rank is a multiple of V_ALIGN: rows of values start aligned, so their
    # loads can be vectorised (an odd rank leaves them unaligned, element by element).
    v_rank = tl.multiple_of(tl.load(v_ranks_ptr + head), V_ALIGN)
    k_offset = tl.load(k_offsets_ptr + head).to(tl.int64)
    v_offset = tl.load(v_offsets_ptr + head).to(tl.int64)

    rows = tl.arange(0, ROWS)
    row_query = rows // BLOCK_G
    row_member = rows % BLOCK_G
    row_ok = (row_query < num_queries) & (row_member < group)
    row_position = first_position + row_query  # the last key position each row sees
    k_dims = tl.arange(0, BLOCK_K)
    v_dims = tl.arange(0, BLOCK_V)
    steps = tl.arange(0, BLOCK_N)

    q_ptrs = (query_ptr + (first_token + row_query.to(tl.int64))[:, None] * query_stride_t
              + (head * group + row_member.to(tl.int64))[:, None] * query_stride_h + k_dims[None, :])
    query = tl.load(q_ptrs, mask=row_ok[:, None] & (k_dims < k_rank)[None, :], other=0.0).to(tl.float32)
    # Softmax in base 2; the scale and log2(e) multiply the logits, not the queries, so that
    # 16-bit queries stay exact in TF32.
    scale_log2 = scale * 1.4426950408889634

    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_V], tl.float32)

    table_row = block_table_ptr + seq * table_stride_seq
    for first_key in range(first_read, num_keys, BLOCK_N):
        # BLOCK_N key positions per step, each addressed through its own cache block (any
        # block_size; a step may span several blocks).
        positions = first_key + steps
        key_ok = positions < num_keys
        physical = tl.load(table_row + positions // block_size, mask=key_ok, other=0).to(tl.int64)
        slots = (positions % block_size).to(tl.int64)
        token_base = physical * cache_stride_block + slots  # + block_size * column for the keys
        # Keys [BLOCK_K, BLOCK_N] (dims-major in a block: dim d of a block's tokens is contiguous).
        if KEYS_BY_TOKEN:
            # The GPU layout (`keys_by_token`): a token's k_rank dims contiguous, as its values.
            keys_t = tl.trans(tl.load(
                cache_ptr + (physical * cache_stride_block + block_size * k_offset + slots * k_rank)[:, None]
                + k_dims[None, :], mask=key_ok[:, None] & (k_dims < k_rank)[None, :], other=0.0).to(tl.float32))
        elif KEY_RUNS == 1:
            # The step lies in one block: each dim's BLOCK_N keys are one contiguous run, which
            # the compiler can see (the block id is a scalar), so the loads are vectorised.
            block = tl.load(table_row + first_key // block_size).to(tl.int64)
            keys_t = tl.load(cache_ptr + block * cache_stride_block + block_size * (k_offset + k_dims)[:, None]
                             + (first_key % block_size + steps)[None, :],
                             mask=(k_dims < k_rank)[:, None] & key_ok[None, :], other=0.0).to(tl.float32)
        elif KEY_RUNS > 1:
            # KEY_RUNS whole blocks per step, a contiguous run of block_size keys per dim each.
            run_blocks = first_key // block_size + tl.arange(0, KEY_RUNS)
            run_ids = tl.load(table_row + run_blocks, mask=run_blocks * block_size < num_keys, other=0).to(tl.int64)
            in_block = tl.arange(0, block_size)
            run_ok = (run_blocks[:, None] * block_size + in_block[None, :]) < num_keys  # [KEY_RUNS, block_size]
            keys_t = tl.load(cache_ptr + run_ids[None, :, None] * cache_stride_block
                             + (block_size * (k_offset + k_dims))[:, None, None] + in_block[None, None, :],
                             mask=(k_dims < k_rank)[:, None, None] & run_ok[None, :, :], other=0.0).to(tl.float32)
            keys_t = tl.reshape(keys_t, (BLOCK_K, BLOCK_N))
        else:
            keys_t = tl.load(cache_ptr + token_base[None, :] + block_size * (k_offset + k_dims)[:, None],
                             mask=(k_dims < k_rank)[:, None] & key_ok[None, :], other=0.0).to(tl.float32)
        # Values [BLOCK_N, BLOCK_V] (token-major); unread slots are 0 so 0-weight x NaN cannot leak.
        values = tl.load(cache_ptr + (physical * cache_stride_block + block_size * v_offset + slots * v_rank)[:, None]
                         + v_dims[None, :],
                         mask=key_ok[:, None] & (v_dims < v_rank)[None, :], other=0.0).to(tl.float32)
        if USE_DOT:
            logits = tl.dot(query, keys_t, input_precision=DOT_PRECISION) * scale_log2
        else:
            logits = tl.sum(query[:, :, None] * keys_t[None, :, :], axis=1) * scale_log2
        visible = row_ok[:, None] & key_ok[None, :] & (positions[None, :] <= row_position[:, None])
        logits = tl.where(visible, logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        # Rows that have seen nothing yet keep a finite reference so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(logits - safe_max[:, None])
        correction = tl.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        if USE_DOT:
            acc = acc * correction[:, None] + tl.dot(probs, values, input_precision=DOT_PRECISION)
        else:
            acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * values[None, :, :], axis=1)
        row_max = new_max

    if SPLITS > 1:
        # The partial of (task, split), rows = the group: acc [ROWS, BLOCK_V], then (max, sum).
        part = task_id.to(tl.int64) * SPLITS + split
        tl.store(partial_acc_ptr + (part * ROWS + rows)[:, None] * BLOCK_V + v_dims[None, :], acc)
        tl.store(partial_stats_ptr + (part * ROWS + rows) * 2, row_max)
        tl.store(partial_stats_ptr + (part * ROWS + rows) * 2 + 1, row_sum)
    else:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        o_ptrs = (out_ptr + (first_token + row_query.to(tl.int64))[:, None] * out_stride_t
                  + (head * group + row_member.to(tl.int64))[:, None] * out_stride_h + v_dims[None, :])
        tl.store(o_ptrs, out, mask=row_ok[:, None] & (v_dims < v_rank)[None, :])


@triton.jit
def _combine_splits_kernel(
    partial_acc_ptr, partial_stats_ptr, out_ptr, v_ranks_ptr, group, num_heads,
    out_stride_t, out_stride_h,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SPLITS: tl.constexpr,
):
    """Program p = decode task p (sequence p // H, KV head p % H): the softmax-weighted sum of
    its SPLITS partials, each rescaled from its own running max to the common one; stores the
    group's rows, columns ``d < v_rank``. Empty partials (max -inf, sum 0) weigh 0."""
    task_id = tl.program_id(0).to(tl.int64)
    seq = task_id // num_heads
    head = task_id % num_heads
    splits = tl.arange(0, SPLITS)
    rows = tl.arange(0, ROWS)
    v_dims = tl.arange(0, BLOCK_V)
    stats = partial_stats_ptr + ((task_id * SPLITS + splits)[:, None] * ROWS + rows[None, :]) * 2
    split_max = tl.load(stats)  # [SPLITS, ROWS]
    split_sum = tl.load(stats + 1)
    top = tl.max(split_max, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(split_max - safe_top[None, :])  # exp2(-inf) = 0 for an empty split
    total = tl.sum(weight * split_sum, axis=0)
    acc = tl.load(partial_acc_ptr + ((task_id * SPLITS + splits)[:, None, None] * ROWS + rows[None, :, None]) * BLOCK_V
                  + v_dims[None, None, :])  # [SPLITS, ROWS, BLOCK_V]
    out = tl.sum(weight[:, :, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)[:, None]
    v_rank = tl.load(v_ranks_ptr + head)
    o_ptrs = out_ptr + seq * out_stride_t + (head * group + rows.to(tl.int64))[:, None] * out_stride_h + v_dims[None, :]
    tl.store(o_ptrs, out, mask=(rows < group)[:, None] & (v_dims < v_rank)[None, :])


def choose_key_splits(num_tasks: int, max_seq_len: int, multiprocessors: int, min_keys: int = 256) -> int:
    """Splits of each decode task's keys (flash-decoding): a power of two, enough that the
    ``num_tasks * splits`` programs fill every multiprocessor about twice, no split shorter than
    ``min_keys`` (a partial costs a store and a combine), 1 when the tasks alone fill the GPU.
    ``max_seq_len`` is the host-side bound vLLM's metadata carries, so no device sync."""
    splits = 1
    while (num_tasks * splits < 2 * multiprocessors and max_seq_len >= 2 * splits * min_keys):
        splits *= 2
    return splits


def _tile_queries(num_tokens: int, num_seqs: int, group_block: int) -> int:
    """Queries per tile: 1 when every sequence has one query (decode: ``T == S``), else enough
    to fill ``_PREFILL_ROWS`` rows with the group. Decided from shapes, without a device sync."""
    if num_tokens <= num_seqs:
        return 1
    return max(1, _PREFILL_ROWS // group_block)


def build_tasks(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, heads: PackedHeads, num_tokens: int,
                tile_queries: int, balanced: bool, width: torch.Tensor | None = None) -> torch.Tensor:
    """The launch order of the tasks: int32 ``[U * H, 5]`` rows (sequence, KV head, first
    query's token index, queries in the tile, position of the tile's first query), on the
    device of ``query_start_loc``, built with torch ops only (no host sync).

    ``U = min(T, S + T // tile_queries)`` bounds the tiles (a sequence of ``n`` queries has
    ``ceil(n / tile_queries) <= n // tile_queries + 1`` tiles, and no more than ``n``); rows
    past the real tiles have 0 queries. ``balanced``: rows sorted by cost (keys read x
    ``(k_rank + v_rank)``) descending, stable; else tile-major (sequence, tile), then KV head.
    """
    device = query_start_loc.device
    num_seqs, num_heads = seq_lens.shape[0], heads.num_heads
    upper = min(num_tokens, num_seqs + num_tokens // tile_queries)
    starts = query_start_loc.to(torch.int64)
    counts = starts[1:] - starts[:-1]  # [S] queries per sequence
    tiles = (counts + tile_queries - 1) // tile_queries
    tile_ends = torch.cumsum(tiles, 0)
    tile_ids = torch.arange(upper, device=device, dtype=torch.int64)
    seq = torch.searchsorted(tile_ends, tile_ids, right=True)  # == S past the last real tile
    real = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    tile_in_seq = tile_ids - (tile_ends[seq] - tiles[seq])
    offset = tile_in_seq * tile_queries
    first_token = starts[seq] + offset
    num_queries = torch.where(real, (counts[seq] - offset).clamp(max=tile_queries), 0)
    first_position = seq_lens.to(device=device, dtype=torch.int64)[seq] - counts[seq] + offset
    head_ids = torch.arange(num_heads, device=device, dtype=torch.int64)
    per_tile = torch.stack([seq, first_token, num_queries, first_position], 1)  # [U, 4]
    tasks = torch.empty(upper, num_heads, _TASK_FIELDS, device=device, dtype=torch.int64)
    tasks[:, :, 0] = per_tile[:, None, 0]
    tasks[:, :, 1] = head_ids[None, :]
    tasks[:, :, 2:] = per_tile[:, None, 1:]
    tasks = tasks.view(upper * num_heads, _TASK_FIELDS)
    if balanced:
        if width is None:
            width = (heads.k_ranks.to(torch.int64) + heads.v_ranks.to(torch.int64)).to(device)
        keys_read = torch.where(tasks[:, 3] > 0, tasks[:, 4] + tasks[:, 3], 0)
        cost = keys_read * width[tasks[:, 1]]
        tasks = tasks[torch.sort(cost, descending=True, stable=True).indices]
    return tasks.to(torch.int32).contiguous()


def reduced_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, heads: PackedHeads, scale: float,
                      output_width: int, balanced: bool = True, block_size: int | None = None,
                      key_splits: int = 1, max_seq_len: int | None = None, keys_by_token: bool = False) -> torch.Tensor:
    """Attention of ``query`` ``[T, Hq, QW]`` over the packed ``kv_cache`` ``[num_blocks, >=
    block_size * row_width]`` (fp32, fp16 or bf16, contiguous rows); returns ``[T, Hq,
    output_width]`` fp32 on the query's device (see the module docstring).

    ``block_table`` ``[S, max_blocks]`` int, ``query_start_loc`` ``[S + 1]``, ``seq_lens`` ``[S]``
    as vLLM passes them; ``block_size`` default: as many rows as a cache block holds.
    Preconditions not checked (they would need a device sync): ``query_start_loc`` is
    non-decreasing from 0 to ``T``, each sequence's query count is ``<= seq_lens[s]``, the block
    table covers ``seq_lens[s]`` positions with valid block ids. Shapes, dtypes and devices are
    checked (ValueError).

    ``key_splits > 1`` splits each decode task's keys over that many programs (flash-decoding:
    fills the GPU when sequences x KV heads are few and long), then combines the partials in a
    second launch; it needs ``max_seq_len`` (host int, ``>= max(seq_lens)``, as vLLM's metadata
    has it) and a power of two; prefill and mixed batches ignore it. See :func:`choose_key_splits`.
    ``keys_by_token``: the cache holds each head's keys token-major (:func:`keys_by_token`), the
    layout a GPU reads best; the default is :class:`PackedHeads`' dims-major keys.
    """
    if key_splits < 1 or key_splits & (key_splits - 1):
        raise ValueError(f"key_splits must be a power of two >= 1, got {key_splits}")
    if key_splits > 1 and (max_seq_len is None or max_seq_len <= 0):
        raise ValueError(f"key_splits={key_splits} needs max_seq_len, the host-side bound of seq_lens")
    if query.dim() != 3 or not query.dtype.is_floating_point:
        raise ValueError(f"query must be floating [T, Hq, QW], got {query.dtype} {list(query.shape)}")
    if kv_cache.dim() != 2 or kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"kv_cache must be fp32/fp16/bf16 [num_blocks, width], got {kv_cache.dtype} "
                         f"{list(kv_cache.shape)}")
    if kv_cache.stride(1) != 1:
        raise ValueError(f"kv_cache rows must be contiguous, got strides {kv_cache.stride()}")
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    block_size = heads.block_size_of(kv_cache, block_size)
    if block_size <= 0:
        raise ValueError(f"kv_cache rows of {kv_cache.shape[1]} hold no row of {heads.row_width}")
    num_tokens, num_q_heads, query_width = query.shape
    num_heads = heads.num_heads
    if num_heads == 0 or num_q_heads % num_heads:
        raise ValueError(f"{num_q_heads} query heads are not a whole group of {num_heads} KV heads")
    group = num_q_heads // num_heads
    on_device = _device_heads(heads, query.device)
    max_k_rank, max_v_rank = on_device.max_k_rank, on_device.max_v_rank
    if max_k_rank > query_width:
        raise ValueError(f"query width {query_width} is narrower than the widest k_rank {max_k_rank}")
    if output_width < max_v_rank:
        raise ValueError(f"output_width {output_width} is narrower than the widest v_rank {max_v_rank}")
    if seq_lens.dim() != 1 or tuple(query_start_loc.shape) != (seq_lens.shape[0] + 1,):
        raise ValueError(f"query_start_loc must be [S + 1] for seq_lens [S], got {list(query_start_loc.shape)} "
                         f"and {list(seq_lens.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table must be [S, max_blocks] for {seq_lens.shape[0]} sequences, "
                         f"got {list(block_table.shape)}")
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, query on {query.device}")
    if kv_cache.device != query.device:
        raise ValueError(f"kv_cache is on {kv_cache.device}, query on {query.device}")

    output = torch.zeros(num_tokens, num_q_heads, output_width, dtype=torch.float32, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return output
    decode = num_tokens == num_seqs  # one query per sequence (vLLM puts each request's tokens together)
    group_block = triton.next_power_of_2(group)
    tile_queries = _tile_queries(num_tokens, num_seqs, group_block)
    if decode:
        # The group alone is the program's rows: padded to tl.dot's 16 on a GPU (the padding
        # rows are masked; tensor cores make them cheaper than the broadcast path).
        group_block = max(group_block, _MIN_DOT)
        order = _decode_order(seq_lens, on_device.width, num_heads) if balanced else None
        tasks = order if order is not None else seq_lens  # unused when not ORDERED
        num_programs = num_seqs * num_heads
    else:
        tasks = build_tasks(query_start_loc, seq_lens, heads, num_tokens, tile_queries, balanced, on_device.width)
        num_programs = tasks.shape[0]
    rows = tile_queries * group_block
    block_k = max(_MIN_DOT, triton.next_power_of_2(max_k_rank))
    block_v = max(_MIN_DOT, triton.next_power_of_2(max_v_rank))
    use_dot = rows >= _MIN_DOT
    if use_dot:
        # Keys per step, from an H100 sweep (batch 32 x 4096 keys, 8 KV heads x 4, bf16, 4 warps):
        # 16-bit caches whose value rows start aligned (every v_rank a multiple of 8) take 128
        # (full width 0.31 ms, 50% dims 0.21); unaligned ranks 64 (adaptive: 0.45 ms at 64,
        # 1.09 at 128); fp32 caches 32 (wider fp32 tiles spill registers).
        if _TILE_OVERRIDE.get("block_n"):
            block_n = _TILE_OVERRIDE["block_n"]
        elif kv_cache.dtype == torch.float32:
            block_n = _DOT_KEYS // 2
        else:
            block_n = 2 * _DOT_KEYS if on_device.v_align >= 8 else _DOT_KEYS
    else:
        block_n = min(_DOT_KEYS, max(_MIN_DOT, _MAX_PRODUCT // (rows * max(block_k, block_v))))
    limits = device_limits(kv_cache.device)
    # A step stages its key and value tiles in shared memory (the cache's dtype) and, with
    # dots, the rows' probabilities (fp32): as many keys as fit the GPU's (AMD: 64 KiB). A
    # sweep's override is taken as given.
    if not _TILE_OVERRIDE.get("block_n"):
        block_n = fit_shared(block_n, (block_k + block_v) * kv_cache.dtype.itemsize + 4 * rows, limits)
    if query.stride(2) != 1:
        query = query.contiguous()
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    splits = key_splits if decode else 1
    if splits > 1:
        # Whole steps per split: each split starts where a step of the unsplit loop would, so
        # every key-loading path (KEY_RUNS) sees the alignment it assumes.
        split_keys = -(-(-(-max_seq_len // splits)) // block_n) * block_n
        partial_acc = torch.empty(num_programs * splits * rows * block_v, dtype=torch.float32, device=query.device)
        partial_stats = torch.empty(num_programs * splits * rows * 2, dtype=torch.float32, device=query.device)
    else:
        split_keys, partial_acc, partial_stats = 0, output, output  # unused
    _reduced_attention_kernel[(num_programs, splits)](
        query, kv_cache, table, tasks, output,
        on_device.k_ranks, on_device.v_ranks, on_device.k_offsets, on_device.v_offsets,
        group, float(scale),
        query.stride(0), query.stride(1), kv_cache.stride(0), table.stride(0),
        output.stride(0), output.stride(1),
        BLOCK_M=tile_queries, BLOCK_G=group_block, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_V=block_v,
        USE_DOT=use_dot, TASK_FIELDS=_TASK_FIELDS, block_size=block_size, KEY_RUNS=_key_runs(block_size, block_n),
        V_ALIGN=on_device.v_align,
        DECODE=decode, ORDERED=decode and balanced, DOT_PRECISION=dot_precision(kv_cache.dtype, limits),
        seq_lens_ptr=seq_lens, num_heads=num_heads,
        partial_acc_ptr=partial_acc, partial_stats_ptr=partial_stats, split_keys=split_keys, SPLITS=splits,
        KEYS_BY_TOKEN=keys_by_token, K_ALIGN=on_device.k_align,
        **{key: _TILE_OVERRIDE[key] for key in ("num_warps", "num_stages") if _TILE_OVERRIDE.get(key)},
    )
    if splits > 1:
        _combine_splits_kernel[(num_programs,)](
            partial_acc, partial_stats, output, on_device.v_ranks, group, num_heads,
            output.stride(0), output.stride(1), ROWS=rows, BLOCK_V=block_v, SPLITS=splits)
    return output


def keys_by_token(kv_cache: torch.Tensor, heads: PackedHeads, block_size: int) -> torch.Tensor:
    """A copy of a packed cache ``[num_blocks, >= block_size * row_width]`` with each head's keys
    token-major inside each block (token ``t``'s dims at ``block_size * k_offset + t * k_rank``,
    as values are laid out): the same bytes per block, what ``keys_by_token=True`` reads."""
    converted = kv_cache.clone()
    for head in range(heads.num_heads):
        rank, offset = int(heads.k_ranks[head]), int(heads.k_offsets[head])
        region = slice(block_size * offset, block_size * (offset + rank))
        converted[:, region] = kv_cache[:, region].reshape(-1, rank, block_size).transpose(1, 2).reshape(
            kv_cache.shape[0], -1)
    return converted


def _key_runs(block_size: int, block_n: int) -> int:
    """How a step of ``block_n`` keys reads them: 1 = one block holds the whole step, k > 1 = k
    whole blocks, 0 = key by key through the block table (a block size that is not a power of
    two). Powers of two throughout, so a step never straddles a block unevenly."""
    if block_size & (block_size - 1):
        return 0
    return 1 if block_size >= block_n else block_n // block_size


@dataclass(frozen=True)
class _HeadsOnDevice:
    """What the kernel reads of a :class:`PackedHeads`, on one device, with the host-side
    extremes read once (so a call never synchronises to check the ranks)."""

    k_ranks: torch.Tensor  # int32 [H]
    v_ranks: torch.Tensor  # int32 [H]
    k_offsets: torch.Tensor  # int64 [H]
    v_offsets: torch.Tensor  # int64 [H]
    width: torch.Tensor  # int64 [H]: k_rank + v_rank, the per-key cost of a head
    max_k_rank: int
    max_v_rank: int
    v_align: int  # the largest power of two (<= 16) dividing every v_rank
    k_align: int  # the same for every k_rank


def _device_heads(heads: PackedHeads, device: torch.device) -> _HeadsOnDevice:
    """The heads' tensors on ``device``, made once per (heads, device) and kept on ``heads``."""
    cached = heads.__dict__.setdefault("_on_device", {})
    if device not in cached:
        for name in ("k_ranks", "v_ranks", "k_offsets", "v_offsets"):
            if tuple(getattr(heads, name).shape) != (heads.num_heads,):
                raise ValueError(f"heads.{name} must be [{heads.num_heads}], got {list(getattr(heads, name).shape)}")
        k_ranks, v_ranks = heads.k_ranks.cpu(), heads.v_ranks.cpu()
        if heads.num_heads and (int(k_ranks.min()) <= 0 or int(v_ranks.min()) <= 0):
            raise ValueError("every head needs a positive k_rank and v_rank")
        cached[device] = _HeadsOnDevice(
            k_ranks.to(device=device, dtype=torch.int32), v_ranks.to(device=device, dtype=torch.int32),
            heads.k_offsets.to(device=device, dtype=torch.int64), heads.v_offsets.to(device=device, dtype=torch.int64),
            (k_ranks.long() + v_ranks.long()).to(device), int(k_ranks.max()), int(v_ranks.max()),
            _power_of_two_dividing(v_ranks.tolist(), 16), _power_of_two_dividing(k_ranks.tolist(), 16))
    return cached[device]


def _power_of_two_dividing(values: list[int], cap: int) -> int:
    """The largest power of two, at most ``cap``, that divides every value."""
    align = cap
    while align > 1 and any(value % align for value in values):
        align //= 2
    return align


def _decode_order(seq_lens: torch.Tensor, width: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Decode tasks ``s * H + h`` longest first (cost = keys x (k_rank + v_rank)), int32."""
    cost = seq_lens.to(torch.int64)[:, None] * width[None, :]
    return torch.sort(cost.reshape(-1), descending=True, stable=True).indices.to(torch.int32)
