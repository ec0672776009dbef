"""The `heads` layout (`h2o`, `snapkv`): a `HeadSlotMap` per request, each layer and KV head its
own tokens, all heads the same count, so one `seq_lens` and vLLM's block table serve every
head and vLLM's kernel reads the cache unchanged; only the writes differ per head.

The prompt is written in table order and pruned per layer and head once that layer has
attended to all of it (`policy.prefill_survivors`); past it, once the cache is full, every
head evicts its own lowest-scored tokens (`policy.evicted`: lowest value in the per-slot
table, outside the protected sinks and recent window, ties to the oldest) and the new
token's K/V takes one of their slots in that head (EQUIP, per head).

The per-slot table (`HeadMass`) is the policy's score of every cached token per layer and
KV head. A policy that keeps attention mass (`h2o`: `keeps_attention_mass`) adds each step's
softmax probabilities to it, in one kernel pass per layer that holds a block of queries'
logits at a time; the same pass also writes the attention output and vLLM's attention is
skipped, on decode-only steps and, where the platform's kernel set says so
(`fused_prefill_mass`: the CPU's), on steps with prompt chunks too (`KVPRUNE_FUSED_MASS=0`
keeps vLLM's attention and adds the mass pass, for comparing the two). Another scorer writes
the table once, when it prunes the prompt (`snapkv`). With `KVPRUNE_SHIFT_APPEND=1`
(benchmarks only) every head gathers its survivors to the front and appends instead, as H2O's
own cache does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

from vllm_kvprune import envs
from vllm_kvprune.kernels.victims import VictimSearch
from vllm_kvprune.worker.head_map import SKIP, HeadSlotMap
from vllm_kvprune.worker.layouts.base import LayerCall, PrefillCompaction, Row, RowPlanner, StepPlan, moved
from vllm_kvprune.worker.layouts.tokens import SHIFT_APPEND

FUSED_MASS = envs.get("FUSED_MASS", "1") == "1"


class HeadMass:
    """The policy's score of every cached token, per layer and local KV head, `[layers, heads,
    num_blocks * block_size]`, indexed by global slot like the cache (h2o: accumulated
    attention mass). Each head is decided by the rank that holds it, so no rank needs
    another's scores."""

    def __init__(self, layer_names: list[str], num_blocks: int, block_size: int, num_heads: int,
                 device: torch.device | str = "cpu") -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        # Beside the cache (its device): the attention kernel adds to it in every layer.
        self.by_slot = torch.zeros(len(layer_names), num_heads, num_blocks * block_size, dtype=torch.float32,
                                   device=device)

    @property
    def num_layers(self) -> int:
        return self.by_slot.shape[0]

    @property
    def num_heads(self) -> int:
        return self.by_slot.shape[1]

    def move(self, layer: int, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Scores follow tokens moved per head (`[M, heads]` global slots, SKIP ignored)."""
        heads = torch.arange(self.num_heads, device=destinations.device).expand_as(destinations)
        moved_here = destinations != SKIP
        layer_mass = self.by_slot[layer]
        layer_mass[heads[moved_here], destinations[moved_here]] = layer_mass[heads[moved_here], sources[moved_here]]

    def reset(self, layer: int, slots: torch.Tensor) -> None:
        """New tokens start with no score (`[T, heads]` global slots)."""
        self.by_slot[layer][torch.arange(self.num_heads, device=slots.device).expand_as(slots), slots] = 0.0


@dataclass
class MassQueries:
    """The queries whose attention mass is kept this step, one entry per query token."""

    tokens: torch.Tensor  # [N] token index in the batch
    rows: torch.Tensor  # [N] block-table row
    key_counts: torch.Tensor  # [N] physical keys it attends to (causal inside a prompt chunk)
    decode_only: bool  # every token is its row's single decode token, in batch order
    whole_step: bool = False  # the step's every token, in batch order (tokens = 0 .. N-1)

    @classmethod
    def of_rows(cls, parts: list[np.ndarray], decode_only: bool, step_tokens: int | None = None) -> MassQueries:
        """From a planner's parts, each `[q, 3]`: token, row, key count; `step_tokens`: the
        step's token count, if known (to tell whether the queries are the whole step)."""
        queries = np.concatenate(parts)
        whole = step_tokens is not None and len(queries) == step_tokens and bool(
            (queries[:, 0] == np.arange(step_tokens)).all())
        queries = torch.from_numpy(queries).T.contiguous()
        return cls(tokens=queries[0], rows=queries[1], key_counts=queries[2], decode_only=decode_only,
                   whole_step=whole or decode_only)

    def to(self, device: torch.device | str) -> MassQueries:
        return replace(self, tokens=moved(self.tokens, device), rows=moved(self.rows, device),
                       key_counts=moved(self.key_counts, device))

    def of(self, query: torch.Tensor) -> torch.Tensor:
        """These queries' rows of the step's `query` (a view where they are the whole step)."""
        return query[: len(self.tokens)] if self.whole_step else query[self.tokens]

    def give_output(self, kernels: Any) -> bool:
        """Whether the mass pass also writes the step's attention output (and the platform's
        attention is skipped): every token of the step keeps mass, and the step decodes only
        or the platform's kernel set fuses prompt chunks too (`KVPRUNE_FUSED_MASS=0`: never)."""
        return FUSED_MASS and self.whole_step and (self.decode_only or kernels.fused_prefill_mass)


@dataclass
class PromptView:
    """What a head-wise policy may read of a prompt it prunes in one layer: the queries of the
    prompt's tokens of this step (its last chunk, post-RoPE `[q, Hq, D]`), its cached keys
    (`read_keys()`: `[P, H, D]`, read only if asked), and the layer's scale and soft-cap."""

    queries: torch.Tensor
    read_keys: Callable[[], torch.Tensor]
    scale: float
    softcap: float


@dataclass
class HeadPlan(StepPlan):
    """Slots per layer, token and KV head `[layers, T, heads]`, the lazy-pruning moves before
    they are written (`[layers, M, heads]` sources and destinations, SKIP-padded), the prompts
    each layer prunes after its attention, and the queries whose mass is kept."""

    head_slot_mapping: torch.Tensor | None = None
    head_moves: tuple[torch.Tensor, torch.Tensor] | None = None
    prefill_compactions: list[PrefillCompaction] = field(default_factory=list)
    mass_queries: MassQueries | None = None

    def to_device(self, device: torch.device | str) -> HeadPlan:
        self.head_slot_mapping = moved(self.head_slot_mapping, device)
        self.head_moves = None if self.head_moves is None else tuple(moved(part, device) for part in self.head_moves)
        if self.mass_queries is not None:
            self.mass_queries = self.mass_queries.to(device)
        return self

    def fused(self, call: LayerCall) -> bool:
        """Whether this step's attention output comes from the mass pass (`MassQueries.give_output`)."""
        return self.mass_queries is not None and self.mass_queries.give_output(call.kernels)

    def write(self, call: LayerCall, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Lazy-pruning moves first, then each new token's K/V of every head into that head's
        own slot (a victim's, in place), starting with no score."""
        scores, layer = call.tables, call.index
        if self.head_moves is not None:
            with call.moving():
                sources, destinations = self.head_moves[0][layer], self.head_moves[1][layer]
                call.kernels.copy_slots(call.layer, call.kv_cache, sources, destinations)
                scores.move(layer, sources, destinations)
        slots = self.head_slot_mapping[layer]
        num_tokens = len(slots)
        call.kernels.write_slots(call.layer, key[:num_tokens], value[:num_tokens], call.kv_cache, slots)
        scores.reset(layer, slots)

    def attend(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any,
               output: torch.Tensor) -> torch.Tensor:
        if self.fused(call):
            num_tokens, impl = len(self.mass_queries.tokens), call.impl
            self._accumulate_mass(call, query, metadata,
                                  output[:num_tokens].view(num_tokens, impl.num_heads, impl.head_size))
            return output
        return call.attend(query, key, value, metadata, output)

    def after_attention(self, call: LayerCall, query: torch.Tensor, metadata: Any) -> None:
        if self.mass_queries is not None and not self.fused(call):
            self._accumulate_mass(call, query, metadata)
        if self.prefill_compactions:
            self._prune_prompts(call, query)

    def _accumulate_mass(self, call: LayerCall, query: torch.Tensor, metadata: Any,
                         output: torch.Tensor | None = None) -> None:
        """Add this step's attention probabilities to each kept token's mass, per KV head, in
        one kernel pass that holds a block of queries' logits at a time; with `output`, the same
        pass computes the attention output too (`fused`: no second pass over the keys)."""
        with call.scoring():
            queries = self.mass_queries
            call.kernels.attention_mass(call.layer, queries.of(query), call.kv_cache, metadata.block_table,
                                        queries.rows, queries.key_counts, call.impl.scale,
                                        call.tables.by_slot[call.index], output, softcap(call.impl))

    def _prune_prompts(self, call: LayerCall, query: torch.Tensor) -> None:
        """Each KV head of this layer keeps its own `keep` tokens of each prompt that ends this
        step, in order, in the prompt's first slots (scores follow)."""
        scores, layer = call.tables, call.index
        sources, destinations = [], []

        def prune(compaction: PrefillCompaction) -> None:
            state, slots, keep = compaction.state, compaction.prompt_slots, compaction.keep
            tokens = compaction.query_tokens
            view = PromptView(query[tokens.start:tokens.stop].reshape(len(tokens), call.impl.num_heads, -1),
                              lambda: call.kernels.read_slots(call.layer, call.kv_cache, slots)[0],
                              call.impl.scale, softcap(call.impl))
            kept = state.policy.prefill_survivors(scores.by_slot[layer], slots, keep, state.config, view)
            state.map.set_layer_survivors(layer, kept.numpy())
            source = slots[kept].T  # [keep, heads]
            destination = slots[:keep, None].expand_as(source).clone()
            destination[source == destination] = SKIP
            sources.append(source)
            destinations.append(destination)

        with call.scoring():
            call.per_request(self.prefill_compactions, prune)
        if not sources:
            return
        with call.moving():
            sources, destinations = torch.cat(sources), torch.cat(destinations)
            call.kernels.copy_slots(call.layer, call.kv_cache, sources, destinations)
            scores.move(layer, sources, destinations)


class HeadPlanner(RowPlanner):
    """Plans the rows of requests holding a `HeadSlotMap`; the policy
    (`policies/base.HeadScorerPolicy`) decides `evicted` (a decode eviction, per head),
    `evicted_many` (the same for a step's rows at once), `prompt_keep` and
    `prefill_survivors` (a prompt's pruning, per layer and head), and says what it
    `protected` and whether it `keeps_attention_mass`."""

    gather_and_append = SHIFT_APPEND

    def __init__(self, block_size: int, tables: Any = None) -> None:
        super().__init__(block_size, tables)
        self.head_slots: list[np.ndarray] = []
        self.head_moves: list[tuple[np.ndarray, np.ndarray]] = []
        self.prefill_compactions: list[PrefillCompaction] = []
        self.mass_queries: list[np.ndarray] = []  # [q, 3]: token, row, key count
        self.decode_only = True
        # Victims searched for the step's evicting rows together (`search_ahead`), by request:
        # (the search's inputs, its victims); a row whose inputs differ searches again.
        self.victims_ahead: dict[str, tuple[tuple, torch.Tensor]] = {}

    @classmethod
    def make_tables(cls, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                    local_kv_heads: int, device: torch.device | str, reduce: Any) -> HeadMass:
        return HeadMass(layer_names, num_blocks, block_size, local_kv_heads, device)

    @classmethod
    def new_map(cls, tables: HeadMass) -> HeadSlotMap:
        return HeadSlotMap(tables.num_layers, tables.num_heads)

    def add(self, row: Row) -> None:
        state, config, heads = row.state, row.state.config, row.state.map
        kept_before_new = heads.num_valid
        if self._evicts_in_decode(row):
            local = self._replace_per_head(row)
            kept_before_new = config.budget - 1
        else:
            new_slots = heads.append(row.positions)
            local = np.broadcast_to(new_slots[None, :, None], (heads.num_layers, row.num_new, heads.num_heads))
        if state.policy.keeps_attention_mass:
            self._add_mass_queries(row, kept_before_new)
        if row.in_prompt:
            self.decode_only = False
            keep = state.policy.prompt_keep(config, heads.num_valid) if row.ends_prompt else None
            if keep is not None:
                prompt_slots = torch.from_numpy(self._global(row.block_row, np.arange(heads.num_valid)))
                self.prefill_compactions.append(PrefillCompaction(
                    state, prompt_slots, keep, range(row.first_token, row.first_token + row.num_new)))
                heads.truncate(keep)
        self.head_slots.append(self._global(row.block_row, local))
        self.seq_lens.append(kept_before_new + row.num_new)

    def search_ahead(self, rows: list[Row]) -> None:
        """The victims of every row that evicts in decode this step, in one search (on a
        GPU's table: one pass there and one copy back, not one per request)."""
        evicting = [row for row in rows if self._evicts_in_decode(row)]
        if not evicting:
            return
        policy = evicting[0].state.policy
        evicting = [row for row in evicting if row.state.policy is policy]
        found = policy.evicted_many(self.tables.by_slot, [self._victim_search(row) for row in evicting])
        for row, victims in zip(evicting, found):
            self.victims_ahead[row.state.request_id] = (self._search_key(row), victims)

    @staticmethod
    def _evicts_in_decode(row: Row) -> bool:
        """Whether this decode row evicts before its token is written (the one test `add` and
        `search_ahead` share, so the search ahead covers exactly the rows that use it)."""
        return row.decoding() and row.state.config.evicts_before(row.state.map.num_valid, 1)

    def _victim_search(self, row: Row) -> VictimSearch:
        config, heads = row.state.config, row.state.map
        sinks, recent = row.state.policy.protected(config)
        return VictimSearch(torch.from_numpy(self._global(row.block_row, np.arange(heads.num_valid))), heads.logical,
                            heads.num_valid + 1 - config.budget, row.num_computed, sinks, recent)

    @staticmethod
    def _search_key(row: Row) -> tuple:
        """What a row's search depends on besides the scores: its map (a restarted request has
        a new one), how much it holds, where it is, its blocks and settings."""
        heads = row.state.map
        return (id(heads), heads.num_valid, row.num_computed, row.block_row.tobytes(), row.state.config)

    def _replace_per_head(self, row: Row) -> np.ndarray:
        """Every head evicts its lowest-scored tokens; returns the new token's local slot per
        layer and head `[layers, 1, heads]` and records the lazy-pruning moves."""
        state, config, heads = row.state, row.state.config, row.state.map
        ahead = self.victims_ahead.get(state.request_id)
        if ahead is not None and ahead[0] == self._search_key(row):
            victims = ahead[1]
        else:
            search = self._victim_search(row)
            victims = state.policy.evicted(self.tables.by_slot, search.slots, torch.from_numpy(search.logical),
                                           search.count, search.next_position, config)
        replace_tokens = heads.gather_replace if self.gather_and_append else heads.replace
        new_slots, sources, destinations = replace_tokens(victims.numpy(), row.num_computed)
        if sources.shape[1]:
            self.head_moves.append((self._global_or_skip(row.block_row, sources),
                                    self._global_or_skip(row.block_row, destinations)))
        return new_slots[:, None, :]

    def _add_mass_queries(self, row: Row, kept_before_new: int) -> None:
        offsets = np.arange(row.num_new, dtype=np.int64)
        self.mass_queries.append(np.stack([row.first_token + offsets, np.full(row.num_new, len(self.seq_lens)),
                                           kept_before_new + 1 + offsets], axis=1))

    def finish(self) -> HeadPlan:
        head_slots = torch.from_numpy(np.ascontiguousarray(np.concatenate(self.head_slots, axis=1)))
        moves = None
        if self.head_moves:
            moves = tuple(torch.from_numpy(np.ascontiguousarray(np.concatenate(part, axis=1)))
                          for part in zip(*self.head_moves))
        mass_queries = None
        if self.mass_queries:
            step_tokens = sum(slots.shape[1] for slots in self.head_slots)
            mass_queries = MassQueries.of_rows(self.mass_queries, self.decode_only, step_tokens)
        return HeadPlan(
            slot_mapping=head_slots[0, :, 0],
            seq_lens=self._seq_lens(),
            head_slot_mapping=head_slots,
            head_moves=moves,
            prefill_compactions=self.prefill_compactions,
            mass_queries=mass_queries,
        )


def softcap(impl: Any) -> float:
    """The layer's logit soft-cap (0: none); vLLM's impl stores 0 for none. A bare impl (the
    worker-level tests drive plans without vLLM) has none."""
    return float(getattr(impl, "logits_soft_cap", 0) or 0)
