"""What every cache layout shares: a step's rows, the planner base, the plan base, and the one
call through which a plan's executor reaches a layer's attention.

A layout (`tokens`, `heads`, `blocks`, `head_pages`, `full`; `policies/base.LAYOUTS`) is one
module beside this one: its plan type (what one step does, in physical slots), the planner
that builds it from the step's rows and the requests' maps, and the plan's executor methods
(`write` before attention, `attend`, `after_attention`), side by side. The attention impl
calls the plan's methods; it never asks which layout it holds.

Step rule shared with `vllm_kvprune.reference` (budget B, prune interval R): before a step
of q new tokens, if `cached + q > B + R - 1` and `cached > B - 1`, evict down to `B - 1`
cached tokens. Decode steps are q = 1; a full prefill is one step evaluated at its end (as if
the next token arrived, so the survivors are compacted while the prompt's blocks are still
ours); a streaming prefill applies the rule at each `prefill_chunk`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_kvprune import vllm_hooks
from vllm_kvprune.worker import faults
from vllm_kvprune.worker.head_map import SKIP

if TYPE_CHECKING:
    from vllm_kvprune.worker.state import RequestKVState, WorkerKVState


class PlanningError(RuntimeError):
    """A step the worker cannot map onto physical slots: a broken contract with the
    scheduler or the runner, never silently run as if no policy were on."""


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


@dataclass
class PrefillCompaction:
    """Prune one request's prompt to `keep` tokens, each layer by its own scores, once the
    layer has attended to all of it; `query_tokens` are the prompt's tokens of this step in
    the batch (its last chunk's), for a policy that scores with their queries."""

    state: RequestKVState
    prompt_slots: torch.Tensor  # [P] global slot of each prompt position
    keep: int
    query_tokens: range = range(0)


class LayerCall:
    """One layer's attention call under a plan: what a layout's executor needs of the impl
    (vLLM's own cache write and attention, the platform's kernels, the layer's shape) and of
    the worker (its tables, FDC's narrow heads), and the one place where the policy's work is
    timed (`moving`, `scoring`) and a request's failure contained (`per_request`).

    Under FDC (`narrow`) the layer's cache holds each token's reduced heads packed in a row:
    `store`, `copy` and `attend` go through FDC's projections and kernel instead of vLLM's."""

    def __init__(self, impl: Any, layer: Any, kv_cache: torch.Tensor, worker: WorkerKVState,
                 forward_args: tuple = (), forward_kwargs: dict | None = None) -> None:
        self.impl, self.layer, self.kv_cache, self.worker = impl, layer, kv_cache, worker
        self.kernels = impl.kernels
        self.narrow = worker.fdc if worker.fdc is not None and kv_cache.numel() else None
        self._forward_args, self._forward_kwargs = forward_args, forward_kwargs or {}

    # ---- where this layer sits ---------------------------------------------------------------
    @property
    def index(self) -> int:
        """The layer's row in the policy's per-layer tables and plan tensors."""
        return self.worker.tables.layer_index[self.layer.layer_name]

    @property
    def block_size(self) -> int:
        """Tokens per block of the layer cache `[num_blocks, H, block_size, 2 * head_size]`."""
        return self.kv_cache.shape[2]

    @property
    def tables(self) -> Any:
        """The policy's per-slot tables (its layout's `make_tables`)."""
        return self.worker.tables

    # ---- the cache ---------------------------------------------------------------------------
    def store(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens' K/V `[T, H, D]` into `slots` (vLLM's own write, or FDC's reduced one,
        which skips slot -1); returns what the cache now holds of them (FDC: the reduced K/V)."""
        if self.narrow is not None:
            num_tokens = len(slots)
            return self.narrow.write(vllm_hooks.layer_index(self.layer.layer_name), key[:num_tokens],
                                     value[:num_tokens], self.kv_cache, slots, self.block_size,
                                     writer=self.kernels.write_narrow)
        self.impl.vllm_cache_update(self.layer, key, value, self.kv_cache, slots)
        return key, value

    def copy(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Whole tokens from `sources` to `destinations` (staged: sources read first), at full
        width (`[n]` or per head `[n, H]`, SKIP ignored) or FDC's narrow one."""
        if len(sources) == 0:
            return
        with self.moving():
            if self.narrow is not None:
                self.narrow.copy(vllm_hooks.layer_index(self.layer.layer_name), self.kv_cache, sources, destinations,
                                 self.block_size)
            else:
                self.kernels.copy_slots(self.layer, self.kv_cache, sources, destinations)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any,
               output: torch.Tensor) -> torch.Tensor:
        """The step's attention over the physical cache: vLLM's kernel, or FDC's reduced one."""
        if self.narrow is not None:
            num_tokens = metadata.num_actual_tokens
            attended = self.narrow.attend(vllm_hooks.layer_index(self.layer.layer_name), query[:num_tokens],
                                          self.kv_cache, metadata.block_table, metadata.query_start_loc,
                                          metadata.seq_lens, self.impl.scale, self.block_size,
                                          attention=self.kernels.reduced_attention)
            output[:num_tokens].view(num_tokens, self.impl.num_heads, self.impl.head_size).copy_(attended)
            return output
        return self.impl.vllm_forward(self.layer, query, key, value, self.kv_cache, metadata, output,
                                      *self._forward_args, **self._forward_kwargs)

    # ---- timing and containment ---------------------------------------------------------------
    def moving(self) -> contextlib.AbstractContextManager:
        """Time spent moving K/V between slots (the metrics' `phase="move"`)."""
        return self._timed("move_seconds")

    def scoring(self) -> contextlib.AbstractContextManager:
        """Time spent scoring (attention mass, votes, a prompt's choice: `phase="score"`)."""
        return self._timed("score_seconds")

    @contextlib.contextmanager
    def _timed(self, total: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self.worker, total, getattr(self.worker, total) + time.perf_counter() - started)

    def per_request(self, items: list, work: Callable[[Any], None], phase: str = "score") -> None:
        """`work(item)` for each item (anything with a `.state`) of a request that has not
        failed, in containment: a failure fails that request alone and the others go on (so
        `work` appends what the step applies last: a failed request's half-done part is never
        applied)."""
        for item in faults.live(items):
            with faults.contained(item.state, phase):
                faults.inject(phase, item.state.request_id)
                work(item)


class RowPlanner:
    """Accumulates one step's rows whose requests hold one kind of map; `finish` returns the
    layout's plan. One subclass per layout, in its module."""

    def __init__(self, block_size: int, tables: Any = None) -> None:
        self.block_size = block_size
        self.tables = tables  # the policy's per-slot tables (`make_tables`) or None
        self.seq_lens: list[int] = []
        self._checkpointed: tuple[int, tuple[str, ...]] | None = None  # (attribute count, names)

    @classmethod
    def make_tables(cls, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                    local_kv_heads: int, device: torch.device | str, reduce: Any) -> Any:
        """The per-slot tables this layout's policies keep beside the cache (None: none);
        `reduce` sums a tensor over tensor-parallel ranks."""
        return None

    @classmethod
    def new_map(cls, tables: Any) -> Any:
        """The map a new (or restarted) request of this layout holds."""
        raise NotImplementedError

    @classmethod
    def live_row(cls, request_map: Any, block_row: np.ndarray) -> np.ndarray:
        """The request's block-table row as its map numbers blocks (vLLM's row, unless the
        layout gives blocks back in the middle of it)."""
        return block_row

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


@dataclass
class StepPlan:
    """One step of the batch in physical terms; built once, executed by every layer.

    The base is vLLM's own step: every token where vLLM's slot mapping puts it, attended by
    the layer's kernel (FDC's narrow one under FDC). A layout's plan overrides what it does
    differently. `worker` is the worker whose maps and tables the plan was made from."""

    slot_mapping: torch.Tensor  # [T] physical slot of each new token
    seq_lens: torch.Tensor  # [num_reqs] physical keys each row attends to
    worker: WorkerKVState | None = None

    def to_device(self, device: torch.device | str) -> StepPlan:
        """What every layer reads of the plan, copied to `device` once per step (a GPU's: not
        once per layer); what the host reads stays there. In place."""
        return self

    def group_slot_mapping(self, table_index: int) -> torch.Tensor:
        """The new tokens' slots in the block table at `table_index` among the policy's
        KV-cache groups (one group per layer: layer `table_index`'s own)."""
        return self.slot_mapping

    def prepare(self, builder: Any, metadata: Any) -> None:
        """After each of the policy's groups' builders made the step's metadata (once, or once
        per layer with a group per layer): what the layout's attention needs beside it
        (per-layer block tables, the platform's schedules)."""

    def write(self, call: LayerCall, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's new tokens into the layer's cache (before attention)."""
        call.store(key, value, slot_mapping)

    def attend(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any,
               output: torch.Tensor) -> torch.Tensor:
        return call.attend(query, key, value, metadata, output)

    def after_attention(self, call: LayerCall, query: torch.Tensor, metadata: Any) -> None:
        """Once every query of the step has attended in this layer (scores, moves)."""


def moved(tensor: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """A host tensor of the plan on `device`, without a sync (None stays None)."""
    return None if tensor is None else tensor.to(device, non_blocking=True)


def concat_moves(moves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not moves:
        return None
    return (torch.from_numpy(np.concatenate([m[0] for m in moves])),
            torch.from_numpy(np.concatenate([m[1] for m in moves])))
