"""The worker's half of "scheduler reserves, worker maps": per-request slot maps and the
plan of one step (which physical slot each new token takes, what moves before and after
attention), derived from token counts only so the scheduler needs no channel to us.

Step rule shared with `vllm_kvprune.reference` (budget B, prune interval R): before a
step of q new tokens, if `cached + q > B + R - 1` and `cached > B - 1`, evict down to
`B - 1` cached tokens. Decode steps are q = 1; a full prefill is one step evaluated at its
end (as if the next token arrived, so the survivors are compacted while the prompt's
blocks are still ours); a streaming prefill applies the rule at each `prefill_chunk`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies import Policy, get_policy
from vllm_kvprune.worker.block_map import LayerBlockMap
from vllm_kvprune.worker.head_map import SKIP, HeadSlotMap
from vllm_kvprune.worker.slot_map import NO_MOVES, Moves, SlotMap

DEBUG = os.environ.get("VLLM_KVPRUNE_DEBUG", "0") == "1"


@dataclass
class RequestKVState:
    """What the worker remembers about one request between steps."""

    config: KVPolicyConfig
    policy: Policy
    slots: SlotMap = field(default_factory=SlotMap)
    # layer name -> original post-RoPE (K, V) of the sink tokens, for re-anchoring.
    sink_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The position shift the sink slots hold now (positions: cache).
    sink_shift: int = 0
    # Block policies: each layer's block order (replaces `slots`, which stays empty).
    blocks: LayerBlockMap | None = None
    # Head-wise policies: each layer's and KV head's slot map (replaces `slots` too).
    heads: HeadSlotMap | None = None


@dataclass
class SinkAnchor:
    """Rewrite a request's sink keys rotated forward by `shift` positions."""

    state: RequestKVState
    sink_positions: np.ndarray
    sink_slots: torch.Tensor
    shift: int


@dataclass
class StepPlan:
    """One step of the batch in physical terms; built once, executed by every layer."""

    slot_mapping: torch.Tensor  # [T] physical slot of each new token
    seq_lens: torch.Tensor  # [num_reqs] physical keys each row attends to
    pre_moves: tuple[torch.Tensor, torch.Tensor] | None = None  # before new tokens are written
    post_moves: tuple[torch.Tensor, torch.Tensor] | None = None  # after attention (prefill end)
    sink_captures: list[tuple[RequestKVState, torch.Tensor]] = field(default_factory=list)
    sink_anchors: list[SinkAnchor] = field(default_factory=list)
    # Block policies: per-layer slots [layers, T], each row's block order where a layer's
    # differs from the table's, and prompts each layer prunes after its attention.
    layer_slot_mapping: torch.Tensor | None = None
    block_orders: list[tuple[int, np.ndarray]] = field(default_factory=list)
    prefill_compactions: list[PrefillCompaction] = field(default_factory=list)
    # Head-wise policies: slots per layer, token and KV head [layers, T, heads], the moves
    # before they are written ([layers, M, heads] sources and destinations, SKIP-padded),
    # and whose attention mass each layer accumulates after its attention.
    head_slot_mapping: torch.Tensor | None = None
    head_moves: tuple[torch.Tensor, torch.Tensor] | None = None
    mass_queries: MassQueries | None = None


@dataclass
class MassQueries:
    """The queries whose attention mass is kept this step, one entry per query token."""

    tokens: torch.Tensor  # [N] token index in the batch
    rows: torch.Tensor  # [N] block-table row
    key_counts: torch.Tensor  # [N] physical keys it attends to (causal inside a prompt chunk)
    decode_only: bool  # every token is its row's single decode token, in batch order


@dataclass
class PrefillCompaction:
    """Prune one request's prompt to `keep` tokens, each layer by its own scores."""

    state: RequestKVState
    prompt_slots: torch.Tensor  # [P] global slot of each prompt position
    keep: int


class LayerScores:
    """Per-slot token scores of every layer, `[layers, num_blocks * block_size]`, indexed by
    global slot like the cache itself, so a block's mean is one reshaped slice."""

    def __init__(self, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.block_size = block_size
        self.total_kv_heads = total_kv_heads
        self.by_slot = torch.zeros(len(layer_names), num_blocks * block_size, dtype=torch.float32)

    @property
    def num_layers(self) -> int:
        return self.by_slot.shape[0]

    def block_means(self, block_ids: np.ndarray) -> torch.Tensor:
        """Mean token score (over this and every other tensor-parallel rank's heads) of
        each layer's blocks `[layers, n]`; every rank gets the same numbers, so every rank
        drops the same blocks."""
        per_block = self.by_slot.view(self.num_layers, -1, self.block_size)
        layers = torch.arange(self.num_layers)[:, None]
        sums = per_block[layers, torch.from_numpy(block_ids)].sum(dim=-1)
        return _sum_over_ranks(sums) / (self.block_size * self.total_kv_heads)

    def token_means(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return _sum_over_ranks(self.by_slot[layer, slots]) / self.total_kv_heads


class HeadMass:
    """Accumulated attention mass of every layer and local KV head, `[layers, heads,
    num_blocks * block_size]`, indexed by global slot like the cache. Each head is decided on
    by the rank that holds it, so no rank needs another's mass."""

    def __init__(self, layer_names: list[str], num_blocks: int, block_size: int, num_heads: int) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.by_slot = torch.zeros(len(layer_names), num_heads, num_blocks * block_size, dtype=torch.float32)

    @property
    def num_layers(self) -> int:
        return self.by_slot.shape[0]

    @property
    def num_heads(self) -> int:
        return self.by_slot.shape[1]

    def move(self, layer: int, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Mass follows tokens moved per head (`[M, heads]` global slots, SKIP ignored)."""
        heads = torch.arange(self.num_heads).expand_as(destinations)
        moved = destinations != SKIP
        layer_mass = self.by_slot[layer]
        layer_mass[heads[moved], destinations[moved]] = layer_mass[heads[moved], sources[moved]]

    def reset(self, layer: int, slots: torch.Tensor) -> None:
        """New tokens start with no mass (`[T, heads]` global slots)."""
        self.by_slot[layer][torch.arange(self.num_heads).expand_as(slots), slots] = 0.0


def _sum_over_ranks(local_sums: torch.Tensor) -> torch.Tensor:
    """Add up what each tensor-parallel rank scored over its own KV heads."""
    from vllm_kvprune import vllm_hooks

    return vllm_hooks.tp_all_reduce(local_sums)


@dataclass
class StepRows:
    """The runner's view of the rows of this step (set just before metadata is built)."""

    req_ids: list[str]
    num_computed: np.ndarray
    num_prompt: np.ndarray
    block_rows: np.ndarray
    extra_args: list[dict | None]


class WorkerKVState:
    """All bounded requests of one worker, keyed by request id (rows get reordered)."""

    def __init__(self, engine_config: KVPolicyConfig) -> None:
        self.engine_config = engine_config
        self.requests: dict[str, RequestKVState] = {}
        self.rows: StepRows | None = None
        self.policy = get_policy(engine_config.name) if engine_config.active else None
        # Scored policies, once the cache exists: LayerScores (block) or HeadMass (head).
        self.scores: LayerScores | HeadMass | None = None
        # Wall time spent planning steps and keeping scores (H2O's attention mass), for the
        # benchmarks.
        self.plan_seconds = 0.0
        self.score_seconds = 0.0
        # > 0 while the runner runs a profiling or warm-up batch (no requests: not planned).
        self.dummy_runs = 0
        # Layer name -> rotate(keys, shifts) with that layer's own RoPE (`positions: cache`).
        self.sink_rotations: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}

    def bind_cache(self, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                   local_kv_heads: int | None = None) -> None:
        """Called once the KV cache is allocated; scored policies keep scores per slot
        (`local_kv_heads`: this rank's share of the heads, all of them by default)."""
        granularity = self.policy.granularity if self.policy is not None else None
        if granularity == "block":
            self.scores = LayerScores(layer_names, num_blocks, block_size, total_kv_heads)
        elif granularity == "head":
            self.scores = HeadMass(layer_names, num_blocks, block_size, local_kv_heads or total_kv_heads)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def held_bytes(self) -> int:
        """Bytes of per-request state (slot maps, sink keys): it follows each request's cap,
        not its longest sequence (the score tables are sized by the pool, once)."""
        total = 0
        for state in self.requests.values():
            total += state.slots.logical.nbytes
            total += state.heads.nbytes if state.heads is not None else 0
            total += state.blocks.nbytes if state.blocks is not None else 0
            total += sum(k.nbytes + v.nbytes for k, v in state.sink_kv.values())
        return total

    def _state_for(self, request_id: str, num_computed: int, extra_args: dict | None) -> RequestKVState:
        state = self.requests.get(request_id)
        if state is None or num_computed == 0:
            # New, or resumed after preemption: it re-prefills from scratch.
            config = self.engine_config.for_request(extra_args)
            state = RequestKVState(config=config, policy=get_policy(config.name))
            if state.policy.granularity == "block":
                state.blocks = LayerBlockMap(self.scores.num_layers, self.scores.block_size)
            elif state.policy.granularity == "head":
                state.heads = HeadSlotMap(self.scores.num_layers, self.scores.num_heads)
            self.requests[request_id] = state
        return state

    def plan(self, query_start_loc: np.ndarray, block_size: int) -> StepPlan | None:
        """The physical plan of the step whose rows were published by the runner."""
        rows = self.rows
        if not self.engine_config.active:
            return None
        num_reqs = len(query_start_loc) - 1
        if rows is None or len(rows.req_ids) != num_reqs:
            # An active policy never runs a step unplanned: the kernel would read and write
            # logical slots of blocks the request no longer holds.
            raise PlanningError(
                f"kvprune: a step of {num_reqs} rows is being built, but the runner published "
                f"{'no rows' if rows is None else f'{len(rows.req_ids)} requests'} for it")
        started = time.perf_counter()
        builder = _PlanBuilder(block_size, self.scores)
        for row in range(num_reqs):
            state = self._state_for(rows.req_ids[row], int(rows.num_computed[row]), rows.extra_args[row])
            builder.add_row(
                state,
                first_token=int(query_start_loc[row]),
                num_computed=int(rows.num_computed[row]),
                num_new=int(query_start_loc[row + 1] - query_start_loc[row]),
                num_prompt=int(rows.num_prompt[row]),
                block_row=rows.block_rows[row],
            )
        plan = builder.finish()
        self.plan_seconds += time.perf_counter() - started
        return plan


class _PlanBuilder:
    """Accumulates the rows of one step into a `StepPlan`."""

    def __init__(self, block_size: int, scores: LayerScores | HeadMass | None = None) -> None:
        self.block_size = block_size
        self.scores = scores
        self.layer_slots: list[np.ndarray] = []
        self.block_orders: list[tuple[int, np.ndarray]] = []
        self.prefill_compactions: list[PrefillCompaction] = []
        self.slot_mapping: list[np.ndarray] = []
        self.seq_lens: list[int] = []
        self.pre_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.post_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.sink_captures: list[tuple[RequestKVState, torch.Tensor]] = []
        self.sink_anchors: list[SinkAnchor] = []
        self.head_slots: list[np.ndarray] = []
        self.head_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.mass_queries: list[np.ndarray] = []  # [q, 3]: token, row, key count
        self.decode_only = True

    def _global(self, block_row: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return block_row[slots // self.block_size].astype(np.int64) * self.block_size + slots % self.block_size

    def _add_moves(self, target: list, block_row: np.ndarray, moves: Moves) -> None:
        if len(moves[0]):
            target.append((self._global(block_row, moves[0]), self._global(block_row, moves[1])))

    def add_row(self, state: RequestKVState, first_token: int, num_computed: int, num_new: int,
                num_prompt: int, block_row: np.ndarray) -> None:
        if state.blocks is not None:
            self._add_block_row(state, num_computed, num_new, num_prompt, block_row)
            return
        if state.heads is not None:
            self._add_head_row(state, first_token, num_computed, num_new, num_prompt, block_row)
            return
        config, slots = state.config, state.slots
        positions = np.arange(num_computed, num_computed + num_new, dtype=np.int64)
        pre = post = NO_MOVES
        if num_computed < num_prompt:
            chunk = config.prefill_chunk
            if config.prefill == "streaming" and num_computed % chunk == 0:
                pre = evict_for(state, min(chunk, num_prompt - num_computed))
            kept_before_new = slots.num_valid
            new_slots = slots.append(positions)
            if config.prefill == "full" and num_computed + num_new == num_prompt:
                post = evict_for(state, 1)
        else:
            _require_one_token(num_new)
            if config.evicts_before(slots.num_valid, 1):
                kept_before_new = config.budget - 1
                victims = state.policy.victims(slots.logical, slots.num_valid + 1 - config.budget, config)
                new_slot, pre = slots.replace(victims, num_computed)
                new_slots = np.array([new_slot], np.int64)
            else:
                kept_before_new = slots.num_valid
                new_slots = slots.append(positions)
        if DEBUG:
            slots.check()
        self._add_moves(self.pre_moves, block_row, pre)
        self._add_moves(self.post_moves, block_row, post)
        self.slot_mapping.append(self._global(block_row, new_slots))
        self.seq_lens.append(kept_before_new + num_new)
        self._plan_sinks(state, first_token, num_computed, num_new, kept_before_new, block_row)

    def _add_block_row(self, state: RequestKVState, num_computed: int, num_new: int, num_prompt: int,
                       block_row: np.ndarray) -> None:
        """A block policy's row: the prompt is written in table order and pruned per layer
        at its end; past it, when every block is full, each layer evicts its own worst
        R blocks and the first of them takes the new token as the tail (EQUIP, by block)."""
        config, blocks = state.config, state.blocks
        positions = np.arange(num_computed, num_computed + num_new, dtype=np.int64)
        if num_computed >= num_prompt and blocks.tail_full and not blocks.free.shape[1] \
                and blocks.order.shape[1] >= config.cap_blocks(self.block_size):
            means = self.scores.block_means(block_row[blocks.order])
            victims = state.policy.victim_blocks(means, config.prune_interval, config, self.block_size)
            blocks.evict(victims.numpy())
        local = blocks.append(positions)
        self.layer_slots.append(self._global(block_row, local))
        self.seq_lens.append(blocks.num_valid)
        if num_computed + num_new == num_prompt and blocks.num_valid > config.budget:
            self.prefill_compactions.append(PrefillCompaction(
                state, torch.from_numpy(self._global(block_row, np.arange(blocks.num_valid))), config.budget))
            blocks.compact(config.budget)
        if not blocks.is_identity():
            self.block_orders.append((len(self.seq_lens) - 1, blocks.order))
        if DEBUG:
            blocks.check()

    def _add_head_row(self, state: RequestKVState, first_token: int, num_computed: int, num_new: int,
                      num_prompt: int, block_row: np.ndarray) -> None:
        """A head-wise policy's row: the prompt is written in table order, its mass kept as it
        is attended to, and pruned per layer and head at its end; past it, once the cache is
        full, every head evicts its own lowest-mass tokens and the new token takes one of
        their slots in that head (EQUIP, per head)."""
        config, heads = state.config, state.heads
        num_layers, num_heads = heads.num_layers, heads.num_heads
        kept_before_new = heads.num_valid
        if num_computed >= num_prompt:
            _require_one_token(num_new)
        if num_computed >= num_prompt and config.evicts_before(heads.num_valid, 1):
            local = self._replace_per_head(state, num_computed, block_row)
            kept_before_new = config.budget - 1
        else:
            positions = np.arange(num_computed, num_computed + num_new)
            local = np.broadcast_to(heads.append(positions)[None, :, None], (num_layers, num_new, num_heads))
        self._add_mass_queries(first_token, num_new, len(self.seq_lens), kept_before_new)
        if num_computed < num_prompt:
            self.decode_only = False
            if num_computed + num_new == num_prompt and config.evicts_before(heads.num_valid, 1):
                self.prefill_compactions.append(PrefillCompaction(
                    state, torch.from_numpy(self._global(block_row, np.arange(heads.num_valid))), config.budget - 1))
                heads.truncate(config.budget - 1)
        self.head_slots.append(self._global(block_row, local))
        self.seq_lens.append(kept_before_new + num_new)
        if DEBUG and (heads.is_identity or not (heads.logical == SKIP).any()):  # a pruned prompt: next step
            heads.check()

    def _replace_per_head(self, state: RequestKVState, num_computed: int, block_row: np.ndarray) -> np.ndarray:
        """Every head evicts its lowest-mass tokens; returns the new token's local slot per
        layer and head `[layers, 1, heads]` and records the lazy-pruning moves."""
        config, heads = state.config, state.heads
        slots = torch.from_numpy(self._global(block_row, np.arange(heads.num_valid)))
        victims = state.policy.evicted(self.scores.by_slot, slots, torch.from_numpy(heads.logical),
                                       heads.num_valid + 1 - config.budget, num_computed, config)
        new_slots, sources, destinations = heads.replace(victims.numpy(), num_computed)
        if sources.shape[1]:
            self.head_moves.append((self._global_or_skip(block_row, sources),
                                    self._global_or_skip(block_row, destinations)))
        return new_slots[:, None, :]

    def _add_mass_queries(self, first_token: int, num_new: int, row: int, kept_before_new: int) -> None:
        offsets = np.arange(num_new, dtype=np.int64)
        self.mass_queries.append(np.stack([first_token + offsets, np.full(num_new, row),
                                           kept_before_new + 1 + offsets], axis=1))

    def _global_or_skip(self, block_row: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return np.where(slots == SKIP, SKIP, self._global(block_row, np.maximum(slots, 0)))

    def _plan_sinks(self, state: RequestKVState, first_token: int, num_computed: int, num_new: int,
                    kept_before_new: int, block_row: np.ndarray) -> None:
        config = state.config
        if config.positions != "cache" or config.sinks == 0:
            return
        if num_computed < config.sinks:
            count = min(config.sinks, num_computed + num_new) - num_computed
            self.sink_captures.append((state, torch.arange(first_token, first_token + count)))
        shift = num_computed - kept_before_new  # tokens evicted so far
        if shift != state.sink_shift:
            sink_slots = np.flatnonzero(state.slots.logical < config.sinks)
            self.sink_anchors.append(SinkAnchor(
                state, state.slots.logical[sink_slots],
                torch.from_numpy(self._global(block_row, sink_slots)), shift,
            ))
            state.sink_shift = shift

    def finish(self) -> StepPlan:
        if self.layer_slots:
            return self._finish_block_plan()
        if self.head_slots:
            return self._finish_head_plan()
        return StepPlan(
            slot_mapping=torch.from_numpy(np.concatenate(self.slot_mapping)),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            pre_moves=_concat_moves(self.pre_moves),
            post_moves=_concat_moves(self.post_moves),
            sink_captures=self.sink_captures,
            sink_anchors=self.sink_anchors,
        )

    def _finish_block_plan(self) -> StepPlan:
        layer_slots = torch.from_numpy(np.concatenate(self.layer_slots, axis=1))
        return StepPlan(
            slot_mapping=layer_slots[0],
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            layer_slot_mapping=layer_slots,
            block_orders=self.block_orders,
            prefill_compactions=self.prefill_compactions,
        )


    def _finish_head_plan(self) -> StepPlan:
        head_slots = torch.from_numpy(np.ascontiguousarray(np.concatenate(self.head_slots, axis=1)))
        moves = None
        if self.head_moves:
            moves = tuple(torch.from_numpy(np.ascontiguousarray(np.concatenate(part, axis=1)))
                          for part in zip(*self.head_moves))
        queries = torch.from_numpy(np.concatenate(self.mass_queries)).T.contiguous()
        return StepPlan(
            slot_mapping=head_slots[0, :, 0],
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            head_slot_mapping=head_slots,
            head_moves=moves,
            prefill_compactions=self.prefill_compactions,
            mass_queries=MassQueries(tokens=queries[0], rows=queries[1], key_counts=queries[2],
                                     decode_only=self.decode_only),
        )


class PlanningError(RuntimeError):
    """A step the worker cannot map onto physical slots: a broken contract with the
    scheduler or the runner, never silently run as if no policy were on."""


def _require_one_token(num_new: int) -> None:
    if num_new != 1:
        raise PlanningError(f"kvprune: a bounded request runs one token per step past its prompt, got {num_new} "
                            "(the scheduler's step rule, KVPruneScheduler._reserve_prefill_lookahead)")


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
