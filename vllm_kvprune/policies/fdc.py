"""FDC (fast KV dimensionality compression): every token stays, each KV head narrower.

Offline, `vllm-kvprune calibrate fdc` fits per layer and KV head a rotation that puts the
post-RoPE query/key dimensions (and the value dimensions) in decreasing order of weight, and
a rank per head from one removal rate. Served, the attention backend projects each layer's
post-RoPE queries and keys (and values) onto their head's first dims, caches the reduced
keys and values packed side by side (no head padded to the widest), attends in the reduced
space and turns the output back. Nothing is evicted, so there is nothing to plan per step:
the engine's maps stay vLLM's; the narrower cache lives in the KV-cache spec and the kernel.
What the paper leaves open and what we chose: `docs/FDC.md`.

FDC is also a cache *format* under an eviction policy whose module reads the `fdc` setting
(`streaming`, `paged_eviction`): the policy's layout and decisions, each token narrower.
`check_format` and `FORMAT_REFUSALS` hold for every config with a calibration.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_kvprune.policies.base import NameOf, Policy
from vllm_kvprune.policies.settings import FDC, KVConfigError

if TYPE_CHECKING:
    from vllm_kvprune.config import KVPolicyConfig

_KEEPS_ALL = "keeps every token; remove it"
# What FDC's reduced-space kernel does not honour (`worker/features.py` feature -> why), whatever
# the policy it runs under: it is plain causal softmax attention in the reduced space. Checked on
# the layers FDC narrows, a model's full-attention layers: a hybrid model's sliding-window layers
# stay vLLM's at full width (their memory is bounded by the window), so a window is no refusal.
FORMAT_REFUSALS = {"softcap": "FDC's kernel does not cap logits", "sinks": "FDC's kernel has none"}


class FdcPolicy(Policy):
    """Narrower heads, every token kept (`full` layout: vLLM's own block tables)."""

    name = "fdc"
    summary = ('FDC: every token, each KV head narrower. Offline, `vllm-kvprune calibrate fdc MODEL --out FILE` fits '
               'per layer and KV head a rotation of the post-RoPE queries and keys (and of the values) and a rank '
               'per head from one removal rate; served, the attention backend projects q/k/v after RoPE, caches each '
               "head's reduced K/V packed side by side (no padding to the widest head), attends in the reduced space "
               "in a C++ kernel (LPT schedule) and turns the output back. vLLM's KV-cache spec reports each layer's "
               'narrower token, so the same memory holds more tokens (the mean width over layers sets the pool). '
               'Compiled or eager. Composes with the policies that read `fdc` (`--kv-policy streaming --kv-fdc '
               "FILE`: the policy's cap of narrower blocks; docs/MODELS.md's traits table says which and why not). "
               '`docs/FDC.md`')
    layout = "full"
    settings = (FDC,)
    refused_settings = {"budget": _KEEPS_ALL, "window": _KEEPS_ALL}
    fdc_refusal = None
    model_refusals = FORMAT_REFUSALS
    reference = "fdc"

    def validate(self, config: KVPolicyConfig, name_of: NameOf) -> KVPolicyConfig:
        if config.fdc is None:
            raise KVConfigError(name_of("fdc"), "policy 'fdc' needs a calibration file (make one with: "
                                                "vllm-kvprune calibrate fdc MODEL --out FILE)")
        return config

    def explain_capacity(self, config: KVPolicyConfig, block_size: int) -> str:
        return "fdc keeps every token, each in a narrower block"


def check_format(config: KVPolicyConfig, name_of: NameOf) -> KVPolicyConfig:
    """A config with a calibration (`fdc` alone or under an eviction policy): the file named as
    text, and the positions FDC keeps (keys are projected after RoPE and never rotated again)."""
    if not isinstance(config.fdc, (str, os.PathLike)) or not str(config.fdc):
        raise KVConfigError(name_of("fdc"), f"must name a calibration file, got {config.fdc!r}")
    if config.positions != "original":
        raise KVConfigError(name_of("positions"), f"policy {config.name!r} with FDC supports only 'original' (keys "
                                                  "are projected after RoPE and are never rotated again)")
    return config.replace(fdc=str(config.fdc))


POLICY = FdcPolicy()
