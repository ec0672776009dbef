"""StreamingLLM: the first `sinks` tokens plus the most recent window."""

from __future__ import annotations

import numpy as np

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies.base import Policy


class StreamingPolicy(Policy):
    """Attention sinks + recent window; eviction is purely positional."""

    name = "streaming"

    def survivors(self, logical: np.ndarray, keep: int, config: KVPolicyConfig) -> np.ndarray:
        order = np.argsort(logical, kind="stable")
        sinks = order[logical[order] < config.sinks]
        recent = order[len(sinks):][-(keep - len(sinks)):] if keep > len(sinks) else order[:0]
        return np.concatenate([sinks, recent])

    def victims(self, logical: np.ndarray, count: int, config: KVPolicyConfig) -> np.ndarray:
        candidates = np.flatnonzero(logical >= config.sinks)
        oldest = np.argsort(logical[candidates], kind="stable")[:count]
        return candidates[oldest]
