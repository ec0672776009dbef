"""The `tokens` layout (`streaming`): one `SlotMap` per request serves every layer and head.

Evictions compact (prefill) or overwrite a victim in place (decode, EQUIP); with
`positions: cache` the sinks are captured when first written and re-anchored (rotated
forward by the tokens evicted so far) whenever that count changes. Under FDC the same plan
runs on the narrow cache (`LayerCall` stores, copies and attends through FDC).

`KVPRUNE_SHIFT_APPEND=1` is a baseline for benchmarks, never for serving: a decode
eviction then shifts every survivor after the victims down and appends the new token at the
end, as StreamingLLM's contiguous cache does (the same tokens kept, in the same order as
there; EQUIP's end-to-end comparison).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_kvprune import envs
from vllm_kvprune.worker.layouts.base import LayerCall, Row, RowPlanner, StepPlan, concat_moves, moved
from vllm_kvprune.worker.slot_map import NO_MOVES, Moves, SlotMap

if TYPE_CHECKING:
    from vllm_kvprune.worker.state import RequestKVState

# Benchmarks only: the methods' own evictions instead of EQUIP's in-place write.
SHIFT_APPEND = envs.get("SHIFT_APPEND", "0") == "1"


@dataclass
class SinkAnchor:
    """Rewrite a request's sink keys rotated forward by `shift` positions."""

    state: RequestKVState
    sink_positions: np.ndarray
    sink_slots: torch.Tensor
    shift: int


@dataclass
class TokenPlan(StepPlan):
    """Moves before the new tokens are written (evictions with lazy pruning or a streaming
    prefill), after attention (a full prefill's compaction, while the prompt's tail blocks are
    still the request's), and the sinks captured and re-anchored (`positions: cache`)."""

    pre_moves: tuple[torch.Tensor, torch.Tensor] | None = None
    post_moves: tuple[torch.Tensor, torch.Tensor] | None = None
    sink_captures: list[tuple[RequestKVState, torch.Tensor]] = field(default_factory=list)
    sink_anchors: list[SinkAnchor] = field(default_factory=list)

    def to_device(self, device: torch.device | str) -> TokenPlan:
        self.pre_moves = None if self.pre_moves is None else tuple(moved(part, device) for part in self.pre_moves)
        self.post_moves = None if self.post_moves is None else tuple(moved(part, device) for part in self.post_moves)
        return self

    def write(self, call: LayerCall, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        for state, token_index in self.sink_captures:
            # Sinks may arrive over several steps (a prompt shorter than `sinks`).
            captured = (key[token_index].clone(), value[token_index].clone())
            earlier = state.map.sink_kv.get(call.layer.layer_name)
            if earlier is not None:
                captured = (torch.cat([earlier[0], captured[0]]), torch.cat([earlier[1], captured[1]]))
            state.map.sink_kv[call.layer.layer_name] = captured
        if self.pre_moves is not None:
            call.copy(*self.pre_moves)
        if self.sink_anchors:
            with call.moving():
                self._reanchor_sinks(call)
        call.store(key, value, slot_mapping)

    def _reanchor_sinks(self, call: LayerCall) -> None:
        keys, values, shifts, slots = [], [], [], []
        for anchor in self.sink_anchors:
            sink_keys, sink_values = anchor.state.map.sink_kv[call.layer.layer_name]
            index = torch.from_numpy(anchor.sink_positions)
            keys.append(sink_keys[index])
            values.append(sink_values[index])
            shifts.append(torch.full((len(index),), anchor.shift, dtype=torch.int64))
            slots.append(anchor.sink_slots)
        rotate = call.worker.sink_rotations[call.layer.layer_name]
        rotated = rotate(torch.cat(keys), torch.cat(shifts))
        call.kernels.write_slots(call.layer, rotated, torch.cat(values), call.kv_cache, torch.cat(slots))

    def after_attention(self, call: LayerCall, query: torch.Tensor, metadata: Any) -> None:
        if self.post_moves is not None:
            call.copy(*self.post_moves)


class TokenPlanner(RowPlanner):
    """Plans the rows of requests holding a `SlotMap`; the policy decides `survivors` (a
    compaction) and `victims` (a decode eviction)."""

    shift_and_append = SHIFT_APPEND

    def __init__(self, block_size: int, tables: Any = None) -> None:
        super().__init__(block_size, tables)
        self.slot_mapping: list[np.ndarray] = []
        self.pre_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.post_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.sink_captures: list[tuple[RequestKVState, torch.Tensor]] = []
        self.sink_anchors: list[SinkAnchor] = []

    @classmethod
    def new_map(cls, tables: Any) -> SlotMap:
        return SlotMap()

    def add(self, row: Row) -> None:
        state, config, slots = row.state, row.state.config, row.state.map
        pre = post = NO_MOVES
        if row.decoding() and config.evicts_before(slots.num_valid, 1):
            kept_before_new = config.budget - 1
            victims = state.policy.victims(slots.logical, slots.num_valid + 1 - config.budget, config)
            if self.shift_and_append:
                pre = slots.compact(np.setdiff1d(np.arange(slots.num_valid), victims))
                mapped = self._global(row.block_row, slots.append(row.positions))
            else:
                new_slot, pre = slots.replace(victims, row.num_computed)
                mapped = np.array([self._global_one(row.block_row, new_slot)], np.int64)
        else:
            chunk = config.prefill_chunk
            if row.in_prompt and config.prefill == "streaming" and row.num_computed % chunk == 0:
                pre = evict_for(state, min(chunk, row.num_prompt - row.num_computed))
            kept_before_new = slots.num_valid
            mapped = self._global(row.block_row, slots.append(row.positions))
            if row.in_prompt and config.prefill == "full" and row.ends_prompt:
                post = evict_for(state, 1)
        self._add_moves(self.pre_moves, row.block_row, pre)
        self._add_moves(self.post_moves, row.block_row, post)
        self.slot_mapping.append(mapped)
        self.seq_lens.append(kept_before_new + row.num_new)
        self._plan_sinks(row, kept_before_new)

    def _add_moves(self, target: list, block_row: np.ndarray, moves: Moves) -> None:
        if len(moves[0]):
            target.append((self._global(block_row, moves[0]), self._global(block_row, moves[1])))

    def _plan_sinks(self, row: Row, kept_before_new: int) -> None:
        state, config, slots = row.state, row.state.config, row.state.map
        if config.positions != "cache" or config.sinks == 0:
            return
        if row.num_computed < config.sinks:
            count = min(config.sinks, row.num_computed + row.num_new) - row.num_computed
            self.sink_captures.append((state, torch.arange(row.first_token, row.first_token + count)))
        shift = row.num_computed - kept_before_new  # tokens evicted so far
        if shift != slots.sink_shift:
            sink_slots = np.flatnonzero(slots.logical < config.sinks)
            self.sink_anchors.append(SinkAnchor(
                state, slots.logical[sink_slots], torch.from_numpy(self._global(row.block_row, sink_slots)), shift))
            slots.sink_shift = shift

    def finish(self) -> TokenPlan:
        return TokenPlan(
            slot_mapping=torch.from_numpy(np.concatenate(self.slot_mapping)),
            seq_lens=self._seq_lens(),
            pre_moves=concat_moves(self.pre_moves),
            post_moves=concat_moves(self.post_moves),
            sink_captures=self.sink_captures,
            sink_anchors=self.sink_anchors,
        )


def evict_for(state: RequestKVState, num_incoming: int) -> Moves:
    """Apply the step rule before `num_incoming` tokens arrive; compacts the survivors."""
    config, slots = state.config, state.map
    if not config.evicts_before(slots.num_valid, num_incoming):
        return NO_MOVES
    return slots.compact(state.policy.survivors(slots.logical, config.budget - 1, config))
