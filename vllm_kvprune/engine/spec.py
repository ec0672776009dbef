"""The KV-cache spec of a layer whose per-request footprint a policy caps."""

from __future__ import annotations

import dataclasses

from vllm_kvprune.config import policy_from_vllm_config
from vllm_kvprune.vllm_hooks import FullAttentionSpec


class KVPruneSpec(FullAttentionSpec):
    """Full attention, but a request keeps at most `cap` blocks once its prompt is in.

    Field-less on purpose: `FullAttentionSpec.merge` rebuilds the spec from the base
    fields only, so any field of ours would be silently reset. The cap is derived from
    the engine config instead, by the same pure function the worker uses.
    """

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # vLLM admits a model only if one request at max_model_len fits the pool; a
        # bounded request needs its cap (or its streaming prefill), so report that: a
        # max_model_len far beyond the pool then fits, for generations longer than the pool.
        # Under `prefill: full` a prompt is cached whole before it is pruned, so the longest
        # prompt is bounded by the pool instead: the front end answers a longer one with
        # HTTP 400 (and the scheduler never queues one), see `KVPruneScheduler`.
        policy = policy_from_vllm_config(vllm_config)
        full = super().max_memory_usage_bytes(vllm_config)
        if not policy.active:
            return full
        blocks = policy.peak_blocks(self.block_size, vllm_config.model_config.max_model_len)
        return min(full, blocks * self.page_size_bytes)

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        # The worker's block-table row is append-only (VLLM_NOTES 5). A footprint policy's vote
        # gives blocks back in place (null positions, at most the prompt's blocks), and the
        # blocks its kept tokens take later come after them (at most `max_len + 2` tokens' worth
        # per head, page-rounded): a row may reach twice vLLM's width, plus the rounding. Only
        # the worker's table widens (int32 entries); the pool is unchanged.
        width = super().max_num_blocks_per_req(vllm_config, max_len)
        if policy_from_vllm_config(vllm_config).reports_footprint:
            return 2 * width + 2
        return width


class OwnGroupPerLayer:
    """Mixin before a KV-cache spec with a `layer` field: it merges only with its own layer's, so
    vLLM's hybrid grouping gives every layer a KV-cache group of its own over the one pool.
    vLLM's grouping tries to merge same-type layers; a raise keeps two layers apart (and its
    own `merge` would rebuild the spec from the base fields, dropping `layer`)."""

    @classmethod
    def merge(cls, specs: list):
        assert len({spec.layer for spec in specs}) == 1, "a layer's spec merges only with its own"
        return specs[0]

    def is_uniform_with_collection(self, kv_cache_specs: dict) -> bool:
        return all(isinstance(spec, type(self)) and spec.layer == self.layer for spec in kv_cache_specs.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerKVPruneSpec(OwnGroupPerLayer, KVPruneSpec):
    """`KVPruneSpec` of one layer (`layer`: its index among the pruned layers), one KV-cache group
    per layer (`OwnGroupPerLayer`): a block is one layer's page, each layer holds only its own
    blocks, and a request holds the sum over layers (docs/PER_LAYER.md). Chosen by the policy's
    trait `per_layer_tables`; registered as its own uniform base, so no two layers form one group."""

    layer: int = 0


class FdcSpec(FullAttentionSpec):
    """Full attention whose heads are narrower (FDC): `head_size` is the per-layer packed width
    of the reduced keys and values over `2 * num_kv_heads`, so the pool counts the bytes a token
    really takes. Every token is kept: vLLM's own manager serves it. Field-less, as above."""


class PrunedFdcSpec(KVPruneSpec):
    """FDC's narrower heads under an eviction policy (`streaming` or `paged_eviction` with
    `fdc`): the cap of `KVPruneSpec` (our manager returns the blocks past it) over FDC's
    narrowed `head_size`, so the two savings multiply. Field-less, as above."""
