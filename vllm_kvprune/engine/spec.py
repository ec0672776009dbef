"""The KV-cache spec of a layer whose per-request footprint a policy caps."""

from __future__ import annotations

from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvprune.config import policy_from_vllm_config


class KVPruneSpec(FullAttentionSpec):
    """Full attention, but a request keeps at most `cap` blocks once its prompt is in.

    Field-less on purpose: `FullAttentionSpec.merge` rebuilds the spec from the base
    fields only, so any field of ours would be silently reset. The cap is derived from
    the engine config instead, by the same pure function the worker uses.
    """

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # vLLM admits a model only if one request at max_model_len fits the pool; a
        # bounded request needs its cap, so report that (a long max_model_len then fits).
        full = super().max_memory_usage_bytes(vllm_config)
        policy = policy_from_vllm_config(vllm_config)
        if not policy.active:
            return full
        blocks = policy.cap_blocks(self.block_size)
        prefill_blocks = policy.prefill_cap_blocks(self.block_size)
        if prefill_blocks is not None:
            blocks = max(blocks, prefill_blocks)
        return min(full, blocks * self.page_size_bytes)
