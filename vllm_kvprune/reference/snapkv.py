"""Reference implementation of SnapKV (Li et al.), per KV head, on the contiguous cache of
:mod:`.model`: the oracle of the engine's ``snapkv`` policy, written plainly in fp32 from the
full attention probabilities of the prompt's step.

Semantics (budget ``B``, prune interval ``R``, observation window ``w``, pooling width ``k``):

* At the end of the prompt (``P`` tokens, one step), per layer: the probabilities the last
  ``w`` queries give the prompt (causal softmax, the layer's scale) are averaged over those
  queries, the columns of the first ``P - w`` tokens are smoothed by an average pool of width
  ``k`` (zero padding, ``k // 2`` each side, divided by ``k``) and averaged over each KV head's
  query group.  Each KV head chooses the ``C = min(P - w, B - 1 - w)`` best of its first
  ``P - w`` tokens (the lowest dropped first, ties to the oldest); the window is never chosen.
* The step rule of :class:`~vllm_kvprune.reference.budgeted.BudgetedReference`: when it evicts,
  each head keeps its chosen tokens and, of the others (the window and the generated tokens),
  the newest; so the chosen tokens stay for good and the rest slides.
* Positions are the original ones (keys cached after RoPE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .allocation import SpreadReference
from .budgeted import BudgetedReference, lowest_scores_first
from .model import StepOutput


class SnapKVReference(BudgetedReference):
    """SnapKV: the prompt tokens the observation window attends to, per KV head, and a window
    of the newest tokens."""

    needs_attentions = True

    def __init__(self, model: nn.Module, *, budget: int, window: int = 64, kernel: int = 5,
                 prune_interval: int = 1) -> None:
        if window > budget - 1 or kernel % 2 == 0:
            raise ValueError(f"need window <= budget - 1 and an odd kernel, got {window}, {kernel} (budget {budget})")
        self.window, self.kernel = window, kernel
        super().__init__(model, budget=budget, prune_interval=prune_interval)

    def reset(self) -> None:
        super().reset()
        # Per layer: the positions each KV head chose at the end of the prompt ([kv_heads, C]).
        self.chosen: list[torch.Tensor | None] = [None] * self.num_layers
        self.scores: list[torch.Tensor | None] = [None] * self.num_layers  # [kv_heads, P - w], for tests

    def on_step(self, out: StepOutput, num_new: int) -> None:
        if self.tokens_seen != num_new:  # only the prompt's step (the whole prompt, `prefill: full`)
            return
        num_prompt, window = num_new, self.window
        if num_prompt <= window:
            return
        num_chosen = min(num_prompt - window, self.budget - 1 - window)
        for layer, probs in enumerate(out.attentions):  # [Hq, P, P]
            kv_heads = self.cache.k[layer].shape[0]
            attended = probs[:, num_prompt - window:, : num_prompt - window].mean(dim=1)  # [Hq, P - w]
            pooled = F.avg_pool1d(attended[:, None], kernel_size=self.kernel, padding=self.kernel // 2, stride=1)
            scores = pooled[:, 0].view(kv_heads, -1, num_prompt - window).mean(dim=1)  # [H, P - w]
            dropped = lowest_scores_first(scores)[:, : num_prompt - window - num_chosen]
            outside = torch.ones_like(scores, dtype=torch.bool)
            outside.scatter_(1, dropped, False)
            self.chosen[layer] = torch.arange(num_prompt - window).expand(kv_heads, -1)[outside].view(kv_heads, -1)
            self.scores[layer] = scores

    def choose_keep(self, n_keep: int) -> list[torch.Tensor]:
        return [self._keep_layer(layer, n_keep) for layer in range(self.num_layers)]

    def _keep_layer(self, layer: int, n_keep: int) -> torch.Tensor:
        positions = self.cache.positions[layer]  # [kv_heads, n], each head in arrival order
        kv_heads, n = positions.shape
        chosen = self.chosen[layer]
        is_chosen = torch.zeros_like(positions, dtype=torch.bool)
        if chosen is not None:
            is_chosen = (positions[:, :, None] == chosen[:, None, :]).any(dim=2)
        kept = []
        for head in range(kv_heads):
            others = (~is_chosen[head]).nonzero()[:, 0]  # in arrival order: the oldest first
            evicted = others[: n - n_keep]
            keep = torch.ones(n, dtype=torch.bool)
            keep[evicted] = False
            kept.append(keep.nonzero()[:, 0])
        return torch.stack(kept)


class SpreadSnapKVReference(SpreadReference):
    """SnapKV's scores (as :class:`SnapKVReference`'s, from the prompt step's probabilities),
    the window protected, the budget spread by ``allocation`` (:mod:`.allocation`)."""

    def __init__(self, model: nn.Module, *, budget: int, allocation: str, window: int = 64, kernel: int = 5) -> None:
        self.window, self.kernel = window, kernel
        super().__init__(model, budget=budget, allocation=allocation, protected=(0, window))

    def prompt_scores(self, out: StepOutput, layer: int, first: int, stop: int) -> torch.Tensor:
        probs, num_prompt, window = out.attentions[layer], self.num_prompt, self.window  # [Hq, P, P]
        kv_heads, outside = self.cache.k[layer].shape[0], num_prompt - window
        attended = probs[:, num_prompt - window:, :outside].mean(dim=1)  # [Hq, P - w]
        pooled = F.avg_pool1d(attended[:, None], kernel_size=self.kernel, padding=self.kernel // 2, stride=1)
        return pooled[:, 0].view(kv_heads, -1, outside).mean(dim=1)[:, first:stop]


def from_config(model: nn.Module, config, block_size: int) -> SnapKVReference | SpreadSnapKVReference:
    """The oracle of a served `snapkv` config (`KVPolicyConfig`)."""
    if config.allocation != "uniform":
        return SpreadSnapKVReference(model, budget=config.budget, allocation=config.allocation,
                                        window=config.snapkv_window, kernel=config.snapkv_kernel)
    return SnapKVReference(model, budget=config.budget, window=config.snapkv_window, kernel=config.snapkv_kernel,
                           prune_interval=config.prune_interval)
