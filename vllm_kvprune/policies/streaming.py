"""StreamingLLM: the first `sinks` tokens plus the most recent window."""

from __future__ import annotations

import numpy as np

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies.base import Policy

_NOT_A_CANDIDATE = np.iinfo(np.int64).max  # a sink's stand-in position in the oldest-token search


class StreamingPolicy(Policy):
    """Attention sinks + recent window; eviction is purely positional."""

    name = "streaming"

    def survivors(self, logical: np.ndarray, keep: int, config: KVPolicyConfig) -> np.ndarray:
        order = np.argsort(logical, kind="stable")
        sinks = order[logical[order] < config.sinks]
        recent = order[len(sinks):][-(keep - len(sinks)):] if keep > len(sinks) else order[:0]
        return np.concatenate([sinks, recent])

    def victims(self, logical: np.ndarray, count: int, config: KVPolicyConfig) -> np.ndarray:
        if count == 1 and len(logical):  # a decode step's eviction: the oldest non-sink (positions are distinct)
            oldest = int(np.argmin(np.where(logical >= config.sinks, logical, _NOT_A_CANDIDATE)))
            return np.array([oldest], np.int64) if logical[oldest] >= config.sinks else np.empty(0, np.int64)
        candidates = np.flatnonzero(logical >= config.sinks)
        oldest = np.argsort(logical[candidates], kind="stable")[:count]
        return candidates[oldest]
