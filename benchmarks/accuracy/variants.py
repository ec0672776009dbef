"""Ablations: a policy of ours at other per-request settings, run and reported under a name of
its own (`python -m benchmarks accuracy --policies <name>`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    """`settings`: the per-request `kv_*` settings that make it; `engine`: the engine settings
    it needs (one that a request cannot choose alone: `allocation`); `kvpress`: kvpress's press
    for the policy at the same settings runs beside it (where the press has them)."""

    policy: str
    settings: dict[str, Any]
    kvpress: bool = False
    engine: dict[str, Any] = field(default_factory=dict)


VARIANTS: dict[str, Variant] = {
    # The paper's own rule (no protected sinks, no protected newest block: every block a
    # candidate), next to ours.
    "paged_eviction_paper": Variant("paged_eviction", {"kv_sinks": 0, "kv_recent": 0}),
    # SnapKV's pooling 15 wide instead of kvpress's 5: a 5-digit needle and the words before it
    # fall under one pooled peak (docs/SNAPKV.md, "Accuracy").
    "snapkv_pool15": Variant("snapkv", {"kv_snapkv_kernel": 15}, kvpress=True),
    # SnapKV's budget spread over layers (PyramidKV) or over each layer's heads (AdaKV), on
    # head-pages with a KV-cache group per layer; beside kvpress's PyramidKVPress / AdaKVPress.
    "snapkv_pyramid": Variant("snapkv", {"kv_allocation": "pyramid"}, kvpress=True, engine={"allocation": "pyramid"}),
    "snapkv_adaptive": Variant("snapkv", {"kv_allocation": "adaptive"}, kvpress=True,
                               engine={"allocation": "adaptive"}),
    # The same for H2O's prompt mass (kvpress has no press for it: AdaKVPress refuses
    # ObservedAttentionPress, PyramidKVPress is SnapKV's).
    "h2o_pyramid": Variant("h2o", {"kv_allocation": "pyramid"}, engine={"allocation": "pyramid"}),
    "h2o_adaptive": Variant("h2o", {"kv_allocation": "adaptive"}, engine={"allocation": "adaptive"}),
}
# The variants that spread a policy's budget differently (`allocation`): the accuracy suite
# sets them against the policy's uniform budget at equal memory (`memory.allocation_table`).
ALLOCATIONS = {name: variant.policy for name, variant in VARIANTS.items() if "allocation" in variant.engine}
