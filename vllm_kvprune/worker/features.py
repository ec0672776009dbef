"""What each policy honours of a model's attention, layer by layer; the rest refuses at start-up.

The worker reads every attention layer as vLLM built it (its impl's window, soft-cap, ALiBi,
sinks, cache dtype, attention type, KV sharing, and the RoPE the layer applies) and decides
once, before the KV cache exists. What no policy runs with is refused here; what one policy
cannot honour is that policy's `model_refusals` trait (`vllm_kvprune/policies/`), checked on
the layers it prunes (the full-attention layers; under FDC's narrow heads the format's refusals
join the policy's on those same layers, the ones FDC narrows); the remedy names the policies
that do honour it. The table in docs/MODELS.md
is rendered from the same traits (`tools/policy_docs.py`, tested).

Why: the policies reorder a request's slots (EQUIP), so everything vLLM's kernel derives
from a key's slot index is wrong after an eviction: a sliding window (physical distance) and
ALiBi (physical distance) are; soft-capping and learned sinks are not (per logit, per head),
and vLLM's kernel applies them, unless a policy computes logits itself. Our slot kernels move
K/V in the model dtype, not fp8 with scales. Sliding-window layers of a hybrid model (Gemma
2/3) keep vLLM's own cache and manager, at full width under FDC too: the policy prunes (FDC
narrows) the full-attention layers, which is where the memory goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies import REGISTRY
from vllm_kvprune.policies.fdc import FORMAT_REFUSALS

# A model feature a policy may refuse (its `model_refusals` keys) -> how the refusal names it.
FEATURES = {"sliding_window": "sliding-window attention", "softcap": "logit soft-capping",
            "sinks": "attention sinks"}


def _window_tokens(window: Any) -> int | None:
    """The tokens a sliding window spans (None: no window). vLLM's CPU impl stores the window
    (-1: none); its GPU impls store the (left, right) reach, `(window - 1, 0)` for a decoder
    and `(-1, -1)` for none."""
    if isinstance(window, tuple):
        left = window[0]
        return None if left < 0 else int(left) + 1
    return None if window in (None, -1) else int(window)


class UnsupportedModelError(RuntimeError):
    """A policy cannot honour a feature of the model's attention; the message is one line."""


@dataclass(frozen=True)
class LayerFeatures:
    """The attention features of one layer, as vLLM built it."""

    name: str
    sliding_window: int | None
    softcap: float
    alibi: bool
    sinks: bool
    kv_cache_dtype: str
    attn_type: str
    shares_kv: bool
    kernel_refusal: str | None = None

    @classmethod
    def of(cls, name: str, attention: Any) -> "LayerFeatures":
        impl = attention.impl
        return cls(
            name=name,
            sliding_window=_window_tokens(getattr(impl, "sliding_window", None)),
            softcap=float(getattr(impl, "logits_soft_cap", 0) or 0),
            alibi=getattr(impl, "alibi_slopes", None) is not None,
            sinks=getattr(impl, "sinks", None) is not None,
            kv_cache_dtype=str(getattr(impl, "kv_cache_dtype", "auto")),
            attn_type=str(getattr(getattr(impl, "attn_type", "decoder"), "value", getattr(impl, "attn_type", "decoder"))),
            shares_kv=getattr(impl, "kv_sharing_target_layer_name", None) is not None,
            # What the wrapped backend's own kernel would run that the policies do not honour.
            kernel_refusal=impl.policy_refusal() if callable(getattr(impl, "policy_refusal", None)) else None,
        )

    @property
    def pruned(self) -> bool:
        """Whether the policy prunes this layer (sliding-window layers stay vLLM's)."""
        return self.sliding_window is None

    def has(self, feature: str) -> bool:
        """Whether this layer has one of `FEATURES`."""
        if feature == "sliding_window":
            return self.sliding_window is not None
        return bool(getattr(self, feature))


def honouring(feature: str) -> list[str]:
    """The policies that serve a model with `feature` on the layers they prune."""
    return [name for name, policy in REGISTRY.items() if name != "none" and feature not in policy.model_refusals]


def refusal(config: KVPolicyConfig, layers: list[LayerFeatures],
            rope_ok: Callable[[str], str | None] | None = None) -> str | None:
    """Why `config`'s policy cannot run on these layers (one line), or None.

    `rope_ok(layer_name)` says why the layer's RoPE cannot re-anchor sinks (None: it can);
    it is asked only for `positions: cache`.
    """
    policy = config.name
    if not config.active:
        return None

    def refused(feature: str, layer: LayerFeatures, remedy: str = "") -> str:
        return f"{policy}: {feature} ({layer.name}) is not supported" + (f"; {remedy}" if remedy else "")

    refusals = dict(config.policy.model_refusals)
    if config.narrow_heads:
        refusals.update(FORMAT_REFUSALS)
    for layer in layers:
        if layer.kernel_refusal is not None:
            return refused(layer.kernel_refusal, layer, "use --attention-backend TRITON_ATTN")
        if layer.attn_type != "decoder":
            return refused(f"{layer.attn_type} attention", layer)
        if layer.shares_kv:
            return refused("KV cache shared across layers", layer)
        if layer.kv_cache_dtype != "auto":
            return refused(f"KV cache dtype {layer.kv_cache_dtype}", layer, "use --kv-cache-dtype auto")
        if layer.alibi:
            return refused("ALiBi", layer, "its biases follow slot order, which eviction changes")
        # The policy's layers: those it prunes (and FDC narrows); the others stay vLLM's.
        if not layer.pruned:
            continue
        for feature, why in refusals.items():
            if not layer.has(feature):
                continue
            if config.narrow_heads and feature in FORMAT_REFUSALS:
                return refused(FEATURES[feature], layer, why)  # FDC's kernel, whatever the policy
            return refused(FEATURES[feature], layer, f"{why}; use {', '.join(honouring(feature))}")
    pruned = [layer for layer in layers if layer.pruned]
    if not pruned:
        return refused("sliding-window attention", layers[0],
                       "every layer has a window, so there is no full-attention layer to prune")
    if config.positions == "cache" and rope_ok is not None:
        for layer in pruned:
            why = rope_ok(layer.name)
            if why is not None:
                return refused(f"positions: cache with {why}", layer, "use positions: original")
    return None
