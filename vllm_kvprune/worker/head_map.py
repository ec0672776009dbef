"""Which logical token each physical slot holds, per layer and KV head (head-wise policies)."""

from __future__ import annotations

import numpy as np

SKIP = -1  # a move whose destination is SKIP does nothing (the kernels' convention)


class HeadSlotMap:
    """Physical slot -> logical position for one request, per layer and KV head.

    `logical[l, h, s]` is the position that local slot s holds for KV head h of layer l.
    Heads keep different tokens but always the same number, so one `seq_len` and one
    block-table row serve every head. Invariants, checked by `check()`:
    - every (layer, head) holds exactly the slots [0, num_valid) (no holes: the kernel
      attends every slot below seq_len);
    - no (layer, head) holds a position twice.
    """

    def __init__(self, num_layers: int, num_heads: int) -> None:
        # Room to grow: a decode step appends one slot to every head, without reallocating.
        self._held = np.empty((num_layers, num_heads, 64), np.int64)
        self.num_valid = 0

    @property
    def logical(self) -> np.ndarray:
        """`[layers, heads, num_valid]`, a view (writes land in the map)."""
        return self._held[:, :, : self.num_valid]

    @property
    def num_layers(self) -> int:
        return self._held.shape[0]

    def append(self, positions: np.ndarray) -> np.ndarray:
        """New tokens in the next slots, the same ones for every head; returns them `[q]`."""
        start, stop = self.num_valid, self.num_valid + len(positions)
        if stop > self._held.shape[2]:
            grown = np.empty((*self._held.shape[:2], max(stop, 2 * self._held.shape[2])), np.int64)
            grown[:, :, :start] = self.logical
            self._held = grown
        self._held[:, :, start:stop] = positions
        self.num_valid = stop
        return np.arange(start, stop, dtype=np.int64)

    def replace(self, victims: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """EQUIP per head: evict `victims` `[layers, heads, r]` (local slots) and write one new
        token in place of a victim of every head.

        Returns the new token's slot per head `[layers, heads]` and the moves to apply before
        writing it, `[layers, r - 1, heads]` sources and destinations (SKIP where a head has
        fewer to move). With one victim nothing moves; with more (lazy pruning) survivors past
        the new end of the prefix fill the other holes.
        """
        num_layers, num_heads, count = victims.shape
        new_valid = self.num_valid - count + 1
        if count == 1:
            new_slots = victims[:, :, 0].copy()
            self._held[np.arange(num_layers)[:, None], np.arange(num_heads), new_slots] = position
            return new_slots, np.empty((num_layers, 0, num_heads), np.int64), np.empty((num_layers, 0, num_heads), np.int64)
        new_slots = np.empty((num_layers, num_heads), np.int64)
        sources = np.full((num_layers, count - 1, num_heads), SKIP, np.int64)
        destinations = np.full_like(sources, SKIP)
        for layer in range(num_layers):
            for head in range(num_heads):
                logical = self._held[layer, head]
                is_victim = np.zeros(self.num_valid, bool)
                is_victim[victims[layer, head]] = True
                holes = np.flatnonzero(is_victim[:new_valid])
                stranded = np.flatnonzero(~is_victim[new_valid:]) + new_valid
                new_slots[layer, head] = holes[0]
                logical[holes[1:]] = logical[stranded]
                logical[holes[0]] = position
                sources[layer, : len(stranded), head] = stranded
                destinations[layer, : len(stranded), head] = holes[1:]
        self.num_valid = new_valid
        return new_slots, sources, destinations

    def truncate(self, num_kept: int) -> None:
        """A prompt is being pruned to `num_kept` tokens per head; `set_layer_survivors`
        then records which ones each layer's heads kept."""
        self.num_valid = num_kept
        self.logical[:] = SKIP

    def set_layer_survivors(self, layer: int, positions: np.ndarray) -> None:
        """`positions` `[heads, num_valid]`: what layer `layer`'s heads hold, slot by slot."""
        self._held[layer, :, : self.num_valid] = positions

    def check(self) -> None:
        ordered = np.sort(self.logical, axis=2)
        assert (ordered >= 0).all(), "a slot below num_valid holds no token"
        assert (np.diff(ordered, axis=2) > 0).all(), "a logical token is mapped twice in one head"
