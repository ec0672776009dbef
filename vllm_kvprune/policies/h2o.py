"""H2O (Zhang et al., "Heavy-Hitter Oracle"): keep the tokens with the most attention mass.

Per layer and KV head (a KV head's mass sums its GQA query group), every token keeps the
softmax probability it received from every query so far. Each head keeps the `sinks`
first tokens, the `recent` newest ones and, in the rest of the budget, its heavy hitters;
heads disagree on which tokens, never on how many. Ties go against the oldest token.

`allocation: pyramid / adaptive` spreads the budget over layers or over each layer's heads
(`policies/allocation.py`): the spread variant below, on head-pages, chooses the prompt's heavy
hitters once and keeps every generated token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_kvprune.policies import allocation
from vllm_kvprune.policies.base import BudgetedPolicy, HeadScorerPolicy, NameOf
from vllm_kvprune.policies.settings import ALLOCATION, RECENT, KVConfigError

if TYPE_CHECKING:
    from vllm_kvprune.config import KVPolicyConfig


class H2OPolicy(HeadScorerPolicy):
    """Evicts, per KV head, the lowest-mass tokens outside the sinks and the recent window; the
    mass is every query's softmax probabilities, added up (`keeps_attention_mass`)."""

    name = "h2o"
    summary = ('H2O: per layer and KV head, the `sinks`, the `recent` newest tokens and the tokens with the most '
               'accumulated attention mass (a KV head sums its GQA query group); each head evicts its own '
               "lowest-mass token and the new token's K/V for that head is written into that head's victim slot "
               "(EQUIP per head: all heads hold the same number of tokens, so vLLM's attention reads them "
               'unchanged); mass from a C++ kernel that computes decode attention and mass in one pass, never '
               'materialising attention; lazy pruning')
    settings = (*BudgetedPolicy.settings, RECENT, ALLOCATION)
    notes = {"recent": "`h2o`: newest tokens every head keeps (default `(budget - sinks) // 2`); the other "
                       "`budget - 1 - sinks - recent` kept tokens are heavy hitters"}
    fdc_refusal = "h2o's attention mass would have to come from the reduced-space kernel, which does not compute it"
    model_refusals = {"sinks": "its decode attention and mass run in our kernel, which has no learned sinks"}
    reference = "h2o"
    kvpress = "ObservedAttentionPress"  # heavy hitters by accumulated attention, without sinks or a recent window
    keeps_attention_mass = True

    def validate(self, config: KVPolicyConfig, name_of: NameOf) -> KVPolicyConfig:
        config = super().validate(config, name_of)
        if config.sinks + config.recent_size > config.budget - 1:
            raise KVConfigError(name_of("recent"), f"must be at most budget - 1 - sinks = "
                                                   f"{config.budget - 1 - config.sinks} (room for the new token), got "
                                                   f"{config.recent}")
        allocation.check_settings(config, name_of)
        return config

    def protected(self, config: KVPolicyConfig) -> tuple[int, int]:
        return config.sinks, config.recent_size


class SpreadH2OPolicy(allocation.SpreadBudget, H2OPolicy):
    """`h2o` with `allocation: pyramid` or `adaptive` (`policies/allocation.SpreadBudget`): the
    sinks and the recent window are protected, the other prompt tokens are scored by the
    attention mass every prompt query gave them (the same mass, accumulated over the prompt's
    chunks by the same kernel, in a table beside the cache); nothing is evicted after the
    prompt. kvpress has no such press (AdaKVPress refuses ObservedAttentionPress)."""

    kvpress = None

    def protected_prompt(self, config: KVPolicyConfig) -> tuple[int, int]:
        return config.sinks, config.recent_size

    def prompt_scores(self, prompt: Any, config: KVPolicyConfig, first: int, stop: int) -> torch.Tensor:
        return prompt.scores[:, first:stop]


POLICY = H2OPolicy()
H2OPolicy.spread = SpreadH2OPolicy()
