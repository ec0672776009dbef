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

from typing import Any

import numpy as np
import torch

from vllm_kvprune.policies.base import Policy
from vllm_kvprune.policies.settings import Setting

P = Setting("gvote_p", float, 0.95, "Nucleus threshold; each query head votes for as many keys as the last "
            "prompt token's top-p attention set holds (1 keeps everything).", fraction=True, per_request=True,
            metavar="P")
SAMPLES = Setting("gvote_samples", int, 8, "Synthetic queries that vote.", minimum=1, per_request=True,
                  metavar="S")
FUTURE = Setting("gvote_future", int, 16, "Future positions whose RoPE cos/sin the synthetic queries "
                 "average.", minimum=1)
SEED = Setting("gvote_seed", int, 0, "Sampling seed (layer l draws from seed + 7919 l), so a run is "
               "reproducible.", minimum=0, metavar="SEED")
_OWN_FOOTPRINT = "chooses its own footprint; remove it"


class GVotePolicy(Policy):
    """Budget-free, per-head keep sets of different lengths (`head_pages` layout)."""

    name = "gvote"
    summary = ('GVote, budget-free: at the end of each prompt, per layer, synthetic future queries (drawn from a '
               "Gaussian fitted to the layer's hidden states, projected and rotated by the model's own weights and "
               "RoPE) vote for keys; each KV head keeps the union of its group's votes, **its own length**. The kept "
               "tokens of each head are packed into head-pages (one KV head's block), and each layer has blocks of "
               "its own (a KV-cache group per layer over the one pool), so a request holds the sum over layers of "
               "`ceil(sum_h ceil(len_h / block_size) / H)` layer pages: memory follows the mean over heads and "
               "layers; the surplus goes back to the pool at once (the worker reports each layer's need on the step "
               'output). Nothing is evicted after the vote. Runs eager (`--enforce-eager` is set for it). Method and '
               'choices: `docs/GVOTE.md`, `docs/PER_LAYER.md`')
    layout = "head_pages"
    settings = (P, SAMPLES, FUTURE, SEED)
    refused_settings = {"budget": _OWN_FOOTPRINT, "window": _OWN_FOOTPRINT,
                        "prefill": "supports only 'full' (it votes once over the whole prompt)"}
    fdc_refusal = ("gvote's per-head lengths (head-pages) and FDC's per-head widths (packed rows) are two layouts "
                   "that are not combined")
    model_refusals = {"softcap": "its vote computes logits without soft-capping",
                      "sinks": "its head-page attention hands the kernel one KV head's query group per sequence, "
                               "which per-query-head sinks would not follow"}
    eager = "the vote reads each layer's query-projection input through a module hook, which a compiled graph would not run"
    reference = "gvote"
    gathers_hidden_states = True

    def explain_capacity(self, config, block_size: int) -> str:
        return "a voted request may keep every token of its prompt and output, as without a policy"

    def check_model(self, model: Any, layer_names: list[str]) -> str | None:
        """The vote projects synthetic hidden states with each layer's own fused QKV projection and RoPE."""
        from vllm_kvprune import vllm_hooks

        for layer_name in layer_names:
            owner = model.get_submodule(layer_name.rsplit(".", 1)[0])
            if not hasattr(owner, "qkv_proj"):
                return f"gvote: attention without a fused QKV projection ({layer_name}) is not supported"
            if vllm_hooks.rope_rotation(getattr(owner, "rotary_emb", None)) is None:
                return f"gvote: attention without a plain rotary embedding ({layer_name}) is not supported"
        return None

    def prompt_keep_mask(self, prompt: Any, config) -> np.ndarray:
        """The layer's vote (`worker/voting.LayerVoter`: the model's projection and RoPE, the
        statistics the layer gathered over the prompt, the last prompt token's query)."""
        pages, layer = prompt.pages, prompt.layer
        return prompt.voter.vote(config, self, prompt.queries[-1].float(), prompt.keys, pages.hidden_sum[layer],
                                 pages.hidden_sumsq[layer], int(pages.hidden_count[layer]))

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


POLICY = GVotePolicy()
