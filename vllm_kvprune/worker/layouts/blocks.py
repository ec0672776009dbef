"""The `blocks` layout (`paged_eviction`): a `LayerBlockMap` per request, each layer its own
order of the request's blocks.

The prompt is written in table order and pruned per layer right after that layer's attention
on its last chunk (its scores are complete then); past it, when every block is full, each
layer evicts its own worst R blocks and the first of them takes the new token as the tail
(EQUIP, by block). All blocks but the tail are full in every layer, so the valid slots are a
prefix of each layer's table and one `seq_lens` serves all layers; the plan carries per-layer
slots and the block orders of the rows that differ, turned into per-layer block tables once
a step (`prepare`). Token scores are written beside each token, `[layers, num_blocks *
block_size]` by global slot, so a block's mean is a slice; scores are summed over
tensor-parallel ranks before any choice, so every rank evicts the same blocks. Under FDC the
same plan runs on the narrow cache, scoring the reduced K/V it stores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from vllm_kvprune.worker.block_map import LayerBlockMap
from vllm_kvprune.worker.layouts.base import LayerCall, PrefillCompaction, Row, RowPlanner, StepPlan, moved


class LayerScores:
    """Per-slot token scores of every layer, `[layers, num_blocks * block_size]`, indexed by
    global slot like the cache itself, so a block's mean is one reshaped slice. `reduce` adds a
    tensor up over tensor-parallel ranks (each rank scores its own KV heads)."""

    def __init__(self, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                 device: torch.device | str = "cpu", reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
                 ) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.block_size = block_size
        self.total_kv_heads = total_kv_heads
        self.reduce = reduce
        # Beside the cache (its device): scores are written with the tokens, in every layer.
        self.by_slot = torch.zeros(len(layer_names), num_blocks * block_size, dtype=torch.float32, device=device)

    @property
    def num_layers(self) -> int:
        return self.by_slot.shape[0]

    def block_means(self, block_ids: np.ndarray) -> torch.Tensor:
        """Mean token score (over this and every other tensor-parallel rank's heads) of
        each layer's blocks `[layers, n]`; every rank gets the same numbers, so every rank
        drops the same blocks."""
        return self.block_means_many([block_ids])[0]

    def block_means_many(self, block_ids: list[np.ndarray]) -> list[torch.Tensor]:
        """`block_means` of several requests' blocks at once: one gather where the table is,
        one sum over ranks and one copy to the host for the lot (on a GPU, one sync a step
        instead of one per evicting request)."""
        per_block = self.by_slot.view(self.num_layers, -1, self.block_size)
        layers = torch.arange(self.num_layers, device=per_block.device)[:, None]
        together = torch.from_numpy(np.concatenate(block_ids, axis=1)).to(per_block.device, non_blocking=True)
        sums = per_block[layers, together].sum(dim=-1)
        means = (self.reduce(sums) / (self.block_size * self.total_kv_heads)).cpu()
        return list(torch.split(means, [ids.shape[1] for ids in block_ids], dim=1))

    def token_means(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Mean token score of `slots` in `layer`, on the host (where choices are made)."""
        return (self.reduce(self.by_slot[layer, slots]) / self.total_kv_heads).cpu()


@dataclass
class BlockPlan(StepPlan):
    """Per-layer slots `[layers, T]`, each row's block order where a layer's differs from the
    table's, and the prompts each layer prunes after its attention."""

    layer_slot_mapping: torch.Tensor | None = None
    block_orders: list[tuple[int, np.ndarray]] = field(default_factory=list)
    prefill_compactions: list[PrefillCompaction] = field(default_factory=list)
    layer_tables: torch.Tensor | None = None  # [layers, rows, cols], made by `prepare`

    def to_device(self, device: torch.device | str) -> BlockPlan:
        self.layer_slot_mapping = moved(self.layer_slot_mapping, device)
        return self

    def prepare(self, builder: Any, metadata: Any) -> None:
        """`[layers, rows, cols]`: each layer's block table, rows reordered where its blocks are.

        Only the columns the kernel reads this step are built (the blocks below the longest
        physical `seq_len`, and every block a reordered row names: at most a prompt's or a
        cap's), not vLLM's `max_model_len` width."""
        self.layer_tables = layer_block_tables(metadata.block_table, self, self.worker.tables)

    def write(self, call: LayerCall, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """This layer's own slots, and each new token's score beside it (under FDC, the score
        of what the narrow cache holds)."""
        scores, layer, policy = call.tables, call.index, self.worker.policy
        slots = self.layer_slot_mapping[layer]
        num_tokens = len(slots)
        key, value = key[:num_tokens], value[:num_tokens]
        if call.narrow is not None:
            stored_keys, stored_values = call.store(key, value, slots)
            scores.by_slot[layer, slots] = policy.token_scores(stored_keys, stored_values)
            return
        call.kernels.store_token_scores(call.layer, key, value, scores.by_slot[layer], slots, policy)
        call.store(key, value, slots)

    def attend(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any,
               output: torch.Tensor) -> torch.Tensor:
        if self.layer_tables is not None:
            metadata = dataclasses.replace(metadata, block_table=self.layer_tables[call.index])
        return call.attend(query, key, value, metadata, output)

    def after_attention(self, call: LayerCall, query: torch.Tensor, metadata: Any) -> None:
        """After a prompt's last chunk has attended to all of it: keep each prompt's best
        tokens of this layer, in order, in its first slots (scores move with them)."""
        if not self.prefill_compactions:
            return
        scores, layer = call.tables, call.index
        sources, destinations = [], []

        def prune(compaction: PrefillCompaction) -> None:
            state, slots = compaction.state, compaction.prompt_slots
            token_means = scores.token_means(layer, slots)
            kept = state.policy.prefill_survivors(token_means, compaction.keep, state.config, call.block_size)
            state.map.set_layer_survivors(layer, kept.numpy())
            sources.append(slots[kept])
            destinations.append(slots[: compaction.keep])

        with call.scoring():
            call.per_request(self.prefill_compactions, prune)
        if not sources:
            return
        sources, destinations = torch.cat(sources), torch.cat(destinations)
        moving = sources != destinations
        sources, destinations = sources[moving], destinations[moving]
        call.copy(sources, destinations)
        scores.by_slot[layer, destinations] = scores.by_slot[layer, sources]


def layer_block_tables(block_table: torch.Tensor, plan: BlockPlan, scores: LayerScores) -> torch.Tensor | None:
    """Each layer's block table for the step (None: every layer reads the table as it is)."""
    if not plan.block_orders:
        return None
    num_layers, block_size = scores.num_layers, scores.block_size
    width = max(-(-int(plan.seq_lens.max()) // block_size), *(int(order.max()) + 1 for _, order in plan.block_orders))
    block_table = block_table[:, : min(width, block_table.shape[1])]
    columns = torch.arange(block_table.shape[1]).expand(num_layers, block_table.shape[0], -1).clone()
    for row, order in plan.block_orders:
        columns[:, row, : order.shape[1]] = torch.from_numpy(order)
    return block_table.expand(num_layers, -1, -1).gather(2, columns.to(block_table.device, non_blocking=True))


class BlockPlanner(RowPlanner):
    """Plans the rows of requests holding a `LayerBlockMap`; the policy decides
    `victim_blocks` (each layer's blocks to evict) and `prefill_survivors` (a prompt's best
    tokens per layer)."""

    def __init__(self, block_size: int, tables: Any = None) -> None:
        super().__init__(block_size, tables)
        self.layer_slots: list[np.ndarray] = []
        self.block_orders: list[tuple[int, np.ndarray]] = []
        self.prefill_compactions: list[PrefillCompaction] = []
        # Block means read for the step's evicting rows together (`search_ahead`), by request:
        # (the blocks read, their means); a row whose blocks differ reads its own.
        self.means_ahead: dict[str, tuple[bytes, torch.Tensor]] = {}

    @classmethod
    def make_tables(cls, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                    local_kv_heads: int, device: torch.device | str, reduce: Any) -> LayerScores:
        return LayerScores(layer_names, num_blocks, block_size, total_kv_heads, device, reduce)

    @classmethod
    def new_map(cls, tables: LayerScores) -> LayerBlockMap:
        return LayerBlockMap(tables.num_layers, tables.block_size)

    def search_ahead(self, rows: list[Row]) -> None:
        """The block means of every row that evicts in decode this step, read in one go (on a
        GPU's table: one gather and one copy back, not one per request)."""
        evicting = [row for row in rows if self._evicts_in_decode(row)]
        if not evicting:
            return
        block_ids = [row.block_row[row.state.map.order] for row in evicting]
        for row, ids, means in zip(evicting, block_ids, self.tables.block_means_many(block_ids)):
            self.means_ahead[row.state.request_id] = (ids.tobytes(), means)

    def _evicts_in_decode(self, row: Row) -> bool:
        """Whether this decode row evicts blocks before its token is written (the one test
        `add` and `search_ahead` share)."""
        config, blocks = row.state.config, row.state.map
        return row.decoding() and blocks.tail_full and not blocks.free.shape[1] \
            and blocks.order.shape[1] >= config.cap_blocks(self.block_size)

    def _block_means(self, row: Row) -> torch.Tensor:
        block_ids = row.block_row[row.state.map.order]
        ahead = self.means_ahead.get(row.state.request_id)
        if ahead is not None and ahead[0] == block_ids.tobytes():
            return ahead[1]
        return self.tables.block_means(block_ids)

    def add(self, row: Row) -> None:
        state, config, blocks = row.state, row.state.config, row.state.map
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

    def finish(self) -> BlockPlan:
        layer_slots = torch.from_numpy(np.concatenate(self.layer_slots, axis=1))
        return BlockPlan(
            slot_mapping=layer_slots[0],
            seq_lens=self._seq_lens(),
            layer_slot_mapping=layer_slots,
            block_orders=self.block_orders,
            prefill_compactions=self.prefill_compactions,
        )
