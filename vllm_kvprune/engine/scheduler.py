"""The scheduler subclass: per-request budgets and policy-shaped prefill chunks."""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from vllm_kvprune.config import KVPolicyConfig, policy_from_vllm_config
from vllm_kvprune.engine.manager import KVPruneManager

logger = logging.getLogger("vllm_kvprune")


def chunk_tokens(policy: KVPolicyConfig, num_prompt_tokens: int, num_computed: int, num_new: int) -> int:
    """How many of `num_new` tokens a bounded request may run in this step.

    The worker's state machine depends on step boundaries, so they are made
    independent of batching:
    - a prefill chunk never crosses the prompt's end (compaction happens exactly there);
    - with `prefill: streaming` a chunk never crosses a multiple of `prefill_chunk`;
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
    return end - num_computed


class KVPruneScheduler(Scheduler):
    """vLLM's scheduler, plus the per-request policy table the capped managers read."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.kv_policy: KVPolicyConfig = policy_from_vllm_config(vllm_config)
        self.request_policies: dict[str, KVPolicyConfig] = {}
        self.kvprune_managers = [
            manager
            for manager in self.kv_cache_manager.coordinator.single_type_managers
            if isinstance(manager, KVPruneManager)
        ]
        for manager in self.kvprune_managers:
            manager.bind_policies(self.request_policies.get)
        self._log_capacity()

    def _log_capacity(self) -> None:
        # vLLM's own "KV cache size" line multiplies the capped footprint by
        # max_model_len and overstates the pool; say what it really holds.
        if not self.kvprune_managers or not self.kv_policy.active:
            return
        block_size = self.kvprune_managers[0].block_size
        num_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        cap = self.kv_policy.cap_blocks(block_size)
        logger.info(
            "kvprune: policy %s, budget %d tokens; the KV pool holds %d blocks (%d tokens); "
            "a request keeps at most %d blocks after prefill, so up to %d requests fit at once",
            self.kv_policy.name, self.kv_policy.budget, num_blocks, num_blocks * block_size,
            cap, num_blocks // cap,
        )

    def add_request(self, request: Request) -> None:
        # The front end has validated the overrides (HTTP 400 otherwise).
        extra_args = request.sampling_params.extra_args if request.sampling_params else None
        self.request_policies[request.request_id] = self.kv_policy.for_request(extra_args)
        super().add_request(request)

    def _free_request(self, request: Request, *args, **kwargs):
        result = super()._free_request(request, *args, **kwargs)
        self.request_policies.pop(request.request_id, None)
        return result

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        policy = self.request_policies.get(request.request_id)
        if policy is None or not policy.active:
            return num_new_tokens
        return chunk_tokens(policy, request.num_prompt_tokens, num_computed_tokens, num_new_tokens)

    def held_blocks(self, request_id: str) -> int:
        """Real (non-null) blocks the request holds now, over all groups; for invariant checks."""
        return sum(
            sum(1 for block in manager.req_to_blocks.get(request_id, ()) if not block.is_null)
            for manager in self.kv_cache_manager.coordinator.single_type_managers
        )
