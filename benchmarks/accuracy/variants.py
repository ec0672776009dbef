"""Ablations: a policy of ours at other per-request settings, run and reported under a name of
its own (`python -m benchmarks accuracy --policies <name>`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Variant:
    """`settings`: the per-request `kv_*` settings that make it; `kvpress`: kvpress's press for
    the policy runs beside it at the same settings (where the press has them)."""

    policy: str
    settings: dict[str, Any]
    kvpress: bool = False


VARIANTS: dict[str, Variant] = {
    # The paper's own rule (no protected sinks, no protected newest block: every block a
    # candidate), next to ours.
    "paged_eviction_paper": Variant("paged_eviction", {"kv_sinks": 0, "kv_recent": 0}),
    # SnapKV's pooling 15 wide instead of kvpress's 5: a 5-digit needle and the words before it
    # fall under one pooled peak (docs/SNAPKV.md, "Accuracy").
    "snapkv_pool15": Variant("snapkv", {"kv_snapkv_kernel": 15}, kvpress=True),
}
