"""The worker's half of "scheduler reserves, worker maps": what the worker remembers per
request (its map of physical slots, its sink keys) and per layer (the policy's scores), and
the plan of each step, derived from token counts only so the scheduler needs no channel to
us. How each kind of map plans a row is in `worker/planners.py`; the plan itself, in
`worker/plan.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_kvprune import vllm_hooks
from vllm_kvprune.engine import checks
from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies import Policy, get_policy
from vllm_kvprune.worker import faults
from vllm_kvprune.worker.block_map import LayerBlockMap
from vllm_kvprune.worker.head_map import SKIP, HeadSlotMap
from vllm_kvprune.worker.head_page_map import HeadPageMap
from vllm_kvprune.worker.plan import MassQueries, PlanningError, PrefillCompaction, SinkAnchor, StepPlan
from vllm_kvprune.worker.planners import PLANNERS, RowPlanner, Row, evict_for
from vllm_kvprune.worker.slot_map import SlotMap

logger = logging.getLogger("vllm_kvprune")

__all__ = ["HeadMass", "LayerScores", "MassQueries", "PlanningError", "PrefillCompaction", "RequestKVState",
           "SinkAnchor", "StepPlan", "StepRows", "WorkerKVState", "evict_for"]


@dataclass
class RequestKVState:
    """What the worker remembers about one request between steps."""

    config: KVPolicyConfig
    policy: Policy
    request_id: str = ""
    # Why the policy failed for this request (`worker/faults.py`); None while it runs.
    failure: str | None = None
    slots: SlotMap = field(default_factory=SlotMap)
    # layer name -> original post-RoPE (K, V) of the sink tokens, for re-anchoring.
    sink_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The position shift the sink slots hold now (positions: cache).
    sink_shift: int = 0
    # Block policies: each layer's block order (replaces `slots`, which stays empty).
    blocks: LayerBlockMap | None = None
    # Head-wise policies: each layer's and KV head's slot map (replaces `slots` too).
    heads: HeadSlotMap | None = None
    # Head-page policies: each layer's and KV head's own tokens in head-pages, and while the
    # prompt is prefilled the statistics of each layer's query-projection input (sum and sum
    # of squares per channel, float64, `[layers, hidden]`, and the token count).
    pages: HeadPageMap | None = None
    hidden_sum: torch.Tensor | None = None
    hidden_sumsq: torch.Tensor | None = None
    hidden_count: torch.Tensor | None = None

    def kept_tokens(self) -> tuple[float, int]:
        """Tokens the cache holds for this request: mean and max over layers and KV heads,
        from whichever map the policy keeps."""
        for held in (self.pages, self.heads, self.blocks):
            if held is not None:
                return held.kept_tokens()
        return self.slots.kept_tokens()

    def kept_choices(self) -> tuple[str, list]:
        """Which positions the request keeps, sorted, as (map kind, positions): "slots" one
        list for every layer and head, "blocks" one per layer, "heads"/"pages" one per layer
        and (this rank's) KV head. The debug mode records it when a request ends (tests
        compare tensor-parallel ranks with one process)."""
        if self.pages is not None and self.pages.lengths is not None:
            return "pages", [[sorted(self.pages.kept_positions(layer, head).tolist())
                              for head in range(self.pages.num_heads)] for layer in range(self.pages.num_layers)]
        if self.pages is not None:
            return "slots", list(range(self.pages.num_uniform))
        if self.heads is not None:
            return "heads", np.sort(self.heads.logical, axis=2).tolist()
        if self.blocks is not None:
            return "blocks", [sorted(row[row >= 0].tolist()) for row in self.blocks.logical]
        return "slots", sorted(self.slots.logical.tolist())


class LayerScores:
    """Per-slot token scores of every layer, `[layers, num_blocks * block_size]`, indexed by
    global slot like the cache itself, so a block's mean is one reshaped slice."""

    def __init__(self, layer_names: list[str], num_blocks: int, block_size: int, total_kv_heads: int,
                 device: torch.device | str = "cpu") -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.block_size = block_size
        self.total_kv_heads = total_kv_heads
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
        means = (_sum_over_ranks(sums) / (self.block_size * self.total_kv_heads)).cpu()
        return list(torch.split(means, [ids.shape[1] for ids in block_ids], dim=1))

    def token_means(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Mean token score of `slots` in `layer`, on the host (where choices are made)."""
        return (_sum_over_ranks(self.by_slot[layer, slots]) / self.total_kv_heads).cpu()


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

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


class HeadMass:
    """Accumulated attention mass of every layer and local KV head, `[layers, heads,
    num_blocks * block_size]`, indexed by global slot like the cache. Each head is decided on
    by the rank that holds it, so no rank needs another's mass."""

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
        """Mass follows tokens moved per head (`[M, heads]` global slots, SKIP ignored)."""
        heads = torch.arange(self.num_heads, device=destinations.device).expand_as(destinations)
        moved = destinations != SKIP
        layer_mass = self.by_slot[layer]
        layer_mass[heads[moved], destinations[moved]] = layer_mass[heads[moved], sources[moved]]

    def reset(self, layer: int, slots: torch.Tensor) -> None:
        """New tokens start with no mass (`[T, heads]` global slots)."""
        self.by_slot[layer][torch.arange(self.num_heads, device=slots.device).expand_as(slots), slots] = 0.0


def _sum_over_ranks(local_sums: torch.Tensor) -> torch.Tensor:
    """Add up what each tensor-parallel rank scored over its own KV heads."""
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
        # Once the cache exists: LayerScores (block), HeadMass (head) or PagedLayers (headpage).
        self.scores: LayerScores | HeadMass | PagedLayers | None = None
        # Wall time spent planning steps, scoring (H2O's attention mass, GVote's vote, prompt
        # pruning's choice) and moving K/V between slots (lazy pruning, compactions, sinks),
        # for the metrics and the benchmarks.
        self.plan_seconds = 0.0
        self.score_seconds = 0.0
        self.move_seconds = 0.0
        self._reported_seconds = (0.0, 0.0, 0.0)  # plan, score, move time already reported
        self._planned: list[str] = []  # requests of the steps planned since the last report
        self._step_plan: tuple[StepRows, StepPlan] | None = None  # this step's rows and their plan
        # VLLM_KVPRUNE_CHECK=1: the last planned step's (request, block row) pairs and block size,
        # checked after the step ran (a head-wise prompt's survivors are set by its layers).
        self._to_check: tuple[list, int] | None = None
        # > 0 while the runner runs a profiling or warm-up batch (no requests: not planned).
        self.dummy_runs = 0
        # VLLM_KVPRUNE_CHECK=1: request id -> `RequestKVState.kept_choices()` when it ended.
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
        """Called once the KV cache is allocated; scored policies keep scores per slot
        (`local_kv_heads`: this rank's share of the heads, all of them by default), on the
        cache's `device`."""
        granularity = self.policy.granularity if self.policy is not None else None
        if granularity == "block":
            self.scores = LayerScores(layer_names, num_blocks, block_size, total_kv_heads, device)
        elif granularity == "head":
            self.scores = HeadMass(layer_names, num_blocks, block_size, local_kv_heads or total_kv_heads, device)
        elif granularity == "headpage":
            self.scores = PagedLayers(layer_names, block_size, local_kv_heads or total_kv_heads)

    def drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and checks.enabled():
            # Debug mode: what the request kept when it ended (the last few hundred requests).
            self.ended_choices[request_id] = state.kept_choices()
            while len(self.ended_choices) > 512:
                self.ended_choices.pop(next(iter(self.ended_choices)))

    def held_bytes(self) -> int:
        """Bytes of per-request state (slot maps, sink keys): it follows each request's cap,
        not its longest sequence (the score tables are sized by the pool, once)."""
        total = 0
        for state in self.requests.values():
            total += state.slots.logical.nbytes
            total += state.heads.nbytes if state.heads is not None else 0
            total += state.blocks.nbytes if state.blocks is not None else 0
            total += state.pages.nbytes if state.pages is not None else 0
            total += sum(t.nbytes for t in (state.hidden_sum, state.hidden_sumsq) if t is not None)
            total += sum(k.nbytes + v.nbytes for k, v in state.sink_kv.values())
        return total

    def _state_for(self, request_id: str, num_computed: int, extra_args: dict | None) -> RequestKVState:
        state = self.requests.get(request_id)
        if state is None or (num_computed == 0 and state.failure is None):
            # New, or resumed after preemption: it re-prefills from scratch.
            # A placeholder first, so that a failure below still has a state to fail.
            state = RequestKVState(config=self.engine_config, policy=self.policy, request_id=request_id)
            self.requests[request_id] = state
            state.config = self.engine_config.for_request(extra_args)
            state.policy = get_policy(state.config.name)
            PLANNERS[state.policy.granularity].attach_map(state, self.scores)
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
        if isinstance(self.scores, PagedLayers):
            report["footprints"] = self.footprints()
        return report

    def footprints(self) -> dict[str, int]:
        """Blocks each voted request needs for its next steps (head-page policies), for the
        scheduler: what it allocates before them. The scheduler reads this step's report before
        it schedules the next step, or under async scheduling the step after (one more token)."""
        extra_tokens = 1 + self.footprint_lookahead
        return {request_id: state.pages.blocks_needed(extra_tokens) for request_id, state in self.requests.items()
                if state.pages is not None and state.pages.is_paged and state.failure is None}

    def settle_holes(self, report: dict) -> dict:
        """`report` (merged over tensor-parallel ranks, so every rank settles the same) with,
        for each request's first footprint after its vote, the positions of its block-table
        row the vote gives back (`HeadPageMap.settle_holes`): the scheduler frees exactly those."""
        for request_id, footprint in (report.get("footprints") or {}).items():
            state = self.requests.get(request_id)
            if state is not None and state.pages is not None and state.pages.row_holes is None:
                report.setdefault("holes", {})[request_id] = state.pages.settle_holes(footprint)
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
        builder = _PlanBuilder(block_size, self.scores)
        if PLANNERS[self.policy.granularity].searches_ahead():  # the engine's policy: every row's kind
            builder.search_ahead(self._known_rows(rows, query_start_loc))
        live_rows = []  # each row's block-table row as its map numbers blocks
        for row in range(num_reqs):
            request_id = rows.req_ids[row]
            row_args = dict(first_token=int(query_start_loc[row]), num_computed=int(rows.num_computed[row]),
                            num_new=int(query_start_loc[row + 1] - query_start_loc[row]),
                            num_prompt=int(rows.num_prompt[row]), block_row=rows.block_rows[row])
            try:
                state = self._state_for(request_id, row_args["num_computed"], rows.extra_args[row])
                if state.pages is not None:
                    row_args["block_row"] = state.pages.live_row(row_args["block_row"])
                if state.failure is None:
                    faults.inject("plan", request_id)
                    builder.add_row(state, **row_args)
                    continue
            except Exception as error:  # noqa: BLE001 - contained: this request fails alone
                state = self.requests[request_id]  # `_state_for` stores it before anything can fail
                faults.fail(state, "plan", error)
            finally:
                live_rows.append(row_args["block_row"])
            builder.add_quarantined(state, **row_args)
        plan = builder.finish()
        self._planned.extend(rows.req_ids)
        if checks.enabled():  # VLLM_KVPRUNE_CHECK=1: checked once the step has run (step_report)
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
            if state is None or state.failure is not None or state.pages is not None:
                continue
            known.append(Row(state, int(query_start_loc[index]), int(rows.num_computed[index]),
                             int(query_start_loc[index + 1] - query_start_loc[index]), int(rows.num_prompt[index]),
                             rows.block_rows[index]))
        return known


class _PlanBuilder:
    """Accumulates the rows of one step into a `StepPlan`, through the planner of the map
    the step's requests hold (one kind per step: the policy is the engine's)."""

    def __init__(self, block_size: int, scores: LayerScores | HeadMass | None = None) -> None:
        self.block_size = block_size
        self.scores = scores
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
        type(planner).attach_map(fresh, self.scores)
        planner.add(Row(fresh, first_token, 0, num_new, num_new + 1, block_row))

    def _planner_for(self, state: RequestKVState) -> RowPlanner:
        planner_cls = PLANNERS[state.policy.granularity]
        if self._planner is None:
            self._planner = planner_cls(self.block_size, self.scores)
        elif type(self._planner) is not planner_cls:
            raise PlanningError(f"kvprune: one step mixes {type(self._planner).__name__} and {planner_cls.__name__} rows")
        return self._planner

    def finish(self) -> StepPlan:
        if self._planner is None:
            raise PlanningError("kvprune: a step with no rows")
        return self._planner.finish()
