"""Per-head caches of different lengths, packed into head-pages (budget-free policies).

The layer cache `[num_blocks, H, block_size, 2D]` is also `[num_blocks * H, 1, block_size,
2D]`: one KV head's `block_size` tokens per "head-page", and vLLM's CPU kernel attends each
(request, KV head) as its own sequence over any list of head-pages (VLLM_NOTES D3). A request
holding blocks `b_0 .. b_{n-1}` owns the head-pages `b_i * H + h`; numbered locally as
`j = i * H + h`, head-page j is `block_row[j // H] * H + j % H` of the pool. A local
head-slot is `j * block_size + offset`.

While its prompt is prefilled a request is uniform: token p of head h sits at offset
`p % bs` of local head-page `(p // bs) * H + h` (vLLM's own layout, written by vLLM's own op).
The vote then gives each (layer, head) its own kept tokens; they are packed, head after
head, into the layer's first head-pages, so layer l uses `sum_h ceil(len_lh / bs)` of
them and the request needs `ceil(max_l of that / H)` blocks: memory follows the mean over
heads, not the longest head. Decode appends one token to every head; a head whose last
page is full takes the layer's next unused head-page.

Each layer's blocks are its own when every layer has a KV-cache group of its own
(`Policy.per_layer_tables`: the request's rows `[groups, width]`, `group_of_layer` the
identity): layer l's head-page j is then `rows[l][j // H] * H + j % H`, the request holds
`sum_l ceil(pages_l / H)` blocks, and its memory follows the mean over layers and heads. With
one table for every layer (`group_of_layer` all 0, a row `[width]`), the fullest layer sets the
count. Either way the map numbers each layer's head-pages from 0 in that layer's own row.

Local block i is not always position i of a block-table row: the worker's rows are
append-only (VLLM_NOTES 5), so the blocks the vote gives back stay in them as stale ids,
`row_holes[l] = (start, stop)` per layer, and blocks allocated later come after them.
`live_row` is each layer's row without them; the scheduler nulls the same positions
(`engine/manager.py`).
"""

from __future__ import annotations

import numpy as np

from vllm_kvprune.worker.head_map import SKIP
from vllm_kvprune.worker.slot_map import InvariantError


class HeadPageMap:
    """Which head-pages hold which tokens, per layer and KV head, for one request.

    Invariants, checked by `check()` once paged:
    - head (l, h) holds `lengths[l, h]` tokens in its first `ceil(lengths / bs)` pages;
    - within a layer no head-page is listed twice, and every listed page is below `used[l]`;
    - no (layer, head) holds a position twice.
    """

    def __init__(self, num_layers: int, num_heads: int, block_size: int,
                 group_of_layer: np.ndarray | None = None) -> None:
        self.num_layers, self.num_heads, self.block_size = num_layers, num_heads, block_size
        # The KV-cache group whose blocks each layer's head-pages live in (all 0: one table).
        self.group_of_layer = np.zeros(num_layers, np.int64) if group_of_layer is None else np.asarray(group_of_layer)
        self.num_groups = int(self.group_of_layer.max()) + 1
        self.num_uniform = 0  # tokens while uniform (every head holds positions 0..n-1)
        self.lengths: np.ndarray | None = None  # [L, H] once paged
        self.pages: np.ndarray | None = None  # [L, H, max pages] local head-page ids, SKIP-padded
        self.used: np.ndarray | None = None  # [L] head-pages in use per layer
        self.positions: np.ndarray | None = None  # [L, H, capacity] position of each held token
        self._voted: np.ndarray | None = None  # [L] layers whose vote has been applied
        self.row_seen = np.zeros(num_layers, np.int64)  # [L] blocks in each layer's row at the prompt's last step
        self.row_holes: np.ndarray | None = None  # [L, 2] (start, stop) of each layer's row given back after the vote
        # While the prompt is prefilled: the statistics of each layer's query-projection input
        # the vote samples from (sum and sum of squares per channel, float64, `[layers,
        # hidden]`, and the token count per layer); dropped once every layer has voted.
        self.hidden_sum = self.hidden_sumsq = self.hidden_count = None

    @property
    def is_paged(self) -> bool:
        return self.lengths is not None and bool(self._voted.all())

    def kept_tokens(self) -> tuple[float, int]:
        """Tokens held per (layer, KV head): their mean and the largest."""
        if self.lengths is None:
            return float(self.num_uniform), self.num_uniform
        return float(self.lengths.mean()), int(self.lengths.max())

    def blocks_spanned(self, block_size: int) -> np.ndarray:
        """Leading local blocks of each layer's row its head-pages live in `[L]` (debug
        checks): head-page j is in local block j // H."""
        if self.lengths is None:
            return np.full(self.num_layers, -(-self.num_uniform // block_size))
        return -(-self.used // self.num_heads)

    def local_slots(self) -> list[np.ndarray]:
        """Each layer's local slots in the blocks its head-pages live in (debug checks)."""
        return [np.arange(count * self.block_size) for count in self.blocks_spanned(self.block_size)]

    # ---- the block-table rows ------------------------------------------------------------
    def live_row(self, block_rows: np.ndarray) -> np.ndarray:
        """Each layer's row `[L, width]` (local block i -> pool block) from the request's rows
        (`[groups, width]`, or one row `[width]` for every layer), without the positions the
        vote gave back (0 past a row's end)."""
        rows = np.atleast_2d(block_rows)
        if rows.shape[0] != self.num_groups:
            raise InvariantError(f"{rows.shape[0]} block-table rows for {self.num_groups} KV-cache groups")
        rows = rows[self.group_of_layer] if self.num_groups > 1 else np.broadcast_to(rows, (self.num_layers, rows.shape[1]))
        if self.row_holes is None or not (self.row_holes[:, 1] > self.row_holes[:, 0]).any():
            return rows
        width = rows.shape[1]
        start, given_back = self.row_holes[:, :1], self.row_holes[:, 1:] - self.row_holes[:, :1]
        index = np.arange(width)[None, :]
        index = index + (index >= start) * given_back
        return np.where(index < width, np.take_along_axis(rows, np.minimum(index, width - 1), axis=1), 0)

    def settle_holes(self, footprints: list[int]) -> list[tuple[int, int]]:
        """Once, with the first footprints (one per group) the scheduler reads after the vote:
        the positions of each group's row, as the worker saw it at the vote, that the
        footprint leaves out."""
        footprint = np.asarray(footprints, np.int64)[self.group_of_layer]
        self.row_holes = np.stack([np.minimum(footprint, self.row_seen), self.row_seen], axis=1)
        first_layer = np.unique(self.group_of_layer, return_index=True)[1]
        return [(int(start), int(stop)) for start, stop in self.row_holes[first_layer]]

    # ---- while uniform ----------------------------------------------------------------
    def append_uniform(self, num_new: int) -> np.ndarray:
        """Prompt tokens, every head the same slot; returns their token indices `[q]`."""
        if self.lengths is not None:
            raise InvariantError("a voted request got prompt tokens")
        start = self.num_uniform
        self.num_uniform += num_new
        return np.arange(start, self.num_uniform, dtype=np.int64)

    def uniform_slots(self, tokens: np.ndarray) -> np.ndarray:
        """Local head-slots `[len(tokens), H]` of uniform tokens (vLLM's layout)."""
        bs, heads = self.block_size, self.num_heads
        pages = (tokens // bs)[:, None] * heads + np.arange(heads)
        return pages * bs + (tokens % bs)[:, None]

    # ---- the vote -----------------------------------------------------------------------
    def apply_layer_vote(self, layer: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keep `keep [H, P]` (bool over the prompt) in layer `layer`: heads are packed in
        order into the layer's first head-pages. Returns the moves, local head-slots
        `sources`, `destinations` (same length, unmoved tokens left out)."""
        heads, bs = self.num_heads, self.block_size
        if keep.shape != (heads, self.num_uniform):
            raise InvariantError(f"vote shape {keep.shape}, expected {(heads, self.num_uniform)}")
        if self.lengths is None:
            self._start_paging()
        lengths = keep.sum(axis=1)
        num_pages = -(-lengths // bs)
        first_page = np.concatenate([[0], np.cumsum(num_pages)[:-1]])
        self._grow_pages(int(num_pages.max()))
        self.pages[layer] = SKIP
        for head in range(heads):
            self.pages[layer, head, : num_pages[head]] = first_page[head] + np.arange(num_pages[head])
        self.used[layer] = int(num_pages.sum())
        self.lengths[layer] = lengths
        self._grow_positions(int(lengths.max()) + 1)
        head_index, position = np.nonzero(keep)  # head-major, positions ascending
        rank = np.arange(len(position)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        self.positions[layer, head_index, rank] = position
        sources = self.uniform_slots(position)[np.arange(len(position)), head_index]
        destinations = self.pages[layer, head_index, rank // bs] * bs + rank % bs
        self._voted[layer] = True
        moved = sources != destinations
        return sources[moved], destinations[moved]

    def _start_paging(self) -> None:
        shape = (self.num_layers, self.num_heads)
        self.lengths = np.zeros(shape, np.int64)
        self.used = np.zeros(self.num_layers, np.int64)
        self.pages = np.full((*shape, 4), SKIP, np.int64)
        self.positions = np.full((*shape, 64), SKIP, np.int64)
        self._voted = np.zeros(self.num_layers, bool)

    def _grow_pages(self, num_pages: int) -> None:
        if num_pages > self.pages.shape[2]:
            grown = np.full((*self.pages.shape[:2], max(num_pages, 2 * self.pages.shape[2])), SKIP, np.int64)
            grown[:, :, : self.pages.shape[2]] = self.pages
            self.pages = grown

    def _grow_positions(self, num_tokens: int) -> None:
        if num_tokens > self.positions.shape[2]:
            grown = np.full((*self.positions.shape[:2], max(num_tokens, 2 * self.positions.shape[2])), SKIP, np.int64)
            grown[:, :, : self.positions.shape[2]] = self.positions
            self.positions = grown

    # ---- decode -------------------------------------------------------------------------
    def append_decode(self, position: int) -> np.ndarray:
        """One token into every head of every layer; returns its local head-slots `[L, H]`.
        A head whose pages are full takes its layer's next head-page (heads in order)."""
        bs = self.block_size
        full = self.lengths % bs == 0  # [L, H]: needs a new page
        new_page_rank = np.cumsum(full, axis=1) - 1  # among this layer's new pages
        page_index = self.lengths // bs
        self._grow_pages(int(page_index.max()) + 1)
        layers, heads = np.nonzero(full)
        self.pages[layers, heads, page_index[layers, heads]] = self.used[layers] + new_page_rank[layers, heads]
        self.used += full.sum(axis=1)
        self._grow_positions(int(self.lengths.max()) + 1)
        all_layers, all_heads = np.indices(self.lengths.shape)
        self.positions[all_layers, all_heads, self.lengths] = position
        slots = self.pages[all_layers, all_heads, page_index] * bs + self.lengths % bs
        self.lengths += 1
        return slots

    def blocks_needed(self, extra_tokens: int = 0) -> np.ndarray:
        """Blocks the request must hold in each KV-cache group `[groups]` for its tokens plus
        `extra_tokens` more in every head (a layer's pages are exactly `sum_h ceil(len_h /
        bs)`: no page is ever given up); a group's fullest layer sets its count (one group per
        layer: each layer's own)."""
        needed = np.zeros(self.num_groups, np.int64)
        np.maximum.at(needed, self.group_of_layer, self.layer_blocks(extra_tokens))
        return needed

    def mean_layer_blocks(self) -> float:
        """Blocks per layer, averaged over layers: what the request holds per layer when every
        layer has a block table of its own."""
        return float(self.layer_blocks(0).mean())

    def layer_blocks(self, extra_tokens: int = 0) -> np.ndarray:
        """Blocks each layer's head-pages fill `[L]` (every layer alike before the vote)."""
        bs = self.block_size
        if self.lengths is None:
            return np.full(self.num_layers, -(-(self.num_uniform + extra_tokens) // bs))
        pages = (-(-(self.lengths + extra_tokens) // bs)).sum(axis=1)
        return -(-pages // self.num_heads)

    # ---- what the kernel reads ----------------------------------------------------------
    def page_tables(self, num_pages: int) -> np.ndarray:
        """Local head-pages `[L, H, num_pages]` of every layer (SKIP past a head's own)."""
        if self.pages.shape[2] >= num_pages:
            return self.pages[:, :, :num_pages]
        table = np.full((self.num_layers, self.num_heads, num_pages), SKIP, np.int64)
        table[:, :, : self.pages.shape[2]] = self.pages
        return table

    def page_table(self, layer: int, num_pages: int) -> np.ndarray:
        """Local head-pages `[H, num_pages]` of layer `layer`."""
        return self.page_tables(num_pages)[layer]

    def kept_positions(self, layer: int, head: int) -> np.ndarray:
        """Positions held by (layer, head), in the order they are stored."""
        return self.positions[layer, head, : self.lengths[layer, head]].copy()

    def kept_choices(self) -> tuple[str, list]:
        """The positions kept, sorted, per layer and (this rank's) KV head ("slots" while uniform)."""
        if self.lengths is None:
            return "slots", list(range(self.num_uniform))
        return "pages", [[sorted(self.kept_positions(layer, head).tolist()) for head in range(self.num_heads)]
                         for layer in range(self.num_layers)]

    @property
    def nbytes(self) -> int:
        held = (self.lengths, self.pages, self.used, self.positions, self.hidden_sum, self.hidden_sumsq)
        return sum(part.nbytes for part in held if part is not None)

    def check(self) -> None:
        """The invariants above, over every layer and head at once (the debug mode runs this
        for every planned request in every step)."""
        if self.lengths is None:
            return
        counts = -(-self.lengths // self.block_size)  # [L, H] pages each head lists
        if (counts > self.pages.shape[2]).any() or (self.lengths > self.positions.shape[2]).any():
            raise InvariantError("a head lists more pages or tokens than its map holds")
        listed = np.arange(self.pages.shape[2]) < counts[..., None]  # [L, H, P]
        bad = listed & ((self.pages == SKIP) | (self.pages >= self.used[:, None, None]))
        if bad.any():
            layer, head = np.argwhere(bad.any(axis=2))[0]
            raise InvariantError(f"layer {layer} head {head}: a page is missing or unallocated")
        held = np.arange(self.positions.shape[2]) < self.lengths[..., None]  # [L, H, capacity]
        twice = _rows_with_a_repeat(self.positions.reshape(-1, self.positions.shape[2]),
                                    held.reshape(-1, held.shape[2]))
        if len(twice):
            layer, head = divmod(int(twice[0]), self.num_heads)
            raise InvariantError(f"layer {layer} head {head}: a position is held twice")
        twice = _rows_with_a_repeat(self.pages.reshape(self.num_layers, -1), listed.reshape(self.num_layers, -1))
        if len(twice):
            raise InvariantError(f"layer {twice[0]}: a head-page is mapped twice")


def _rows_with_a_repeat(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Rows of `values [N, M]` where a value appears twice among the `valid` entries: the others
    are replaced by distinct values above any real one, then each row is sorted."""
    above = np.iinfo(np.int64).max - np.arange(values.shape[1], dtype=np.int64)
    ordered = np.sort(np.where(valid, values, above), axis=1)
    return np.flatnonzero((np.diff(ordered, axis=1) == 0).any(axis=1))


def _pool_blocks(block_rows: np.ndarray, local_blocks: np.ndarray) -> np.ndarray:
    """Pool block ids of local ones: through one row `[width]`, or through each layer's row
    `[L, width]` for local ids whose first axis is the layer's."""
    if block_rows.ndim == 1:
        return block_rows[local_blocks].astype(np.int64)
    layers = np.arange(len(block_rows)).reshape((-1,) + (1,) * (local_blocks.ndim - 1))
    return block_rows[layers, local_blocks].astype(np.int64)


def global_head_slots(block_rows: np.ndarray, local: np.ndarray, num_heads: int, block_size: int) -> np.ndarray:
    """Pool-wide head-slots (in the `[num_blocks * H, 1, block_size, 2D]` view) of local ones
    (`block_rows`: one row, or each layer's for `local [L, ...]`); SKIP stays SKIP."""
    page = np.maximum(local, 0) // block_size
    pool_page = _pool_blocks(block_rows, page // num_heads) * num_heads + page % num_heads
    return np.where(local == SKIP, SKIP, pool_page * block_size + np.maximum(local, 0) % block_size)


def global_head_pages(block_rows: np.ndarray, local_pages: np.ndarray, num_heads: int) -> np.ndarray:
    """Pool-wide head-page ids of local ones (as `global_head_slots`; SKIP -> 0, a page the
    kernel never reads past the sequence's length)."""
    safe = np.maximum(local_pages, 0)
    return np.where(local_pages == SKIP, 0, _pool_blocks(block_rows, safe // num_heads) * num_heads + safe % num_heads)
