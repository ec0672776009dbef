"""PagedEviction (Chitty-Venkata et al.): token importance ||V||_2 / ||K||_2, no attention needed.

Prefill keeps the best `budget` prompt tokens of each layer; decode evicts the whole block
with the lowest mean token score each time the request's blocks are all full. Scores are
averaged over KV heads, as in the paper. Ties go against the oldest token or block. Our
additions, on by default: the `sinks` and the newest `recent` tokens (one block) are never
evicted; `sinks: 0, recent: 0` is the paper's rule.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from vllm_kvprune.policies.base import BudgetedPolicy
from vllm_kvprune.policies.settings import FDC, RECENT, KVConfigError, Surface

if TYPE_CHECKING:
    from vllm_kvprune.config import KVPolicyConfig


class PagedEvictionPolicy(BudgetedPolicy):
    """Scores tokens from K and V as they are written; evicts per layer (`blocks` layout)."""

    name = "paged_eviction"
    summary = ('PagedEviction: the best `budget` prompt tokens of each layer by ‖V‖/‖K‖ (first `sinks` and last '
               "block always kept); at decode, each time a request's blocks are all full, each layer evicts its "
               'lowest-scoring block and reuses it in place as its new tail (per-layer block tables, one shared '
               '`seq_lens`); lazy pruning drops R blocks every R fills. The kept sinks and newest block are our '
               "additions: `sinks: 0, recent: 0` is the paper's own rule (every block a candidate)")
    layout = "blocks"
    settings = (*BudgetedPolicy.settings, RECENT, FDC)
    notes = {"recent": "`paged_eviction`: newest tokens never evicted (default: one block): the prompt's last "
                       "`recent`, the blocks holding the newest `recent` at decode; `recent: 0` with `sinks: 0` is "
                       "the paper's own rule, every block a candidate"}
    fdc_refusal = None
    reference = "paged_eviction"
    kvpress = "KnormPress"  # key norms alone: the nearest of kvpress's presses

    def check_engine(self, config: KVPolicyConfig, block_size: int, surface: Surface) -> None:
        super().check_engine(config, block_size, surface)
        # Sink blocks and the newest blocks are never evicted; at least one other block must be.
        tail_blocks = self.protected_tail_blocks(config, block_size)
        needed = (self.protected_blocks(config, block_size) + tail_blocks + 1) * block_size
        if config.budget < needed:
            raise KVConfigError(surface.name("budget"), f"{self.name} needs at least {needed} tokens with "
                                                        f"{config.sinks} sinks, {tail_blocks} protected newest "
                                                        f"block(s) and block size {block_size} (sink blocks + one "
                                                        f"evictable block + the newest), got {config.budget}")

    def cap_blocks(self, config: KVPolicyConfig, block_size: int) -> int:
        """The budget's blocks and R - 1 spare ones: a request evicts R blocks every R block fills."""
        return math.ceil(config.budget / block_size) + config.prune_interval - 1

    @staticmethod
    def protected_blocks(config: KVPolicyConfig, block_size: int) -> int:
        """Leading blocks never evicted: those holding the sinks."""
        return math.ceil(config.sinks / block_size)

    @staticmethod
    def protected_tail(config: KVPolicyConfig, block_size: int) -> int:
        """Newest tokens never evicted (`recent`; default one block)."""
        return block_size if config.recent is None else config.recent

    def protected_tail_blocks(self, config: KVPolicyConfig, block_size: int) -> int:
        """Trailing blocks never evicted at decode: those holding the newest `protected_tail`
        tokens (its blocks are full when it evicts)."""
        return math.ceil(self.protected_tail(config, block_size) / block_size)

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
        protected[num_tokens - self.protected_tail(config, block_size):] = True
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
        first = self.protected_blocks(config, block_size)
        candidates = block_means[:, first:block_means.shape[1] - self.protected_tail_blocks(config, block_size)]
        return torch.sort(candidates, dim=1, stable=True).indices[:, :count] + first


POLICY = PagedEvictionPolicy()
