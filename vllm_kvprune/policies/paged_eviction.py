"""PagedEviction (Chitty-Venkata et al.): token importance ||V||_2 / ||K||_2, no attention needed.

Prefill keeps the best `budget` prompt tokens of each layer; decode evicts the whole block
with the lowest mean token score each time the request's blocks are all full. Scores are
averaged over KV heads, as in the paper. Ties go against the oldest token or block. Our
additions, on by default: the `sinks` and the newest `recent` tokens (one block) are never
evicted; `sinks: 0, recent: 0` is the paper's rule.
"""

from __future__ import annotations

import torch

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies.base import Policy


class PagedEvictionPolicy(Policy):
    """Scores tokens from K and V as they are written; evicts per layer."""

    name = "paged_eviction"
    granularity = "block"

    @staticmethod
    def token_scores(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's KV heads of ||V_h|| / ||K_h|| for tokens `[T, H, D]` -> `[T]`.

        A sum, not a mean, so that ranks holding different heads can add theirs up; the
        caller divides by the total number of KV heads. RoPE is a rotation: ||K|| is the same
        before and after it.
        """
        return (value.float().norm(dim=-1) / key.float().norm(dim=-1)).sum(dim=-1)

    def prefill_survivors(self, scores: torch.Tensor, keep: int, config: KVPolicyConfig,
                          block_size: int) -> torch.Tensor:
        """Slots (= prompt positions) of the `keep` tokens to keep, ascending.

        The first `sinks` tokens and the prompt's last `recent` (default `block_size`) are
        always kept; the rest of the budget goes to the highest scores.
        """
        num_tokens = len(scores)
        protected = torch.zeros(num_tokens, dtype=torch.bool)
        protected[: config.sinks] = True
        protected[num_tokens - config.protected_tail(block_size):] = True
        candidates = (~protected).nonzero()[:, 0]
        num_evicted = num_tokens - keep
        # Ascending score, stable: among equal scores the oldest goes first.
        evicted = candidates[torch.sort(scores[candidates], stable=True).indices[:num_evicted]]
        kept = torch.ones(num_tokens, dtype=torch.bool)
        kept[evicted] = False
        return kept.nonzero()[:, 0]

    def victim_blocks(self, block_means: torch.Tensor, count: int, config: KVPolicyConfig,
                      block_size: int) -> torch.Tensor:
        """Positions in each layer's block order of the `count` blocks to evict.

        `block_means` is `[layers, blocks]` in kernel order (oldest first); the sink blocks
        at the front and the blocks of the newest `recent` tokens at the end (default: the
        last block) are never candidates.
        """
        first = config.protected_blocks(block_size)
        candidates = block_means[:, first:block_means.shape[1] - config.protected_tail_blocks(block_size)]
        return torch.sort(candidates, dim=1, stable=True).indices[:, :count] + first
