"""Which logical token each physical slot holds, per layer and KV head (head-wise policies)."""

from __future__ import annotations

import numpy as np

from vllm_kvprune.worker.slot_map import InvariantError

SKIP = -1  # a move whose destination is SKIP does nothing (the kernels' convention)


class HeadSlotMap:
    """Physical slot -> logical position for one request, per layer and KV head.

    `logical[l, h, s]` is the position that local slot s holds for KV head h of layer l.
    Heads keep different tokens but always the same number, so one `seq_len` and one
    block-table row serve every head. Invariants, checked by `check()`:
    - every (layer, head) holds exactly the slots [0, num_valid) (no holes: the kernel
      attends every slot below seq_len);
    - no (layer, head) holds a position twice.

    Memory follows the cap, not the longest sequence: until the first eviction every head
    holds slot s = position s, which is not stored at all (a prompt of any length costs
    nothing here); after it the table has room for about twice the tokens held, and a
    pruned prompt gives its room back.
    """

    def __init__(self, num_layers: int, num_heads: int) -> None:
        self._shape = (num_layers, num_heads)
        # None while every head holds the identity (slot s = position s).
        self._held: np.ndarray | None = None
        self.num_valid = 0

    @property
    def logical(self) -> np.ndarray:
        """`[layers, heads, num_valid]`, a view (writes land in the map)."""
        self._materialize()
        return self._held[:, :, : self.num_valid]

    @property
    def num_layers(self) -> int:
        return self._shape[0]

    def kept_tokens(self) -> tuple[float, int]:
        """Tokens held (mean and max over heads and layers: every head holds the same count)."""
        return float(self.num_valid), self.num_valid

    def kept_choices(self) -> tuple[str, list]:
        """The positions kept, sorted, per layer and (this rank's) KV head."""
        return "heads", np.sort(self.logical, axis=2).tolist()

    def local_slots(self) -> np.ndarray:
        """The request's local slots this map holds, in every head (debug checks)."""
        return np.arange(self.num_valid)

    def blocks_spanned(self, block_size: int) -> int:
        """Leading local blocks of the request's row its slots live in (debug checks)."""
        return -(-self.num_valid // block_size)

    @property
    def num_heads(self) -> int:
        return self._shape[1]

    @property
    def is_identity(self) -> bool:
        """Whether every head still holds slot s = position s (nothing evicted yet)."""
        return self._held is None

    def _materialize(self, capacity: int = 0) -> None:
        if self._held is None:
            self._held = np.empty((*self._shape, max(64, capacity, 2 * self.num_valid)), np.int64)
            self._held[:, :, : self.num_valid] = np.arange(self.num_valid)

    def _reserve(self, num_slots: int) -> None:
        """Room for `num_slots` slots per head (doubling, so a decode step rarely copies)."""
        if num_slots > self._held.shape[2]:
            grown = np.empty((*self._shape, max(num_slots, 2 * self._held.shape[2])), np.int64)
            grown[:, :, : self.num_valid] = self._held[:, :, : self.num_valid]
            self._held = grown

    def append(self, positions: np.ndarray) -> np.ndarray:
        """New tokens in the next slots, the same ones for every head; returns them `[q]`."""
        start, stop = self.num_valid, self.num_valid + len(positions)
        if self._held is None and np.array_equal(positions, np.arange(start, stop)):
            self.num_valid = stop  # still the identity
            return np.arange(start, stop, dtype=np.int64)
        self._materialize(stop)
        self._reserve(stop)
        self._held[:, :, start:stop] = positions
        self.num_valid = stop
        return np.arange(start, stop, dtype=np.int64)

    def replace(self, victims: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """EQUIP per head: evict `victims` `[layers, heads, r]` (local slots) and write one new
        token in place of a victim of every head.

        Returns the new token's slot per head `[layers, heads]` and the moves to apply before
        writing it, `[layers, r - 1, heads]` sources and destinations (SKIP where a head has
        fewer to move). With one victim nothing moves; with more (lazy pruning) survivors past
        the new end of the prefix fill the other holes, in slot order: the k-th hole below the
        new end takes the k-th survivor past it (every head at once, no loop over heads).
        """
        self._materialize()
        num_layers, num_heads, count = victims.shape
        new_valid = self.num_valid - count + 1
        layers = np.arange(num_layers)[:, None]
        heads = np.arange(num_heads)
        if count == 1:
            new_slots = victims[:, :, 0].copy()
            self._held[layers, heads, new_slots] = position
            empty = np.empty((num_layers, 0, num_heads), np.int64)
            return new_slots, empty, empty.copy()
        # Only the last count - 1 slots can strand a survivor past the new end, so everything
        # here is [layers, heads, count]-sized, whatever the cache length.
        holes = np.sort(victims, axis=2)  # the holes below the new end come first, ascending
        tail = np.arange(new_valid, self.num_valid)  # [count - 1]
        tail_is_victim = (tail[None, None, :, None] == victims[:, :, None, :]).any(axis=3)
        stranded = tail[np.argsort(tail_is_victim, axis=2, kind="stable")]  # survivors first, in order
        num_stranded = (~tail_is_victim).sum(axis=2)  # == holes below the new end - 1, per head
        new_slots = holes[:, :, 0]
        fills = np.arange(count - 1) < num_stranded[:, :, None]  # [L, H, count-1]
        sources = np.where(fills, stranded, SKIP)
        destinations = np.where(fills, holes[:, :, 1:], SKIP)
        moved_layer, moved_head, _ = np.nonzero(fills)
        held = self._held
        held[moved_layer, moved_head, destinations[fills]] = held[moved_layer, moved_head, sources[fills]]
        held[layers, heads, new_slots] = position
        self.num_valid = new_valid
        return new_slots, sources.transpose(0, 2, 1).copy(), destinations.transpose(0, 2, 1).copy()

    def gather_replace(self, victims: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The baseline EQUIP replaces (H2O's gather-and-append, for benchmarks): every head's
        survivors are gathered to the front in slot order and the new token appended after
        them. Returns what `replace` returns; the moves now span every survivor past each
        head's first victim, `[layers, num_valid - r, heads]` (SKIP where one stays put)."""
        self._materialize()
        num_layers, num_heads, count = victims.shape
        kept = self.num_valid - count
        is_victim = np.zeros((num_layers, num_heads, self.num_valid), bool)
        is_victim[np.arange(num_layers)[:, None, None], np.arange(num_heads)[None, :, None], victims] = True
        survivors = np.argsort(is_victim, axis=2, kind="stable")[:, :, :kept]  # ascending slots
        destinations = np.arange(kept)
        moved = survivors != destinations
        held = self._held
        held[:, :, :kept] = np.take_along_axis(held[:, :, :self.num_valid], survivors, axis=2)
        held[:, :, kept] = position
        self.num_valid = kept + 1
        sources = np.where(moved, survivors, SKIP)
        destinations = np.where(moved, destinations, SKIP)
        return (np.full((num_layers, num_heads), kept, np.int64), sources.transpose(0, 2, 1).copy(),
                destinations.transpose(0, 2, 1).copy())

    def truncate(self, num_kept: int) -> None:
        """A prompt is being pruned to `num_kept` tokens per head; `set_layer_survivors`
        then records which ones each layer's heads kept. The prompt's room is given back."""
        self.num_valid = num_kept
        self._held = np.full((*self._shape, max(64, 2 * num_kept)), SKIP, np.int64)

    def set_layer_survivors(self, layer: int, positions: np.ndarray) -> None:
        """`positions` `[heads, num_valid]`: what layer `layer`'s heads hold, slot by slot."""
        self._materialize()
        self._held[layer, :, : self.num_valid] = positions

    @property
    def nbytes(self) -> int:
        """Bytes this map holds (its table; nothing while it is the identity)."""
        return 0 if self._held is None else self._held.nbytes

    def check(self) -> None:
        if self._held is None:
            return  # the identity: every slot holds its own position, once
        ordered = np.sort(self.logical, axis=2)
        if not (ordered >= 0).all():
            raise InvariantError("a slot below num_valid holds no token")
        if not (np.diff(ordered, axis=2) > 0).all():
            raise InvariantError("a logical token is mapped twice in one head")

