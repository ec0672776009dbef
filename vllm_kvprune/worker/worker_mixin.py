"""What our workers (CPU and GPU) add to vLLM's."""

from __future__ import annotations

from vllm_kvprune import vllm_hooks
from vllm_kvprune.config import policy_from_vllm_config

HEADS_OUTERMOST = "LBHNC"  # vLLM's HND layout: each block's KV heads outermost


class KVPruneWorkerMixin:
    """Before a vLLM worker (ours on CPU and GPU)."""

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """vLLM's layouts, narrowed to HND (`LBHNC`) under a head-page policy, whose view needs
        a block's heads outermost, and under FDC, whose packed rows view each block as one row
        (`fdc_layers.blocks_of`); vLLM's GPU kernels read strides, its CPU kernel takes HND only."""
        layouts = super().get_supported_kv_cache_layouts()
        policy = policy_from_vllm_config(self.vllm_config)
        if policy.active and (policy.narrow_heads or policy.policy.layout == "head_pages"):
            if HEADS_OUTERMOST not in layouts:
                raise ValueError(f"kv_policy {policy.name!r} needs the KV cache's heads outermost in each block "
                                 f"(HND, {HEADS_OUTERMOST}); the attention backends take only {layouts}")
            return [HEADS_OUTERMOST]
        return layouts

    def kvprune_ended_choices(self) -> dict:
        """`LLM.collective_rpc("kvprune_ended_choices")` (debug mode, `KVPRUNE_CHECK=1`):
        this process's tensor-parallel rank and what each ended request kept
        (`RequestKVState.kept_choices`)."""
        rank, world_size = vllm_hooks.tp_rank_and_size()
        return {"rank": rank, "world_size": world_size, "choices": dict(self.model_runner.kv_state.ended_choices)}
