"""Pure-torch slot ops on vLLM's CPU paged KV cache, for any probed layout.

These are the oracle the C++ ops are tested against and the fallback when the extension is
not built. They address the cache as ``[num_blocks * num_kv_heads, page_elems]`` rows and use
the layout's index maps as column indices, so nothing here assumes a particular ISA.
Semantics (shared with the C++ ops): slot -1 is skipped on write and reads as zeros; duplicate
destination slots leave an unspecified one of the writers.
"""

from __future__ import annotations

import torch

from vllm_kvprune.kernels.layout import CacheLayout


def write_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    layout: CacheLayout,
) -> None:
    """Write key/value ``[T, H, D]`` into ``slots`` (``[T]`` or ``[T, H]``), in place."""
    pages = _pages(kv_cache, layout)
    per_head_slots = _per_head(slots, kv_cache, "slots")
    _check_tokens(key, "key", kv_cache, per_head_slots.shape[0])
    _check_tokens(value, "value", kv_cache, per_head_slots.shape[0])
    token_idx, head_idx = torch.nonzero(per_head_slots >= 0, as_tuple=True)
    rows, offsets_in_block = _page_coords(per_head_slots[token_idx, head_idx], head_idx, kv_cache)
    pages[rows.unsqueeze(1), layout.key_offsets[offsets_in_block]] = key[token_idx, head_idx]
    pages[rows.unsqueeze(1), layout.value_offsets[offsets_in_block]] = value[token_idx, head_idx]


def read_slots(
    kv_cache: torch.Tensor, slots: torch.Tensor, layout: CacheLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather K and V ``[n, H, D]`` of ``slots`` (``[n]`` or ``[n, H]``)."""
    pages = _pages(kv_cache, layout)
    per_head_slots = _per_head(slots, kv_cache, "slots")
    num_tokens, num_heads = per_head_slots.shape
    key = kv_cache.new_zeros(num_tokens, num_heads, layout.head_size)
    value = kv_cache.new_zeros(num_tokens, num_heads, layout.head_size)
    token_idx, head_idx = torch.nonzero(per_head_slots >= 0, as_tuple=True)
    rows, offsets_in_block = _page_coords(per_head_slots[token_idx, head_idx], head_idx, kv_cache)
    key[token_idx, head_idx] = pages[rows.unsqueeze(1), layout.key_offsets[offsets_in_block]]
    value[token_idx, head_idx] = pages[rows.unsqueeze(1), layout.value_offsets[offsets_in_block]]
    return key, value


def copy_slots(
    kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, layout: CacheLayout
) -> None:
    """Move whole tokens from ``src_slots`` to ``dst_slots`` (both ``[n]`` or ``[n, H]``).

    Reading every source into a staging copy before writing is what makes overlapping
    source and destination sets (compaction) safe. Pairs whose destination is -1 are skipped.
    """
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} differ in shape")
    if bool(((dst_slots >= 0) & (src_slots < 0)).any()):
        raise ValueError("copy_slots: a valid dst slot has source -1; only pairs with dst -1 are skipped")
    staged_key, staged_value = read_slots(kv_cache, src_slots, layout)
    write_slots(staged_key, staged_value, kv_cache, dst_slots, layout)


def attention_mass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    block_table: torch.Tensor,
    query_rows: torch.Tensor,
    key_counts: torch.Tensor,
    scale: float,
    mass: torch.Tensor,
    output: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> None:
    """Softmax attention of each query over its row's first ``key_counts[i]`` slots; adds each
    slot's probability, summed over the query heads of its KV head, to ``mass [H, num_slots]``
    and, if given, writes the attention output ``[N, Hq, D]``. One query at a time, in fp32;
    ``softcap > 0`` caps the scaled logits to ``softcap * tanh(logits / softcap)`` first.
    """
    num_queries, query_heads, head_size = query.shape
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    if query_heads % num_heads or head_size != layout.head_size:
        raise ValueError(
            f"query {list(query.shape)} does not fit a cache of {num_heads} KV heads, head_size {layout.head_size}"
        )
    if mass.shape != (num_heads, num_blocks * block_size) or mass.dtype != torch.float32:
        raise ValueError(f"mass must be float32 [{num_heads}, {num_blocks * block_size}], got {mass.dtype} {list(mass.shape)}")
    if output is not None and output.shape != query.shape:
        raise ValueError(f"output must be {list(query.shape)}, got {list(output.shape)}")
    group = query_heads // num_heads
    for i in range(num_queries):
        row, count = int(query_rows[i]), int(key_counts[i])
        if not 0 <= count <= block_table.shape[1] * block_size:
            raise ValueError(f"key_counts[{i}] = {count} exceeds the block table's {block_table.shape[1]} blocks")
        if count == 0:
            if output is not None:
                output[i] = 0
            continue
        positions = torch.arange(count)
        slots = block_table[row].to(torch.int64)[positions // block_size] * block_size + positions % block_size
        key, value = read_slots(kv_cache, slots, layout)  # [n, H, D]
        key = key.float().repeat_interleave(group, dim=1)  # [n, Hq, D], query head q -> KV head q // group
        value = value.float().repeat_interleave(group, dim=1)
        logits = scale * torch.einsum("qd,nqd->qn", query[i].float(), key)
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        probs = torch.softmax(logits, dim=-1)  # [Hq, n]
        mass.index_add_(1, slots, probs.view(num_heads, group, count).sum(dim=1))
        if output is not None:
            output[i] = torch.einsum("qn,nqd->qd", probs, value).to(output.dtype)


def lowest_mass_slots(mass: torch.Tensor, slots: torch.Tensor, logical: torch.Tensor, count: int,
                      next_position: int, sinks: int, recent: int) -> torch.Tensor:
    """H2O's victims per layer and KV head, ``[layers, heads, count]`` indices into ``slots``:
    lowest ``mass[l, h, slots[i]]`` first, ties to the older position, never a sink
    (``logical < sinks``) nor a recent token (``logical >= next_position - recent``)."""
    scores = mass[:, :, slots].masked_fill((logical < sinks) | (logical >= next_position - recent), float("inf"))
    by_age = torch.argsort(logical, dim=-1, stable=True)
    ranked = torch.sort(scores.gather(-1, by_age), dim=-1, stable=True)
    if not bool(torch.isfinite(ranked.values[..., count - 1]).all()):
        raise ValueError(f"fewer than {count} evictable tokens in some head")
    return by_age.gather(-1, ranked.indices[..., :count])


def _pages(kv_cache: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """The cache as one row per (block, head) page; a view, so writes land in the cache."""
    if kv_cache.dim() != 4 or not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache must be a contiguous [num_blocks, num_kv_heads, block_size, 2*head_size] "
            f"tensor, got shape {tuple(kv_cache.shape)} contiguous={kv_cache.is_contiguous()}"
        )
    num_blocks, num_heads, block_size, two_head_size = kv_cache.shape
    if (block_size, two_head_size // 2) != (layout.block_size, layout.head_size):
        raise ValueError(
            f"layout is for block_size={layout.block_size}, head_size={layout.head_size}; "
            f"kv_cache has block_size={block_size}, head_size={two_head_size // 2}"
        )
    return kv_cache.view(num_blocks * num_heads, layout.page_elems)


def _per_head(slots: torch.Tensor, kv_cache: torch.Tensor, name: str) -> torch.Tensor:
    """Slots as ``[n, H]``, broadcasting vLLM-style ``[n]`` slots over heads; range-checked."""
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    if slots.dim() == 1:
        slots = slots.unsqueeze(1).expand(-1, num_heads)
    elif slots.dim() != 2 or slots.shape[1] != num_heads:
        raise ValueError(f"{name} must be [n] or [n, {num_heads}], got {tuple(slots.shape)}")
    slots = slots.to(torch.int64)
    num_slots = num_blocks * block_size
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
        raise ValueError(f"{name} out of range: valid slots are -1 (skip) and 0..{num_slots - 1}")
    return slots


def _page_coords(
    slots: torch.Tensor, head_idx: torch.Tensor, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page row, token offset inside the block) of each (slot, head) pair."""
    num_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    return (slots // block_size) * num_heads + head_idx, slots % block_size


def _check_tokens(tokens: torch.Tensor, name: str, kv_cache: torch.Tensor, num_tokens: int) -> None:
    expected = (num_tokens, kv_cache.shape[1], kv_cache.shape[3] // 2)
    if tuple(tokens.shape) != expected:
        raise ValueError(f"{name} must be {list(expected)} (T, num_kv_heads, head_size), got {list(tokens.shape)}")
    if tokens.dtype != kv_cache.dtype:
        raise ValueError(f"{name} dtype {tokens.dtype} differs from kv_cache dtype {kv_cache.dtype}")


def head_page_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    softcap: float = 0.0,
) -> None:
    """Decode attention where each (request n, KV head h) is its own sequence of
    ``lengths[n, h]`` tokens in head-pages: token ``j`` is offset ``j % block_size`` of head-page
    ``pages[n, h, j // block_size]`` (head-page ``p`` = KV head ``p % H`` of block ``p // H``;
    -1 pads past the used pages). Query heads ``h * G .. h * G + G - 1`` of ``query [N, Hq, D]``
    attend head (n, h); ``output [N, Hq, D]`` is written (zeros for length 0). One head at a
    time, in fp32; ``softcap > 0`` caps the scaled logits to ``softcap * tanh(logits / softcap)``.
    Reads through the head-page view ``[num_blocks * H, 1, block_size, 2D]`` with ``read_slots``.
    """
    num_requests, query_heads, head_size = query.shape
    num_blocks, num_heads, block_size, two_head_size = kv_cache.shape
    if query_heads % num_heads or head_size != layout.head_size:
        raise ValueError(
            f"query {list(query.shape)} does not fit a cache of {num_heads} KV heads, head_size {layout.head_size}"
        )
    if output.shape != query.shape:
        raise ValueError(f"output must be {list(query.shape)}, got {list(output.shape)}")
    if pages.dim() != 3 or tuple(pages.shape[:2]) != (num_requests, num_heads):
        raise ValueError(f"pages must be [{num_requests}, {num_heads}, max_pages], got {list(pages.shape)}")
    if tuple(lengths.shape) != (num_requests, num_heads):
        raise ValueError(f"lengths must be [{num_requests}, {num_heads}], got {list(lengths.shape)}")
    group = query_heads // num_heads
    head_page_cache = kv_cache.view(num_blocks * num_heads, 1, block_size, two_head_size)
    for n in range(num_requests):
        for h in range(num_heads):
            heads_of_group = slice(h * group, (h + 1) * group)
            length = int(lengths[n, h])
            if not 0 <= length <= pages.shape[2] * block_size:
                raise ValueError(f"lengths[{n}, {h}] = {length} exceeds the {pages.shape[2]} head-pages of pages")
            if length == 0:
                output[n, heads_of_group] = 0
                continue
            tokens = torch.arange(length)
            head_pages = pages[n, h].to(torch.int64)[tokens // block_size]
            if int(head_pages.min()) < 0 or int(head_pages.max()) >= num_blocks * num_heads:
                raise ValueError(f"pages[{n}, {h}] holds an invalid head-page among its first {length} tokens")
            key, value = read_slots(head_page_cache, head_pages * block_size + tokens % block_size, layout)
            key, value = key[:, 0].float(), value[:, 0].float()  # [length, D]
            logits = scale * query[n, heads_of_group].float() @ key.T  # [G, length]
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            output[n, heads_of_group] = (torch.softmax(logits, dim=-1) @ value).to(output.dtype)
