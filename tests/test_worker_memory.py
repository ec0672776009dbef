"""Worker state follows each request's cap: maps that have evicted nothing store nothing, a
pruned prompt gives its room back, lazy per-head eviction is vectorised (and equals the plain
per-head loop), and per-layer block tables are as wide as the step reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_kvprune.worker.block_map import LayerBlockMap
from vllm_kvprune.worker.head_map import SKIP, HeadSlotMap


def replace_one_head_at_a_time(logical: np.ndarray, victims: np.ndarray, position: int):
    """The plain rule, per (layer, head): holes below the new end take the survivors past it."""
    layers, heads, count = victims.shape
    num_valid = logical.shape[2]
    new_valid = num_valid - count + 1
    held = logical.copy()
    new_slots = np.empty((layers, heads), np.int64)
    sources = np.full((layers, count - 1, heads), SKIP)
    destinations = np.full_like(sources, SKIP)
    for layer in range(layers):
        for head in range(heads):
            is_victim = np.zeros(num_valid, bool)
            is_victim[victims[layer, head]] = True
            holes = np.flatnonzero(is_victim[:new_valid])
            stranded = np.flatnonzero(~is_victim[new_valid:]) + new_valid
            held[layer, head, holes[1:]] = held[layer, head, stranded]
            held[layer, head, holes[0]] = position
            new_slots[layer, head] = holes[0]
            sources[layer, : len(stranded), head] = stranded
            destinations[layer, : len(stranded), head] = holes[1:]
    return held[:, :, :new_valid], new_slots, sources, destinations


@pytest.mark.parametrize("count", [2, 3, 8, 17])
def test_vectorised_replace_equals_the_per_head_rule(count: int) -> None:
    rng = np.random.default_rng(count)
    for trial in range(20):
        layers, heads, num_valid = 3, 4, int(rng.integers(count + 2, 200))
        heads_map = HeadSlotMap(layers, heads)
        heads_map.append(np.arange(num_valid))
        heads_map.logical[:] = rng.permutation(1000)[:num_valid]  # any distinct positions
        before = heads_map.logical.copy()
        # Victims biased to the tail now and then, so that some heads strand nothing.
        victims = np.stack([np.stack([rng.choice(num_valid if trial % 3 else count + 1, count, replace=False)
                                      + (0 if trial % 3 else num_valid - count - 1) for _ in range(heads)])
                            for _ in range(layers)])
        expected = replace_one_head_at_a_time(before, victims, 5000)
        got_slots, got_sources, got_destinations = heads_map.replace(victims, 5000)
        np.testing.assert_array_equal(heads_map.logical, expected[0])
        np.testing.assert_array_equal(got_slots, expected[1])
        np.testing.assert_array_equal(got_sources, expected[2])
        np.testing.assert_array_equal(got_destinations, expected[3])
        heads_map.check()


def test_head_map_stores_nothing_until_it_evicts_and_shrinks_after_a_prompt() -> None:
    heads = HeadSlotMap(num_layers=30, num_heads=3)
    heads.append(np.arange(8000))  # a long prompt, written in order
    assert heads.is_identity and heads.nbytes == 0
    assert heads.logical[7, 2, 123] == 123  # read on demand, the identity
    heads = HeadSlotMap(num_layers=30, num_heads=3)
    heads.append(np.arange(8000))
    heads.truncate(1023)  # the prompt is pruned to the budget
    for layer in range(30):
        heads.set_layer_survivors(layer, np.tile(np.arange(0, 8000, 7)[:1023], (3, 1)))
    assert heads.nbytes <= 30 * 3 * 2 * 1023 * 8  # room for twice the kept tokens, not the prompt
    for position in range(8000, 8100):  # decoding grows it by doubling, bounded by the cap
        heads.append(np.array([position]))
    assert heads.nbytes <= 30 * 3 * 2 * 1123 * 8


def test_block_map_stores_positions_only_once_it_reorders() -> None:
    blocks = LayerBlockMap(num_layers=30, block_size=32)
    blocks.append(np.arange(8000))
    assert blocks.nbytes < 30 * 250 * 8 * 2  # block orders only
    blocks.compact(1024)  # the prompt pruned to 32 blocks
    assert blocks.logical.shape == (30, 1024)
    blocks.check()


def test_layer_block_tables_are_as_wide_as_the_step_reads() -> None:
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.worker.layouts.blocks import layer_block_tables
    from vllm_kvprune.worker.state import StepRows, WorkerKVState

    config = KVPolicyConfig.from_dict({"name": "paged_eviction", "budget": 128, "sinks": 4})
    state = WorkerKVState(config)
    state.bind_cache(["l0", "l1"], num_blocks=300, block_size=32, total_kv_heads=2)
    block_row = np.arange(1, 129, dtype=np.int32)  # a max_model_len of 4096 tokens: 128 columns
    state.rows = StepRows(["r"], np.array([0]), np.array([300]), block_row[None], [None])
    state.plan(np.array([0, 300]), 32)  # the prompt, pruned to 4 blocks
    state.tables.by_slot.uniform_()
    for computed in range(300, 300 + 64):  # decode until a block is evicted and reused
        state.rows = StepRows(["r"], np.array([computed]), np.array([300]), block_row[None], [None])
        plan = state.plan(np.array([0, 1]), 32)
        tables = layer_block_tables(torch.from_numpy(block_row[None]), plan, state.tables)
        if tables is not None:
            assert tables.shape[2] <= config.cap_blocks(32) + 1 < block_row.shape[0]
            return
    raise AssertionError("no block was evicted")
