"""Debug invariant mode: `KVPRUNE_CHECK=1` checks, after every engine step, what the tests
otherwise check from outside, and stops the engine loudly (`InvariantError`) at the first breach.

Scheduler side (`check_scheduler`, after each `update_from_output`, and `check_released` after a
request is freed or preempted):
- a request under a capped policy holds at most `block_limit` blocks of each capped group (its
  prompt's blocks while it is prefilled, its cap or its worker-reported footprint after; under
  async scheduling one more, allocated for a step before the report that limits it arrived);
- no block of a capped group is listed twice, by two requests or two groups (our blocks are
  never prefix-cached, so sharing one is always a bug);
- a finished, aborted or preempted request holds no block, and an idle engine's pool is whole.
Worker side (`WorkerKVState.plan`, `check_planned`): each planned request's map holds every
position at most once and no slot twice (`check()` of its map), every block its map reaches is
a real block of its own block-table row (no write outside its own blocks: not into vLLM's null
block, not past its row), and no two requests' maps reach the same physical slot (with the
scheduler's check that no block is held twice, no request writes into another's blocks).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_kvprune import envs

from vllm_kvprune.worker.slot_map import InvariantError

CHECK_ENV = envs.name("CHECK")


def enabled() -> bool:
    return envs.get("CHECK") == "1"


def check_scheduler(scheduler: Any, capped_managers: list) -> None:
    from vllm_kvprune.engine.scheduler import KVPruneAsyncScheduler

    # Async scheduling allocates a step ahead of the report that sets a footprint's limit.
    slack = 1 if isinstance(scheduler, KVPruneAsyncScheduler) else 0
    owners: dict[int, str] = {}
    for manager in capped_managers:
        for request_id, blocks in manager.req_to_blocks.items():
            if not blocks:
                continue
            if request_id not in scheduler.requests:
                raise InvariantError(f"kvprune check: request {request_id} is gone but holds {len(blocks)} blocks")
            limit = manager.block_limit(request_id)
            if limit is not None and len(blocks) > limit + slack:
                raise InvariantError(f"kvprune check: request {request_id} holds {len(blocks)} blocks, its limit "
                                     f"is {limit}")
            for block in blocks:
                if block.is_null:
                    continue
                owner = owners.setdefault(block.block_id, request_id)
                if owner != request_id or block.ref_cnt != 1:
                    raise InvariantError(f"kvprune check: block {block.block_id} is held by {owner} and "
                                         f"{request_id} (ref count {block.ref_cnt})")
    if capped_managers and not scheduler.has_unfinished_requests():
        pool = scheduler.kv_cache_manager.block_pool
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:  # block 0 is the null block
            raise InvariantError(f"kvprune check: the engine is idle but {pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()} "
                                 "blocks are not back in the pool")


def check_released(scheduler: Any, request_id: str) -> None:
    from vllm_kvprune.engine.scheduler import held_blocks

    held = held_blocks(scheduler, request_id)
    if held:
        raise InvariantError(f"kvprune check: request {request_id} was freed but still holds {held} blocks")


def _check_inside_own_blocks(request_id: str, spanned: int, block_row: np.ndarray) -> None:
    """A map reads and writes its request's first `spanned` local blocks: each must be a real
    block of the request's row (block 0 is vLLM's null block, a row's padding)."""
    if spanned > len(block_row) or (block_row[:spanned] == 0).any():
        real = int(np.count_nonzero(block_row[:spanned]))
        raise InvariantError(f"kvprune check: request {request_id}'s map reaches {spanned} blocks, its block-table "
                             f"row holds {real} of them: a write outside its own blocks")


def check_planned(states: list[tuple[str, Any, np.ndarray]], block_size: int) -> None:
    """`states`: (request id, its RequestKVState, its block-table row as its map numbers blocks:
    one row `[width]`, or each layer's `[L, width]` for a map whose layers' blocks are their own
    (`blocks_spanned` and `local_slots` then per layer too))."""
    held_slots, holders = [], []
    for request_id, state, block_row in states:
        rows = np.atleast_2d(np.asarray(block_row))
        state.map.check()
        spanned = np.broadcast_to(np.asarray(state.map.blocks_spanned(block_size)), (len(rows),))
        local = state.map.local_slots()
        for layer, (row, count, slots) in enumerate(zip(rows, spanned, local if isinstance(local, list) else [local])):
            _check_inside_own_blocks(request_id, int(count), row)
            # Keyed by layer: with one table for every layer, each layer's cache is its own tensor.
            held_slots.append((layer, row[slots // block_size].astype(np.int64) * block_size + slots % block_size))
            holders += [request_id] * len(slots)
    if held_slots:
        stride = 1 + max(int(slots.max(initial=0)) for _, slots in held_slots)
        every = np.concatenate([layer * stride + slots for layer, slots in held_slots])
        unique, first, counts = np.unique(every, return_index=True, return_counts=True)
        if (counts > 1).any():
            key = int(unique[counts > 1][0])
            sharing = sorted({holders[i] for i in np.flatnonzero(every == key)})
            layer, slot = divmod(key, stride)
            raise InvariantError(f"kvprune check: slot {slot} is held by {', '.join(sharing)} (layer {layer})")
