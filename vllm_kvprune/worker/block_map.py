"""Which of a request's blocks each layer reads, in which order (block-granular policies)."""

from __future__ import annotations

import numpy as np

from vllm_kvprune.worker.slot_map import InvariantError


class LayerBlockMap:
    """Per-layer block order of one request whose layers evict different whole blocks.

    `order[l]` lists the request's local block indices (positions in its block-table row)
    in the order layer l's kernel reads them. Invariants, checked by `check()`:
    - every layer holds `num_valid` tokens: all blocks in `order[l]` are full except the
      last (the tail), so the valid slots are a prefix of each layer's table and one
      `seq_lens` serves every layer;
    - in each layer, `order[l]` and `free[l]` (blocks emptied by a lazy eviction, used as
      the next tails) are disjoint;
    - `logical[l, s]` is the position held by local slot s in layer l, -1 if none, and no
      position is held twice in a layer.
    """

    def __init__(self, num_layers: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_valid = 0
        self.order = np.empty((num_layers, 0), np.int64)
        self.free = np.empty((num_layers, 0), np.int64)
        # None until the first compaction or eviction: every layer then still holds slot
        # s = position s, which is not stored (a prompt of any length costs nothing here).
        self._logical: np.ndarray | None = None
        self._identity: bool | None = True  # `is_identity`, None once order or free changed
        self._layers = np.arange(num_layers)[:, None]  # row index of every layer, for fancy indexing

    @property
    def logical(self) -> np.ndarray:
        """`[layers, slots]`: the position each local slot holds in each layer, -1 if none."""
        if self._logical is None:
            width = self.order.shape[1] * self.block_size
            self._logical = np.where(np.arange(width) < self.num_valid, np.arange(width), -1)
            self._logical = np.tile(self._logical, (self.num_layers, 1))
        return self._logical

    @property
    def nbytes(self) -> int:
        """Bytes this map holds (block orders, its layer index and, once materialised, positions)."""
        held = self.order.nbytes + self.free.nbytes + self._layers.nbytes
        return held + (0 if self._logical is None else self._logical.nbytes)

    @property
    def num_layers(self) -> int:
        return self.order.shape[0]

    def kept_tokens(self) -> tuple[float, int]:
        """Tokens held (mean and max over layers: every layer holds the same count)."""
        return float(self.num_valid), self.num_valid

    def kept_choices(self) -> tuple[str, list]:
        """The positions kept, sorted, per layer."""
        return "blocks", [sorted(row[row >= 0].tolist()) for row in self.logical]

    def local_slots(self) -> np.ndarray:
        """The request's local slots in the blocks some layer reads or keeps free (debug checks)."""
        blocks = np.unique(np.concatenate([self.order.ravel(), self.free.ravel()]))
        return (blocks[:, None] * self.block_size + np.arange(self.block_size)).ravel()

    @property
    def num_blocks(self) -> int:
        """Blocks in use or free, in every layer."""
        return self.order.shape[1] + self.free.shape[1]

    def blocks_spanned(self, block_size: int) -> int:
        """Leading local blocks of the request's row its layers read (used or free in each)."""
        return self.num_blocks

    @property
    def tail_full(self) -> bool:
        return self.num_valid % self.block_size == 0

    def is_identity(self) -> bool:
        """Whether every layer still reads its blocks in table order (no eviction yet).
        Worked out again only after the order or the free blocks changed (a decode step
        that only fills its tail changes neither)."""
        if self._identity is None:
            self._identity = not self.free.shape[1] and bool((self.order == np.arange(self.order.shape[1])).all())
        return self._identity

    def append(self, positions: np.ndarray) -> np.ndarray:
        """Write new tokens after the last valid slot; returns local slots `[layers, q]`."""
        if len(positions) == 1 and not self.tail_full:  # a decode step's token: into every layer's tail
            slots = self.order[:, -1:] * self.block_size + self.num_valid % self.block_size
            self.num_valid += 1
        else:
            slots = self._fill_tails(len(positions))
        if self._logical is not None:
            self._grow_logical(int(slots.max()) + 1)
            self._logical[self._layers, slots] = positions
        return slots

    def _fill_tails(self, count: int) -> np.ndarray:
        """Local slots `[layers, count]` for `count` new tokens, tail after tail (opened as needed)."""
        slots = np.empty((self.num_layers, count), np.int64)
        done = 0
        while done < count:
            if self.tail_full:
                self._open_tail()
            offset = self.num_valid % self.block_size
            chunk = min(count - done, self.block_size - offset)
            slots[:, done:done + chunk] = self.order[:, -1:] * self.block_size + offset + np.arange(chunk)
            self.num_valid += chunk
            done += chunk
        return slots

    def _open_tail(self) -> None:
        if self.free.shape[1]:
            tail, self.free = self.free[:, :1], self.free[:, 1:]
        else:
            tail = np.full((self.num_layers, 1), self.num_blocks, np.int64)
        self.order = np.concatenate([self.order, tail], axis=1)
        self._identity = None

    def _grow_logical(self, num_slots: int) -> None:
        missing = num_slots - self._logical.shape[1]
        if missing > 0:
            self._logical = np.pad(self._logical, ((0, 0), (0, missing)), constant_values=-1)

    def evict(self, victims: np.ndarray) -> None:
        """Drop the blocks at positions `victims` `[layers, r]` of each layer's order (full
        blocks only); they become free, in the given order, for the next tails."""
        logical = self.logical  # materialised (if still the identity) before the order changes
        layers = self._layers
        dropped = self.order[layers, victims]
        keep = np.ones(self.order.shape, bool)
        keep[layers, victims] = False
        self.order = self.order[keep].reshape(self.num_layers, -1)
        self.free = np.concatenate([self.free, dropped], axis=1)
        self._identity = None
        self.num_valid -= victims.shape[1] * self.block_size
        slots = dropped[:, :, None] * self.block_size + np.arange(self.block_size)
        logical[layers[:, :, None], slots] = -1

    def compact(self, num_kept: int) -> None:
        """After a prompt is pruned to `num_kept` tokens, in the first blocks of every layer;
        `set_layer_survivors` then records which tokens each layer kept."""
        num_blocks = -(-num_kept // self.block_size)
        self.order = np.tile(np.arange(num_blocks, dtype=np.int64), (self.num_layers, 1))
        self.free = np.empty((self.num_layers, 0), np.int64)
        self._identity = None
        self.num_valid = num_kept
        # The prompt's room is given back: positions for the kept blocks only.
        self._logical = np.full((self.num_layers, num_blocks * self.block_size), -1, np.int64)

    def set_layer_survivors(self, layer: int, positions: np.ndarray) -> None:
        logical = self.logical
        logical[layer] = -1
        logical[layer, : len(positions)] = positions

    def check(self) -> None:
        for layer in range(self.num_layers):
            if np.intersect1d(self.order[layer], self.free[layer]).size:
                raise InvariantError("a block is both used and free")
            if self._logical is None:
                continue  # the identity: every slot holds its own position, once
            held = self._logical[layer][self._logical[layer] >= 0]
            if len(np.unique(held)) != len(held):
                raise InvariantError("a logical token is mapped twice")
        expected_blocks = -(-self.num_valid // self.block_size)
        if self.order.shape[1] != expected_blocks:
            raise InvariantError("blocks in use do not match the tokens held")
