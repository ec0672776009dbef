"""FDC's narrow write on the GPU: reduced keys/values stored into the packed cache in one launch.

Same semantics as :meth:`vllm_kvprune.kernels.reduced_attention.PackedHeads.write` (its torch
reference), over a cache viewed as ``[num_blocks, block_stride]``, plus what vLLM's slot mapping
needs: **slot -1 is skipped**. The torch write cannot skip a slot without first finding the real
ones, which reads a mask back to the host, a device sync in every layer of every step; here each
program loads its token's slot and returns if it is negative.

A program is (token, run of packed columns): the columns are ``PackedHeads``' own (each key
column's head, dim, offset in a block and token stride, the same for values), made once per
block size and device, so the kernel knows nothing of the layout beyond them and the
token-major keys of the GPU path need no second kernel. Keys and values are rounded to the
cache's dtype by torch first (its ``.to``, as the reference does), and the kernel moves bits
(same-width integers, as the slot ops): Triton's interpreter rounds fp32 to bf16 differently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvprune.kernels.triton.slot_ops import _BIT_TYPES

# Packed columns per program: a head's worth of dims or more, few programs per token.
_BLOCK_COLUMNS = 128


@triton.jit
def _store_columns(source_ptr, cache_ptr, token, base, within, columns, num_columns,
                   heads_ptr, dims_ptr, offsets_ptr, strides_ptr, stride_t, stride_h):
    """Token `token`'s elements of the packed `columns` (keys' or values') from `source` into
    the block at `base`, row `within`."""
    ok = columns < num_columns
    heads = tl.load(heads_ptr + columns, mask=ok, other=0)
    dims = tl.load(dims_ptr + columns, mask=ok, other=0)
    offsets = tl.load(offsets_ptr + columns, mask=ok, other=0)
    strides = tl.load(strides_ptr + columns, mask=ok, other=0)
    elements = tl.load(source_ptr + token * stride_t + heads * stride_h + dims, mask=ok)
    tl.store(cache_ptr + base + offsets + within * strides, elements, mask=ok)


@triton.jit
def _write_packed_kernel(
    key_ptr, value_ptr, cache_ptr, slots_ptr,
    key_heads_ptr, key_dims_ptr, key_columns_ptr, key_strides_ptr, num_key_columns,
    value_heads_ptr, value_dims_ptr, value_columns_ptr, value_strides_ptr, num_value_columns,
    block_size, block_stride,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    BLOCK_C: tl.constexpr,
):
    """Program (t, j): packed key and value columns [j * BLOCK_C, (j + 1) * BLOCK_C) of token t."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        base = (slot // block_size) * block_stride
        within = slot % block_size
        columns = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        _store_columns(key_ptr, cache_ptr, token, base, within, columns, num_key_columns,
                       key_heads_ptr, key_dims_ptr, key_columns_ptr, key_strides_ptr, key_stride_t, key_stride_h)
        _store_columns(value_ptr, cache_ptr, token, base, within, columns, num_value_columns,
                       value_heads_ptr, value_dims_ptr, value_columns_ptr, value_strides_ptr, value_stride_t,
                       value_stride_h)


def write_packed(heads, kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 block_size: int | None = None) -> None:
    """Store reduced keys/values ``[n, H, >= rank]`` of ``n`` tokens at ``slots`` ``[n]`` of a
    packed cache ``[num_blocks, >= block_size * heads.row_width]`` (contiguous), skipping slot -1;
    ``heads``: the layer's ``PackedHeads``. No range check (no device sync): the slots are the
    worker's own."""
    if kv_cache.dim() != 2 or not kv_cache.is_contiguous() or kv_cache.dtype not in _BIT_TYPES:
        raise ValueError("the packed cache must be a contiguous [num_blocks, values] of float32, float16 or "
                         f"bfloat16, got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    block_size = heads.block_size_of(kv_cache, block_size)
    if slots.dim() != 1 or key.shape[0] != slots.shape[0] or value.shape[0] != slots.shape[0]:
        raise ValueError(f"slots {tuple(slots.shape)}, keys {tuple(key.shape)} and values {tuple(value.shape)} "
                         "must give one row per token")
    if key.shape[1] != heads.num_heads or value.shape[1] != heads.num_heads:
        raise ValueError(f"keys and values must have {heads.num_heads} heads")
    if slots.shape[0] == 0:
        return
    bits = _BIT_TYPES[kv_cache.dtype]
    key, value = (tensor.to(kv_cache.dtype).contiguous().view(bits) for tensor in (key, value))
    key_heads, key_dims, key_columns, key_strides, value_heads, value_dims, value_columns, value_strides = \
        heads.columns(block_size, kv_cache.device)
    widest = max(key_columns.shape[0], value_columns.shape[0])
    grid = (slots.shape[0], triton.cdiv(widest, _BLOCK_COLUMNS))
    _write_packed_kernel[grid](
        key, value, kv_cache.view(bits), slots.to(kv_cache.device),
        key_heads, key_dims, key_columns, key_strides, key_columns.shape[0],
        value_heads, value_dims, value_columns, value_strides, value_columns.shape[0],
        block_size, kv_cache.stride(0),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        BLOCK_C=_BLOCK_COLUMNS,
    )
