"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation").

At the end of the prompt, each layer's KV heads score the prompt by the attention its last
`snapkv_window` queries (the observation window) pay to it: softmax probabilities over the
prompt (causal, the layer's scale and soft-cap), averaged over the window's queries,
smoothed by average pooling of width `snapkv_kernel` (a kept token brings its neighbours:
SnapKV's clustering; zeros past the ends, as `avg_pool1d` pads) and averaged over the KV
head's GQA group. Each head chooses the `budget - 1 - window` best tokens outside the
window; the window itself is always kept. The scores are those of kvpress's `SnapKVPress`
(its defaults: window 64, kernel 5); the parity test compares the kept positions.

Decode stays within the budget (our choice; SnapKV compresses only the prompt): the chosen
prompt tokens stay for good, and the window and the generated tokens slide, the oldest of
them evicted first, per head in place (EQUIP, the `heads` layout). A prompt shorter than
the budget chooses every token outside its window. The window's queries must be computed in
one step: the scheduler ends no prompt chunk within the window of the prompt's end
(`prompt_tail`). Ties between scores go against the oldest token.

`allocation: pyramid / adaptive` spreads the same total over layers or over each layer's heads
(`policies/allocation.py`): the spread variant below, on head-pages, compresses the prompt only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllm_kvprune.policies import allocation
from vllm_kvprune.policies.base import HeadScorerPolicy, NameOf
from vllm_kvprune.policies.settings import ALLOCATION, BUDGET, PRUNE_INTERVAL, KVConfigError, Setting

if TYPE_CHECKING:
    from vllm_kvprune.config import KVPolicyConfig

WINDOW = Setting("snapkv_window", int, 64, "Observation window: the prompt's last queries whose attention scores "
                 "the prompt; always kept.", minimum=1, metavar="TOKENS")
KERNEL = Setting("snapkv_kernel", int, 5, "Width of the average pooling that smooths the scores (odd).", minimum=1,
                 per_request=True, metavar="K")
CHOSEN = 1.0  # the score table's value of a chosen prompt token (every other token: 0, evicted oldest first)


class SnapKVPolicy(HeadScorerPolicy):
    """Keeps, per layer and KV head, the prompt tokens its observation window attends to most,
    and a sliding window of the newest tokens."""

    name = "snapkv"
    summary = ("SnapKV: at the end of the prompt, per layer and KV head, the prompt tokens the last `snapkv_window` "
               "queries attend to most (scores pooled over `snapkv_kernel` neighbours, averaged over the GQA group) "
               "and the window itself; the chosen tokens stay, the window and the generated tokens slide (EQUIP per "
               "head)")
    settings = (BUDGET, PRUNE_INTERVAL, WINDOW, KERNEL, ALLOCATION)
    fdc_refusal = "snapkv's per-head slots and FDC's packed narrow rows are not combined"
    model_refusals = {"sinks": "its window scores are softmax probabilities without the learned sinks"}
    reference = "snapkv"
    kvpress = "SnapKVPress"

    def validate(self, config: KVPolicyConfig, name_of: NameOf) -> KVPolicyConfig:
        if config.budget is None:
            raise KVConfigError(name_of("budget"), "policy 'snapkv' needs a budget (tokens kept)")
        if config.snapkv_window > config.budget - 1:
            raise KVConfigError(name_of("snapkv_window"), f"must be at most budget - 1 = {config.budget - 1} (the "
                                                          f"window is always kept), got {config.snapkv_window}")
        if config.snapkv_kernel % 2 == 0:
            raise KVConfigError(name_of("snapkv_kernel"), f"must be odd (pooling keeps the prompt's length), got "
                                                          f"{config.snapkv_kernel}")
        allocation.check_settings(config, name_of)
        return config

    def kvpress_settings(self, config: KVPolicyConfig) -> dict:
        return {"window_size": config.snapkv_window, "kernel_size": config.snapkv_kernel}

    def prompt_tail(self, config: KVPolicyConfig) -> int:
        return config.snapkv_window

    def prompt_keep(self, config: KVPolicyConfig, num_prompt: int) -> int | None:
        if config.evicts_before(num_prompt, 1):
            return config.budget - 1
        return num_prompt if num_prompt > config.snapkv_window else None  # choose, evict later

    def prefill_survivors(self, scores: torch.Tensor, slots: torch.Tensor, keep: int, config: KVPolicyConfig,
                          prompt: Any = None) -> torch.Tensor:
        """Marks each head's chosen tokens in `scores` (`CHOSEN`) and keeps them, the window and
        the newest others up to `keep`, ascending `[heads, keep]`."""
        num_heads, num_prompt = scores.shape[0], len(slots)
        window = config.snapkv_window
        num_chosen = min(num_prompt - window, config.budget - 1 - window)
        positions = torch.arange(num_prompt).expand(num_heads, -1)
        if num_chosen == num_prompt - window:
            chosen = positions[:, : num_prompt - window]  # every token outside the window
        else:
            window_scores = self.window_scores(prompt.queries[-window:], prompt.read_keys(), prompt.scale,
                                               prompt.softcap, config.snapkv_kernel).cpu()
            # The lowest go first, ties to the oldest: the rest are chosen, in position order.
            dropped = torch.sort(window_scores, dim=-1, stable=True).indices[:, : num_prompt - window - num_chosen]
            outside = torch.ones(num_heads, num_prompt - window, dtype=torch.bool)
            outside.scatter_(1, dropped, False)
            chosen = positions[:, : num_prompt - window][outside].view(num_heads, num_chosen)
        heads = torch.arange(num_heads)[:, None]
        table_slots = slots.to(scores.device)[chosen.to(scores.device)]
        scores[heads.to(scores.device), table_slots] = CHOSEN
        # Keep the chosen and the newest of the rest (the window first): evicted later, oldest first.
        is_chosen = torch.zeros(num_heads, num_prompt, dtype=torch.bool)
        is_chosen.scatter_(1, chosen, True)
        rest = positions[~is_chosen].view(num_heads, num_prompt - num_chosen)
        kept = torch.cat([chosen, rest[:, rest.shape[1] - (keep - num_chosen):]], dim=1)
        return torch.sort(kept, dim=1).values

    @staticmethod
    def window_scores(queries: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float,
                      kernel: int) -> torch.Tensor:
        """SnapKV's score of each prompt token outside the window, per KV head `[H, P - w]`:
        `queries` `[w, Hq, D]` are the window's (post-RoPE), `keys` `[P, H, D]` the prompt's."""
        window, num_q_heads, head_dim = queries.shape[0], queries.shape[-2], queries.shape[-1]
        num_prompt, num_kv_heads = keys.shape[0], keys.shape[1]
        group = num_q_heads // num_kv_heads
        grouped = queries.float().reshape(window, num_kv_heads, group, head_dim)
        logits = torch.einsum("whgd,phd->hgwp", grouped, keys.float()) * scale  # [H, G, w, P]
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        # Window query i sits at position P - w + i and sees the keys up to it.
        future = torch.arange(num_prompt, device=keys.device)[None, :] > \
            torch.arange(num_prompt - window, num_prompt, device=keys.device)[:, None]
        probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
        attended = probs[..., : num_prompt - window].mean(dim=2)  # [H, G, P - w]
        pooled = F.avg_pool1d(attended.reshape(num_q_heads, 1, -1), kernel_size=kernel, padding=kernel // 2, stride=1)
        return pooled.view(num_kv_heads, group, -1).mean(dim=1)


class SpreadSnapKVPolicy(allocation.SpreadBudget, SnapKVPolicy):
    """`snapkv` with `allocation: pyramid` or `adaptive` (`policies/allocation.SpreadBudget`):
    the window is protected, the other prompt tokens are scored as `snapkv` scores them."""

    def protected_prompt(self, config: KVPolicyConfig) -> tuple[int, int]:
        return 0, config.snapkv_window

    def prompt_scores(self, prompt: Any, config: KVPolicyConfig, first: int, stop: int) -> torch.Tensor:
        window = config.snapkv_window
        return self.window_scores(prompt.queries[-window:], prompt.keys.transpose(0, 1), prompt.scale,
                                  prompt.softcap, config.snapkv_kernel)[:, first:stop]

    def kvpress_settings(self, config: KVPolicyConfig) -> dict:
        scorer = super().kvpress_settings(config)
        if config.allocation == "pyramid":
            return {"name": "PyramidKVPress", **scorer}
        return {"name": "AdaKVPress", "press": {"name": "SnapKVPress", **scorer}}


POLICY = SnapKVPolicy()
SnapKVPolicy.spread = SpreadSnapKVPolicy()
