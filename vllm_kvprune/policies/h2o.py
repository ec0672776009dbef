"""H2O (Zhang et al., "Heavy-Hitter Oracle"): keep the tokens with the most attention mass.

Per layer and KV head (a KV head's mass sums its GQA query group), every token keeps the
softmax probability it received from every query so far. Each head keeps the `sinks`
first tokens, the `recent` newest ones and, in the rest of the budget, its heavy hitters;
heads disagree on which tokens, never on how many. Ties go against the oldest token.
"""

from __future__ import annotations

import torch

from vllm_kvprune import kernels
from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.kernels.victims import VictimSearch
from vllm_kvprune.policies.base import Policy


class H2OPolicy(Policy):
    """Evicts, per KV head, the lowest-mass tokens outside the sinks and the recent window."""

    name = "h2o"
    granularity = "head"

    def evicted(self, mass: torch.Tensor, slots: torch.Tensor, logical: torch.Tensor, count: int,
                next_position: int, config: KVPolicyConfig) -> torch.Tensor:
        """Indices into `slots` `[n]` (a request's global slots), `[layers, heads, count]`, of
        the tokens each layer's heads evict: lowest `mass` (the table `[layers, heads,
        num_slots]`), outside the sinks and the recent window before `next_position`; the
        slots hold positions `logical` `[layers, heads, n]`."""
        return kernels.lowest_mass_slots(mass, slots, logical, count, next_position, config.sinks,
                                         config.recent_size)

    def evicted_many(self, mass: torch.Tensor, searches: list[VictimSearch]) -> list[torch.Tensor]:
        """`evicted` for several requests of one step at once (each search carries its
        request's sinks and recent window): where the table is, in one pass on a device."""
        return kernels.lowest_mass_slots_many(mass, searches)

    def prefill_survivors(self, mass: torch.Tensor, slots: torch.Tensor, keep: int,
                          config: KVPolicyConfig) -> torch.Tensor:
        """Indices into a prompt's `slots` `[P]` (= prompt positions) that each head of one
        layer keeps, ascending `[heads, keep]`; `mass` is that layer's table `[heads, num_slots]`."""
        num_heads, num_tokens = mass.shape[0], len(slots)
        positions = torch.arange(num_tokens).expand(1, num_heads, -1)
        evicted = self.evicted(mass[None], slots, positions, num_tokens - keep, num_tokens, config)[0]
        kept = torch.ones(num_heads, num_tokens, dtype=torch.bool)
        kept.scatter_(1, evicted, False)
        return torch.arange(num_tokens).expand(num_heads, -1)[kept].view(num_heads, keep)
