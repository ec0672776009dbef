"""StreamingLLM: the first `sinks` tokens plus the most recent window."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vllm_kvprune.policies.base import BudgetedPolicy
from vllm_kvprune.policies.settings import FDC, POSITIONS, PREFILL, PREFILL_CHUNK

if TYPE_CHECKING:
    from vllm_kvprune.config import KVPolicyConfig

_NOT_A_CANDIDATE = np.iinfo(np.int64).max  # a sink's stand-in position in the oldest-token search


class StreamingPolicy(BudgetedPolicy):
    """Attention sinks + recent window; eviction is purely positional, the same for every layer.

    Decisions (`tokens` layout): both methods get `logical`, the logical position held by each
    valid physical slot of one request (`logical[i]` for slot i, all distinct). Ties cannot
    happen: positions are distinct."""

    name = "streaming"
    summary = ('`sinks` first tokens + the most recent window (StreamingLLM), EQUIP in-place slots, lazy pruning, '
               '`positions: original/cache`, `prefill: full/streaming`')
    layout = "tokens"
    settings = (*BudgetedPolicy.settings, POSITIONS, PREFILL, PREFILL_CHUNK, FDC)
    fdc_refusal = None
    reference = "streaming"
    kvpress = "StreamingLLMPress"

    def kvpress_settings(self, config: KVPolicyConfig) -> dict:
        return {"n_sink": config.sinks}

    def survivors(self, logical: np.ndarray, keep: int, config: KVPolicyConfig) -> np.ndarray:
        """Slots to keep (at most `keep`), in the order they will be compacted to."""
        order = np.argsort(logical, kind="stable")
        sinks = order[logical[order] < config.sinks]
        recent = order[len(sinks):][-(keep - len(sinks)):] if keep > len(sinks) else order[:0]
        return np.concatenate([sinks, recent])

    def victims(self, logical: np.ndarray, count: int, config: KVPolicyConfig) -> np.ndarray:
        """`count` slots whose tokens are evicted now."""
        if count == 1 and len(logical):  # a decode step's eviction: the oldest non-sink (positions are distinct)
            oldest = int(np.argmin(np.where(logical >= config.sinks, logical, _NOT_A_CANDIDATE)))
            return np.array([oldest], np.int64) if logical[oldest] >= config.sinks else np.empty(0, np.int64)
        candidates = np.flatnonzero(logical >= config.sinks)
        oldest = np.argsort(logical[candidates], kind="stable")[:count]
        return candidates[oldest]


POLICY = StreamingPolicy()
