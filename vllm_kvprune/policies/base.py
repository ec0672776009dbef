"""What a policy decides, separated from how the engine carries it out."""

from __future__ import annotations

import numpy as np

from vllm_kvprune.config import KVPolicyConfig


class Policy:
    """Chooses which cached tokens survive; the slot maps and kernels do the rest.

    Both methods get `logical`: the logical position held by each valid physical slot
    of one request (`logical[i]` for slot i, all distinct). Ties are broken towards
    evicting the oldest token, the same rule as the reference implementations.
    """

    name: str = "base"
    # "token": one slot map for all layers (survivors/victims below); "block": each layer
    # evicts its own whole blocks (see `PagedEvictionPolicy`); "head": each layer and KV
    # head evicts its own tokens (see `H2OPolicy`); "headpage": each layer and KV head keeps
    # its own number of tokens, in head-pages (see `GVotePolicy`); "dims": every token stays,
    # each head narrower (see `FdcPolicy`; no per-step plan).
    granularity: str = "token"

    def survivors(self, logical: np.ndarray, keep: int, config: KVPolicyConfig) -> np.ndarray:
        """Slots to keep (at most `keep`), in the order they will be compacted to."""
        raise NotImplementedError

    def victims(self, logical: np.ndarray, count: int, config: KVPolicyConfig) -> np.ndarray:
        """`count` slots whose tokens are evicted now."""
        raise NotImplementedError
