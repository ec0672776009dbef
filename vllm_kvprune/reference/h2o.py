"""Reference implementation of H2O (Zhang et al., "H2O: Heavy-Hitter Oracle"), per KV head.

Written plainly on a contiguous per-layer cache with eager attention, fp32, as the oracle for
the engine's ``h2o`` policy (gather-and-append: every eviction builds new tensors).

Semantics:

* Attention mass, per layer and KV head: every query of every step adds its softmax
  probabilities to the keys it attended to (for a KV head, summed over its GQA query group).
  A token's mass starts when it enters the cache (its own prompt chunk's causal attention
  included) and is dropped with it.
* The step rule of :class:`~vllm_kvprune.reference.model.BudgetedReference` (budget B, prune
  interval R): before a step of q tokens, if ``len(cache) + q > B + R - 1`` and
  ``len(cache) > B - 1``, every layer and KV head keeps ``B - 1`` tokens: the ``sinks``
  first tokens, the ``recent`` most recent ones, and the ``B - 1 - sinks - recent`` others of
  largest mass (ties: the oldest token is evicted first). Heads keep different tokens but
  always the same number.
* Positions are the original ones (keys cached after RoPE).
"""

from __future__ import annotations

import torch
from torch import nn

from .allocation import SpreadReference
from .model import StepOutput
from .budgeted import BudgetedReference, lowest_scores_first


class H2OReference(BudgetedReference):
    """H2O: heavy hitters by accumulated attention mass, plus sinks and a recent window."""

    needs_attentions = True

    def __init__(self, model: nn.Module, *, budget: int, recent: int, sinks: int = 0, prune_interval: int = 1,
                 prefill: str = "full", prefill_chunk: int = 256) -> None:
        if sinks < 0 or recent < 0 or sinks + recent > budget - 1:
            raise ValueError(f"need sinks + recent <= budget - 1, got {sinks} + {recent} with budget {budget}")
        self.sinks, self.recent = sinks, recent
        super().__init__(model, budget=budget, prune_interval=prune_interval, prefill=prefill,
                         prefill_chunk=prefill_chunk)

    def reset(self) -> None:
        super().reset()
        self.mass: list[torch.Tensor | None] = [None] * self.num_layers  # [kv_heads, n] per layer

    def on_step(self, out: StepOutput, num_new: int) -> None:
        for layer, probs in enumerate(out.attentions):
            kv_heads = self.cache.k[layer].shape[0]
            num_q_heads, num_queries, num_keys = probs.shape
            added = probs.view(kv_heads, num_q_heads // kv_heads, num_queries, num_keys).sum(dim=(1, 2))
            earlier = self.mass[layer]
            if earlier is not None:
                added[:, : earlier.shape[1]] += earlier
            self.mass[layer] = added

    def choose_keep(self, n_keep: int) -> list[torch.Tensor]:
        return [self._keep_layer(layer, n_keep) for layer in range(self.num_layers)]

    def _keep_layer(self, layer: int, n_keep: int) -> torch.Tensor:
        mass = self.mass[layer]
        kv_heads, n = mass.shape
        positions = self.cache.positions[layer]  # [kv_heads, n], each head in arrival order
        protected = (positions < self.sinks) | (torch.arange(n) >= n - self.recent)
        kept = []
        for head in range(kv_heads):
            candidates = (~protected[head]).nonzero()[:, 0]
            num_evicted = n - n_keep
            evicted = candidates[lowest_scores_first(mass[head, candidates])[:num_evicted]]
            keep = torch.ones(n, dtype=torch.bool)
            keep[evicted] = False
            kept.append(keep.nonzero()[:, 0])
        kept = torch.stack(kept)  # ascending per head: the order the cache keeps
        self.mass[layer] = torch.gather(mass, 1, kept)
        return kept


class SpreadH2OReference(SpreadReference):
    """H2O's mass over the prompt (every prompt query's probabilities, summed over each KV
    head's query group), the sinks and the recent window protected, the budget spread by
    ``allocation`` (:mod:`.allocation`); nothing is evicted after the prompt."""

    def __init__(self, model: nn.Module, *, budget: int, allocation: str, recent: int, sinks: int = 0) -> None:
        super().__init__(model, budget=budget, allocation=allocation, protected=(sinks, recent))

    def prompt_scores(self, out: StepOutput, layer: int, first: int, stop: int) -> torch.Tensor:
        probs = out.attentions[layer]  # [Hq, P, P], causal
        kv_heads = self.cache.k[layer].shape[0]
        num_q_heads, num_queries, num_keys = probs.shape
        mass = probs.view(kv_heads, num_q_heads // kv_heads, num_queries, num_keys).sum(dim=(1, 2))
        return mass[:, first:stop]


def from_config(model: nn.Module, config, block_size: int) -> H2OReference | SpreadH2OReference:
    """The oracle of a served `h2o` config (`KVPolicyConfig`)."""
    if config.allocation != "uniform":
        return SpreadH2OReference(model, budget=config.budget, allocation=config.allocation,
                                  recent=config.recent_size, sinks=config.sinks)
    return H2OReference(model, budget=config.budget, recent=config.recent_size, sinks=config.sinks,
                        prune_interval=config.prune_interval)
