"""FDC (fast KV dimensionality compression): every token stays, each KV head narrower.

Offline, `vllm-kvprune calibrate fdc` fits per layer and KV head a rotation that puts the
post-RoPE query/key dimensions (and the value dimensions) in decreasing order of weight, and
a rank per head from one removal rate. Served, the attention backend projects each layer's
post-RoPE queries and keys (and values) onto their head's first dims, caches the reduced
keys and values packed side by side (no head padded to the widest), attends in the reduced
space and turns the output back. Nothing is evicted, so there is nothing to plan per step:
the engine's maps stay vLLM's; the narrower cache lives in the KV-cache spec and the kernel.
What the paper leaves open and what we chose: `docs/FDC.md`.
"""

from __future__ import annotations

from vllm_kvprune.policies.base import Policy


class FdcPolicy(Policy):
    """Narrower heads, every token kept (no slot map: vLLM's own block tables)."""

    name = "fdc"
    granularity = "dims"
