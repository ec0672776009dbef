"""`HeadPageMap`: per-head kept lengths packed into head-pages (no engine: fast)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_kvprune.worker.head_map import SKIP
from vllm_kvprune.worker.head_page_map import HeadPageMap, global_head_pages, global_head_slots
from vllm_kvprune.worker.slot_map import InvariantError

BS, HEADS, LAYERS = 4, 3, 2


def voted_map(prompt: int, keep: np.ndarray) -> tuple[HeadPageMap, list]:
    pages = HeadPageMap(LAYERS, HEADS, BS)
    pages.append_uniform(prompt)
    moves = [pages.apply_layer_vote(layer, keep[layer]) for layer in range(LAYERS)]
    return pages, moves


def test_uniform_slots_are_vllms_layout():
    pages = HeadPageMap(LAYERS, HEADS, BS)
    tokens = pages.append_uniform(6)
    slots = pages.uniform_slots(tokens)
    # token 5 of head 2: block 1, head 2 -> local head-page 1 * 3 + 2, offset 1
    assert slots[5, 2] == (1 * HEADS + 2) * BS + 1
    block_row = np.array([7, 9])
    # In the pool: block 9, head 2, offset 1 of the [blocks * heads, 1, bs] view.
    assert global_head_slots(block_row, slots, HEADS, BS)[5, 2] == (9 * HEADS + 2) * BS + 1


def test_vote_packs_heads_and_needs_the_mean_not_the_max():
    rng = np.random.default_rng(0)
    prompt = 40
    keep = rng.random((LAYERS, HEADS, prompt)) < np.array([0.9, 0.2, 0.1])[None, :, None]
    pages, moves = voted_map(prompt, keep)
    assert pages.is_paged
    pages.check()
    for layer in range(LAYERS):
        assert (pages.lengths[layer] == keep[layer].sum(axis=1)).all()
        assert pages.used[layer] == (-(-pages.lengths[layer] // BS)).sum()
        for head in range(HEADS):
            assert (pages.kept_positions(layer, head) == np.flatnonzero(keep[layer, head])).all()
    longest = -(-pages.lengths.max() // BS)  # blocks a max-over-heads layout would need
    assert pages.blocks_needed().tolist() == [-(-pages.used.max() // HEADS)] and pages.blocks_needed()[0] < longest
    # A KV-cache group per layer: each layer needs its own count, the sum below every layer at the fullest's.
    per_layer = HeadPageMap(LAYERS, HEADS, BS, group_of_layer=np.arange(LAYERS))
    per_layer.append_uniform(prompt)
    for layer in range(LAYERS):
        per_layer.apply_layer_vote(layer, keep[layer])
    assert per_layer.blocks_needed().tolist() == (-(-pages.used // HEADS)).tolist()


def test_moves_put_every_kept_token_in_its_page():
    """Replaying the moves on a fake cache (read all sources first) gives each head its kept
    positions, in order, page after page."""
    rng = np.random.default_rng(1)
    prompt = 23
    keep = rng.random((LAYERS, HEADS, prompt)) < 0.5
    keep[:, :, 0] = True
    pages, moves = voted_map(prompt, keep)
    for layer in range(LAYERS):
        cache = np.full(8 * HEADS * BS, -1)
        tokens = np.arange(prompt)
        uniform = pages.uniform_slots(tokens)  # [P, H]
        for head in range(HEADS):
            cache[uniform[:, head]] = tokens * 10 + head
        sources, destinations = moves[layer]
        cache[destinations] = cache[sources].copy()
        for head in range(HEADS):
            held = pages.kept_positions(layer, head)
            table = pages.page_table(layer, -(-len(held) // BS))[head]
            slots = table[np.arange(len(held)) // BS] * BS + np.arange(len(held)) % BS
            assert (cache[slots] == held * 10 + head).all()


def test_decode_appends_to_every_head_and_takes_new_pages():
    keep = np.zeros((LAYERS, HEADS, 8), bool)
    keep[:, 0, :4] = True  # head 0: one full page
    keep[:, 1, :1] = True  # head 1: one token
    keep[:, 2, :8] = True  # head 2: two full pages
    pages, _ = voted_map(8, keep)
    assert pages.blocks_needed(1).tolist() == [-(-(2 + 1 + 3) // HEADS)]  # heads 0 and 2 need a new page
    slots = pages.append_decode(8)
    assert slots.shape == (LAYERS, HEADS)
    assert (pages.lengths[0] == [5, 2, 9]).all()
    assert pages.used[0] == 4 + 2
    # Head 0's new page is the layer's next one (4), head 2's the one after (5).
    assert slots[0, 0] == 4 * BS and slots[0, 2] == 5 * BS
    assert slots[0, 1] == 1 * BS + 1  # head 1 (page 1) still has room
    pages.check()
    for position in range(9, 20):
        pages.append_decode(position)
        pages.check()
    assert (pages.kept_positions(1, 1) == np.concatenate([[0], np.arange(8, 20)])).all()


def test_check_catches_a_page_mapped_twice():
    keep = np.ones((LAYERS, HEADS, 8), bool)
    pages, _ = voted_map(8, keep)
    pages.pages[0, 1, 0] = pages.pages[0, 0, 0]
    with pytest.raises(InvariantError, match="mapped twice"):
        pages.check()


def test_check_catches_a_position_held_twice_and_an_unallocated_page():
    keep = np.ones((LAYERS, HEADS, 8), bool)
    pages, _ = voted_map(8, keep)
    pages.check()
    pages.positions[1, 0, 3] = pages.positions[1, 0, 2]
    with pytest.raises(InvariantError, match="layer 1 head 0: a position is held twice"):
        pages.check()
    pages, _ = voted_map(8, keep)
    pages.pages[0, 1, 0] = pages.used[0]
    with pytest.raises(InvariantError, match="layer 0 head 1: a page is missing or unallocated"):
        pages.check()
    pages, _ = voted_map(8, keep)
    pages.positions[0, 1, 8:] = 0  # past its length: not held, so not a repeat
    pages.check()


def test_global_pages_keep_skip_harmless():
    block_row = np.array([5, 6])
    table = np.array([[0, 4, SKIP]])
    assert global_head_pages(block_row, table, HEADS).tolist() == [[5 * HEADS, 6 * HEADS + 1, 0]]


def test_blocks_spanned_follow_the_pages_in_use():
    """The debug checks' span: uniform, every block the prompt filled; voted, the blocks that
    hold the busiest layer's head-pages (page j lives in local block j // H)."""
    pages = HeadPageMap(LAYERS, HEADS, BS)
    pages.append_uniform(9)
    assert pages.blocks_spanned(BS).tolist() == [3, 3]  # 9 tokens of 4 per block, every layer
    keep = np.zeros((LAYERS, HEADS, 9), bool)
    keep[0, :, :5] = True  # layer 0: 2 pages per head, 6 pages: 2 blocks
    keep[1, 0, :1] = keep[1, 1, :1] = keep[1, 2, :1] = True  # layer 1: 3 pages: 1 block
    pages, _ = voted_map(9, keep)
    assert pages.used.tolist() == [6, 3] and pages.blocks_spanned(BS).tolist() == [2, 1]


def test_the_live_row_skips_the_positions_a_vote_gave_back():
    """The worker's row is append-only: after a vote leaves 2 of 5 blocks, blocks allocated
    later come after the 3 given back, and local block 2 is the first of them."""
    pages = HeadPageMap(num_layers=1, num_heads=2, block_size=4)
    pages.row_seen[:] = 5
    assert pages.live_row(np.array([7, 8, 9, 10, 11, 0])).tolist() == [[7, 8, 9, 10, 11, 0]]  # not settled yet
    assert pages.settle_holes([2]) == [(2, 5)]
    assert pages.live_row(np.array([7, 8, 9, 10, 11, 20, 21, 0])).tolist() == [[7, 8, 20, 21, 0, 0, 0, 0]]
    wide = HeadPageMap(num_layers=1, num_heads=2, block_size=4)
    wide.row_seen[:] = 2
    assert wide.settle_holes([3]) == [(2, 2)]  # a footprint beyond the row gives nothing back
    assert wide.live_row(np.array([7, 8, 20])).tolist() == [[7, 8, 20]]


def test_per_layer_rows_give_back_each_layers_own_surplus():
    """A KV-cache group per layer: each layer's row is its own, and the vote gives back each
    layer's surplus at its own position (layer 0 keeps 2 of 4 blocks, layer 1 keeps 1)."""
    pages = HeadPageMap(num_layers=2, num_heads=2, block_size=4, group_of_layer=np.array([0, 1]))
    rows = np.array([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 0, 0]])
    assert pages.live_row(rows).tolist() == rows.tolist()
    with pytest.raises(InvariantError, match="1 block-table rows for 2 KV-cache groups"):
        pages.live_row(rows[0])
    pages.row_seen[:] = 4
    assert pages.settle_holes([2, 1]) == [(2, 4), (1, 4)]
    grown = np.array([[1, 2, 3, 4, 9, 0], [5, 6, 7, 8, 10, 11]])  # blocks allocated after the vote
    assert pages.live_row(grown).tolist() == [[1, 2, 9, 0, 0, 0], [5, 10, 11, 0, 0, 0]]
    # Each layer's head-pages through its own row: page 3 is local block 1, head 1 (pool block 2 in
    # layer 0, 10 in layer 1).
    assert global_head_pages(pages.live_row(grown), np.array([[[3]], [[3]]]), 2).tolist() == [[[2 * 2 + 1]], [[10 * 2 + 1]]]


def test_footprints_cover_one_more_token_under_async_scheduling():
    """The scheduler reads a step's footprint before the next step, or under async scheduling
    before the one after: one more token in every head. The first footprint after the vote
    names the row positions it gives back, once."""
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.policies import get_policy
    from vllm_kvprune.worker.state import RequestKVState, WorkerKVState

    keep = np.zeros((LAYERS, HEADS, 40), bool)
    keep[:, :, : BS - 1] = True  # the next token fills every head's page, the one after needs a new one
    pages, _ = voted_map(40, keep)
    pages.row_seen[:] = -(-40 // BS)
    worker = WorkerKVState(KVPolicyConfig(name="gvote"))
    worker.requests["r"] = RequestKVState(config=worker.engine_config, policy=get_policy("gvote"), request_id="r",
                                          map=pages)
    sync = worker.footprints()["r"]
    assert sync == pages.blocks_needed(1).tolist()
    worker.footprint_lookahead = 1
    assert worker.footprints()["r"] == pages.blocks_needed(2).tolist() and pages.blocks_needed(2)[0] > sync[0]
    report = worker.settle_holes({"footprints": {"r": sync}})
    assert report["holes"] == {"r": [(sync[0], -(-40 // BS))]}
    assert "holes" not in worker.settle_holes({"footprints": {"r": sync}})  # named once
