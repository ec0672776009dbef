"""H2O (Zhang et al., "Heavy-Hitter Oracle"): keep the tokens with the most attention mass.

Per layer and KV head (a KV head's mass sums its GQA query group), every token keeps the
softmax probability it received from every query so far. Each head keeps the `sinks`
first tokens, the `recent` newest ones and, in the rest of the budget, its heavy hitters;
heads disagree on which tokens, never on how many. Ties go against the oldest token.
"""

from __future__ import annotations

import torch

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies.base import Policy


class H2OPolicy(Policy):
    """Evicts, per KV head, the lowest-mass tokens outside the sinks and the recent window."""

    name = "h2o"
    granularity = "head"

    def evicted(self, mass: torch.Tensor, logical: torch.Tensor, count: int, next_position: int,
                config: KVPolicyConfig) -> torch.Tensor:
        """Slots `[..., count]` to evict from caches whose slots hold positions `logical`
        `[..., n]` with masses `mass` `[..., n]`; `next_position` is the first position
        not yet cached, so the recent window is `next_position - recent` onwards."""
        protected = (logical < config.sinks) | (logical >= next_position - config.recent_size)
        scores = mass.masked_fill(protected, float("inf"))
        lowest = torch.topk(scores, count, dim=-1, largest=False)
        if bool(((scores <= lowest.values[..., -1:]).sum(dim=-1) == count).all()):
            return lowest.indices  # the count lowest are strictly below the rest: no tie
        # Ties at the boundary: order by (mass, position), oldest first among equals.
        by_age = torch.argsort(logical, dim=-1, stable=True)
        ranked = torch.sort(scores.gather(-1, by_age), dim=-1, stable=True).indices[..., :count]
        return by_age.gather(-1, ranked)

    def prefill_survivors(self, mass: torch.Tensor, keep: int, config: KVPolicyConfig) -> torch.Tensor:
        """Slots (= prompt positions) each head keeps of a prompt `mass` `[heads, P]`,
        ascending `[heads, keep]`."""
        num_heads, num_tokens = mass.shape
        positions = torch.arange(num_tokens).expand(num_heads, -1)
        evicted = self.evicted(mass, positions, num_tokens - keep, num_tokens, config)
        kept = torch.ones(num_heads, num_tokens, dtype=torch.bool)
        kept.scatter_(1, evicted, False)
        return positions[kept].view(num_heads, keep)
