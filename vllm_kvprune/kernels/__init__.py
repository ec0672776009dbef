"""Slot-level K/V moves on vLLM's CPU paged KV cache: the EQUIP in-place update and friends.

Each op takes the layer cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` and a
:class:`CacheLayout` probed from vLLM (:func:`probe_layout` / :func:`layout_for_cache`), so it
writes exactly where vLLM's attention kernel reads, whatever ISA packed the cache. Slots are
int64 ``[n]`` (one slot per token for all heads, like vLLM's ``slot_mapping``) or ``[n, H]``
(one slot per token and KV head, for head-wise policies); slot -1 is skipped.

The C++ extension (``vllm_kvprune._C``, ops ``torch.ops.kvprune.*``) runs them in parallel;
without it the pure-torch versions in :mod:`vllm_kvprune.kernels.reference` are used, slower,
and one warning says so.
"""

from __future__ import annotations

import logging

import torch

from vllm_kvprune.kernels import reference
from vllm_kvprune.kernels.layout import (
    CacheLayout,
    default_isa,
    layout_for_cache,
    probe_layout,
    vec_layout,
)

__all__ = [
    "HAS_EXTENSION",
    "CacheLayout",
    "attention_mass",
    "copy_slots",
    "default_isa",
    "extension_isa",
    "layout_for_cache",
    "lowest_mass_slots",
    "lowest_mass_slots_many",
    "probe_layout",
    "read_slots",
    "vec_layout",
    "write_slots",
]

logger = logging.getLogger("vllm_kvprune")


def _load_extension() -> bool:
    """Import the C++ ops once; on failure, warn once and let the torch path take over."""
    try:
        import vllm_kvprune._C  # noqa: F401  (registers torch.ops.kvprune.*)
    except ImportError as error:
        logger.warning(
            "vllm_kvprune C++ extension is not available (%s); KV-cache slot ops fall back to "
            "the slower pure-torch implementation. Reinstall with "
            "`pip install --no-build-isolation -e .` to build it.",
            error,
        )
        return False
    return True


HAS_EXTENSION: bool = _load_extension()


def extension_isa() -> str | None:
    """Instruction set the extension was compiled for, or None without the extension."""
    return str(torch.ops.kvprune.build_isa()) if HAS_EXTENSION else None


def write_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    layout: CacheLayout,
) -> None:
    """Write key/value ``[T, H, D]`` into ``slots`` (``[T]`` or ``[T, H]``) of ``kv_cache``.

    This is the EQUIP update: new tokens overwrite victim slots in place, so the cost is
    proportional to the tokens written, not to the cache length.
    """
    slots = _as_slots(slots)
    if not HAS_EXTENSION:
        reference.write_slots(key, value, kv_cache, slots, layout)
        return
    torch.ops.kvprune.write_slots(
        _unit_last_stride(key),
        _unit_last_stride(value),
        kv_cache,
        slots,
        layout.key_offsets,
        layout.value_offsets,
        layout.tiling_list,
    )


def copy_slots(
    kv_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layout: CacheLayout,
) -> None:
    """Move whole tokens (K and V) from ``src_slots`` to ``dst_slots`` within one layer cache.

    All sources are read before any destination is written, so compaction may move tokens
    onto slots that other moved tokens vacate. Pairs with destination -1 are skipped;
    destinations must be distinct.
    """
    src_slots, dst_slots = _as_slots(src_slots), _as_slots(dst_slots)
    if not HAS_EXTENSION:
        reference.copy_slots(kv_cache, src_slots, dst_slots, layout)
        return
    torch.ops.kvprune.copy_slots(
        kv_cache, src_slots, dst_slots, layout.key_offsets, layout.value_offsets, layout.tiling_list
    )


def read_slots(
    kv_cache: torch.Tensor, slots: torch.Tensor, layout: CacheLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n, H, D]`` held in ``slots`` (``[n]`` or ``[n, H]``); slot -1 reads zeros.

    Scorers that need cached keys (H2O's attention mass, GVote) read them through this,
    since the cache order is ISA-specific.
    """
    slots = _as_slots(slots)
    if not HAS_EXTENSION:
        return reference.read_slots(kv_cache, slots, layout)
    key, value = torch.ops.kvprune.read_slots(
        kv_cache, slots, layout.key_offsets, layout.value_offsets, layout.tiling_list
    )
    return key, value


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
    """Attention probability mass per cached slot (H2O heavy hitters), read from the cache.

    ``query [N, Hq, D]`` (any float dtype, rows may be strided); query i attends to slots
    ``0 .. key_counts[i] - 1`` of block-table row ``query_rows[i]`` (slot s in block
    ``block_table[row, s // block_size]`` at offset ``s % block_size``); query head q uses KV
    head ``q // (Hq // H)``. With ``p = softmax(scale * q.K)`` in fp32, adds to
    ``mass [H, num_blocks * block_size]`` (float32) at each slot's global index the sum of p
    over the query heads of each KV head, and writes ``output[i, q] = sum_s p_s V_s`` when
    ``output`` (``[N, Hq, D]``, float32 or the query dtype) is given. A query with no keys
    adds nothing and gets a zero output. ``block_table`` is int32 (vLLM's) or int64.
    ``softcap > 0`` soft-caps the scaled logits first (``softcap * tanh(x / softcap)``), as
    vLLM's kernel does for Gemma 2-style models.
    """
    query_rows, key_counts = _as_slots(query_rows), _as_slots(key_counts)
    if not HAS_EXTENSION:
        reference.attention_mass(query, kv_cache, layout, block_table, query_rows, key_counts, scale, mass, output,
                                 softcap)
        return
    torch.ops.kvprune.attention_mass(
        _unit_last_stride(query),
        kv_cache,
        block_table,
        query_rows,
        key_counts,
        float(scale),
        mass,
        output,
        layout.key_offsets,
        layout.value_offsets,
        layout.tiling_list,
        float(softcap),
    )


def lowest_mass_slots(mass: torch.Tensor, slots: torch.Tensor, logical: torch.Tensor, count: int,
                      next_position: int, sinks: int, recent: int) -> torch.Tensor:
    """H2O's victims: for each layer and KV head, the ``count`` indices into ``slots`` (a
    request's global slots ``[n]``) of the tokens to evict, ``[layers, heads, count]``, best
    first. ``mass`` is the table ``[layers, heads, num_slots]`` (float32), ``logical``
    ``[layers, heads, n]`` the position each slot holds per head. Lowest mass goes first,
    ties to the older position; positions below ``sinks`` and from ``next_position - recent``
    on are never chosen."""
    slots = _as_slots(slots)
    if mass.device.type != "cpu":
        # A GPU's table: only the request's slots come to the host (the choice is planned there).
        mass = mass[:, :, slots.to(mass.device)].cpu()
        slots = torch.arange(mass.shape[-1])
    if not HAS_EXTENSION:
        return reference.lowest_mass_slots(mass, slots, logical, count, next_position, sinks, recent)
    if logical.dtype != torch.int64 or logical.stride(-1) != 1:
        logical = logical.to(torch.int64).contiguous()
    return torch.ops.kvprune.lowest_mass_slots(mass, slots, logical, count, next_position, sinks, recent)


def lowest_mass_slots_many(mass: torch.Tensor, searches: list) -> list[torch.Tensor]:
    """`lowest_mass_slots` for several requests (`kernels.victims.VictimSearch`): on the host's
    table each request by the C++ op; on a device's, all of them there at once
    (`victims.lowest_mass_slots_batched`: one copy back instead of one table per request)."""
    if mass.device.type != "cpu":
        from vllm_kvprune.kernels.victims import lowest_mass_slots_batched

        return lowest_mass_slots_batched(mass, searches)
    return [lowest_mass_slots(mass, search.slots, torch.from_numpy(search.logical), search.count,
                              search.next_position, search.sinks, search.recent) for search in searches]


def _as_slots(slots: torch.Tensor) -> torch.Tensor:
    """int64 and contiguous, as the C++ ops require (free when it already is)."""
    if slots.dtype != torch.int64:
        slots = slots.to(torch.int64)
    return slots.contiguous()


def _unit_last_stride(tokens: torch.Tensor) -> torch.Tensor:
    """vLLM hands K/V as views of the fused QKV output: rows may be strided, dims must not."""
    return tokens if tokens.stride(-1) == 1 else tokens.contiguous()
