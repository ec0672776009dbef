"""The `head_pages` layout (`gvote`; `snapkv` with `allocation: pyramid / adaptive`): a
`HeadPageMap` per request, each layer and KV head its own tokens and its own count, packed into
head-pages (the layer cache viewed as `[num_blocks * H, 1, block_size, 2D]`, one KV head of one
block per page).

The prompt is written in vLLM's layout and attended by vLLM's kernel (for a vote, while a
pre-hook on each layer's QKV projection gathers the statistics of its input: `worker/voting.py`);
after each layer's attention on the prompt's last chunk that layer decides each head's kept
tokens (`policy.prompt_keep_mask`: gvote's vote through `LayerVoter.vote`, or a scorer's
budgets) and packs them into the layer's first head-pages. A
step with a voted request writes per (token, head) into head-pages and attends each
(request, KV head) as its own sequence with vLLM's kernel (queries permuted to `[H, T, G,
D]`; one schedule per layer, built with the step's metadata by the platform's builder). The
runner attaches each voted request's block need to the step output (`WorkerKVState.
footprints`); the scheduler frees the surplus at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_kvprune.worker.head_page_map import HeadPageMap, global_head_pages, global_head_slots
from vllm_kvprune.worker.layouts.base import LayerCall, PlanningError, Row, RowPlanner, StepPlan, moved
from vllm_kvprune.worker.layouts.heads import MassQueries, softcap

if TYPE_CHECKING:
    from vllm_kvprune.worker.state import RequestKVState


class PagedLayers:
    """The layers a head-page policy keeps per-head caches for (no score table: the vote
    reads the cache once), and what each layer's vote needs from the model."""

    def __init__(self, layer_names: list[str], block_size: int, num_heads: int) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.layer_names = layer_names
        self.block_size = block_size
        self.num_heads = num_heads
        # layer name -> the model's query projection and RoPE for synthetic queries (runner).
        self.voters: dict = {}
        self.dtype = torch.float32  # the model's
        self.gathering = True  # off while a vote runs the projection on synthetic states
        # The KV-cache group of each layer's blocks: its own (one group per layer, the engine's
        # way, set by the runner) or all 0 (one table for every layer).
        self.group_of_layer = np.zeros(len(layer_names), np.int64)
        self.prompt_mass: torch.Tensor | None = None  # see `mass_of_layer`

    def mass_of_layer(self, layer: int, kv_cache: torch.Tensor) -> torch.Tensor:
        """The attention mass each prompt token got so far, per local KV head and global slot of
        layer `layer`, `[H, num_blocks * block_size]` (fp32, beside the cache; for a scorer that
        `keeps_attention_mass`). With a KV-cache group per layer every block is one layer's at a
        time, so one table serves every layer; with one table for all layers each has its own."""
        if self.prompt_mass is None:
            num_blocks, num_heads, block_size = kv_cache.shape[:3]
            tables = 1 if len(np.unique(self.group_of_layer)) == self.num_layers else self.num_layers
            self.prompt_mass = torch.zeros(tables, num_heads, num_blocks * block_size, dtype=torch.float32,
                                           device=kv_cache.device)
        return self.prompt_mass[layer if self.prompt_mass.shape[0] > 1 else 0]

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


@dataclass
class HiddenRows:
    """Prompt tokens `[start, stop)` of the batch whose query-projection input a request keeps
    statistics of."""

    state: RequestKVState
    start: int
    stop: int


@dataclass
class Vote:
    """A request whose prompt ends this step: each layer decides its kept tokens after its
    attention (`policy.prompt_keep_mask`: gvote's vote, a scorer's budgets)."""

    state: RequestKVState
    first_token: int  # the request's first prompt token of this step, its index in the batch
    last_token: int  # the last prompt token's index in the batch
    block_rows: np.ndarray  # [L, width] each layer's row
    num_prompt: int


@dataclass
class LayerPrompt:
    """What a head-page policy reads to decide one layer's kept prompt tokens: the layer (of
    `num_layers`), the prompt's queries of this step (post-RoPE `[q, Hq, D]`, its last chunk),
    its keys `[H, P, D]`, the layer's scale and soft-cap, for a vote (`gathers_hidden_states`)
    the layer's query path (`voter`) and the request's map with the prompt's statistics, and
    for a scorer that `keeps_attention_mass` the mass every prompt query gave each token."""

    layer: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    scale: float
    softcap: float
    voter: Any
    pages: HeadPageMap
    scores: torch.Tensor | None = None  # [H, P]: the prompt's attention mass (`keeps_attention_mass`)


@dataclass
class PageAttention:
    """Attention over head-pages: row r's KV head h is pseudo-request `h * R + r`, whose
    queries are rows `h * T + query_start_loc[r] ..` of the queries permuted to `[H, T, G, D]`."""

    query_start_loc: torch.Tensor  # [H * R + 1] int32
    seq_lens: torch.Tensor  # [layers, H * R] int32
    block_tables: torch.Tensor  # [layers, H * R, width] int32, pool head-page ids
    num_tokens: int
    max_seq_lens: list[int] = field(default_factory=list)  # per layer, read on the host
    schedules: list = field(default_factory=list)  # per layer, the platform's kernel schedule


@dataclass
class HeadPagePlan(StepPlan):
    """The rows whose prompt statistics each layer gathers, the prompts each layer votes on
    after its attention, and (when a row is paged) every layer's head-slots `[layers, T,
    heads]` and pseudo-request attention (one sequence per row and KV head)."""

    hidden_rows: list[HiddenRows] = field(default_factory=list)
    votes: list[Vote] = field(default_factory=list)
    layer_slot_mapping: torch.Tensor | None = None  # [L, T] each layer's slots (uniform steps)
    page_slot_mapping: torch.Tensor | None = None
    page_attention: PageAttention | None = None
    # Prompt tokens whose attention mass is kept (a scorer that `keeps_attention_mass`): their
    # queries and, per layer, their own slots `[L, N]` (vLLM's layout), whose mass starts at 0.
    mass_queries: MassQueries | None = None
    mass_slots: torch.Tensor | None = None

    def group_slot_mapping(self, table_index: int) -> torch.Tensor:
        return self.layer_slot_mapping[table_index]

    def to_device(self, device: torch.device | str) -> HeadPagePlan:
        self.layer_slot_mapping = moved(self.layer_slot_mapping, device)
        self.page_slot_mapping = moved(self.page_slot_mapping, device)
        self.mass_slots = moved(self.mass_slots, device)
        if self.mass_queries is not None:
            self.mass_queries = self.mass_queries.to(device)
        pages = self.page_attention
        if pages is not None:
            self.page_attention = dataclasses.replace(
                pages, query_start_loc=moved(pages.query_start_loc, device), seq_lens=moved(pages.seq_lens, device),
                block_tables=moved(pages.block_tables, device))
        return self

    def prepare(self, builder: Any, metadata: Any) -> None:
        # Once a step: with one group per layer every group's builder comes here.
        if self.page_attention is not None and not self.page_attention.schedules:
            builder.schedule_pages(self.page_attention)

    def write(self, call: LayerCall, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Uniform steps: vLLM's own write. Paged: each new token's K/V of every head into that
        head's own page. A prompt token's mass starts at 0."""
        if self.mass_slots is not None:
            mass = call.tables.mass_of_layer(call.index, call.kv_cache)
            mass[:, self.mass_slots[call.index]] = 0.0
        if self.page_slot_mapping is None:
            call.store(key, value, slot_mapping)
            return
        slots = self.page_slot_mapping[call.index]  # [T, H]
        num_tokens, num_heads = slots.shape
        call.kernels.write_slots(call.layer, key[:num_tokens].reshape(num_tokens * num_heads, 1, -1),
                                 value[:num_tokens].reshape(num_tokens * num_heads, 1, -1),
                                 head_page_view(call.kv_cache), slots.reshape(-1))

    def attend(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any,
               output: torch.Tensor) -> torch.Tensor:
        """Uniform steps: vLLM's attention. Paged: every row's KV head as its own sequence over
        head-pages, queries permuted to `[H, T, G, D]` so each sequence's are contiguous."""
        if self.page_attention is None:
            if self.fused(call):  # the prompt's mass pass writes the output too
                num_tokens, impl = len(self.mass_queries.tokens), call.impl
                self._accumulate_prompt_mass(call, query, metadata,
                                             output[:num_tokens].view(num_tokens, impl.num_heads, impl.head_size))
                return output
            return call.attend(query, key, value, metadata, output)
        pages, layer, impl = self.page_attention, call.index, call.impl
        num_tokens, num_kv_heads = pages.num_tokens, impl.num_kv_heads
        group = impl.num_heads // num_kv_heads
        grouped = query[:num_tokens].reshape(num_tokens, num_kv_heads, group, impl.head_size)
        sequences = grouped.transpose(0, 1).contiguous().view(num_kv_heads * num_tokens, group, impl.head_size)
        attended = torch.empty_like(sequences)
        page_metadata = impl.page_metadata(metadata, pages, layer)
        impl.vllm_forward(call.layer, sequences, None, None, head_page_view(call.kv_cache), page_metadata, attended)
        output[:num_tokens].view(num_tokens, num_kv_heads, group, impl.head_size).copy_(
            attended.view(num_kv_heads, num_tokens, group, impl.head_size).transpose(0, 1))
        return output

    def fused(self, call: LayerCall) -> bool:
        """A step of prompt chunks only whose output comes from the mass pass (`MassQueries.give_output`)."""
        return self.mass_queries is not None and self.mass_queries.give_output(call.kernels)

    def after_attention(self, call: LayerCall, query: torch.Tensor, metadata: Any) -> None:
        if self.mass_queries is not None and not self.fused(call):
            self._accumulate_prompt_mass(call, query, metadata)
        if self.votes:
            self._vote(call, query)

    def _accumulate_prompt_mass(self, call: LayerCall, query: torch.Tensor, metadata: Any,
                                output: torch.Tensor | None = None) -> None:
        """Add the prompt queries' attention probabilities of this step to each prompt token's
        mass, per KV head (the mass kernel `h2o` keeps on its `heads` layout, over vLLM's block
        table: a prompt is still in vLLM's layout until it is decided on); with `output`, the
        same pass writes the attention output (`fused`)."""
        with call.scoring():
            queries = self.mass_queries
            call.kernels.attention_mass(call.layer, queries.of(query), call.kv_cache, metadata.block_table,
                                        queries.rows, queries.key_counts, call.impl.scale,
                                        call.tables.mass_of_layer(call.index, call.kv_cache), output,
                                        softcap(call.impl))

    def _vote(self, call: LayerCall, query: torch.Tensor) -> None:
        """After a prompt's last chunk has attended: this layer's vote, and each head's kept
        tokens packed into the layer's first head-pages (sources are read before any write)."""
        layer, impl = call.index, call.impl
        voter = call.tables.voters.get(call.layer.layer_name)
        block_size, num_heads = call.kv_cache.shape[2], call.kv_cache.shape[1]
        sources, destinations = [], []

        def cast(vote: Vote) -> None:
            state, pages = vote.state, vote.state.map
            prompt, block_row = np.arange(vote.num_prompt), vote.block_rows[layer]
            prompt_slots = block_row[prompt // block_size].astype(np.int64) * block_size + prompt % block_size
            keys, _ = call.kernels.read_slots(call.layer, call.kv_cache, torch.from_numpy(prompt_slots))
            queries = query[vote.first_token: vote.last_token + 1].reshape(vote.last_token + 1 - vote.first_token,
                                                                           impl.num_heads, -1)
            scores = None
            if state.policy.keeps_attention_mass:
                scores = call.tables.mass_of_layer(layer, call.kv_cache)[:, torch.from_numpy(prompt_slots)]
            keep = state.policy.prompt_keep_mask(
                LayerPrompt(layer, call.tables.num_layers, queries, keys.transpose(0, 1), impl.scale, softcap(impl),
                            voter, pages, scores), state.config)
            moved_from, moved_to = pages.apply_layer_vote(layer, keep)
            sources.append(global_head_slots(block_row, moved_from, num_heads, block_size))
            destinations.append(global_head_slots(block_row, moved_to, num_heads, block_size))
            if pages.is_paged:
                pages.hidden_sum = pages.hidden_sumsq = pages.hidden_count = None  # the prompt is done

        with call.scoring():
            call.per_request(self.votes, cast)
        if sources:
            with call.moving():
                call.kernels.copy_slots(call.layer, head_page_view(call.kv_cache),
                                        torch.from_numpy(np.concatenate(sources)),
                                        torch.from_numpy(np.concatenate(destinations)))


class HeadPagePlanner(RowPlanner):
    """Plans the rows of requests holding a `HeadPageMap`; the policy decides the vote
    (`worker/voting.LayerVoter` asks it for the budgets and the votes)."""

    def __init__(self, block_size: int, tables: Any = None) -> None:
        super().__init__(block_size, tables)
        self.rows: list[tuple[Row, np.ndarray]] = []  # (row, local head-slots [L, q, H] or uniform [q])
        self.hidden_rows: list[HiddenRows] = []
        self.votes: list[Vote] = []
        self.any_paged = False
        self.mass_queries: list[np.ndarray] = []  # [q, 3]: token, row, key count
        self.mass_slots: list[np.ndarray] = []  # [L, q]

    @classmethod
    def make_tables(cls, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                    local_kv_heads: int, device: torch.device | str, reduce: Any) -> PagedLayers:
        return PagedLayers(layer_names, block_size, local_kv_heads)

    @classmethod
    def new_map(cls, tables: PagedLayers) -> HeadPageMap:
        return HeadPageMap(tables.num_layers, tables.num_heads, tables.block_size, tables.group_of_layer)

    @classmethod
    def live_row(cls, request_map: HeadPageMap, block_row: np.ndarray) -> np.ndarray:
        """Each layer's row `[L, width]`, without the blocks the vote gave back
        (`HeadPageMap.live_row`): a row's `block_row` here is per layer."""
        return request_map.live_row(block_row)

    def add(self, row: Row) -> None:
        pages = row.state.map
        if row.decoding():
            if not pages.is_paged:
                raise PlanningError("kvprune: a head-page request decodes before its prompt was decided on")
            needed = pages.layer_blocks(1)  # [L]
            width = row.block_row.shape[1]
            if needed.max() > width or (row.block_row[np.arange(width) < needed[:, None]] == 0).any():
                layer = int(np.argmax(needed - (row.block_row != 0).sum(axis=1)))
                raise PlanningError(f"kvprune: a request needs {needed[layer]} blocks for its kept tokens in layer "
                                    f"{layer}, the scheduler gave it {int((row.block_row[layer] != 0).sum())}")
            self.any_paged = True
            self.rows.append((row, pages.append_decode(row.num_computed)[:, None, :]))
            self.seq_lens.append(0)  # per layer and head: see finish
            return
        tokens = pages.append_uniform(row.num_new)
        if row.state.policy.keeps_attention_mass:  # causal: token p attends to positions 0..p
            self.mass_queries.append(np.stack([row.first_token + np.arange(row.num_new),
                                               np.full(row.num_new, len(self.seq_lens)), tokens + 1], axis=1))
            bs = self.block_size
            self.mass_slots.append(row.block_row[:, tokens // bs].astype(np.int64) * bs + tokens % bs)
        if row.state.policy.gathers_hidden_states:
            self.hidden_rows.append(HiddenRows(row.state, row.first_token, row.first_token + row.num_new))
        if row.ends_prompt:
            pages.row_seen = np.count_nonzero(row.block_row, axis=1)  # a row is real ids, then 0-padding
            self.votes.append(Vote(row.state, row.first_token, row.first_token + row.num_new - 1, row.block_row,
                                   row.num_prompt))
        self.rows.append((row, tokens))
        self.seq_lens.append(pages.num_uniform)

    def finish(self) -> HeadPagePlan:
        if not self.any_paged:
            # Every row is uniform: vLLM's own slots (each layer's in its own row) and attention.
            bs = self.block_size
            slots = torch.from_numpy(np.concatenate(
                [row.block_row[:, tokens // bs].astype(np.int64) * bs + tokens % bs for row, tokens in self.rows], axis=1))
            plan = HeadPagePlan(slot_mapping=slots[0], seq_lens=self._seq_lens(), hidden_rows=self.hidden_rows,
                                votes=self.votes, layer_slot_mapping=slots)
        else:
            plan = self._finish_paged()
        if self.mass_queries:
            # With every row uniform (prompt chunks only) the queries may be the whole step.
            step_tokens = None if self.any_paged else sum(len(tokens) for _, tokens in self.rows)
            plan.mass_queries = MassQueries.of_rows(self.mass_queries, decode_only=False, step_tokens=step_tokens)
            plan.mass_slots = torch.from_numpy(np.ascontiguousarray(np.concatenate(self.mass_slots, axis=1)))
        return plan

    def _finish_paged(self) -> HeadPagePlan:
        first = self.rows[0][0].state.map
        num_layers, num_heads, bs = first.num_layers, first.num_heads, self.block_size
        num_rows = len(self.rows)
        slots, seq_lens, tables = [], np.zeros((num_layers, num_heads, num_rows), np.int64), []
        for index, (row, local) in enumerate(self.rows):
            pages = row.state.map
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
        return HeadPagePlan(
            slot_mapping=page_slots[0, :, 0],
            layer_slot_mapping=page_slots[:, :, 0],  # not written through (see `write`): a real slot of each row
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


def head_page_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The layer cache as one KV head per page, `[num_blocks * H, 1, block_size, 2D]`."""
    num_blocks, num_heads, block_size, packed = kv_cache.shape
    return kv_cache.view(num_blocks * num_heads, 1, block_size, packed)
