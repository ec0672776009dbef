"""Reference implementation of PagedEviction (Chitty-Venkata et al.).

Written the way the paper describes it, on a contiguous per-layer cache, fp32, as the oracle
the engine's ``paged_eviction`` policy is tested against. Nothing here knows about slots,
block tables or block orders: a "block" is ``block_size`` consecutive entries of the cache.

Semantics (the engine implements exactly the same):

* Token score, per layer: ``||V||_2 / ||K||_2`` of each KV head (keys after RoPE, which does not
  change their norm), averaged over the KV heads. Computed from the cached K and V.
* ``budget`` B, ``block_size`` bs, ``sinks`` S, ``prune_interval`` R. A request holds at most
  ``cap = ceil(B / bs) + R - 1`` blocks after its prompt.
* ``recent`` N: the newest tokens never evicted (default bs; 0 with S = 0 is the paper's rule).
* Prefill is one step over the whole prompt with full attention. Then, if the prompt is longer
  than B, each layer keeps B tokens in their original order: the first S and the last N
  prompt tokens always, the rest by highest score (ties: the oldest token is evicted first).
* Decode: before a new token is appended to a cache that fills all ``cap`` blocks, each layer
  evicts the R blocks with the lowest mean token score; never one of the last ceil(N / bs)
  (most recent) blocks and never a block holding one of the first S tokens (ties: the oldest
  block goes first). So with
  R = 1 a layer drops one block each time its blocks are full, and with R > 1 it drops R blocks
  every R block fills.
* Positions are always the original ones (keys cached after RoPE).
* With FDC (``head_transform``) the cache holds each head's reduced keys and values, and the
  scores are taken from them: what is cached is what is scored.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .model import HeadTransform, StepOutput, forward_step
from .budgeted import BudgetedReference, lowest_scores_first


class PagedEvictionReference(BudgetedReference):
    """PagedEviction on a contiguous cache: token gather at prefill, block removal at decode."""

    def __init__(self, model: nn.Module, *, budget: int, block_size: int, sinks: int = 0,
                 prune_interval: int = 1, recent: int | None = None,
                 head_transform: HeadTransform | None = None) -> None:
        super().__init__(model, budget=budget, prune_interval=prune_interval, head_transform=head_transform)
        self.block_size = block_size
        self.sinks = sinks
        self.recent = block_size if recent is None else recent
        self.cap_tokens = (math.ceil(budget / block_size) + prune_interval - 1) * block_size

    def token_scores(self, layer: int) -> torch.Tensor:
        """``[n]``: mean over KV heads of ||V|| / ||K|| for each cached token of ``layer``."""
        keys, values = self.cache.k[layer].float(), self.cache.v[layer].float()
        return (values.norm(dim=-1) / keys.norm(dim=-1)).mean(dim=0)

    @torch.inference_mode()
    def step(self, token_ids) -> StepOutput:
        num_new = len(token_ids)
        if num_new == 1 and len(self.cache) == self.cap_tokens:
            for layer in range(self.num_layers):
                self._evict_blocks(layer)
        kept_before = len(self.cache)
        positions = torch.arange(self.next_position, self.next_position + num_new)
        out = forward_step(self.model, token_ids, self.cache, positions, head_transform=self.head_transform)
        self.next_position += num_new
        self.tokens_seen += num_new
        self.last_kept = kept_before + num_new
        if kept_before == 0 and num_new > self.budget:
            for layer in range(self.num_layers):
                self._prune_prompt(layer)
        return out

    def _prune_prompt(self, layer: int) -> None:
        num_tokens = self.cache.layer_len(layer)
        index = torch.arange(num_tokens)
        protected = (index < self.sinks) | (index >= num_tokens - self.recent)
        candidates = index[~protected]
        scores = self.token_scores(layer)[candidates]
        evicted = candidates[lowest_scores_first(scores)[: num_tokens - self.budget]]
        keep = torch.ones(num_tokens, dtype=torch.bool)
        keep[evicted] = False
        self.cache.keep_layer(layer, index[keep])

    def _evict_blocks(self, layer: int) -> None:
        bs = self.block_size
        num_blocks = self.cache.layer_len(layer) // bs
        block_scores = self.token_scores(layer).view(num_blocks, bs).mean(dim=1)
        first_positions = self.cache.positions[layer][0].view(num_blocks, bs).min(dim=1).values
        newest = math.ceil(self.recent / bs)  # blocks holding the newest `recent` tokens
        candidates = torch.arange(num_blocks - newest)[first_positions[:num_blocks - newest] >= self.sinks]
        victims = candidates[lowest_scores_first(block_scores[candidates])[: self.prune_interval]]
        keep = torch.ones(num_blocks, bs, dtype=torch.bool)
        keep[victims] = False
        self.cache.keep_layer(layer, torch.arange(num_blocks * bs)[keep.flatten()])


def from_config(model: nn.Module, config, block_size: int) -> PagedEvictionReference:
    """The oracle of a served `paged_eviction` config (`KVPolicyConfig`) at the engine's block
    size, FDC's narrow heads included."""
    from .fdc import transform_for

    return PagedEvictionReference(model, budget=config.budget, block_size=block_size, sinks=config.sinks,
                                  prune_interval=config.prune_interval, recent=config.recent,
                                  head_transform=transform_for(model, config))
