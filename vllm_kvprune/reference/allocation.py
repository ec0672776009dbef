"""Budgets spread by layer (``pyramid``, PyramidKV) or over each layer's KV heads (``adaptive``,
AdaKV), written plainly: the oracle of the engine's ``allocation`` setting
(``vllm_kvprune/policies/allocation.py``), for any scorer that compresses the prompt only.

A scorer keeps ``first`` tokens at the prompt's start and ``last`` at its end in every head (its
protected ones: ``h2o``'s sinks and recent window, ``snapkv``'s window) and scores the ``N``
others; ``uniform`` would let every head choose ``C = B - 1 - first - last`` of them (budget
``B``). ``N <= C``: every token is kept. Otherwise:

* ``pyramid``: layer ``l`` of ``L`` (0 the lowest) chooses its ``C_l`` best, ``C_l = round(most -
  l * (most - least) / (L - 1))`` with ``least = C / 20`` and ``most = 2C - least``; where ``most >
  N``, ``most = N`` and ``least = 2C - most`` (the mean stays ``C``).
* ``adaptive``: each head keeps its ``f`` best, ``f = min(C, max(0, max(1, int(0.2 (C + first +
  last))) - first - last))`` (kvpress's floor, 0.2 of a head's mean share, which the protected
  tokens cover first); of the rest of every head together, the ``H (N - C)`` lowest are dropped
  (ties: the oldest, then the lowest head).

A head's best: its lowest scores go first, ties to the oldest.  After the prompt every token is
kept (:class:`.budgeted.PromptKeepReference`).
"""

from __future__ import annotations

import torch
from torch import nn

from .budgeted import PromptKeepReference
from .model import StepOutput

__all__ = ["SpreadReference", "adaptive_chosen", "best_of_each_head", "pyramid_count"]


def _ranked(scores: torch.Tensor, head: int) -> list[int]:
    """Head ``head``'s tokens from its first to drop to its last: ascending score, ties oldest first."""
    return sorted(range(scores.shape[1]), key=lambda position: (float(scores[head, position]), position))


def best_of_each_head(scores: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Head h's ``counts[h]`` best tokens of ``scores`` ``[H, N]``, bool."""
    chosen = torch.zeros(scores.shape, dtype=torch.bool)
    for head, count in enumerate(counts):
        ranked = _ranked(scores, head)
        chosen[head, ranked[len(ranked) - count:]] = True
    return chosen


def pyramid_count(mean_chosen: int, outside: int, layer: int, num_layers: int) -> int:
    """PyramidKV's count of layer ``layer`` (0 the lowest): linear from ``2C - C/20`` down to
    ``C/20``, the lowest capped at the ``outside`` tokens there are (the top raised to match)."""
    if mean_chosen >= outside or num_layers == 1:
        return min(mean_chosen, outside)
    least = mean_chosen / 20
    most = 2 * mean_chosen - least
    if most > outside:
        most, least = outside, 2 * mean_chosen - outside
    return min(outside, max(0, round(most - layer * (most - least) / (num_layers - 1))))


def adaptive_chosen(scores: torch.Tensor, mean_chosen: int, protected: int) -> torch.Tensor:
    """AdaKV's split of ``H * mean_chosen`` over the heads of ``scores`` ``[H, N]``: each head's
    floor first, then the best of the rest of every head together."""
    kv_heads, outside = scores.shape
    if mean_chosen >= outside:
        return torch.ones(kv_heads, outside, dtype=torch.bool)
    floor = min(mean_chosen, max(0, max(1, int(0.2 * (mean_chosen + protected))) - protected))
    chosen = best_of_each_head(scores, [floor] * kv_heads)
    rest = sorted((float(scores[h, p]), p, h) for h in range(kv_heads) for p in range(outside) if not chosen[h, p])
    for _, position, head in rest[kv_heads * (outside - mean_chosen):]:
        chosen[head, position] = True
    return chosen


class SpreadReference(PromptKeepReference):
    """A scorer's budget spread by ``allocation`` over the prompt, which alone is compressed;
    a subclass scores the prompt (:meth:`prompt_scores`, from the prompt step's probabilities)."""

    needs_attentions = True

    def __init__(self, model: nn.Module, *, budget: int, allocation: str, protected: tuple[int, int]) -> None:
        if allocation not in ("pyramid", "adaptive"):
            raise ValueError(f"allocation must be pyramid or adaptive, got {allocation!r}")
        if sum(protected) > budget - 1:
            raise ValueError(f"the protected tokens {protected} leave no room in budget {budget}")
        self.budget_tokens, self.allocation, self.protected = budget, allocation, protected
        super().__init__(model)

    def prompt_scores(self, out: StepOutput, layer: int, first: int, stop: int) -> torch.Tensor:
        """Each KV head's score of prompt tokens ``first .. stop - 1`` in ``layer``, ``[H, stop - first]``."""
        raise NotImplementedError

    def choose_prompt(self, out: StepOutput, capture: dict) -> list[torch.Tensor]:
        num_prompt = self.num_prompt
        first, last = self.protected
        stop, mean_chosen = num_prompt - last, self.budget_tokens - 1 - first - last
        masks = []
        for layer in range(self.num_layers):
            kv_heads = self.cache.k[layer].shape[0]
            keep = torch.ones(kv_heads, num_prompt, dtype=torch.bool)
            if stop - first > mean_chosen:
                scores = self.prompt_scores(out, layer, first, stop).float().cpu()
                if self.allocation == "pyramid":
                    count = pyramid_count(mean_chosen, stop - first, layer, self.num_layers)
                    keep[:, first:stop] = best_of_each_head(scores, [count] * kv_heads)
                else:
                    keep[:, first:stop] = adaptive_chosen(scores, mean_chosen, first + last)
            masks.append(keep.to(self.cache.k[layer].device))
        return masks
