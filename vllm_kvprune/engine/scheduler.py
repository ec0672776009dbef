"""The scheduler subclass: per-request budgets, policy-shaped prefill chunks, and admission
that cannot stall."""

from __future__ import annotations

import logging

from vllm_kvprune import metrics, vllm_hooks
from vllm_kvprune.config import REPORT_KEY, KVConfigError, KVPolicyConfig, policy_from_vllm_config
from vllm_kvprune.engine import checks
from vllm_kvprune.engine.manager import KVPruneManager
from vllm_kvprune.vllm_hooks import AsyncScheduler, Scheduler, SlidingWindowSpec

logger = logging.getLogger("vllm_kvprune")


def chunk_tokens(policy: KVPolicyConfig, num_prompt_tokens: int, num_computed: int, num_new: int) -> int:
    """How many of `num_new` tokens a bounded request may run in this step.

    The worker's state machine depends on step boundaries, so they are made
    independent of batching:
    - a prefill chunk never crosses the prompt's end (compaction happens exactly there);
    - with `prefill: streaming` a chunk never crosses a multiple of `prefill_chunk`;
    - a chunk never ends within the policy's `prompt_tail` of the prompt's end: the last
      chunk holds at least those tokens (or none is run this step; vLLM schedules it later);
    - past the prompt, one token per step, also when a preempted request replays its
      outputs: each replayed token then sees the same cache it saw the first time,
      so recompute after preemption is exact.
    """
    if num_computed >= num_prompt_tokens:
        return min(num_new, 1)
    end = min(num_computed + num_new, num_prompt_tokens)
    if policy.prefill == "streaming":
        chunk = policy.prefill_chunk
        end = min(end, (num_computed // chunk + 1) * chunk)
    tail = policy.policy.prompt_tail(policy)
    if 0 < num_prompt_tokens - end < tail:
        end = max(num_computed, num_prompt_tokens - tail)
    return end - num_computed


def _wants_report(request) -> bool:
    extra_args = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
    return bool(extra_args) and extra_args.get(REPORT_KEY) in (True, 1)


class KVPruneSchedulerMixin:
    """Before vLLM's scheduler (`KVPruneScheduler`) or its async scheduler
    (`KVPruneAsyncScheduler`): the per-request policy table the capped managers read.

    Admission: a request whose peak need (its prompt's prefill or its cap, in the policy's
    KV-cache group, plus what vLLM's own groups need, e.g. a hybrid model's sliding-window
    layers) exceeds the whole pool could never run and would block every request queued
    behind it; it is finished at once with an error and a log line saying why. The front
    end refuses such requests earlier, with HTTP 400, wherever it can tell.
    """

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.kv_policy: KVPolicyConfig = policy_from_vllm_config(vllm_config)
        self.request_policies: dict[str, KVPolicyConfig] = {}
        self.refused: dict[str, str] = {}  # request -> why its overrides were refused here, until its output
        managers = vllm_hooks.single_type_managers(self)
        self.kvprune_managers = [manager for manager in managers if isinstance(manager, KVPruneManager)]
        # Per policy group: the share of the policy's layers one of its blocks holds a page of (1 with
        # one group; 1 / layers with a group per layer), so reports count blocks of all its layers.
        self._policy_shares = layer_shares([group for group, manager in zip(self.kv_cache_config.kv_cache_groups,
                                                                               managers)
                                            if isinstance(manager, KVPruneManager)])
        for manager in self.kvprune_managers:
            manager.bind_policies(self.request_policies.get, self._prompt_tokens)
        # Blocks a request needs from vLLM's own (uncapped) groups, e.g. sliding windows.
        self._other_group_blocks = sum(
            -(-manager.kv_cache_spec.max_memory_usage_bytes(vllm_config) // manager.kv_cache_spec.page_size_bytes)
            for manager in managers if not isinstance(manager, KVPruneManager)
        )
        self._log_capacity()
        self._checking = checks.enabled() and bool(self.kvprune_managers)  # KVPRUNE_CHECK=1
        # Metrics (vllm_kvprune.metrics): counted when vLLM logs stats and a policy is on.
        folder = metrics.metrics_dir()
        self.kvprune_stats = None
        self.last_kept: dict[str, tuple[float, int]] = {}  # reporting request -> (mean, max) kept tokens
        if self.log_stats and folder and self.kv_policy.active:
            from vllm_kvprune.metrics.engine import EngineStats

            self.kvprune_stats = EngineStats(vllm_config, folder)
            for manager in self.kvprune_managers:
                manager.bind_returned(self._count_returned)
            self._write_stats(force=True)

    def _prompt_tokens(self, request_id: str) -> int | None:
        request = self.requests.get(request_id)
        return request.num_prompt_tokens if request is not None else None

    @property
    def usable_blocks(self) -> int:
        return vllm_hooks.pool_blocks(self)

    def peak_blocks(self, policy: KVPolicyConfig, num_prompt_tokens: int) -> int:
        """Most blocks one request with this policy and prompt holds at once, over all groups."""
        block_size = self.kvprune_managers[0].block_size
        per_group = policy.peak_blocks(block_size, self.max_model_len, num_prompt_tokens)
        return per_group * len(self.kvprune_managers) + self._other_group_blocks

    def _log_capacity(self) -> None:
        # vLLM's own "KV cache size" line multiplies the capped footprint by
        # max_model_len and overstates the pool; say what it really holds.
        if not self.kvprune_managers or not self.kv_policy.active:
            return
        policy, block_size = self.kv_policy, self.kvprune_managers[0].block_size
        if policy.reports_footprint:
            layers = len(self.kvprune_managers)
            logger.info("kvprune: policy %s; the KV pool holds %d blocks of one layer each (%d tokens of all %d "
                        "layers); each request keeps what its vote chooses, per layer and KV head in head-pages, "
                        "each layer in blocks of its own, and the surplus goes back to the pool",
                        policy.name, self.usable_blocks, self.usable_blocks * block_size // max(layers, 1), layers)
            return
        cap = policy.cap_blocks(block_size)
        longest = self.usable_blocks - self._other_group_blocks
        if policy.prefill == "full":
            longest_prompt = f"prompts of up to {min(longest * block_size, self.max_model_len)} tokens (prefill: full)"
        else:
            longest_prompt = f"prompts of up to {self.max_model_len} tokens (prefill: streaming)"
        logger.info(
            "kvprune: policy %s, budget %d tokens; the KV pool holds %d blocks (%d tokens); a request "
            "keeps at most %d blocks after its prompt, so up to %d requests fit at once; it serves %s",
            policy.name, policy.budget or 0, self.usable_blocks, self.usable_blocks * block_size, cap,
            self.usable_blocks // max(cap, 1), longest_prompt,
        )

    def add_request(self, request) -> None:
        # The front end has validated the overrides (HTTP 400 otherwise); one that reaches the
        # engine unchecked (a front end without the plugin's checks) fails alone, never the engine.
        extra_args = request.sampling_params.extra_args if request.sampling_params else None
        try:
            policy, refusal = self.kv_policy.for_request(extra_args), None
        except KVConfigError as error:
            policy, refusal = self.kv_policy, error  # held to the engine's until it is finished
        self.request_policies[request.request_id] = policy
        super().add_request(request)
        if refusal is not None:
            logger.error("kvprune: request %s: %s; finishing it with an error", request.request_id, refusal)
            vllm_hooks.fail_at_next_step(self, request.request_id)
            self.refused[request.request_id] = f"kvprune: {refusal}"
            if self.kvprune_stats is not None:
                self.kvprune_stats.rejected(refusal.setting)
            return
        if self.kvprune_managers and policy.active:
            needed = self.peak_blocks(policy, request.num_prompt_tokens)
            if needed > self.usable_blocks:
                logger.error(
                    "kvprune: request %s can never fit the KV pool: with %s (budget %s, prefill %s) and a "
                    "prompt of %d tokens it needs %d blocks at once, the pool has %d; finishing it with an "
                    "error (a smaller kv_budget, a shorter prompt or --kv-prefill streaming would fit)",
                    request.request_id, policy.name, policy.budget, policy.prefill, request.num_prompt_tokens,
                    needed, self.usable_blocks,
                )
                vllm_hooks.fail_at_next_step(self, request.request_id)
                if self.kvprune_stats is not None:
                    self.kvprune_stats.rejected("prompt")

    def update_from_output(self, scheduler_output, model_runner_output):
        # Head-page policies: what each voted request needs for its next token, as the worker
        # counted it; a vote's surplus goes back to the pool now.
        # One count (and once, the positions given back) per KV-cache group of the policy, in
        # group order: one group, or one per layer.
        holes = vllm_hooks.step_report_of(model_runner_output).get("holes") or {}
        for request_id, group_blocks in vllm_hooks.footprints_of(model_runner_output).items():
            if request_id in self.requests:
                group_holes = holes.get(request_id) or [None] * len(group_blocks)
                for manager, num_blocks, given_back in zip(self.kvprune_managers, group_blocks, group_holes, strict=True):
                    manager.set_footprint(request_id, num_blocks, None if given_back is None else tuple(given_back))
        # The tokens each request that asked for a `kv_report` keeps, as last reported, for that
        # report when it ends.
        for request_id, kept in (vllm_hooks.step_report_of(model_runner_output).get("kept") or {}).items():
            request = self.requests.get(request_id)
            if request is not None and _wants_report(request):
                self.last_kept[request_id] = kept
        if self.kvprune_stats is not None:  # before vLLM frees what finished in this step
            self.kvprune_stats.step(vllm_hooks.step_report_of(model_runner_output),
                                    scheduler_output.num_scheduled_tokens, self.request_policies.get,
                                    self.kv_policy.name)
        failures = self._take_failures(model_runner_output)
        failures.update(self.refused)  # finished in this output too (`fail_at_next_step`)
        self.refused = {}
        if failures:
            model_runner_output = vllm_hooks.without_tokens(model_runner_output, set(failures))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if failures:
            vllm_hooks.name_failures(outputs, failures)
        if self.kvprune_stats is not None:
            self._write_stats(force=not self.has_unfinished_requests())
        if self._checking:
            checks.check_scheduler(self, self.kvprune_managers)
        return outputs

    def _take_failures(self, model_runner_output) -> dict[str, str]:
        """Requests the policy failed for in this step (`worker/faults.py`): each finishes with
        an error in this step's output (its token is dropped), and its blocks go back."""
        failures = {}
        for request_id, why in (vllm_hooks.step_report_of(model_runner_output).get("failed") or {}).items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue  # reported again until the worker hears it finished
            logger.error("kvprune: request %s fails: %s; its blocks go back to the pool, the other requests "
                         "go on", request_id, why)
            vllm_hooks.fail_at_next_step(self, request_id)
            if self.kvprune_stats is not None:
                policy = self.request_policies.get(request_id)
                self.kvprune_stats.failed(policy.name if policy is not None else self.kv_policy.name)
            failures[request_id] = why
        return failures

    def _free_request(self, request, *args, **kwargs):
        policy = self.request_policies.get(request.request_id)
        report = self.kv_report(request) if _wants_report(request) else None
        if self.kvprune_stats is not None and policy is not None and policy.active and request.num_computed_tokens:
            self.kvprune_stats.finished(request.request_id, policy.name, self._policy_blocks(request.request_id),
                                        self._unpruned_blocks(request))
        result = super()._free_request(request, *args, **kwargs)
        self.last_kept.pop(request.request_id, None)
        if report is not None and isinstance(result, tuple) and len(result) == 2:
            # Back to the caller in the request's output (`RequestOutput.kv_transfer_params`).
            kv_params, other = result
            result = ({**(kv_params or {}), "kvprune": report}, other)
        self.request_policies.pop(request.request_id, None)
        if self._checking and not kwargs.get("delay_free_blocks"):
            checks.check_released(self, request.request_id)
        return result

    def kv_report(self, request) -> dict:
        """A finished request's KV statistics (asked for with the `kv_report` extra arg): its
        policy, the blocks it held at the end in the policy's KV-cache groups against those it
        would hold without the policy (blocks of all the policy's layers: with a group per
        layer a fraction, its layer pages over the layers), and the tokens it kept (mean and max
        over layers and KV heads, as the worker last reported them; absent with
        KVPRUNE_METRICS=0)."""
        request_id = request.request_id
        policy = self.request_policies.get(request_id)
        report = {"policy": policy.name if policy is not None else self.kv_policy.name,
                  "blocks_held": self._policy_blocks(request_id), "blocks_without_policy": self._unpruned_blocks(request)}
        kept = self.last_kept.get(request_id)
        if kept is not None:
            report["kept_tokens_mean"], report["kept_tokens_max"] = kept
        return report

    def _preempt_request(self, request, *args, **kwargs):
        policy = self.request_policies.get(request.request_id)
        if self.kvprune_stats is not None and policy is not None and policy.active:
            self.kvprune_stats.preempted(request.request_id, policy.name)
        self.last_kept.pop(request.request_id, None)  # it re-prefills from nothing
        result = super()._preempt_request(request, *args, **kwargs)
        if self._checking:
            checks.check_released(self, request.request_id)
        return result

    def shutdown(self) -> None:
        super().shutdown()
        if self.kvprune_stats is not None:
            self.kvprune_stats.remove()

    # ---- metrics --------------------------------------------------------------------------
    def _count_returned(self, request_id: str, num_blocks: int) -> None:
        if self.kvprune_stats is None:
            return
        policy = self.request_policies.get(request_id)
        self.kvprune_stats.returned(num_blocks, policy.name if policy is not None else self.kv_policy.name)

    def _policy_blocks(self, request_id: str) -> float:
        """Real blocks the request holds in the policy's own KV-cache groups, in blocks of all the
        policy's layers (with a group per layer: its layer pages over the layers)."""
        held = sum(share * held_blocks(self, request_id, [manager])
                   for share, manager in zip(self._policy_shares, self.kvprune_managers))
        return held if len(self.kvprune_managers) > 1 else int(held)

    def _unpruned_blocks(self, request) -> int:
        """Blocks (of all the policy's layers) the request would hold without the policy."""
        if not self.kvprune_managers:
            return 0
        return -(-request.num_computed_tokens // self.kvprune_managers[0].block_size)

    def _write_stats(self, force: bool = False) -> None:
        stats = self.kvprune_stats
        if not stats.due(force):
            return
        stats.set_gauge("blocks_held", float(sum(self._policy_blocks(r.request_id) for r in self.running)))
        stats.set_gauge("blocks_without_pruning", float(sum(self._unpruned_blocks(r) for r in self.running)))
        stats.write()

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        policy = self.request_policies.get(request.request_id)
        if policy is None or not policy.active:
            return num_new_tokens
        return chunk_tokens(policy, request.num_prompt_tokens, num_computed_tokens, num_new_tokens)

    def held_blocks(self, request_id: str) -> int:
        """Real (non-null) blocks the request holds now, over all groups; for invariant checks."""
        return held_blocks(self, request_id)


class KVPruneScheduler(KVPruneSchedulerMixin, Scheduler):
    """vLLM's scheduler with the policies (`async_scheduling` off: always on a CPU)."""


class KVPruneAsyncScheduler(KVPruneSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler with the policies (`async_scheduling` on, vLLM's default on a
    GPU): step N+1 is scheduled while step N runs, with a placeholder for N's token. Every
    hook above reads the scheduler's own counts (computed tokens, prompt length), which
    count that placeholder, so chunks, caps and admission are the same; what arrives one
    step later is the worker's report (kept tokens, failures), which only metrics and fault
    containment read, and a failed request's in-flight step is quarantined by the worker.
    Head-page footprints (gvote) arrive a step late too, so there the worker's footprint covers
    one more token (`WorkerKVState.footprint_lookahead`) and the manager never takes a block
    from a list's tail, where the worker may not have seen it (`KVPruneManager._give_back`)."""


def held_blocks(scheduler, request_id: str, managers=None) -> int:
    """Real (non-null) blocks a request holds now in any vLLM scheduler's pool (ours or stock),
    over all KV-cache groups (or only those of `managers`)."""
    return sum(
        sum(1 for block in manager.req_to_blocks.get(request_id, ()) if not block.is_null)
        for manager in (vllm_hooks.single_type_managers(scheduler) if managers is None else managers)
    )


def layer_shares(groups) -> list[float]:
    """Per KV-cache group: the share of these groups' layers one of its blocks holds a page of (1
    with one group for every layer; 1 / layers with a group per layer)."""
    total = sum(len(group.layer_names) for group in groups)
    return [len(group.layer_names) / total for group in groups]


def model_block_shares(scheduler) -> list[float]:
    """`layer_shares` over every KV-cache group of the model (vLLM's order)."""
    return layer_shares(scheduler.kv_cache_config.kv_cache_groups)


def _model_groups(scheduler, growing_only: bool = False) -> list[tuple[float, object]]:
    """(`layer_shares` share, manager) of every KV-cache group, or only of those whose memory grows
    with the context (all but a hybrid model's sliding windows, vLLM's, bounded by the window
    under every policy)."""
    return [(share, manager) for share, manager in zip(model_block_shares(scheduler),
                                                       vllm_hooks.single_type_managers(scheduler))
            if not (growing_only and isinstance(manager.kv_cache_spec, SlidingWindowSpec))]


def held_model_blocks(scheduler, request_id: str) -> float:
    """Real blocks a request holds, in blocks of the whole model (a page of every layer): with a
    KV-cache group per layer, its layer pages over the number of layers. What compares a policy
    with per-layer tables (`gvote`) with one that has one table (`none`)."""
    return sum(share * held_blocks(scheduler, request_id, [manager]) for share, manager in _model_groups(scheduler))


def growing_managers(scheduler) -> list:
    """The managers of the KV-cache groups whose memory grows with the context (`_model_groups`)."""
    return [manager for _, manager in _model_groups(scheduler, growing_only=True)]


def growing_share(scheduler) -> float:
    """The share of the model's layers whose memory grows with the context (`held_growing_blocks`'
    groups): 1 without sliding windows; 3 / 18 on Gemma-3-270M."""
    return sum(share for share, _ in _model_groups(scheduler, growing_only=True))


def held_growing_blocks(scheduler, request_id: str) -> float:
    """`held_model_blocks` over the KV-cache groups whose memory grows with the context. What
    compares a policy's memory with a press that also cuts the sliding layers below their window."""
    return sum(share * held_blocks(scheduler, request_id, [manager])
               for share, manager in _model_groups(scheduler, growing_only=True))
