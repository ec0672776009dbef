"""Which logical token each physical slot of a request holds."""

from __future__ import annotations

import numpy as np

Moves = tuple[np.ndarray, np.ndarray]  # (source slot indices, destination slot indices)
NO_MOVES: Moves = (np.empty(0, np.int64), np.empty(0, np.int64))


class InvariantError(RuntimeError):
    """A slot map broke one of its invariants: a bug in the plugin, never a user error."""


class SlotMap:
    """Physical slot -> logical position for one request (all layers of a layer-uniform policy).

    Slot indices count tokens inside the request's own blocks (slot i lives in the
    request's block i // block_size). Invariants, checked by `check()`:
    - the live slots are exactly the prefix [0, num_valid): the CPU kernel attends every
      slot below a request's seq_len, so holes are never left behind;
    - no logical position is held by two slots.
    """

    def __init__(self) -> None:
        self.logical = np.empty(0, np.int64)
        # `positions: cache`: layer name -> the sink tokens' original post-RoPE (K, V), and the
        # position shift the sink slots hold now (tokens evicted when they were last rotated).
        self.sink_kv: dict[str, tuple] = {}
        self.sink_shift = 0

    @property
    def num_valid(self) -> int:
        return len(self.logical)

    def kept_tokens(self) -> tuple[float, int]:
        """Tokens held (mean and max over heads and layers: every one holds the same)."""
        return float(self.num_valid), self.num_valid

    def kept_choices(self) -> tuple[str, list]:
        """The positions kept, sorted: one list for every layer and head."""
        return "slots", sorted(self.logical.tolist())

    @property
    def nbytes(self) -> int:
        """Bytes this map holds (its positions and the sink tokens' K/V)."""
        return self.logical.nbytes + sum(k.nbytes + v.nbytes for k, v in self.sink_kv.values())

    def local_slots(self) -> np.ndarray:
        """The request's local slots this map holds (debug checks)."""
        return np.arange(self.num_valid)

    def blocks_spanned(self, block_size: int) -> int:
        """Leading local blocks of the request's row its slots live in (debug checks)."""
        return -(-self.num_valid // block_size)

    def append(self, positions: np.ndarray) -> np.ndarray:
        """Put new tokens in the next free slots; returns their slot indices."""
        start = self.num_valid
        self.logical = np.concatenate([self.logical, positions.astype(np.int64)])
        return np.arange(start, self.num_valid, dtype=np.int64)

    def compact(self, kept_slots: np.ndarray) -> Moves:
        """Keep only `kept_slots`, moved (in the given order) to the front."""
        kept_slots = np.asarray(kept_slots, np.int64)
        self.logical = self.logical[kept_slots]
        destinations = np.arange(len(kept_slots), dtype=np.int64)
        moved = kept_slots != destinations
        return kept_slots[moved], destinations[moved]

    def replace(self, victim_slots: np.ndarray, position: int) -> tuple[int, Moves]:
        """EQUIP: evict `victim_slots` and write one new token in place of one of them.

        With one victim the new token simply overwrites it (no copy at all). With more
        (lazy pruning), survivors beyond the new end of the prefix fill the other holes.
        Returns the new token's slot and the moves to apply before writing it.
        """
        if len(victim_slots) == 1:  # a decode step's one eviction: overwritten where it is
            new_slot = int(victim_slots[0])
            self.logical[new_slot] = position
            return new_slot, NO_MOVES
        new_valid = self.num_valid - len(victim_slots) + 1
        is_victim = np.zeros(self.num_valid, bool)
        is_victim[victim_slots] = True
        holes = np.flatnonzero(is_victim[:new_valid])
        stranded = np.flatnonzero(~is_victim[new_valid:]) + new_valid
        new_slot = int(holes[0])
        sources, destinations = stranded, holes[1:]
        self.logical[destinations] = self.logical[sources]
        self.logical[new_slot] = position
        self.logical = self.logical[:new_valid]
        return new_slot, (sources, destinations)

    def check(self) -> None:
        if len(np.unique(self.logical)) != self.num_valid:
            raise InvariantError("a logical token is mapped twice")
