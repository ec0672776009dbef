"""H2O's victims for a whole step's requests at once, where the mass table is.

`kernels.lowest_mass_slots` searches one request on the host (the C++ op), a device's table
copied back request by request. On a GPU that host search, not the attention, was most of
h2o's step (`bench gpu-steps`, docs/GPU.md). Here the step's requests are searched together
on the table's device: their slots and the positions their slots hold go there once, torch
ranks every (request, layer, KV head) there, and only the victims come back, in one copy.
The choice is the host op's: lowest mass first, ties to the older position, never a sink
(position below `sinks`) nor a recent token (from `next_position - recent` on).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Pads the requests' slot lists to one width: sorts after every real position, never evictable.
_PADDING = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class VictimSearch:
    """One request's search: `count` victims per layer and KV head among its `slots` `[n]`
    (global, int64), whose positions per layer and head are `logical` `[layers, heads, n]`."""

    slots: torch.Tensor
    logical: np.ndarray
    count: int
    next_position: int
    sinks: int
    recent: int


def lowest_mass_slots_batched(mass: torch.Tensor, searches: list[VictimSearch]) -> list[torch.Tensor]:
    """Each search's victims, `[layers, heads, count]` indices into its `slots` (host tensors),
    best first; `mass` is the table `[layers, heads, num_slots]` (float32, any device). Raises
    ValueError when a search has fewer than `count` evictable tokens in some head."""
    num_layers, num_heads, _ = mass.shape
    num_requests, width = len(searches), max(len(search.slots) for search in searches)
    pinned = mass.device.type == "cuda"
    slots = torch.zeros(num_requests, width, dtype=torch.int64, pin_memory=pinned)
    positions = torch.full((num_requests, num_layers, num_heads, width), _PADDING, dtype=torch.int32,
                           pin_memory=pinned)
    bounds = torch.empty(num_requests, 2, dtype=torch.int32, pin_memory=pinned)  # evictable [low, high)
    for row, search in enumerate(searches):
        n = len(search.slots)
        slots[row, :n] = search.slots
        positions[row, :, :, :n] = torch.from_numpy(np.asarray(search.logical, dtype=np.int32))
        bounds[row, 0], bounds[row, 1] = search.sinks, search.next_position - search.recent
    slots, positions, bounds = (tensor.to(mass.device, non_blocking=True) for tensor in (slots, positions, bounds))
    scores = mass[:, :, slots.view(-1)].view(num_layers, num_heads, num_requests, width).permute(2, 0, 1, 3)
    low, high = bounds[:, 0].view(-1, 1, 1, 1), bounds[:, 1].view(-1, 1, 1, 1)
    scores = scores.masked_fill((positions < low) | (positions >= high), float("inf"))
    by_age = torch.argsort(positions, dim=-1, stable=True)
    ranked = torch.sort(scores.gather(-1, by_age), dim=-1, stable=True)
    count = max(search.count for search in searches)
    victims = by_age.gather(-1, ranked.indices[..., :count]).cpu()
    chosen_mass = ranked.values[..., :count].cpu()
    out = []
    for row, search in enumerate(searches):
        if not bool(torch.isfinite(chosen_mass[row, :, :, search.count - 1]).all()):
            raise ValueError(f"fewer than {search.count} evictable tokens in some head")
        out.append(victims[row, :, :, : search.count])
    return out


__all__ = ["VictimSearch", "lowest_mass_slots_batched"]
