"""Reference implementation of GVote ("Gaussian voting", Algorithm 1 and Appendix A of the
paper), per layer and KV head, on the contiguous cache of :mod:`.model`.

Written plainly, fp32, as the oracle for the engine's ``gvote`` policy.  GVote has no budget:
the data decide how many prompt tokens each (layer, KV head) keeps.

Semantics (once per request, at the end of the prompt, after one full prefill with keys cached
after RoPE at their original positions; every layer ``l`` on its own):

* Step budget.  ``q0`` is the post-RoPE query of the last prompt token ``[Hq, D]``.  Query head
  ``hq`` (GQA: KV head ``hq // (Hq // Hkv)``) takes the softmax (fp32) of its logits over the P
  prompt keys times the layer's scale (``attn.scaling``, else ``D ** -0.5``); its budget
  ``b[hq]`` is the number of entries of the descending-sorted cumulative probability that are
  ``< p_nuc``, plus one (the size of its top-``p_nuc`` set), clamped to at most P.
* Synthetic queries.  ``X`` = the layer's ``q_proj`` input over the prompt
  (``input_layernorm(h)``, ``[P, hidden]``).  Channel-wise ``mean`` and unbiased ``std`` are
  computed in float64 and cast to float32 (``std`` = 0 when P == 1).  The noise
  ``randn((S, hidden))`` comes from a CPU ``torch.Generator`` seeded with ``seed + 7919 * l``
  (reproducible, independent of the batch), ``h~ = mean + std * noise``.  ``h~`` goes through
  ``q_proj`` (and ``q_norm``, Qwen3) and is rotated with the average of the RoPE cos and sin over
  the ``n_f`` future positions ``P .. P + n_f - 1``.
* Vote.  Each sample and query head ranks the P prompt keys by logit (argsort, as Appendix A)
  and votes for the ``b[hq]`` best; a KV head keeps the union over the samples and over its GQA
  group.
* Prune and decode.  Each (layer, KV head) keeps its voted prompt tokens in position order (so
  heads have different lengths).  Every generated token is appended to every head and nothing
  is evicted afterwards; a decode token in head h attends to h's kept prompt tokens and all
  decode tokens so far.  This reference leaves the cache whole and hides the pruned keys
  (score -inf), which Appendix A.1 equates with compacting the cache per head.

Choices the paper leaves open:

* ``n_f`` (``future``) defaults to 16: the paper gives no value.  Averaging cos and sin over n_f
  positions scales RoPE dimension i by ``|sin(n_f t_i / 2) / (n_f sin(t_i / 2))|``: close to
  one for the slow dimensions (period much longer than n_f), small for those whose period is
  shorter than about n_f, whose phase a query several tokens ahead cannot pin down.  16 damps
  only those fast dimensions and keeps the positional signal of the slow ones.
* The real query's own top-p set ``C_0`` does not join the union (Algorithm 1 returns the
  union of the S votes only; ``C_0`` only sets the budget).  No attention sinks and no recent
  window are added.
* RoPE is the model's own (rotate-half for HF Llama/Qwen, :func:`.model.rotate`), not the
  listing's interleaved ``cat([-q[1::2], q[::2]])``, which does not match rotate-half models.
* The Gaussian is fitted to the input of ``q_proj`` (the normed hidden state), since
  Algorithm 1 multiplies the sampled states by ``W_q`` directly.  Mean and std in float64 (long
  prompts), noise in float32 from a per-layer seeded CPU generator.
* The attention scale is the model's (``attn.scaling``), which is ``1/sqrt(d_k)`` for Llama.

``p_nuc = 1`` means the whole distribution: every budget is P, so every head keeps the whole
prompt (with sharp attention the fp32 cumulative sum reaches 1.0 before the last, tiny,
probabilities, and the top-p rule alone would stop short of P).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .model import StepOutput, _decoder, rope_cos_sin, rotate
from .budgeted import PromptKeepReference

__all__ = [
    "GVoteReference",
    "future_rope",
    "gvote_keep_mask",
    "layer_generator",
    "nucleus_budgets",
    "synthetic_queries",
    "vote_keep_mask",
]

# Seeds of consecutive layers are this far apart (a prime, so layer streams do not line up).
LAYER_SEED_STRIDE = 7919


def layer_generator(seed: int, layer: int) -> torch.Generator:
    """The CPU generator that draws layer ``layer``'s noise."""
    return torch.Generator().manual_seed(seed + LAYER_SEED_STRIDE * layer)


def nucleus_budgets(query: torch.Tensor, keys: torch.Tensor, scale: float, p_nuc: float) -> torch.Tensor:
    """Step budget of each query head, long ``[Hq]``: the size of its top-``p_nuc`` attention
    set.  ``query`` ``[Hq, D]`` (post-RoPE), ``keys`` ``[Hkv, P, D]`` (post-RoPE)."""
    num_kv_heads, num_keys, head_dim = keys.shape
    if p_nuc >= 1:
        # The whole distribution: every key (fp32 cumulative sums reach 1.0 before the tail).
        return torch.full((query.shape[0],), num_keys, dtype=torch.long)
    grouped = query.float().reshape(num_kv_heads, -1, head_dim)
    probs = torch.softmax(torch.einsum("hgd,hpd->hgp", grouped, keys.float()) * scale, dim=-1)
    cumulative = torch.sort(probs, dim=-1, descending=True).values.cumsum(dim=-1)
    budgets = (cumulative < p_nuc).sum(dim=-1) + 1
    # fp32 rounding can leave the total just under p_nuc: never more than every key.
    return budgets.clamp(max=num_keys).reshape(-1).to(torch.long)


def synthetic_queries(
    hidden: torch.Tensor,
    q_project: Callable[[torch.Tensor], torch.Tensor],
    avg_cos: torch.Tensor,
    avg_sin: torch.Tensor,
    samples: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """``samples`` synthetic future queries ``[S, Hq, D]`` (fp32, rotated).

    ``hidden`` ``[P, hidden]``: the ``q_proj`` input over the prompt.  ``q_project`` maps
    ``[S, hidden]`` to the un-rotated queries ``[S, Hq, D]`` (projection and any per-head norm).
    ``avg_cos``/``avg_sin`` ``[D]``: RoPE cos/sin averaged over the future positions.
    The noise ``randn((S, hidden))`` is drawn in fp32 from ``generator`` (a CPU generator)."""
    x = hidden.double()
    mean = x.mean(dim=0).float()
    # torch.std of a single row is nan (n - 1 = 0); one token has no spread.
    std = x.std(dim=0).float() if x.shape[0] > 1 else torch.zeros_like(mean)
    noise = torch.randn((samples, hidden.shape[-1]), generator=generator, dtype=torch.float32)
    h_tilde = mean + std * noise.to(mean.device)
    q = q_project(h_tilde).float()
    return rotate(q, avg_cos.float(), avg_sin.float())


def vote_keep_mask(queries: torch.Tensor, keys: torch.Tensor, budgets: torch.Tensor, scale: float) -> torch.Tensor:
    """The votes: every query ``queries[s, hq]`` picks the ``budgets[hq]`` keys of largest logit
    among ``keys`` ``[Hkv, P, D]`` of its KV head; returns the union over samples and over each
    GQA group, bool ``[Hkv, P]``.  Rank-based as Appendix A (double argsort), which lets each
    head keep its own number of keys."""
    num_kv_heads, num_keys, head_dim = keys.shape
    num_samples, num_q_heads, _ = queries.shape
    grouped = queries.float().reshape(num_samples, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = torch.einsum("shgd,hpd->hgsp", grouped, keys.float()) * scale  # [Hkv, G, S, P]
    ranks = logits.argsort(dim=-1, descending=True).argsort(dim=-1)  # 0 = largest logit
    chosen = ranks < budgets.to(ranks.device).reshape(num_kv_heads, -1, 1, 1)
    return chosen.any(dim=2).any(dim=1)


def gvote_keep_mask(
    q_last: torch.Tensor,
    keys: torch.Tensor,
    hidden: torch.Tensor,
    q_project: Callable[[torch.Tensor], torch.Tensor],
    avg_cos: torch.Tensor,
    avg_sin: torch.Tensor,
    scale: float,
    p_nuc: float,
    samples: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GVote for one layer: returns ``(keep, budgets)``, ``keep`` bool ``[Hkv, P]`` (the prompt
    keys each KV head keeps) and ``budgets`` long ``[Hq]`` (the step budgets).

    ``q_last`` ``[Hq, D]``: post-RoPE query of the last prompt token.  ``keys`` ``[Hkv, P, D]``:
    post-RoPE prompt keys.  ``hidden``, ``q_project``, ``avg_cos``, ``avg_sin``, ``samples``,
    ``generator``: see :func:`synthetic_queries`.  ``scale``: the attention scale."""
    budgets = nucleus_budgets(q_last, keys, scale, p_nuc)
    queries = synthetic_queries(hidden, q_project, avg_cos, avg_sin, samples, generator)
    return vote_keep_mask(queries, keys, budgets, scale), budgets


def future_rope(model: nn.Module, num_prompt: int, future: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE cos and sin ``[D]`` averaged over positions ``P .. P + future - 1``."""
    cos, sin = rope_cos_sin(model, torch.arange(num_prompt, num_prompt + future), like)
    return cos.mean(dim=0), sin.mean(dim=0)


class GVoteReference(PromptKeepReference):
    """GVote: after a full prefill, every (layer, KV head) keeps the prompt tokens voted for by
    ``samples`` synthetic future queries; decode tokens are all kept.

    After :meth:`generate`: ``kept_positions[l][h]`` (sorted long tensor: the prompt positions
    kept by layer l, KV head h), ``kept_lengths`` (long ``[layers, kv_heads]``), ``step_budgets``
    (per layer, long ``[Hq]``).  The output's ``kept_sizes`` are floats here: per decode step,
    the mean over (layer, KV head) of the keys the decode query attends to (kept prompt tokens
    plus every decode token so far, the new one included).
    """

    def __init__(self, model: nn.Module, *, p_nuc: float = 0.95, samples: int = 8, future: int = 16,
                 seed: int = 0) -> None:
        if not 0.0 < p_nuc <= 1.0:
            raise ValueError(f"p_nuc must be in (0, 1], got {p_nuc!r}")
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be an int >= 1, got {samples!r}")
        if not isinstance(future, int) or future < 1:
            raise ValueError(f"future must be an int >= 1, got {future!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.p_nuc, self.samples, self.future, self.seed = p_nuc, samples, future, seed
        # No budget: the driver never evicts; the vote happens after the prompt's step.  Full
        # prefill and original positions (keys cached after RoPE), as the semantics require.
        super().__init__(model)

    def reset(self) -> None:
        super().reset()
        self.kept_positions: list[list[torch.Tensor]] = []
        self.kept_lengths = torch.zeros(0, 0, dtype=torch.long)
        self.step_budgets: list[torch.Tensor] = []

    def choose_prompt(self, out: StepOutput, capture: dict) -> list[torch.Tensor]:
        self._vote(capture)
        return self.prompt_keep

    def _vote(self, capture: dict) -> None:
        """Run GVote on every layer of the just-prefilled prompt and record the keep sets."""
        layers = _decoder(self.model).layers
        num_prompt = self.cache.layer_len(0)
        avg_cos, avg_sin = future_rope(self.model, num_prompt, self.future, capture["q_input"][0])
        self.prompt_keep, self.step_budgets, self.kept_positions = [], [], []
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            head_dim = attn.head_dim
            keep, budgets = gvote_keep_mask(
                capture["query"][index][:, -1],
                self.cache.k[index],
                capture["q_input"][index],
                _query_projection(attn),
                avg_cos,
                avg_sin,
                getattr(attn, "scaling", head_dim**-0.5),
                self.p_nuc,
                self.samples,
                layer_generator(self.seed, index),
            )
            self.prompt_keep.append(keep)
            self.step_budgets.append(budgets.cpu())
            positions = self.cache.positions[index]  # [Hkv, P]: prompt positions, ascending
            self.kept_positions.append([positions[head][keep[head]].cpu() for head in range(keep.shape[0])])
        self.kept_lengths = torch.stack([keep.sum(dim=1) for keep in self.prompt_keep]).cpu().to(torch.long)


def _query_projection(attn: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[S, hidden] -> [S, Hq, D]``: the layer's ``q_proj`` (bias included) and, for Qwen3,
    its per-head ``q_norm``, exactly as :func:`.model.forward_step` applies them."""
    def project(h: torch.Tensor) -> torch.Tensor:
        weight = attn.q_proj.weight
        q = attn.q_proj(h.to(device=weight.device, dtype=weight.dtype)).view(h.shape[0], -1, attn.head_dim)
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
        return q

    return project


def from_config(model: nn.Module, config, block_size: int) -> GVoteReference:
    """The oracle of a served `gvote` config (`KVPolicyConfig`)."""
    return GVoteReference(model, p_nuc=config.gvote_p, samples=config.gvote_samples, future=config.gvote_future,
                          seed=config.gvote_seed)
