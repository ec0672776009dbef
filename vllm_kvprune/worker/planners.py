"""How each kind of request map turns one step's rows into a `StepPlan`.

One small class per cache behaviour over a shared base, in the spirit of vLLM's
`single_type_kv_cache_manager.py`: a planner owns one kind of map (it makes a request's map
and reads the policy's choices into it), plans each row of the step in that map's terms and
finishes the plan its impl path executes. A new cache behaviour is one new class here
beside the others (and its map), not a branch in every method.

Step rule shared with `vllm_kvprune.reference` (budget B, prune interval R): before a step
of q new tokens, if `cached + q > B + R - 1` and `cached > B - 1`, evict down to `B - 1`
cached tokens. Decode steps are q = 1; a full prefill is one step evaluated at its end (as if
the next token arrived, so the survivors are compacted while the prompt's blocks are still
ours); a streaming prefill applies the rule at each `prefill_chunk`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_kvprune.kernels.victims import VictimSearch
from vllm_kvprune.worker.block_map import LayerBlockMap
from vllm_kvprune.worker.head_map import SKIP, HeadSlotMap
from vllm_kvprune.worker.head_page_map import HeadPageMap, global_head_pages, global_head_slots
from vllm_kvprune.worker.plan import (HiddenRows, MassQueries, PageAttention, PlanningError, PrefillCompaction,
                                      SinkAnchor, StepPlan, Vote)
from vllm_kvprune.worker.slot_map import NO_MOVES, Moves, SlotMap

if TYPE_CHECKING:
    from vllm_kvprune.worker.state import RequestKVState

@dataclass(frozen=True)
class Row:
    """One request's part of the step, in logical terms."""

    state: RequestKVState
    first_token: int  # index of its first new token in the batch
    num_computed: int
    num_new: int
    num_prompt: int
    block_row: np.ndarray  # its block-table row (local block i -> pool block)

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.num_computed, self.num_computed + self.num_new, dtype=np.int64)

    @property
    def in_prompt(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def ends_prompt(self) -> bool:
        return self.num_computed + self.num_new == self.num_prompt

    def decoding(self) -> bool:
        """Past its prompt; a bounded request then runs one token per step."""
        if self.in_prompt:
            return False
        if self.num_new != 1:
            raise PlanningError(
                f"kvprune: a bounded request runs one token per step past its prompt, got {self.num_new} "
                "(the scheduler's step rule, KVPruneScheduler._reserve_prefill_lookahead)")
        return True


class RowPlanner:
    """Accumulates one step's rows whose requests hold one kind of map."""

    def __init__(self, block_size: int, scores: Any = None) -> None:
        self.block_size = block_size
        self.scores = scores  # the policy's score table (LayerScores, HeadMass) or None
        self.seq_lens: list[int] = []
        self._checkpointed: tuple[int, tuple[str, ...]] | None = None  # (attribute count, names)

    @classmethod
    def attach_map(cls, state: RequestKVState, scores: Any) -> None:
        """Give a new (or restarted) request the map this planner plans."""

    @classmethod
    def searches_ahead(cls) -> bool:
        """Whether this planner overrides `search_ahead` (a step builds no rows for it otherwise)."""
        return cls.search_ahead is not RowPlanner.search_ahead

    def search_ahead(self, rows: list[Row]) -> None:
        """Before any row is planned: work the planner can do for all of the step's rows at
        once (`rows`: those of live requests, as they will be added). Only an optimisation:
        `add` must plan a row the same without it."""

    def add(self, row: Row) -> None:
        raise NotImplementedError

    def finish(self) -> StepPlan:
        raise NotImplementedError

    # ---- shared: a row that fails half-way leaves the step as it was (worker/faults.py) ----
    def checkpoint(self) -> dict[str, Any]:
        """What `rollback` restores: the length of every list the rows append to, and the flags."""
        fields = vars(self)
        names = self._checkpointed
        if names is None or names[0] != len(fields):  # found once, again if an attribute was added
            names = (len(fields), tuple(name for name, value in fields.items() if isinstance(value, (list, bool))))
            self._checkpointed = names
        return {name: len(fields[name]) if isinstance(fields[name], list) else fields[name] for name in names[1]}

    def rollback(self, checkpoint: dict[str, Any]) -> None:
        for name, kept in checkpoint.items():
            value = getattr(self, name)
            if isinstance(value, list):
                del value[kept:]
            else:
                setattr(self, name, kept)

    # ---- shared: local slots (inside the request's own blocks) to pool-wide slots ----
    def _global(self, block_row: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return block_row[slots // self.block_size].astype(np.int64) * self.block_size + slots % self.block_size

    def _global_one(self, block_row: np.ndarray, slot: int) -> int:
        # One slot (a decode step's): Python arithmetic, a few numpy calls fewer than `_global`.
        return int(block_row[slot // self.block_size]) * self.block_size + slot % self.block_size

    def _global_or_skip(self, block_row: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return np.where(slots == SKIP, SKIP, self._global(block_row, np.maximum(slots, 0)))

    def _seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32)


# Benchmarks only: the methods' own evictions instead of EQUIP's in-place write (below).
SHIFT_APPEND = os.environ.get("VLLM_KVPRUNE_SHIFT_APPEND", "0") == "1"


class TokenPlanner(RowPlanner):
    """Layer-uniform policies (`streaming`): one `SlotMap` per request serves every layer.
    Evictions compact (prefill) or overwrite a victim in place (decode, EQUIP); with
    `positions: cache` the sinks are captured and re-anchored.

    `VLLM_KVPRUNE_SHIFT_APPEND=1` is a baseline for benchmarks, never for serving: a decode
    eviction then shifts every survivor after the victims down and appends the new token at
    the end, as StreamingLLM's contiguous cache does (the same tokens kept, in the same
    order as there; EQUIP's end-to-end comparison)."""

    shift_and_append = SHIFT_APPEND

    def __init__(self, block_size: int, scores: Any = None) -> None:
        super().__init__(block_size, scores)
        self.slot_mapping: list[np.ndarray] = []
        self.pre_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.post_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.sink_captures: list[tuple[RequestKVState, torch.Tensor]] = []
        self.sink_anchors: list[SinkAnchor] = []

    @classmethod
    def attach_map(cls, state: RequestKVState, scores: Any) -> None:
        state.slots = SlotMap()

    def add(self, row: Row) -> None:
        state, config, slots = row.state, row.state.config, row.state.slots
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
        state, config = row.state, row.state.config
        if config.positions != "cache" or config.sinks == 0:
            return
        if row.num_computed < config.sinks:
            count = min(config.sinks, row.num_computed + row.num_new) - row.num_computed
            self.sink_captures.append((state, torch.arange(row.first_token, row.first_token + count)))
        shift = row.num_computed - kept_before_new  # tokens evicted so far
        if shift != state.sink_shift:
            sink_slots = np.flatnonzero(state.slots.logical < config.sinks)
            self.sink_anchors.append(SinkAnchor(
                state, state.slots.logical[sink_slots], torch.from_numpy(self._global(row.block_row, sink_slots)),
                shift))
            state.sink_shift = shift

    def finish(self) -> StepPlan:
        return StepPlan(
            slot_mapping=torch.from_numpy(np.concatenate(self.slot_mapping)),
            seq_lens=self._seq_lens(),
            pre_moves=_concat_moves(self.pre_moves),
            post_moves=_concat_moves(self.post_moves),
            sink_captures=self.sink_captures,
            sink_anchors=self.sink_anchors,
        )


class BlockPlanner(RowPlanner):
    """Block policies (`paged_eviction`): a `LayerBlockMap` per request, each layer its own
    block order. The prompt is written in table order and pruned per layer at its end; past
    it, when every block is full, each layer evicts its own worst R blocks and the first of
    them takes the new token as the tail (EQUIP, by block)."""

    def __init__(self, block_size: int, scores: Any = None) -> None:
        super().__init__(block_size, scores)
        self.layer_slots: list[np.ndarray] = []
        self.block_orders: list[tuple[int, np.ndarray]] = []
        self.prefill_compactions: list[PrefillCompaction] = []
        # Block means read for the step's evicting rows together (`search_ahead`), by request:
        # (the blocks read, their means); a row whose blocks differ reads its own.
        self.means_ahead: dict[str, tuple[bytes, torch.Tensor]] = {}

    @classmethod
    def attach_map(cls, state: RequestKVState, scores: Any) -> None:
        state.blocks = LayerBlockMap(scores.num_layers, scores.block_size)

    def search_ahead(self, rows: list[Row]) -> None:
        """The block means of every row that evicts in decode this step, read in one go (on a
        GPU's table: one gather and one copy back, not one per request)."""
        evicting = [row for row in rows if self._evicts_in_decode(row)]
        if not evicting:
            return
        block_ids = [row.block_row[row.state.blocks.order] for row in evicting]
        for row, ids, means in zip(evicting, block_ids, self.scores.block_means_many(block_ids)):
            self.means_ahead[row.state.request_id] = (ids.tobytes(), means)

    def _evicts_in_decode(self, row: Row) -> bool:
        """Whether this decode row evicts blocks before its token is written (the one test
        `add` and `search_ahead` share)."""
        config, blocks = row.state.config, row.state.blocks
        return row.decoding() and blocks.tail_full and not blocks.free.shape[1] \
            and blocks.order.shape[1] >= config.cap_blocks(self.block_size)

    def _block_means(self, row: Row) -> torch.Tensor:
        block_ids = row.block_row[row.state.blocks.order]
        ahead = self.means_ahead.get(row.state.request_id)
        if ahead is not None and ahead[0] == block_ids.tobytes():
            return ahead[1]
        return self.scores.block_means(block_ids)

    def add(self, row: Row) -> None:
        state, config, blocks = row.state, row.state.config, row.state.blocks
        if self._evicts_in_decode(row):
            means = self._block_means(row)
            victims = state.policy.victim_blocks(means, config.prune_interval, config, self.block_size)
            blocks.evict(victims.numpy())
        local = blocks.append(row.positions)
        self.layer_slots.append(self._global(row.block_row, local))
        self.seq_lens.append(blocks.num_valid)
        if row.ends_prompt and blocks.num_valid > config.budget:
            prompt_slots = torch.from_numpy(self._global(row.block_row, np.arange(blocks.num_valid)))
            self.prefill_compactions.append(PrefillCompaction(state, prompt_slots, config.budget))
            blocks.compact(config.budget)
        if not blocks.is_identity():
            self.block_orders.append((len(self.seq_lens) - 1, blocks.order))

    def finish(self) -> StepPlan:
        layer_slots = torch.from_numpy(np.concatenate(self.layer_slots, axis=1))
        return StepPlan(
            slot_mapping=layer_slots[0],
            seq_lens=self._seq_lens(),
            layer_slot_mapping=layer_slots,
            block_orders=self.block_orders,
            prefill_compactions=self.prefill_compactions,
        )


class HeadPlanner(RowPlanner):
    """Head-wise policies (`h2o`): a `HeadSlotMap` per request, each layer and KV head its own
    tokens, all heads the same count. The prompt is written in table order, its mass kept as
    it is attended to, and pruned per layer and head at its end; past it, once the cache is
    full, every head evicts its own lowest-mass tokens and the new token takes one of their
    slots in that head (EQUIP, per head). With `VLLM_KVPRUNE_SHIFT_APPEND=1` (benchmarks
    only) every head gathers its survivors to the front and appends instead, as H2O's own
    cache does."""

    gather_and_append = SHIFT_APPEND

    def __init__(self, block_size: int, scores: Any = None) -> None:
        super().__init__(block_size, scores)
        self.head_slots: list[np.ndarray] = []
        self.head_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.prefill_compactions: list[PrefillCompaction] = []
        self.mass_queries: list[np.ndarray] = []  # [q, 3]: token, row, key count
        self.decode_only = True
        # Victims searched for the step's evicting rows together (`search_ahead`), by request:
        # (the search's inputs, its victims); a row whose inputs differ searches again.
        self.victims_ahead: dict[str, tuple[tuple, torch.Tensor]] = {}

    @classmethod
    def attach_map(cls, state: RequestKVState, scores: Any) -> None:
        state.heads = HeadSlotMap(scores.num_layers, scores.num_heads)

    def add(self, row: Row) -> None:
        state, config, heads = row.state, row.state.config, row.state.heads
        kept_before_new = heads.num_valid
        if self._evicts_in_decode(row):
            local = self._replace_per_head(row)
            kept_before_new = config.budget - 1
        else:
            new_slots = heads.append(row.positions)
            local = np.broadcast_to(new_slots[None, :, None], (heads.num_layers, row.num_new, heads.num_heads))
        self._add_mass_queries(row, kept_before_new)
        if row.in_prompt:
            self.decode_only = False
            if row.ends_prompt and config.evicts_before(heads.num_valid, 1):
                prompt_slots = torch.from_numpy(self._global(row.block_row, np.arange(heads.num_valid)))
                self.prefill_compactions.append(PrefillCompaction(state, prompt_slots, config.budget - 1))
                heads.truncate(config.budget - 1)
        self.head_slots.append(self._global(row.block_row, local))
        self.seq_lens.append(kept_before_new + row.num_new)

    def search_ahead(self, rows: list[Row]) -> None:
        """The victims of every row that evicts in decode this step, in one search (on a
        GPU's table: one pass there and one copy back, not one per request)."""
        evicting = [row for row in rows if self._evicts_in_decode(row)]
        if not evicting:
            return
        policy = evicting[0].state.policy
        evicting = [row for row in evicting if type(row.state.policy) is type(policy)]
        found = policy.evicted_many(self.scores.by_slot, [self._victim_search(row) for row in evicting])
        for row, victims in zip(evicting, found):
            self.victims_ahead[row.state.request_id] = (self._search_key(row), victims)

    @staticmethod
    def _evicts_in_decode(row: Row) -> bool:
        """Whether this decode row evicts before its token is written (the one test `add` and
        `search_ahead` share, so the search ahead covers exactly the rows that use it)."""
        return row.decoding() and row.state.config.evicts_before(row.state.heads.num_valid, 1)

    def _victim_search(self, row: Row) -> VictimSearch:
        config, heads = row.state.config, row.state.heads
        return VictimSearch(torch.from_numpy(self._global(row.block_row, np.arange(heads.num_valid))), heads.logical,
                            heads.num_valid + 1 - config.budget, row.num_computed, config.sinks, config.recent_size)

    @staticmethod
    def _search_key(row: Row) -> tuple:
        """What a row's search depends on besides the mass: its map (a restarted request has
        a new one), how much it holds, where it is, its blocks and settings."""
        heads = row.state.heads
        return (id(heads), heads.num_valid, row.num_computed, row.block_row.tobytes(), row.state.config)

    def _replace_per_head(self, row: Row) -> np.ndarray:
        """Every head evicts its lowest-mass tokens; returns the new token's local slot per
        layer and head `[layers, 1, heads]` and records the lazy-pruning moves."""
        state, config, heads = row.state, row.state.config, row.state.heads
        ahead = self.victims_ahead.get(state.request_id)
        if ahead is not None and ahead[0] == self._search_key(row):
            victims = ahead[1]
        else:
            search = self._victim_search(row)
            victims = state.policy.evicted(self.scores.by_slot, search.slots, torch.from_numpy(search.logical),
                                           search.count, search.next_position, config)
        replace = heads.gather_replace if self.gather_and_append else heads.replace
        new_slots, sources, destinations = replace(victims.numpy(), row.num_computed)
        if sources.shape[1]:
            self.head_moves.append((self._global_or_skip(row.block_row, sources),
                                    self._global_or_skip(row.block_row, destinations)))
        return new_slots[:, None, :]

    def _add_mass_queries(self, row: Row, kept_before_new: int) -> None:
        offsets = np.arange(row.num_new, dtype=np.int64)
        self.mass_queries.append(np.stack([row.first_token + offsets, np.full(row.num_new, len(self.seq_lens)),
                                           kept_before_new + 1 + offsets], axis=1))

    def finish(self) -> StepPlan:
        head_slots = torch.from_numpy(np.ascontiguousarray(np.concatenate(self.head_slots, axis=1)))
        moves = None
        if self.head_moves:
            moves = tuple(torch.from_numpy(np.ascontiguousarray(np.concatenate(part, axis=1)))
                          for part in zip(*self.head_moves))
        queries = torch.from_numpy(np.concatenate(self.mass_queries)).T.contiguous()
        return StepPlan(
            slot_mapping=head_slots[0, :, 0],
            seq_lens=self._seq_lens(),
            head_slot_mapping=head_slots,
            head_moves=moves,
            prefill_compactions=self.prefill_compactions,
            mass_queries=MassQueries(tokens=queries[0], rows=queries[1], key_counts=queries[2],
                                     decode_only=self.decode_only),
        )


class HeadPagePlanner(RowPlanner):
    """Budget-free head-wise policies (`gvote`): a `HeadPageMap` per request. The prompt is
    written in vLLM's layout and attended by vLLM's kernel; its query-projection statistics
    are gathered, and at its end every layer votes and packs each head's kept tokens into
    head-pages. Past it every head appends; a step with a paged row attends every row and
    KV head as its own sequence over head-pages (the stock kernel, one call per layer)."""

    def __init__(self, block_size: int, scores: Any = None) -> None:
        super().__init__(block_size, scores)
        self.rows: list[tuple[Row, np.ndarray]] = []  # (row, local head-slots [L, q, H] or uniform [q])
        self.hidden_rows: list[HiddenRows] = []
        self.votes: list[Vote] = []
        self.any_paged = False

    @classmethod
    def attach_map(cls, state: RequestKVState, scores: Any) -> None:
        state.pages = HeadPageMap(scores.num_layers, scores.num_heads, scores.block_size)

    def add(self, row: Row) -> None:
        pages = row.state.pages
        if row.decoding():
            if not pages.is_paged:
                raise PlanningError("kvprune: a gvote request decodes before its prompt was voted on")
            needed = pages.blocks_needed(1)
            if needed > len(row.block_row) or (row.block_row[:needed] == 0).any():
                raise PlanningError(f"kvprune: a request needs {needed} blocks for its kept tokens, the "
                                    f"scheduler gave it {int((row.block_row != 0).sum())}")
            self.any_paged = True
            self.rows.append((row, pages.append_decode(row.num_computed)[:, None, :]))
            self.seq_lens.append(0)  # per layer and head: see finish
            return
        tokens = pages.append_uniform(row.num_new)
        self.hidden_rows.append(HiddenRows(row.state, row.first_token, row.first_token + row.num_new))
        if row.ends_prompt:
            pages.row_seen = int(np.count_nonzero(row.block_row))  # a row is real ids, then 0-padding
            self.votes.append(Vote(row.state, row.first_token + row.num_new - 1, row.block_row, row.num_prompt))
        self.rows.append((row, tokens))
        self.seq_lens.append(pages.num_uniform)

    def finish(self) -> StepPlan:
        if not self.any_paged:
            # Every row is uniform: vLLM's own slots and attention.
            slots = np.concatenate([self._global(row.block_row, tokens) for row, tokens in self.rows])
            return StepPlan(slot_mapping=torch.from_numpy(slots), seq_lens=self._seq_lens(),
                            hidden_rows=self.hidden_rows, votes=self.votes)
        return self._finish_paged()

    def _finish_paged(self) -> StepPlan:
        first = self.rows[0][0].state.pages
        num_layers, num_heads, bs = first.num_layers, first.num_heads, self.block_size
        num_rows = len(self.rows)
        slots, seq_lens, tables = [], np.zeros((num_layers, num_heads, num_rows), np.int64), []
        for index, (row, local) in enumerate(self.rows):
            pages = row.state.pages
            if local.ndim == 1:  # uniform: every layer alike
                local = np.broadcast_to(pages.uniform_slots(local)[None], (num_layers, len(local), num_heads))
                seq_lens[:, :, index] = pages.num_uniform
                count = -(-pages.num_uniform // bs)
                table = (np.arange(count) * num_heads)[None, None, :] + np.arange(num_heads)[None, :, None]
                table = np.broadcast_to(table, (num_layers, num_heads, count))
            else:
                seq_lens[:, :, index] = pages.lengths
                count = -(-int(pages.lengths.max()) // bs)
                table = pages.page_tables(count)
            slots.append(global_head_slots(row.block_row, local, num_heads, bs))
            tables.append(global_head_pages(row.block_row, table, num_heads))
        width = max(table.shape[2] for table in tables)
        block_tables = np.zeros((num_layers, num_heads, num_rows, width), np.int64)
        for index, table in enumerate(tables):
            block_tables[:, :, index, : table.shape[2]] = table
        query_start = np.array([row.first_token for row, _ in self.rows] + [self.rows[-1][0].first_token
                                                                           + self.rows[-1][0].num_new])
        num_tokens = int(query_start[-1])
        pseudo_start = (np.arange(num_heads)[:, None] * num_tokens + query_start[None, :-1]).reshape(-1)
        page_slots = torch.from_numpy(np.ascontiguousarray(np.concatenate(slots, axis=1)))
        return StepPlan(
            slot_mapping=page_slots[0, :, 0],
            seq_lens=torch.from_numpy(seq_lens.max(axis=(0, 1)).astype(np.int32)),
            hidden_rows=self.hidden_rows,
            votes=self.votes,
            page_slot_mapping=page_slots,
            page_attention=PageAttention(
                query_start_loc=torch.from_numpy(np.append(pseudo_start, num_heads * num_tokens).astype(np.int32)),
                seq_lens=torch.from_numpy(seq_lens.reshape(num_layers, -1).astype(np.int32)),
                block_tables=torch.from_numpy(block_tables.reshape(num_layers, num_heads * num_rows, width)
                                              .astype(np.int32)),
                num_tokens=num_tokens,
                max_seq_lens=seq_lens.reshape(num_layers, -1).max(axis=1).tolist(),
            ),
        )


# A policy's `granularity` names the planner (and so the map) its requests use.
PLANNERS: dict[str, type[RowPlanner]] = {"token": TokenPlanner, "block": BlockPlanner, "head": HeadPlanner,
                                         "headpage": HeadPagePlanner}


def evict_for(state: RequestKVState, num_incoming: int) -> Moves:
    """Apply the step rule before `num_incoming` tokens arrive; compacts the survivors."""
    config, slots = state.config, state.slots
    if not config.evicts_before(slots.num_valid, num_incoming):
        return NO_MOVES
    return slots.compact(state.policy.survivors(slots.logical, config.budget - 1, config))


def _concat_moves(moves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not moves:
        return None
    return (torch.from_numpy(np.concatenate([m[0] for m in moves])),
            torch.from_numpy(np.concatenate([m[1] for m in moves])))
