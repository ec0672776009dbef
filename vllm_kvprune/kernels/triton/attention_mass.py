"""H2O's fused paged decode attention + attention mass on vLLM's GPU cache.

Same semantics as :func:`vllm_kvprune.kernels.reference.attention_mass` (which, with
``gpu_layout``, is the oracle for a contiguous cache): query ``i`` attends the first
``key_counts[i]`` slots of block-table row ``query_rows[i]`` (position ``p`` is offset
``p % block_size`` of block ``block_table[row, p // block_size]``); each slot's softmax
probability, summed over the query heads of its KV head, is ADDED to ``mass[h, slot]``
(atomics: several queries of one row, e.g. a prefill chunk, hit the same slots), and the
attention output is written to ``output[i]`` in the output's dtype. A count of 0 writes a zero
output and adds nothing. ``softcap > 0`` caps the scaled logits to ``softcap * tanh(x / softcap)``.

One program per (query, KV head) handles the whole query group of that KV head: pass 1 walks
the row's keys, ``key_tile()`` positions at a time (each position gathers its own block id, so
a tile spans several cache blocks and any block size works), with an online softmax (running
max, running sum, output accumulator); pass 2, only when ``mass`` is given, walks the keys again and adds the normalised
probabilities. Both passes are one launch. ``mass=None`` is plain paged decode attention,
``output=None`` computes the mass only (pass 1 then skips V).

Tiles: the query group is padded to at least 16 rows (masked) and the head size to a power of
two (masked), so ``tl.dot`` runs on tensor cores on a GPU. Everything is computed in fp32 after
each load; the dots use TF32 for 16-bit caches (exact for fp16/bf16 keys and queries, only
the probabilities are rounded before P @ V) and IEEE fp32 for fp32 caches.

Not checked (no device sync): the values of ``query_rows`` (must index ``block_table``),
``key_counts`` (``0 <= count <= max_blocks * block_size``) and of the block-table entries the
counts reach (valid block ids). Shapes, dtypes and devices are checked (``ValueError``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvprune.kernels.triton import DeviceLimits, check_cache, device_limits, dot_precision, fit_shared

SUPPORTED_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# Elements of one [key_tile, D_PAD] K (or V) tile, in fp32 after the load. On an H100 (D=128,
# bf16 cache) 128 keys per step ran the fused kernel 2.7x faster than one 16-key block per step
# and 1.5x faster than 256 keys; an fp32 cache at 128 keys collapsed (register spills), hence half.
_KEY_TILE_ELEMS = 128 * 128


@triton.jit
def capped(logits, softcap):
    """``softcap * tanh(logits / softcap)``, with tanh from exp (Triton has no portable tanh);
    exact at the limits (exp overflows to inf -> 1, underflows to 0 -> -1)."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * logits / softcap) + 1.0))


@triton.jit
def softmax_step(logits, running_max, running_sum):
    """One key tile of an online softmax over rows: ``(probs, rescale, max, sum)``, where
    ``probs`` are the tile's unnormalised weights against the new running max and ``rescale``
    is what the rows' earlier accumulations are multiplied by. Every row's tile must hold a
    finite logit (masked keys are -inf, but not all of a row's)."""
    new_max = tl.maximum(running_max, tl.max(logits, axis=1))
    rescale = tl.exp(running_max - new_max)
    probs = tl.exp(logits - new_max[:, None])
    return probs, rescale, new_max, running_sum * rescale + tl.sum(probs, axis=1)


@triton.jit
def group_logits(query, key, scale, softcap, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``[GROUP_PAD, KEY_TILE]`` scaled (and capped) logits of the query group
    ``[GROUP_PAD, D_PAD]`` against one key tile ``[KEY_TILE, D_PAD]``; fp32 in, fp32 out, no masking."""
    logits = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale
    if SOFTCAP:
        logits = capped(logits, softcap)
    return logits


@triton.jit
def _attention_mass_kernel(
    query_ptr, cache_ptr, block_table_ptr, query_rows_ptr, key_counts_ptr, mass_ptr, output_ptr,
    scale, softcap, group, head_size, block_size,
    query_stride_n, query_stride_h,
    output_stride_n, output_stride_h,
    cache_stride_block, cache_stride_head, cache_stride_offset,
    table_stride_row, table_stride_block,
    mass_stride_head, mass_stride_slot,
    GROUP_PAD: tl.constexpr, KEY_TILE: tl.constexpr, D_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr, WRITE_OUTPUT: tl.constexpr, ADD_MASS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (i, h): query i, KV head h, query heads ``h * group .. h * group + group - 1``."""
    query_idx = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    rows_in_group = tl.arange(0, GROUP_PAD)
    keys = tl.arange(0, KEY_TILE)
    dims = tl.arange(0, D_PAD)
    row_ok = rows_in_group < group
    dim_ok = dims < head_size
    query_heads = kv_head * group + rows_in_group

    query = tl.load(query_ptr + query_idx * query_stride_n + query_heads[:, None] * query_stride_h + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    table_row = tl.load(query_rows_ptr + query_idx).to(tl.int64)
    count = tl.load(key_counts_ptr + query_idx).to(tl.int32)
    table_at = block_table_ptr + table_row * table_stride_row
    head_at = cache_ptr + kv_head.to(tl.int64) * cache_stride_head

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    accumulator = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for tile_start in range(0, count, KEY_TILE):
        positions = tile_start + keys
        key_ok = positions < count
        block_ids = tl.load(table_at + (positions // block_size) * table_stride_block, mask=key_ok, other=0).to(tl.int64)
        tile_at = head_at + (block_ids * cache_stride_block + (positions % block_size) * cache_stride_offset)[:, None] \
            + dims[None, :]
        tile_mask = key_ok[:, None] & dim_ok[None, :]
        key = tl.load(tile_at, mask=tile_mask, other=0.0).to(tl.float32)
        logits = group_logits(query, key, scale, softcap, SOFTCAP, DOT_PRECISION)
        logits = tl.where(key_ok[None, :], logits, float("-inf"))
        probs, rescale, running_max, running_sum = softmax_step(logits, running_max, running_sum)
        if WRITE_OUTPUT:
            value = tl.load(tile_at + head_size, mask=tile_mask, other=0.0).to(tl.float32)
            accumulator = accumulator * rescale[:, None] + tl.dot(probs, value, input_precision=DOT_PRECISION)

    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)  # count 0: zero output, no mass
    if WRITE_OUTPUT:
        out = accumulator / safe_sum[:, None]
        tl.store(output_ptr + query_idx * output_stride_n + query_heads[:, None] * output_stride_h + dims[None, :],
                 out.to(output_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    if ADD_MASS:
        inverse_sum = tl.where(row_ok, 1.0 / safe_sum, 0.0)  # padded query rows add nothing
        mass_at = mass_ptr + kv_head.to(tl.int64) * mass_stride_head
        for tile_start in range(0, count, KEY_TILE):
            positions = tile_start + keys
            key_ok = positions < count
            block_ids = tl.load(table_at + (positions // block_size) * table_stride_block, mask=key_ok,
                                other=0).to(tl.int64)
            offsets_in_block = positions % block_size
            tile_at = head_at + (block_ids * cache_stride_block + offsets_in_block * cache_stride_offset)[:, None] \
                + dims[None, :]
            key = tl.load(tile_at, mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
            logits = group_logits(query, key, scale, softcap, SOFTCAP, DOT_PRECISION)
            probs = tl.exp(logits - running_max[:, None]) * inverse_sum[:, None]
            slot_mass = tl.sum(probs, axis=0)
            slots = block_ids * block_size + offsets_in_block
            tl.atomic_add(mass_at + slots * mass_stride_slot, slot_mass, mask=key_ok, sem="relaxed")

def attention_mass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_rows: torch.Tensor,
    key_counts: torch.Tensor,
    scale: float,
    mass: torch.Tensor | None,
    output: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> None:
    """Fused paged attention of ``query [N, Hq, D]`` over ``kv_cache`` (GPU layout, HND or NHD
    strides) + H2O attention mass, one launch.

    ``block_table`` is int32 ``[R, max_blocks]``; ``query_rows [N]`` (integer) picks each
    query's row and ``key_counts [N]`` (integer) how many of the row's first slots it attends.
    ``mass`` (fp32 ``[H, num_blocks * block_size]``, or None) gets each slot's probability summed
    over the ``Hq / H`` query heads of its KV head added in place; ``output`` (``[N, Hq, D]``,
    any float dtype, or None) is overwritten with the attention output. At least one of the two
    must be given. See the module docstring for what is not checked.
    """
    num_blocks, num_heads, block_size, head_size = check_cache(kv_cache)
    if kv_cache.dtype not in SUPPORTED_CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not one of {SUPPORTED_CACHE_DTYPES}")
    group = check_query(query, kv_cache, num_heads, head_size)
    num_queries = query.shape[0]
    if mass is None and output is None:
        raise ValueError("attention_mass: mass and output are both None, nothing to compute")
    if mass is not None:
        expected = (num_heads, num_blocks * block_size)
        if tuple(mass.shape) != expected or mass.dtype != torch.float32:
            raise ValueError(f"mass must be float32 {list(expected)}, got {mass.dtype} {list(mass.shape)}")
        check_device(mass, "mass", kv_cache)
    if output is not None:
        check_output(output, query, kv_cache)
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [R, max_blocks], got {block_table.dtype} {list(block_table.shape)}")
    check_device(block_table, "block_table", kv_cache)
    for name, per_query in (("query_rows", query_rows), ("key_counts", key_counts)):
        if tuple(per_query.shape) != (num_queries,) or per_query.dtype.is_floating_point or per_query.dtype == torch.bool:
            raise ValueError(f"{name} must be integer [{num_queries}], got {per_query.dtype} {list(per_query.shape)}")
        check_device(per_query, name, kv_cache)
    if num_queries == 0:
        return

    # Unused pointers get a tensor that is never dereferenced (the constexpr flags drop the code).
    mass_arg = mass if mass is not None else key_counts
    output_arg = output if output is not None else query
    limits = device_limits(kv_cache.device)
    _attention_mass_kernel[(num_queries, num_heads)](
        query, kv_cache, block_table, query_rows, key_counts, mass_arg, output_arg,
        float(scale), float(softcap), group, head_size, block_size,
        query.stride(0), query.stride(1),
        output_arg.stride(0), output_arg.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0), block_table.stride(1),
        mass_arg.stride(0), mass_arg.stride(-1),
        GROUP_PAD=group_pad(group), KEY_TILE=key_tile(kv_cache.dtype, head_size, group, limits),
        D_PAD=tile_size(head_size), SOFTCAP=softcap > 0, WRITE_OUTPUT=output is not None, ADD_MASS=mass is not None,
        DOT_PRECISION=dot_precision(kv_cache.dtype, limits),
    )


def group_pad(group: int) -> int:
    """Rows of the query-group tile: a power of two >= 16 (``tl.dot``'s minimum on a GPU)."""
    return max(16, triton.next_power_of_2(group))


def tile_size(extent: int) -> int:
    """A power of two >= ``extent`` and >= 16, for a masked tile dimension used in ``tl.dot``
    (the head size)."""
    return max(16, triton.next_power_of_2(extent))


def key_tile(cache_dtype: torch.dtype, head_size: int, group: int = 1, limits: DeviceLimits | None = None) -> int:
    """Key positions per loop iteration, a power of two in [16, 128]: about ``_KEY_TILE_ELEMS``
    elements per tile, halved for fp32 caches (their IEEE dots need more registers), and as many
    as fit the GPU's shared memory by an estimate (a step stages its K and V tiles there in the
    cache's dtype, and the group's fp32 probabilities) that the compile check holds to what
    Triton allocates for NVIDIA's and AMD's GPUs (`targets.py`; AMD's 64 KiB is where it binds).
    `limits`: the current device's by default."""
    limits = limits if limits is not None else device_limits()
    elems = _KEY_TILE_ELEMS // (2 if cache_dtype == torch.float32 else 1)
    tile = max(16, min(128, elems // tile_size(head_size)))
    staged = 2 * tile_size(head_size) * cache_dtype.itemsize + 4 * group_pad(group)
    return fit_shared(tile, staged, limits)


def check_query(query: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, head_size: int) -> int:
    """Validate a float ``[N, Hq, D]`` query (contiguous last dim, cache's device) against a cache
    of ``num_heads`` KV heads; returns the group size ``Hq / H``."""
    if query.dim() != 3 or query.shape[1] % num_heads or query.shape[1] == 0 or query.shape[2] != head_size:
        raise ValueError(
            f"query {list(query.shape)} does not fit a cache of {num_heads} KV heads, head_size {head_size}"
        )
    if not query.dtype.is_floating_point:
        raise ValueError(f"query must be a float tensor, got {query.dtype}")
    if query.numel() and query.stride(2) != 1:
        raise ValueError(f"query needs a contiguous last dimension, got strides {query.stride()}")
    check_device(query, "query", kv_cache)
    return query.shape[1] // num_heads


def check_output(output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """``output`` must be a float tensor shaped like ``query``, contiguous last dim, on the cache's device."""
    if tuple(output.shape) != tuple(query.shape) or not output.dtype.is_floating_point:
        raise ValueError(f"output must be a float {list(query.shape)}, got {output.dtype} {list(output.shape)}")
    if output.numel() and output.stride(2) != 1:
        raise ValueError(f"output needs a contiguous last dimension, got strides {output.stride()}")
    check_device(output, "output", kv_cache)


def check_device(tensor: torch.Tensor, name: str, kv_cache: torch.Tensor) -> None:
    if tensor.device != kv_cache.device:
        raise ValueError(f"{name} is on {tensor.device}, kv_cache on {kv_cache.device}")
