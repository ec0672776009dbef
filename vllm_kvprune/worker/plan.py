"""One step of the batch in physical terms: what the metadata builder plans once and every
layer's attention impl carries out (see `worker/planners.py` for how it is planned)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_kvprune.worker.state import RequestKVState


class PlanningError(RuntimeError):
    """A step the worker cannot map onto physical slots: a broken contract with the
    scheduler or the runner, never silently run as if no policy were on."""


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
    # Head-page policies: the rows whose prompt statistics each layer gathers, the prompts
    # each layer votes on after its attention, and (when a row is paged) every layer's
    # head-slots [layers, T, heads] and pseudo-request attention (one sequence per row and
    # KV head).
    hidden_rows: list[HiddenRows] = field(default_factory=list)
    votes: list[Vote] = field(default_factory=list)
    page_slot_mapping: torch.Tensor | None = None
    page_attention: PageAttention | None = None

    def to_device(self, device: torch.device | str) -> StepPlan:
        """What every layer reads of the plan, copied to `device` once per step (a GPU's: not
        once per layer): slots, moves and the queries whose mass is kept. What the host reads
        (prompt slots for a choice, sink anchors, lengths) stays there. In place."""
        def moved(tensor):
            return None if tensor is None else tensor.to(device, non_blocking=True)

        def moved_pair(tensors):
            return None if tensors is None else (moved(tensors[0]), moved(tensors[1]))

        self.layer_slot_mapping = moved(self.layer_slot_mapping)
        self.head_slot_mapping = moved(self.head_slot_mapping)
        self.head_moves, self.pre_moves, self.post_moves = (moved_pair(self.head_moves), moved_pair(self.pre_moves),
                                                            moved_pair(self.post_moves))
        self.page_slot_mapping = moved(self.page_slot_mapping)
        pages = self.page_attention
        if pages is not None:
            self.page_attention = dataclasses.replace(
                pages, query_start_loc=moved(pages.query_start_loc), seq_lens=moved(pages.seq_lens),
                block_tables=moved(pages.block_tables))
        queries = self.mass_queries
        if queries is not None:
            self.mass_queries = dataclasses.replace(queries, tokens=moved(queries.tokens), rows=moved(queries.rows),
                                                    key_counts=moved(queries.key_counts))
        return self


@dataclass
class HiddenRows:
    """Prompt tokens `[start, stop)` of the batch whose query-projection input a request keeps
    statistics of."""

    state: RequestKVState
    start: int
    stop: int


@dataclass
class Vote:
    """A request whose prompt ends this step: each layer votes after its attention."""

    state: RequestKVState
    last_token: int  # the last prompt token's index in the batch (its query sets the budgets)
    block_row: np.ndarray
    num_prompt: int


@dataclass
class PageAttention:
    """Attention over head-pages: row r's KV head h is pseudo-request `h * R + r`, whose
    queries are rows `h * T + query_start_loc[r] ..` of the queries permuted to `[H, T, G, D]`."""

    query_start_loc: torch.Tensor  # [H * R + 1] int32
    seq_lens: torch.Tensor  # [layers, H * R] int32
    block_tables: torch.Tensor  # [layers, H * R, width] int32, pool head-page ids
    num_tokens: int
    max_seq_lens: list[int] = field(default_factory=list)  # per layer, read on the host
    schedules: list = field(default_factory=list)  # per layer, vLLM's scheduler metadata


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
