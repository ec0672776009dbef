"""KV policies: each decides which tokens stay; the shared mechanism moves them.

A policy is a small class (see `base.Policy`); `get_policy(name)` returns it.
"""

from __future__ import annotations

from vllm_kvprune.policies.base import Policy
from vllm_kvprune.policies.fdc import FdcPolicy
from vllm_kvprune.policies.gvote import GVotePolicy
from vllm_kvprune.policies.h2o import H2OPolicy
from vllm_kvprune.policies.paged_eviction import PagedEvictionPolicy
from vllm_kvprune.policies.streaming import StreamingPolicy

_POLICIES: dict[str, type[Policy]] = {
    "streaming": StreamingPolicy,
    "h2o": H2OPolicy,
    "paged_eviction": PagedEvictionPolicy,
    "gvote": GVotePolicy,
    "fdc": FdcPolicy,
}


def get_policy(name: str) -> Policy:
    """The policy object for an available policy name."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy {name!r} is not available yet") from None


__all__ = ["FdcPolicy", "GVotePolicy", "H2OPolicy", "PagedEvictionPolicy", "Policy", "StreamingPolicy", "get_policy"]
