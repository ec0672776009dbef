"""How a budgeted scorer spreads its budget over layers and KV heads (the `allocation` setting).

A scorer (`snapkv`) scores each prompt token outside its observation window per layer and KV
head; `uniform` lets every head of every layer choose the same count `C` (its budget minus the
window and the next token). The other two keep the same total over the model:

- `pyramid` (PyramidKV): layer `l` of `L` (0 = the lowest) chooses `C_l`, linear from
  `2C - C / beta` at the bottom to `C / beta` at the top (`beta` 20, kvpress's default), so the
  mean over layers is `C`; where the bottom's count would pass the tokens there are, it is
  capped there and the top's raised to keep the total. Our choice: the pyramid spreads the
  chosen tokens, and every layer keeps the protected ones beside them. kvpress (after
  PyramidKV's code) spreads each layer's whole count, window included, `K = C + w` on average,
  so its top layer's `K / beta` must hold the window: below `K = w * beta` (1280 with w 64) it
  falls back to uniform. Ours forms the pyramid at any budget below the prompt.
- `adaptive` (AdaKV): each head first keeps its best `f` tokens (the floor: kvpress's
  `alpha_safeguard` 0.2 of the head's mean share, window included, which the window covers
  first), then the layer's remaining `H * (C - f)` go to the best scores over all its heads
  together (one top-k over heads x tokens), so heads keep different counts.

Ties go against the oldest token (then the lowest head), as everywhere else. Rounding: Python's
`round` (half to even) on each layer's count, so the total may differ from `L * C` by a few
tokens. References: `reference/snapkv.py` (the same rules written plainly).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_kvprune.policies.settings import KVConfigError

if TYPE_CHECKING:
    from vllm_kvprune.config import KVPolicyConfig

PYRAMID_BETA = 20  # kvpress's PyramidKVPress default: the top layer keeps C / beta
ADAPTIVE_FLOOR = 0.2  # kvpress's AdaKVPress `alpha_safeguard`


def pyramid_counts(mean_chosen: int, available: int, num_layers: int, beta: float = PYRAMID_BETA) -> list[int]:
    """Tokens each layer chooses (bottom first) so that their mean is `mean_chosen`, out of
    `available` per head: linear from the bottom's most to the top's least."""
    if mean_chosen >= available or num_layers == 1:
        return [min(mean_chosen, available)] * num_layers
    least = mean_chosen / beta
    most = 2 * mean_chosen - least
    if most > available:
        most = available
        least = 2 * mean_chosen - most
    step = (most - least) / (num_layers - 1)
    return [min(available, max(0, round(most - layer * step))) for layer in range(num_layers)]


def keep_best(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Each row's `count` best of `scores [H, N]` as a mask (the lowest go first, ties to the
    oldest: a stable ascending sort drops its first `N - count`)."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    dropped = torch.sort(scores, dim=-1, stable=True).indices[:, : scores.shape[1] - count]
    return keep.scatter_(1, dropped, False)


def adaptive_keep(scores: torch.Tensor, mean_chosen: int, window: int, floor: float = ADAPTIVE_FLOOR) -> torch.Tensor:
    """AdaKV's split of one layer's `H * mean_chosen` tokens over its heads, a mask `[H, N]`
    over the tokens outside the window: each head's best `f` first (`f` the floor outside the
    window: `max(1, int(floor * (mean_chosen + window))) - window`, at least 0), then the
    best of every head together."""
    num_heads, num_tokens = scores.shape
    if mean_chosen >= num_tokens:
        return torch.ones_like(scores, dtype=torch.bool)
    per_head = min(mean_chosen, max(0, max(1, int(floor * (mean_chosen + window))) - window))
    boosted = scores.float().masked_fill(keep_best(scores, per_head), float("inf"))
    # One ascending sort over every head's tokens, position-major: ties drop the oldest first.
    order = torch.sort(boosted.T.reshape(-1), stable=True).indices[: num_heads * (num_tokens - mean_chosen)]
    keep = torch.ones(num_tokens * num_heads, dtype=torch.bool, device=scores.device)
    keep[order] = False
    return keep.view(num_tokens, num_heads).T.contiguous()


def chosen_mask(scores: torch.Tensor, config: KVPolicyConfig, protected: int, layer: int,
                num_layers: int) -> torch.Tensor:
    """The tokens each head of layer `layer` chooses out of `scores [H, N]` (those outside the
    `protected` ones every head keeps), by `config.allocation`, with uniform's mean count."""
    mean_chosen = config.budget - 1 - protected
    if config.allocation == "pyramid":
        return keep_best(scores, pyramid_counts(mean_chosen, scores.shape[1], num_layers)[layer])
    return adaptive_keep(scores, mean_chosen, protected)


class SpreadBudget:
    """The variant of a budgeted head scorer (`HeadScorerPolicy`) that `allocation: pyramid`
    or `adaptive` selects: its heads keep different counts, in head-pages with a KV-cache
    group per layer, and only the prompt is compressed (as kvpress's presses do): every
    generated token is kept. A policy's variant says which prompt tokens every head keeps
    (`protected_prompt`: so many first and last) and scores the others (`prompt_scores`)."""

    layout = "head_pages"

    def protected_prompt(self, config: KVPolicyConfig) -> tuple[int, int]:
        """How many of the prompt's first and last tokens every head keeps."""
        raise NotImplementedError

    def prompt_scores(self, prompt: Any, config: KVPolicyConfig, first: int, stop: int) -> torch.Tensor:
        """Each head's score of prompt tokens `first .. stop - 1`, `[H, stop - first]`."""
        raise NotImplementedError

    def explain_capacity(self, config: KVPolicyConfig, block_size: int) -> str:
        return (f"allocation {config.allocation} compresses the prompt only: a request may hold its whole prompt "
                "before it is scored and keeps every generated token")

    def prompt_keep_mask(self, prompt: Any, config: KVPolicyConfig) -> np.ndarray:
        """Per KV head of one layer: the protected tokens, and of the others those its
        allocation chooses (the layer's pyramid count, or the layer's total split over its
        heads), bool `[H, P]`. A prompt not longer than the budget keeps every token."""
        num_heads, num_prompt = prompt.keys.shape[0], prompt.keys.shape[1]
        first, last = self.protected_prompt(config)
        stop = num_prompt - last
        keep = np.ones((num_heads, num_prompt), bool)
        if stop - first <= config.budget - 1 - first - last:
            return keep
        scores = self.prompt_scores(prompt, config, first, stop)
        keep[:, first:stop] = chosen_mask(scores, config, first + last, prompt.layer, prompt.num_layers).cpu().numpy()
        return keep


def check_settings(config: KVPolicyConfig, name_of: Any) -> None:
    """What a spread budget cannot take: lazy pruning (nothing is evicted after the prompt)."""
    if config.allocation != "uniform" and config.prune_interval != 1:
        raise KVConfigError(name_of("prune_interval"), f"applies to allocation uniform only ({config.allocation} "
                                                       f"evicts nothing after the prompt), got {config.prune_interval}")


def check_request(engine: KVPolicyConfig, request: KVPolicyConfig, name_of: Any) -> None:
    """A request keeps its engine's layout: uniform (one block table) or a spread (head-pages)."""
    if (engine.allocation == "uniform") != (request.allocation == "uniform"):
        raise KVConfigError(name_of("allocation"), f"{request.allocation!r} is not served by this engine, started "
                                                   f"with allocation {engine.allocation!r}: uniform keeps one block "
                                                   "table, pyramid and adaptive a group per layer of head-pages; "
                                                   "start the server with the allocation to use")


def check_parallel(config: KVPolicyConfig, tensor_parallel_size: int, surface: Any) -> None:
    """`adaptive`'s top-k spans every KV head of a layer: one process must hold them all."""
    if config.allocation == "adaptive" and tensor_parallel_size > 1:
        raise KVConfigError(surface.name("allocation"), "adaptive splits a layer's budget over all its KV heads with "
                                                        "one top-k, which needs every head's scores in one process; "
                                                        f"tensor_parallel_size {tensor_parallel_size} splits them "
                                                        "(use pyramid or uniform)")
