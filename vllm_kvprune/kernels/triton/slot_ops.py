"""Slot ops on vLLM's GPU paged KV cache: write, read and (staged) copy of whole tokens.

Same semantics as the torch references in :mod:`vllm_kvprune.kernels.reference` (which, with
``gpu_layout``, describe a contiguous GPU cache), without the layout argument: the cache is
the logical ``[num_blocks, H, block_size, 2 * D]`` tensor of
:mod:`vllm_kvprune.kernels.triton`, K in ``[..., :D]`` and V in ``[..., D:]``, addressed
through ``kv_cache.stride()`` so HND and NHD caches both work.

* ``slots`` is integer ``[n]`` (the same slot for every KV head, vLLM's ``slot_mapping``) or
  ``[n, H]`` (one slot per head); slot ``s`` is offset ``s % block_size`` of block
  ``s // block_size``.
* Slot -1 is skipped on write and reads as zeros. Duplicate destination slots leave an
  unspecified one of the writers.
* Elements are moved bit for bit: the kernels see the cache and the tokens as same-width
  integers, so no value (NaN payloads included) is ever converted and bf16 needs no
  arithmetic, interpreter or not.

Each op is one kernel launch over a grid of (token, tile of heads) programs, each moving a
``[heads, head_size]`` tile with ``head_size`` padded to a power of two and masked.
``check_range=False`` skips the slot range check, which reads the slots back to the host
(a device sync); the kernels never touch memory for a slot < 0, but an out-of-range slot
is then undefined behaviour, so only pass it for slots that are known to be valid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvprune.kernels.triton import check_cache

# Same-width integer type of each supported cache dtype: the kernels move bits, not values.
_BIT_TYPES: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}

# Upper bound on the elements of one program's [heads, head_size] tile.
_MAX_TILE_ELEMS = 4096


@triton.jit
def _write_slots_kernel(
    key_ptr, value_ptr, cache_ptr, slots_ptr,
    num_heads, head_size, block_size,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    slot_stride_t, slot_stride_h,
    cache_stride_block, cache_stride_head, cache_stride_offset,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (t, j): heads [j * BLOCK_H, (j + 1) * BLOCK_H) of token t, all of head_size."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    slots = tl.load(slots_ptr + token * slot_stride_t + heads * slot_stride_h, mask=head_ok, other=-1)
    valid = head_ok & (slots >= 0)
    safe_slots = tl.where(valid, slots, 0).to(tl.int64)
    page = (safe_slots // block_size) * cache_stride_block + heads * cache_stride_head \
        + (safe_slots % block_size) * cache_stride_offset
    mask = valid[:, None] & (dims < head_size)[None, :]
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
                    mask=mask)
    key_at = cache_ptr + page[:, None] + dims[None, :]
    tl.store(key_at, key, mask=mask)
    tl.store(key_at + head_size, value, mask=mask)


@triton.jit
def _read_slots_kernel(
    cache_ptr, slots_ptr, key_ptr, value_ptr,
    num_heads, head_size, block_size,
    slot_stride_t, slot_stride_h,
    cache_stride_block, cache_stride_head, cache_stride_offset,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (t, j) fills rows t of the contiguous ``[n, H, head_size]`` outputs for heads
    [j * BLOCK_H, (j + 1) * BLOCK_H); heads whose slot is -1 get zeros."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    slots = tl.load(slots_ptr + token * slot_stride_t + heads * slot_stride_h, mask=head_ok, other=-1)
    valid = head_ok & (slots >= 0)
    safe_slots = tl.where(valid, slots, 0).to(tl.int64)
    page = (safe_slots // block_size) * cache_stride_block + heads * cache_stride_head \
        + (safe_slots % block_size) * cache_stride_offset
    dim_ok = (dims < head_size)[None, :]
    load_mask = valid[:, None] & dim_ok
    key_at = cache_ptr + page[:, None] + dims[None, :]
    key = tl.load(key_at, mask=load_mask, other=0)
    value = tl.load(key_at + head_size, mask=load_mask, other=0)
    out = token * num_heads * head_size + heads[:, None] * head_size + dims[None, :]
    store_mask = head_ok[:, None] & dim_ok
    tl.store(key_ptr + out, key, mask=store_mask)
    tl.store(value_ptr + out, value, mask=store_mask)


def write_slots(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                *, check_range: bool = True) -> None:
    """Write key/value ``[T, H, D]`` into ``slots`` (``[T]`` or ``[T, H]``) of ``kv_cache``, in
    place; slot -1 is skipped. key/value need a contiguous last dimension and the cache's dtype.
    """
    num_heads, head_size, block_size = check_supported_cache(kv_cache)
    slots = _checked_slots(slots, kv_cache, "slots", check_range)
    num_tokens = slots.shape[0]
    for name, tokens in (("key", key), ("value", value)):
        _check_tokens(tokens, name, kv_cache, num_tokens)
    if num_tokens == 0:
        return
    block_h, block_d = _tile(num_heads, head_size)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    bits = _BIT_TYPES[kv_cache.dtype]
    _write_slots_kernel[grid](
        key.view(bits), value.view(bits), kv_cache.view(bits), slots,
        num_heads, head_size, block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *_slot_strides(slots),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, *,
               check_range: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n, H, D]`` (new contiguous tensors, the cache's dtype) of ``slots`` (``[n]`` or
    ``[n, H]``); rows whose slot is -1 are zeros."""
    num_heads, head_size, block_size = check_supported_cache(kv_cache)
    slots = _checked_slots(slots, kv_cache, "slots", check_range)
    num_tokens = slots.shape[0]
    key = kv_cache.new_empty(num_tokens, num_heads, head_size)
    value = kv_cache.new_empty(num_tokens, num_heads, head_size)
    if num_tokens == 0:
        return key, value
    block_h, block_d = _tile(num_heads, head_size)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    bits = _BIT_TYPES[kv_cache.dtype]
    _read_slots_kernel[grid](
        kv_cache.view(bits), slots, key.view(bits), value.view(bits),
        num_heads, head_size, block_size,
        *_slot_strides(slots),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return key, value


def copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, *,
               check_range: bool = True) -> None:
    """Move whole tokens from ``src_slots`` to ``dst_slots`` (same shape, ``[n]`` or ``[n, H]``).

    Every source is read into temporaries before any destination is written, so overlapping
    source and destination sets (compaction) are safe. Pairs whose destination is -1 are
    skipped; a valid destination with source -1 is an error.
    """
    check_copy_pairs(src_slots, dst_slots)
    staged_key, staged_value = read_slots(kv_cache, src_slots, check_range=check_range)
    write_slots(staged_key, staged_value, kv_cache, dst_slots, check_range=check_range)


def check_copy_pairs(src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """The reference's copy validation: equal shapes, and no valid destination with source -1
    (the second check reads a flag back from the device)."""
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} differ in shape")
    if bool(((dst_slots >= 0) & (src_slots < 0)).any()):
        raise ValueError("copy_slots: a valid dst slot has source -1; only pairs with dst -1 are skipped")


def checked_slots(slots: torch.Tensor, kv_cache: torch.Tensor, name: str = "slots",
                  check_range: bool = True) -> torch.Tensor:
    """``slots`` as int64 ``[n]`` or ``[n, H]`` on the cache's device, shape- and (optionally)
    range-checked: valid values are -1 (skip) and ``0 .. num_blocks * block_size - 1``. Shared
    with the CUDA ops' wrappers."""
    return _checked_slots(slots, kv_cache, name, check_range)


def check_tokens(tokens: torch.Tensor, name: str, kv_cache: torch.Tensor, num_tokens: int) -> None:
    """``tokens`` must be ``[num_tokens, H, D]`` of the cache's dtype and device. Shared with the
    CUDA ops' wrappers (which, unlike the Triton kernels, take any strides)."""
    expected = (num_tokens, kv_cache.shape[1], kv_cache.shape[3] // 2)
    if tuple(tokens.shape) != expected:
        raise ValueError(f"{name} must be {list(expected)} (T, num_kv_heads, head_size), got {list(tokens.shape)}")
    if tokens.dtype != kv_cache.dtype:
        raise ValueError(f"{name} dtype {tokens.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if tokens.device != kv_cache.device:
        raise ValueError(f"{name} is on {tokens.device}, kv_cache on {kv_cache.device}")


def _check_tokens(tokens: torch.Tensor, name: str, kv_cache: torch.Tensor, num_tokens: int) -> None:
    check_tokens(tokens, name, kv_cache, num_tokens)
    if tokens.numel() and tokens.stride(2) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension, got strides {tokens.stride()}")


def check_supported_cache(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(num_kv_heads, head_size, block_size) of a cache the kernels support."""
    _, num_heads, block_size, head_size = check_cache(kv_cache)
    if kv_cache.dtype not in _BIT_TYPES:
        raise ValueError(f"unsupported kv_cache dtype {kv_cache.dtype}; expected one of {list(_BIT_TYPES)}")
    return num_heads, head_size, block_size


def _checked_slots(slots: torch.Tensor, kv_cache: torch.Tensor, name: str, check_range: bool) -> torch.Tensor:
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {slots.dtype}")
    if slots.dim() not in (1, 2) or (slots.dim() == 2 and slots.shape[1] != num_heads):
        raise ValueError(f"{name} must be [n] or [n, {num_heads}], got {tuple(slots.shape)}")
    if slots.device != kv_cache.device:
        raise ValueError(f"{name} is on {slots.device}, kv_cache on {kv_cache.device}")
    slots = slots.to(torch.int64)
    num_slots = num_blocks * block_size
    if check_range and slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
        raise ValueError(f"{name} out of range: valid slots are -1 (skip) and 0..{num_slots - 1}")
    return slots


def _slot_strides(slots: torch.Tensor) -> tuple[int, int]:
    """(token, head) strides of ``[n]`` or ``[n, H]`` slots; 0 per head broadcasts ``[n]``."""
    return (slots.stride(0), 0) if slots.dim() == 1 else (slots.stride(0), slots.stride(1))


def _tile(num_heads: int, head_size: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_D): head_size padded to a power of two, and as many heads as fit in
    ``_MAX_TILE_ELEMS`` elements (at least one)."""
    block_d = triton.next_power_of_2(head_size)
    block_h = max(1, min(triton.next_power_of_2(num_heads), _MAX_TILE_ELEMS // block_d))
    return block_h, block_d
