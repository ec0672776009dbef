"""The registry of KV policies: one module each, and everything else derives from them.

A policy module declares one `Policy` (`policies/base.py`) as `POLICY`: its settings (shared
ones from `policies/settings.py`, its own beside it), its traits and its decisions. Adding a
method is its module, its reference (`vllm_kvprune/reference/`), a kernel if it needs one and
its line in `MODULES`; the config's fields, the flags, the per-request keys, the request
checks, the model checks and the docs' tables follow.
"""

from __future__ import annotations

import importlib

from vllm_kvprune.policies.base import LAYOUTS, NoPolicy, Policy
from vllm_kvprune.policies.settings import FDC, POSITIONS, PREFILL, PREFILL_CHUNK, PRUNE_INTERVAL, Setting

# The policy modules under vllm_kvprune/policies/, in the order the docs list them.
MODULES = (
    "streaming",
    "h2o",
    "paged_eviction",
    "gvote",
    "fdc",
    "snapkv",
)

REGISTRY: dict[str, Policy] = {NoPolicy.name: NoPolicy()}
for _module in MODULES:
    _policy = importlib.import_module(f"{__name__}.{_module}").POLICY
    REGISTRY[_policy.name] = _policy
del _module, _policy


def get_policy(name: str) -> Policy:
    """The registered policy called `name`."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(REGISTRY)}") from None


def all_settings() -> tuple[Setting, ...]:
    """Every setting some policy reads, each once, in the order the docs list them (shared
    ones first, in the order policies declare them)."""
    seen: dict[str, Setting] = {}
    for policy in REGISTRY.values():
        for setting in policy.settings:
            if seen.setdefault(setting.name, setting) is not setting:
                raise TypeError(f"two settings are called {setting.name!r} ({policy.name}'s is another object)")
    return tuple(seen.values())


def readers(setting_name: str) -> list[str]:
    """The policies that read a setting."""
    return [name for name, policy in REGISTRY.items() if policy.reads(setting_name)]


__all__ = ["FDC", "LAYOUTS", "MODULES", "POSITIONS", "PREFILL", "PREFILL_CHUNK", "PRUNE_INTERVAL", "REGISTRY",
           "Policy", "Setting", "all_settings", "get_policy", "readers"]
