"""GVote (Gaussian voting): each request, layer and KV head keeps the prompt tokens that
synthetic future queries vote for; no budget, the data sets every head's own length.

Once, at the end of the prompt, per layer: the last prompt token's query sets each query
head's step budget (the size of its top-`gvote_p` attention set); `gvote_samples` hidden
states drawn from a channel-wise Gaussian fitted to the layer's query-projection input over
the prompt are projected and rotated at the average RoPE of the next `gvote_future`
positions; each votes for its top-budget keys, and a KV head keeps the union over samples
and over its query group. Decode tokens are appended to every head; nothing is evicted
after the vote. What the paper leaves open and what we chose: `docs/GVOTE.md`.
"""

from __future__ import annotations

import torch

from vllm_kvprune.policies.base import Policy


class GVotePolicy(Policy):
    """Budget-free, per-head keep sets of different lengths (head-pages)."""

    name = "gvote"
    granularity = "headpage"

    @staticmethod
    def layer_generator(seed: int, layer: int) -> torch.Generator:
        """The sampling stream of one layer: the same keep sets in any batch, on any rerun."""
        return torch.Generator().manual_seed(seed + 7919 * layer)

    @staticmethod
    def synthetic_hidden(mean: torch.Tensor, std: torch.Tensor, samples: int,
                         generator: torch.Generator) -> torch.Tensor:
        """`samples` hidden states `[S, hidden]` drawn from N(mean, std) per channel (fp32)."""
        # Drawn on the host (the generator's stream, the same on every device), then moved.
        noise = torch.randn((samples, mean.shape[0]), generator=generator, dtype=torch.float32).to(mean.device)
        return mean.float() + std.float() * noise

    @staticmethod
    def step_budgets(query: torch.Tensor, keys: torch.Tensor, scale: float, p_nuc: float) -> torch.Tensor:
        """Top-p set size of each query head `[Hq]`: `query [Hq, D]`, `keys [H, P, D]`."""
        num_kv_heads, num_keys, _ = keys.shape
        if p_nuc >= 1:  # the whole distribution (fp32 cumulative sums reach 1.0 before its tail)
            return torch.full((query.shape[0],), num_keys, dtype=torch.long, device=query.device)
        grouped = query.float().view(num_kv_heads, -1, query.shape[-1])
        probs = torch.softmax(torch.einsum("hgd,hpd->hgp", grouped, keys.float()) * scale, dim=-1)
        cumulative = torch.sort(probs, dim=-1, descending=True).values.cumsum(dim=-1)
        budgets = (cumulative < p_nuc).sum(dim=-1) + 1
        return budgets.clamp(max=num_keys).reshape(-1)

    @staticmethod
    def keep_mask(synthetic: torch.Tensor, keys: torch.Tensor, budgets: torch.Tensor, scale: float) -> torch.Tensor:
        """The votes: `synthetic [S, Hq, D]` (rotated) queries each pick their head's top
        `budgets[hq]` keys of `keys [H, P, D]`; returns the union per KV head `[H, P]`."""
        num_kv_heads, num_keys, _ = keys.shape
        samples, num_q_heads, head_dim = synthetic.shape
        grouped = synthetic.float().view(samples, num_kv_heads, -1, head_dim)
        logits = torch.einsum("shgd,hpd->hgsp", grouped, keys.float()) * scale  # [H, G, S, P]
        # One top-k at the largest budget gives each query head the logit of its own
        # budget-th key; a key is voted for where its logit reaches that threshold.
        top = torch.topk(logits, int(budgets.max()), dim=-1).values  # [H, G, S, largest], best first
        rank = (budgets.view(num_kv_heads, -1, 1, 1) - 1).expand(-1, -1, samples, 1)
        return (logits >= top.gather(-1, rank)).any(dim=2).any(dim=1)
