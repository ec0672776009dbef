"""PagedEviction's scores on the GPU: token scores fused with the cache write, block means.

* :func:`store_token_scores` computes, for each written token, the sum over this rank's KV
  heads of ``||V_h||_2 / ||K_h||_2`` (fp32, as ``PagedEvictionPolicy.token_scores``) and stores
  it at the token's slot of one layer's score row; slot -1 is skipped.
* :func:`block_means` sums the ``block_size`` slot scores of each listed block of every layer
  and divides by ``divisor`` (the worker passes ``block_size * total_kv_heads``), as
  ``LayerScores.block_means`` does before its tensor-parallel all-reduce.

Both load in the input dtype and compute in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Upper bound on the elements of one program's tile.
_MAX_TILE_ELEMS = 4096


@triton.jit
def _token_scores_kernel(
    key_ptr, value_ptr, scores_ptr, slots_ptr,
    num_heads, head_size,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h, slot_stride,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program t: all heads of token t in one [BLOCK_H, BLOCK_D] tile (BLOCK_H >= num_heads)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token * slot_stride)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    mask = head_ok[:, None] & (dims < head_size)[None, :]
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :],
                  mask=mask, other=0.0).to(tl.float32)
    value = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
                    mask=mask, other=0.0).to(tl.float32)
    key_norm = tl.sqrt(tl.sum(key * key, axis=1))
    value_norm = tl.sqrt(tl.sum(value * value, axis=1))
    # Padding heads would be 0 / 0; they must add nothing.
    ratio = tl.where(head_ok, value_norm / tl.where(head_ok, key_norm, 1.0), 0.0)
    score = tl.sum(ratio, axis=0)
    tl.store(scores_ptr + tl.where(slot >= 0, slot, 0), score, mask=slot >= 0)


@triton.jit
def _block_means_kernel(
    by_slot_ptr, block_ids_ptr, out_ptr,
    num_blocks_listed, block_size, divisor,
    by_slot_stride_layer, by_slot_stride_slot, out_stride_layer,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (l, j): listed blocks [j * BLOCK_N, (j + 1) * BLOCK_N) of layer l."""
    layer = tl.program_id(0).to(tl.int64)
    listed = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = tl.arange(0, BLOCK_S)
    listed_ok = listed < num_blocks_listed
    block_ids = tl.load(block_ids_ptr + listed, mask=listed_ok, other=0)
    slots = block_ids[:, None] * block_size + offsets[None, :]
    mask = listed_ok[:, None] & (offsets < block_size)[None, :]
    scores = tl.load(by_slot_ptr + layer * by_slot_stride_layer + slots * by_slot_stride_slot,
                     mask=mask, other=0.0).to(tl.float32)
    means = tl.sum(scores, axis=1) / divisor
    tl.store(out_ptr + layer * out_stride_layer + listed, means, mask=listed_ok)


def store_token_scores(key: torch.Tensor, value: torch.Tensor, scores_row: torch.Tensor, slots: torch.Tensor,
                       *, check_range: bool = True) -> None:
    """``scores_row[slots[t]] = sum_h ||value[t, h]|| / ||key[t, h]||`` for every token t whose
    slot is not -1, in one launch.

    key/value: ``[T, H, D]``, same shape and dtype, contiguous last dimension.
    scores_row: fp32 ``[num_slots]`` (one layer's row of ``LayerScores.by_slot``), written in place.
    slots: integer ``[T]``, -1 or ``0 .. num_slots - 1`` (``check_range=False`` skips that check,
    which syncs with the device; out-of-range slots are then undefined behaviour).
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [T, H, D], got {list(key.shape)} and {list(value.shape)}")
    if key.dtype != value.dtype or not key.dtype.is_floating_point:
        raise ValueError(f"key and value must share a floating dtype, got {key.dtype} and {value.dtype}")
    if key.numel() and (key.stride(2) != 1 or value.stride(2) != 1):
        raise ValueError(f"key and value need a contiguous last dimension, got {key.stride()} and {value.stride()}")
    if scores_row.dim() != 1 or scores_row.dtype != torch.float32:
        raise ValueError(f"scores_row must be float32 [num_slots], got {scores_row.dtype} {list(scores_row.shape)}")
    num_tokens, num_heads, head_size = key.shape
    slots = _checked_index(slots, "slots", num_tokens, -1, scores_row.shape[0], check_range)
    for name, tensor in (("value", value), ("scores_row", scores_row), ("slots", slots)):
        if tensor.device != key.device:
            raise ValueError(f"{name} is on {tensor.device}, key on {key.device}")
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(head_size)
    _token_scores_kernel[(num_tokens,)](
        key, value, scores_row, slots,
        num_heads, head_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), slots.stride(0),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )


def block_means(by_slot: torch.Tensor, block_ids: torch.Tensor, block_size: int, divisor: float,
                *, check_range: bool = True) -> torch.Tensor:
    """``[L, n]`` fp32: for each layer l and listed block b, the sum of
    ``by_slot[l, b * block_size : (b + 1) * block_size]`` divided by ``divisor``.

    by_slot: fp32 ``[L, num_blocks * block_size]``; block_ids: integer ``[n]`` in
    ``0 .. num_blocks - 1`` (``check_range=False`` skips that check, a device sync).
    """
    if by_slot.dim() != 2 or by_slot.dtype != torch.float32:
        raise ValueError(f"by_slot must be float32 [layers, num_slots], got {by_slot.dtype} {list(by_slot.shape)}")
    if block_size <= 0 or by_slot.shape[1] % block_size:
        raise ValueError(f"by_slot's {by_slot.shape[1]} slots are not whole blocks of {block_size}")
    if divisor == 0:
        raise ValueError("divisor must be non-zero")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be [n], got {list(block_ids.shape)}")
    block_ids = _checked_index(block_ids, "block_ids", block_ids.shape[0], 0, by_slot.shape[1] // block_size,
                               check_range)
    if block_ids.device != by_slot.device:
        raise ValueError(f"block_ids is on {block_ids.device}, by_slot on {by_slot.device}")
    num_layers, num_listed = by_slot.shape[0], block_ids.shape[0]
    means = torch.empty(num_layers, num_listed, dtype=torch.float32, device=by_slot.device)
    if num_layers == 0 or num_listed == 0:
        return means
    block_s = triton.next_power_of_2(block_size)
    block_n = max(1, min(triton.next_power_of_2(num_listed), _MAX_TILE_ELEMS // block_s))
    grid = (num_layers, triton.cdiv(num_listed, block_n))
    _block_means_kernel[grid](
        by_slot, block_ids, means,
        num_listed, block_size, float(divisor),
        by_slot.stride(0), by_slot.stride(1), means.stride(0),
        BLOCK_N=block_n, BLOCK_S=block_s,
    )
    return means


def _checked_index(index: torch.Tensor, name: str, length: int, low: int, high: int,
                   check_range: bool) -> torch.Tensor:
    """``index`` as int64 ``[length]``, values in ``low .. high - 1`` when ``check_range``."""
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {index.dtype}")
    if tuple(index.shape) != (length,):
        raise ValueError(f"{name} must be [{length}], got {list(index.shape)}")
    index = index.to(torch.int64)
    if check_range and index.numel() and (int(index.min()) < low or int(index.max()) >= high):
        raise ValueError(f"{name} out of range: valid values are {low}..{high - 1}")
    return index
