"""Shared plumbing for the reference (oracle) implementations of the KV policies.

Everything here is deliberately plain PyTorch, written the way the papers describe their
methods, so that it can serve as the oracle the engine is tested against (DESIGN.md section 7)
and as the shift-and-append baseline of the KV-update benchmark:

* :class:`ContiguousKVCache` keeps, per layer, K and V as contiguous tensors
  ``[kv_heads, n, head_dim]`` in logical (cache) order.  Eviction is a gather
  (:meth:`ContiguousKVCache.keep`, which builds new tensors: the "shift"), new tokens are
  concatenated at the end (:meth:`ContiguousKVCache.append`).
* :func:`forward_step` is a manual forward of a Hugging Face Llama-style decoder
  (``LlamaForCausalLM``: embed_tokens, per layer input_layernorm, q/k/v/o_proj, rotary embedding,
  post_attention_layernorm, mlp, final norm, lm_head; GQA) over ``q`` new tokens against the
  cache, with eager softmax attention computed in fp32.  The caller controls the RoPE positions
  of queries and keys and, optionally, receives the attention probabilities of the step.
* The generation driver shared by the policies (``BudgetedReference``) is in :mod:`.budgeted`.

Cache orientation.  The cache stores keys either *after* RoPE (``rope="post"``: each key is
rotated once, when written, at the position the step gives it; this is the "original" positions
mode) or *before* RoPE (``rope="pre"``: raw keys are cached and every step rotates all of them at
the key positions it is given; this is how StreamingLLM's own code implements positions inside
the cache).  In both cases the cache also records each token's original absolute position
(``cache.positions``), which is bookkeeping only.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

__all__ = [
    "ContiguousKVCache",
    "HeadTransform",
    "StepOutput",
    "forward_step",
    "compute_logits",
    "rotate",
    "rope_cos_sin",
    "load_reference_model",
]

# Query rows processed per block in the attention of one step (memory bound only; each row's
# softmax is independent, so blocking does not change the result).
_ATTN_QUERY_BLOCK = 512


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


class ContiguousKVCache:
    """Per-layer contiguous KV store: ``k[l]``, ``v[l]`` are ``[kv_heads, n, head_dim]``.

    ``positions[l]`` is ``[kv_heads, n]`` (long): the original absolute position of each cached
    token (bookkeeping; per head so that head-wise policies such as H2O can keep different
    tokens in different heads, as long as every head keeps the same number).

    ``rope`` is ``"post"`` (keys cached after RoPE) or ``"pre"`` (keys cached before RoPE; the
    forward rotates them at the key positions of each step).
    """

    def __init__(self, num_layers: int, rope: str = "post") -> None:
        if rope not in ("post", "pre"):
            raise ValueError(f"rope must be 'post' or 'pre', got {rope!r}")
        self.num_layers = num_layers
        self.rope = rope
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.positions: list[torch.Tensor | None] = [None] * num_layers

    # -- sizes ---------------------------------------------------------------------------------
    def layer_len(self, layer: int) -> int:
        k = self.k[layer]
        return 0 if k is None else int(k.shape[1])

    def __len__(self) -> int:
        """Number of cached tokens (the same in every layer and head for the policies here)."""
        n = self.layer_len(0)
        for layer in range(1, self.num_layers):
            if self.layer_len(layer) != n:
                raise RuntimeError("layers hold different numbers of tokens; use layer_len()")
        return n

    # -- update --------------------------------------------------------------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Append new tokens at the end: ``k``, ``v`` ``[kv_heads, q, head_dim]``,
        ``positions`` ``[q]`` or ``[kv_heads, q]`` (original absolute positions)."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(k.shape[0], -1)
        positions = positions.to(torch.long)
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k.contiguous(), v.contiguous()
            self.positions[layer] = positions.contiguous()
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=1)
            self.v[layer] = torch.cat([self.v[layer], v], dim=1)
            self.positions[layer] = torch.cat([self.positions[layer], positions], dim=1)

    def keep_layer(self, layer: int, indices: torch.Tensor) -> None:
        """Keep only the tokens at ``indices`` (cache indices) of one layer, gathering them into
        new contiguous tensors.  ``indices`` is ``[m]`` (same tokens in every head) or
        ``[kv_heads, m]`` (per head).  Indices are sorted first, so the survivors stay in cache
        (logical) order whatever order the caller gives."""
        k = self.k[layer]
        if k is None:
            if indices.numel():
                raise IndexError("keep() on an empty cache")
            return
        h, _, d = k.shape
        indices = indices.to(device=k.device, dtype=torch.long)
        if indices.dim() == 1:
            indices = torch.sort(indices).values
            self.k[layer] = k.index_select(1, indices)
            self.v[layer] = self.v[layer].index_select(1, indices)
            self.positions[layer] = self.positions[layer].index_select(1, indices)
        elif indices.dim() == 2 and indices.shape[0] == h:
            indices = torch.sort(indices, dim=1).values
            idx3 = indices.unsqueeze(-1).expand(h, indices.shape[1], d)
            self.k[layer] = torch.gather(k, 1, idx3)
            self.v[layer] = torch.gather(self.v[layer], 1, idx3)
            self.positions[layer] = torch.gather(self.positions[layer], 1, indices)
        else:
            raise ValueError(f"indices must be [m] or [kv_heads={h}, m], got {tuple(indices.shape)}")

    def keep(self, indices: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Keep the tokens at ``indices`` in every layer: one tensor (``[m]`` or
        ``[kv_heads, m]``) for all layers, or a sequence with one tensor per layer."""
        if isinstance(indices, torch.Tensor):
            indices = [indices] * self.num_layers
        if len(indices) != self.num_layers:
            raise ValueError("need one index tensor per layer")
        for layer, idx in enumerate(indices):
            self.keep_layer(layer, idx)

    def token_positions(self, layer: int = 0, head: int = 0) -> list[int]:
        """Original absolute positions of the cached tokens (cache order)."""
        p = self.positions[layer]
        return [] if p is None else p[head].tolist()


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@dataclass
class StepOutput:
    """Result of one :func:`forward_step`.

    ``hidden``: final-normed hidden states ``[q, hidden_size]`` (feed to :func:`compute_logits`).
    ``attentions``: if requested, per layer the fp32 attention probabilities
    ``[num_q_heads, q, n_keys]``, keys being the cache before the step (cache order) followed by
    the ``q`` new tokens; masked (future) entries are 0.
    """

    hidden: torch.Tensor
    attentions: list[torch.Tensor] | None = None


class HeadTransform:
    """What :func:`forward_step` lets a method change around attention, per layer: the keys
    ``[Hkv, q, d]`` before RoPE (:meth:`project_pre_rope`), the post-RoPE queries ``[Hq, q, d]``,
    keys and values ``[Hkv, q, d]`` before they are used and cached (:meth:`project`), and the
    attention output ``[Hq, q, d]`` before ``o_proj`` (:meth:`restore`)."""

    def project_pre_rope(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        return k

    def project(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return q, k, v

    def restore(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        return o


def _decoder(model: nn.Module) -> nn.Module:
    return model.model if hasattr(model, "model") else model


def rope_cos_sin(model: nn.Module, positions: torch.Tensor, like: torch.Tensor,
                 layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the model's own rotary embedding at ``positions`` (any shape), returned with
    shape ``positions.shape + [head_dim]`` (the model's RoPE variant and scaling apply).
    ``layer_type``: a hybrid model's kind of layer (Gemma-3's sliding layers have a RoPE base of
    their own); None for a model with one RoPE."""
    rotary = _decoder(model).rotary_emb
    flat = positions.reshape(1, -1).to(device=like.device, dtype=torch.long)
    if hasattr(rotary, "layer_types"):  # one RoPE per kind of layer (Gemma-3)
        cos, sin = rotary(like, flat, layer_type=layer_type or "full_attention")
    else:
        cos, sin = rotary(like, flat)
    return cos.reshape(*positions.shape, -1), sin.reshape(*positions.shape, -1)


def layer_kind(model: nn.Module, layer_idx: int) -> tuple[str | None, int | None]:
    """A layer's kind (`config.layer_types`, None for a model without) and its sliding window
    in tokens (None: full attention), as the Hugging Face attention module was built."""
    attn = _decoder(model).layers[layer_idx].self_attn
    types = getattr(model.config, "layer_types", None)
    return (types[layer_idx] if types else None), getattr(attn, "sliding_window", None)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (the "rotate half" layout used by HF Llama): ``x`` ``[..., n, d]``,
    ``cos``/``sin`` broadcastable to it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_past: int, scale: float, want_probs: bool,
    key_keep: torch.Tensor | None = None, window: tuple[int, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eager causal attention of ``q`` new tokens over ``n_past`` cached keys + themselves.

    q ``[Hq, q, d]``, k/v ``[Hkv, n_past + q, d]``; GQA by grouping query heads (query head
    ``h`` uses KV head ``h // (Hq // Hkv)``).  Scores, softmax and the weighted sum in fp32.
    ``key_keep`` (optional, bool ``[Hkv, n_past + q]``): keys marked False are hidden from
    every query of their KV head (score -inf), on top of the causal mask.
    ``window`` (optional, a sliding-window layer): ``(tokens, query positions [q], key positions
    [n_past + q])``; a query sees only the keys less than ``tokens`` positions behind it.
    Returns the output ``[Hq, q, d]`` (fp32) and optionally the probabilities ``[Hq, q, n]``.
    """
    hq, nq, d = q.shape
    hkv, nk, _ = k.shape
    group = hq // hkv
    qg = q.float().reshape(hkv, group, nq, d)
    kf, vf = k.float(), v.float()
    out = torch.empty(hkv, group, nq, d, dtype=torch.float32, device=q.device)
    probs_all = torch.empty(hkv, group, nq, nk, dtype=torch.float32, device=q.device) if want_probs else None
    key_idx = torch.arange(nk, device=q.device)
    for start in range(0, nq, _ATTN_QUERY_BLOCK):
        stop = min(nq, start + _ATTN_QUERY_BLOCK)
        scores = torch.einsum("hgqd,hkd->hgqk", qg[:, :, start:stop], kf) * scale
        # New token i (0-based in the step) sees the n_past cached keys and new tokens 0..i.
        limit = n_past + torch.arange(start, stop, device=q.device)
        allowed = key_idx.unsqueeze(0) <= limit.unsqueeze(1)  # [rows, nk]
        if window is not None:
            tokens, query_positions, key_positions = window
            allowed = allowed & (query_positions[start:stop, None] - key_positions[None, :] < tokens)
        if key_keep is not None:
            allowed = allowed & key_keep[:, None, None, :]  # [hkv, 1, rows, nk]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, :, start:stop] = torch.einsum("hgqk,hkd->hgqd", probs, vf)
        if probs_all is not None:
            probs_all[:, :, start:stop] = probs
    out = out.reshape(hq, nq, d)
    return out, (probs_all.reshape(hq, nq, nk) if probs_all is not None else None)


@torch.inference_mode()
def forward_step(
    model: nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    cache: ContiguousKVCache,
    positions: torch.Tensor | Sequence[int],
    *,
    query_rope_positions: torch.Tensor | Sequence[int] | None = None,
    key_rope_positions: torch.Tensor | Sequence[int] | None = None,
    output_attentions: bool = False,
    key_keep: Sequence[torch.Tensor] | None = None,
    capture: dict | None = None,
    head_transform: "HeadTransform | None" = None,
) -> StepOutput:
    """Run ``q`` new tokens through the decoder against ``cache`` and append their K/V to it.

    ``positions`` ``[q]``: the tokens' original absolute positions (stored in the cache).
    ``query_rope_positions`` ``[q]``: positions at which the queries are rotated (default:
    ``positions``).  With a ``rope="post"`` cache the new keys are rotated at the same positions
    as their queries before being cached.  With a ``rope="pre"`` cache, raw keys are cached and
    all keys of the step (cache then new) are rotated at ``key_rope_positions``
    (``[n + q]`` or ``[kv_heads, n + q]``; default ``0..n+q-1``, i.e. positions in the cache).

    Each new token attends to the whole cache plus the new tokens up to itself (causal).

    ``key_keep`` (optional): one bool tensor per layer, ``[kv_heads, n + q]`` (the cache before
    the step, in cache order, then the new tokens); a False key is hidden from every query of
    its KV head in that layer (head-wise pruning without moving the cache).  Keep the new tokens
    visible, or a row may see no key at all.
    ``capture`` (optional dict): filled with ``"q_input"``, per layer the input of ``q_proj``
    (``input_layernorm(h)``, ``[q, hidden]``), ``"query"``, per layer the post-RoPE query
    ``[Hq, q, head_dim]``, and with a ``rope="post"`` cache ``"key"`` and ``"value"``, per layer
    the new tokens' post-RoPE keys and values ``[Hkv, q, head_dim]``, and ``"key_pre_rope"``,
    their keys before RoPE.
    ``head_transform`` (optional, ``rope="post"`` caches only): changes each layer's keys before
    RoPE, its post-RoPE queries, keys and values before the keys and values are cached, and the
    attention output before ``o_proj`` (FDC's rotations, :mod:`vllm_kvprune.reference.fdc`; the
    pre-RoPE ablation, :mod:`vllm_kvprune.fdc.pre_rope`).
    """
    dec = _decoder(model)
    device = dec.embed_tokens.weight.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(-1)
    pos = torch.as_tensor(positions, dtype=torch.long, device=device).reshape(-1)
    nq = ids.shape[0]
    if pos.shape[0] != nq:
        raise ValueError("positions must have one entry per input token")
    qpos = pos if query_rope_positions is None else torch.as_tensor(query_rope_positions, dtype=torch.long, device=device).reshape(-1)

    h = dec.embed_tokens(ids)  # [q, hidden]
    n_past = len(cache)
    cos_q, sin_q = rope_cos_sin(model, qpos, h, getattr(model.config, "layer_types", None) and "full_attention")
    if key_keep is not None and len(key_keep) != len(dec.layers):
        raise ValueError("key_keep needs one mask per layer")
    if capture is not None:
        capture["q_input"], capture["query"], capture["key"], capture["value"] = [], [], [], []
        capture["key_pre_rope"] = []
    if head_transform is not None and cache.rope != "post":
        raise ValueError("head_transform needs a post-RoPE cache (keys rotated once, when written)")
    if cache.rope == "pre":
        if key_rope_positions is None:
            kpos = torch.arange(n_past + nq, device=device)
        else:
            kpos = torch.as_tensor(key_rope_positions, dtype=torch.long, device=device)
        if kpos.shape[-1] != n_past + nq:
            raise ValueError("key_rope_positions must cover the cache and the new tokens")
        cos_k, sin_k = rope_cos_sin(model, kpos, h)  # [n+q, d] or [Hkv, n+q, d]

    attentions: list[torch.Tensor] | None = [] if output_attentions else None
    rope_by_kind = {None: (cos_q, sin_q)}
    for layer_idx, layer in enumerate(dec.layers):
        attn = layer.self_attn
        d = attn.head_dim
        kind, window = layer_kind(model, layer_idx)
        if kind not in rope_by_kind:  # a hybrid model's layers of another kind: their own RoPE
            rope_by_kind[kind] = rope_cos_sin(model, qpos, h, kind)
        if cache.rope == "pre" and hasattr(dec.rotary_emb, "layer_types"):
            raise ValueError("a pre-RoPE cache needs a model with one RoPE")
        cos_q, sin_q = rope_by_kind[kind]
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(nq, -1, d).transpose(0, 1)  # [Hq, q, d]
        k = attn.k_proj(x).view(nq, -1, d).transpose(0, 1)  # [Hkv, q, d]
        v = attn.v_proj(x).view(nq, -1, d).transpose(0, 1)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3-style per-head norms
            q = attn.q_norm(q)
        if getattr(attn, "k_norm", None) is not None:
            k = attn.k_norm(k)
        q = rotate(q, cos_q, sin_q)
        if capture is not None:
            capture["q_input"].append(x)
            capture["query"].append(q)
        if cache.rope == "post":
            if capture is not None:
                capture["key_pre_rope"].append(k)
            if head_transform is not None:
                k = head_transform.project_pre_rope(layer_idx, k)
            k = rotate(k, cos_q, sin_q)
            if capture is not None:
                capture["key"].append(k)
                capture["value"].append(v)
            if head_transform is not None:
                q, k, v = head_transform.project(layer_idx, q, k, v)
            cache.append(layer_idx, k, v, pos)
            keys = cache.k[layer_idx]
        else:
            cache.append(layer_idx, k, v, pos)
            keys = rotate(cache.k[layer_idx], cos_k, sin_k)
        values = cache.v[layer_idx]
        scale = getattr(attn, "scaling", d**-0.5)
        keep = None
        if key_keep is not None:
            keep = torch.as_tensor(key_keep[layer_idx], dtype=torch.bool, device=device)
            if keep.shape != (keys.shape[0], keys.shape[1]):
                raise ValueError(f"key_keep[{layer_idx}] must be [kv_heads, n + q] = "
                                 f"{(keys.shape[0], keys.shape[1])}, got {tuple(keep.shape)}")
        # A sliding-window layer: by original positions (the cache's bookkeeping), so it holds
        # whatever order the cache is in.
        sliding = None if window is None else (int(window), pos, cache.positions[layer_idx][0])
        o, probs = _attention(q, keys, values, n_past, scale, output_attentions, keep, sliding)
        if attentions is not None:
            attentions.append(probs)
        if head_transform is not None:
            o = head_transform.restore(layer_idx, o)
        o = o.to(h.dtype).transpose(0, 1).reshape(nq, -1)
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma-3: a norm after attention and around the MLP
            h = h + layer.post_attention_layernorm(attn.o_proj(o))
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        else:
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    return StepOutput(hidden=dec.norm(h), attentions=attentions)


@torch.inference_mode()
def compute_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[rows, vocab]`` from final-normed hidden states ``[rows, hidden]`` (capped
    where the model caps them, `final_logit_softcapping`)."""
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def load_reference_model(model_dir: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a Hugging Face causal LM (a ``LlamaForCausalLM`` for the models of this project)
    from a local folder: eager attention, eval mode, gradients off."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager")
    model.eval()
    model.requires_grad_(False)
    return model
