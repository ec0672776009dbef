"""The worker's half of "scheduler reserves, worker maps": what the worker remembers per
request (the one map of its policy's layout) and per layer (the policy's per-slot tables),
and the plan of each step, derived from token counts only so the scheduler needs no channel
to us. How each layout plans a row and carries out its plan: `worker/layouts/`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.engine import checks
from vllm_kvprune.policies import Policy
from vllm_kvprune.worker import faults
from vllm_kvprune.worker.layouts import PLANNERS, PlanningError, Row, RowPlanner, StepPlan

logger = logging.getLogger("vllm_kvprune")

__all__ = ["PlanningError", "RequestKVState", "StepPlan", "StepRows", "WorkerKVState"]


@dataclass
class RequestKVState:
    """What the worker remembers about one request between steps: its settings, its policy,
    the map of its policy's layout (None for a layout without maps) and, once the policy
    failed for it, why (`worker/faults.py`)."""

    config: KVPolicyConfig
    policy: Policy
    request_id: str = ""
    map: Any = None
    failure: str | None = None

    def kept_tokens(self) -> tuple[float, int]:
        """Tokens the cache holds for this request: mean and max over layers and KV heads."""
        return self.map.kept_tokens()

    def kept_choices(self) -> tuple[str, list]:
        """Which positions the request keeps, sorted, as (map kind, positions): "slots" one
        list for every layer and head, "blocks" one per layer, "heads"/"pages" one per layer
        and (this rank's) KV head. The debug mode records it when a request ends (tests
        compare tensor-parallel ranks with one process)."""
        return self.map.kept_choices()


@dataclass
class StepRows:
    """The runner's view of the rows of this step (set just before metadata is built)."""

    req_ids: list[str]
    num_computed: np.ndarray
    num_prompt: np.ndarray
    block_rows: np.ndarray  # [rows, width]; or [groups, rows, width], one KV-cache group per layer
    extra_args: list[dict | None]

    def block_row(self, row: int) -> np.ndarray:
        """Row `row`'s block-table row `[width]`, or its row of every group `[groups, width]`."""
        return self.block_rows[..., row, :]


class WorkerKVState:
    """All bounded requests of one worker, keyed by request id (rows get reordered)."""

    def __init__(self, engine_config: KVPolicyConfig) -> None:
        self.engine_config = engine_config
        self.requests: dict[str, RequestKVState] = {}
        self.rows: StepRows | None = None
        self.policy = engine_config.policy if engine_config.active else None
        # Once the cache exists: the per-slot tables of the policy's layout (`make_tables`:
        # token scores, attention mass, the paged layers), or None.
        self.tables: Any = None
        # Adds a tensor up over tensor-parallel ranks (vLLM's all-reduce; one rank: itself).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor
        # Wall time spent planning steps, scoring (H2O's attention mass, GVote's vote, prompt
        # pruning's choice) and moving K/V between slots (lazy pruning, compactions, sinks),
        # for the metrics and the benchmarks.
        self.plan_seconds = 0.0
        self.score_seconds = 0.0
        self.move_seconds = 0.0
        self._reported_seconds = (0.0, 0.0, 0.0)  # plan, score, move time already reported
        self._planned: list[str] = []  # requests of the steps planned since the last report
        self._step_plan: tuple[StepRows, StepPlan] | None = None  # this step's rows and their plan
        # KVPRUNE_CHECK=1: the last planned step's (request, block row) pairs and block size,
        # checked after the step ran (a head-wise prompt's survivors are set by its layers).
        self._to_check: tuple[list, int] | None = None
        # > 0 while the runner runs a profiling or warm-up batch (no requests: not planned).
        self.dummy_runs = 0
        # KVPRUNE_CHECK=1: request id -> `RequestKVState.kept_choices()` when it ended.
        self.ended_choices: dict[str, tuple[str, list]] = {}
        # FDC's rotations and packed widths (`fdc` policy), loaded with the model.
        self.fdc = None
        # Tokens a footprint must cover beyond the next one: 1 under async scheduling, where the
        # scheduler reads a step's report after it has scheduled the step that follows.
        self.footprint_lookahead = 0
        # Layer name -> rotate(keys, shifts) with that layer's own RoPE (`positions: cache`).
        self.sink_rotations: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}

    def bind_cache(self, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                   local_kv_heads: int | None = None, device: torch.device | str = "cpu") -> None:
        """Called once the KV cache is allocated: the tables the policy's layout keeps per slot
        (`local_kv_heads`: this rank's share of the heads, all of them by default), on the
        cache's `device`."""
        planner = PLANNERS.get(self.policy.layout) if self.policy is not None else None
        if planner is not None:
            self.tables = planner.make_tables(layer_names, num_blocks, block_size, total_kv_heads,
                                              local_kv_heads or total_kv_heads, device, self.reduce)

    def drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and checks.enabled():
            # Debug mode: what the request kept when it ended (the last few hundred requests).
            self.ended_choices[request_id] = state.kept_choices()
            while len(self.ended_choices) > 512:
                self.ended_choices.pop(next(iter(self.ended_choices)))

    def held_bytes(self) -> int:
        """Bytes of per-request state (maps, sink keys, vote statistics): it follows each
        request's cap, not its longest sequence (the per-slot tables are sized by the pool, once)."""
        return sum(state.map.nbytes for state in self.requests.values() if state.map is not None)

    def _state_for(self, request_id: str, num_computed: int, extra_args: dict | None) -> RequestKVState:
        state = self.requests.get(request_id)
        if state is None or (num_computed == 0 and state.failure is None):
            # New, or resumed after preemption: it re-prefills from scratch. Its state first, with
            # the engine's settings, so that a failure below still has a state to fail (a
            # request's settings never change its policy, so neither its map).
            state = RequestKVState(config=self.engine_config, policy=self.policy, request_id=request_id,
                                   map=PLANNERS[self.policy.layout].new_map(self.tables))
            self.requests[request_id] = state
            state.config = self.engine_config.for_request(extra_args)
        return state

    def step_report(self, with_metrics: bool = True) -> dict:
        """What the scheduler needs from this step: head-page footprints, and for its metrics
        (`vllm_kvprune.metrics`) the tokens each of the step's requests keeps now (mean and max
        over layers and KV heads) and the planning, scoring and moving time since the last report."""
        if self._to_check is not None:
            planned, block_size = self._to_check
            self._to_check = None
            checks.check_planned([(request_id, self.requests[request_id], block_row) for request_id, block_row in planned
                                  if request_id in self.requests and self.requests[request_id].failure is None],
                                 block_size)
        report: dict = {"failed": {request_id: state.failure for request_id, state in self.requests.items()
                                   if state.failure is not None}}
        if with_metrics:
            report["kept"] = {request_id: self.requests[request_id].kept_tokens() for request_id in self._planned
                              if request_id in self.requests and self.requests[request_id].failure is None}
        self._planned = []
        plan, score, move = self._reported_seconds
        report["seconds"] = {"plan": self.plan_seconds - plan, "score": self.score_seconds - score,
                             "move": self.move_seconds - move}
        self._reported_seconds = (self.plan_seconds, self.score_seconds, self.move_seconds)
        if self.policy is not None and self.policy.reports_footprint:
            report["footprints"] = self.footprints()
        return report

    def footprints(self) -> dict[str, list[int]]:
        """Blocks each voted request needs for its next steps in each of the policy's KV-cache
        groups (head-page policies; one group per layer), for the scheduler: what it allocates
        before them. The scheduler reads this step's report before it schedules the next step,
        or under async scheduling the step after (one more token)."""
        extra_tokens = 1 + self.footprint_lookahead
        return {request_id: state.map.blocks_needed(extra_tokens).tolist() for request_id, state in self.requests.items()
                if state.map is not None and state.map.is_paged and state.failure is None}

    def settle_holes(self, report: dict) -> dict:
        """`report` (merged over tensor-parallel ranks, so every rank settles the same) with,
        for each request's first footprint after its vote, the positions of its block-table
        rows the vote gives back, one `(start, stop)` per group (`HeadPageMap.settle_holes`):
        the scheduler frees exactly those."""
        for request_id, footprint in (report.get("footprints") or {}).items():
            state = self.requests.get(request_id)
            if state is not None and state.map is not None and state.map.row_holes is None:
                report.setdefault("holes", {})[request_id] = state.map.settle_holes(footprint)
        return report

    def plan(self, query_start_loc: np.ndarray, block_size: int) -> StepPlan | None:
        """The physical plan of the step whose rows were published by the runner."""
        rows = self.rows
        if not self.engine_config.active:
            return None
        if self._step_plan is not None and self._step_plan[0] is rows:
            # The group's next attention group (FDC: one per layer width) gets the same plan:
            # planning changes the maps, so a step is planned exactly once.
            return self._step_plan[1]
        num_reqs = len(query_start_loc) - 1
        if rows is None or len(rows.req_ids) != num_reqs:
            # An active policy never runs a step unplanned: the kernel would read and write
            # logical slots of blocks the request no longer holds.
            raise PlanningError(
                f"kvprune: a step of {num_reqs} rows is being built, but the runner published "
                f"{'no rows' if rows is None else f'{len(rows.req_ids)} requests'} for it")
        started = time.perf_counter()
        planner_cls = PLANNERS[self.policy.layout]  # the engine's policy: every row's kind
        builder = _PlanBuilder(block_size, self.tables)
        if planner_cls.searches_ahead():  # the engine's policy: every row's kind
            builder.search_ahead(self._known_rows(rows, query_start_loc))
        live_rows = []  # each row's block-table row as its map numbers blocks
        for row in range(num_reqs):
            request_id, vllm_row = rows.req_ids[row], rows.block_row(row)
            row_args = dict(first_token=int(query_start_loc[row]), num_computed=int(rows.num_computed[row]),
                            num_new=int(query_start_loc[row + 1] - query_start_loc[row]),
                            num_prompt=int(rows.num_prompt[row]), block_row=vllm_row)
            try:
                state = self._state_for(request_id, row_args["num_computed"], rows.extra_args[row])
                row_args["block_row"] = planner_cls.live_row(state.map, row_args["block_row"])
                if state.failure is None:
                    faults.inject("plan", request_id)
                    builder.add_row(state, **row_args)
                    continue
            except Exception as error:  # noqa: BLE001 - contained: this request fails alone
                state = self.requests[request_id]  # `_state_for` stores it before anything can fail
                faults.fail(state, "plan", error)
            finally:
                live_rows.append(row_args["block_row"])
            builder.add_quarantined(state, **{**row_args, "block_row": vllm_row})
        plan = builder.finish()
        plan.worker = self
        self._planned.extend(rows.req_ids)
        if checks.enabled():  # KVPRUNE_CHECK=1: checked once the step has run (step_report)
            self._to_check = ([(request_id, live_rows[row].copy()) for row, request_id in enumerate(rows.req_ids)],
                              block_size)
        self.plan_seconds += time.perf_counter() - started
        self._step_plan = (rows, plan)
        return plan

    def _known_rows(self, rows: StepRows, query_start_loc: np.ndarray) -> list[Row]:
        """The step's rows of requests already running and not failed, as the loop in `plan`
        will add them (a new or restarted request is left out: its state is made there)."""
        known = []
        for index, request_id in enumerate(rows.req_ids):
            state = self.requests.get(request_id)
            if state is None or state.failure is not None:
                continue
            known.append(Row(state, int(query_start_loc[index]), int(rows.num_computed[index]),
                             int(query_start_loc[index + 1] - query_start_loc[index]), int(rows.num_prompt[index]),
                             rows.block_row(index)))
        return known


class _PlanBuilder:
    """Accumulates the rows of one step into a `StepPlan`, through the planner of the map
    the step's requests hold (one kind per step: the policy is the engine's)."""

    def __init__(self, block_size: int, tables: Any = None) -> None:
        self.block_size = block_size
        self.tables = tables
        self._planner: RowPlanner | None = None

    def add_row(self, state: RequestKVState, first_token: int, num_computed: int, num_new: int,
                num_prompt: int, block_row: np.ndarray) -> None:
        """Plan one row; a row that fails leaves the plan as it was (the failure is raised)."""
        planner = self._planner_for(state)
        before = planner.checkpoint()
        try:
            planner.add(Row(state, first_token, num_computed, num_new, num_prompt, block_row))
        except BaseException:
            planner.rollback(before)
            raise

    def search_ahead(self, rows: list[Row]) -> None:
        """Let the planner do what it can for all of these rows at once, before they are
        planned one by one (h2o's victim search). An optimisation only: if it fails, every
        row does its own work, and fails alone if it must."""
        if not rows:
            return
        try:
            self._planner_for(rows[0].state).search_ahead(rows)
        except Exception:  # noqa: BLE001 - each row searches again in `add_row`, contained there
            logger.debug("kvprune: the step's joint search failed; each row searches alone", exc_info=True)

    def add_quarantined(self, state: RequestKVState, first_token: int, num_computed: int, num_new: int,
                        num_prompt: int, block_row: np.ndarray) -> None:
        """Plan a failed request's row so that the batch runs and nothing but the request's
        own first slots is touched: a fresh map's first prompt chunk (no eviction, no vote).
        Its output is discarded (`worker/faults.py`)."""
        fresh = RequestKVState(state.config, state.policy, state.request_id, failure=state.failure)
        planner = self._planner_for(fresh)
        fresh.map = type(planner).new_map(self.tables)
        planner.add(Row(fresh, first_token, 0, num_new, num_new + 1, type(planner).live_row(fresh.map, block_row)))

    def _planner_for(self, state: RequestKVState) -> RowPlanner:
        planner_cls = PLANNERS[state.policy.layout]
        if self._planner is None:
            self._planner = planner_cls(self.block_size, self.tables)
        elif type(self._planner) is not planner_cls:
            raise PlanningError(f"kvprune: one step mixes {type(self._planner).__name__} and {planner_cls.__name__} rows")
        return self._planner

    def finish(self) -> StepPlan:
        if self._planner is None:
            raise PlanningError("kvprune: a step with no rows")
        return self._planner.finish()
