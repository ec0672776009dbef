"""Debug invariant mode (`KVPRUNE_CHECK=1`, `vllm_kvprune/engine/checks.py`).

Each check catches the breach it names, on states built to break it; and a real engine with the
checks on runs a preempting, aborting, mixed-budget batch for two kinds of map (slot and per-head)
without a false alarm and finishes with its pool whole."""

from __future__ import annotations

import types

import numpy as np
import pytest

from conftest import engine, scheduler_of
from test_streaming_engine import all_blocks_free, greedy, prompts, run_steps
from vllm_kvprune.engine import checks
from vllm_kvprune.worker.slot_map import InvariantError, SlotMap


def _state(positions) -> types.SimpleNamespace:
    slots = SlotMap()
    slots.append(np.asarray(positions))
    return types.SimpleNamespace(map=slots)


def test_planned_maps_catch_a_position_twice_and_a_shared_slot() -> None:
    checks.check_planned([("a", _state([0, 1, 2]), np.array([5])), ("b", _state([0, 1]), np.array([6]))], 4)
    with pytest.raises(InvariantError, match="mapped twice"):
        checks.check_planned([("a", _state([0, 1, 1]), np.array([5]))], 4)
    with pytest.raises(InvariantError, match="slot 20 is held by a, b"):
        checks.check_planned([("a", _state([0, 1, 2]), np.array([5])), ("b", _state([0, 1]), np.array([5]))], 4)


def test_planned_head_page_maps_are_checked_layer_by_layer() -> None:
    """A map whose layers' blocks are their own (gvote: a KV-cache group per layer) is checked
    through each layer's row: its layers may not reach past their own rows, and two requests
    may not hold one slot in the same layer."""
    from vllm_kvprune.worker.head_page_map import HeadPageMap

    def uniform(num_tokens: int) -> types.SimpleNamespace:
        pages = HeadPageMap(num_layers=2, num_heads=2, block_size=4, group_of_layer=np.array([0, 1]))
        pages.append_uniform(num_tokens)
        return types.SimpleNamespace(map=pages)

    rows_a, rows_b = np.array([[5, 6], [7, 8]]), np.array([[9, 0], [10, 0]])
    checks.check_planned([("a", uniform(6), rows_a), ("b", uniform(3), rows_b)], 4)
    with pytest.raises(InvariantError, match="request b's map reaches 2 blocks, its block-table row holds 1"):
        checks.check_planned([("b", uniform(6), rows_b)], 4)
    # b's layer 1 in a's layer-1 block 7 (slots 28..31).
    with pytest.raises(InvariantError, match=r"slot 28 is held by a, b \(layer 1\)"):
        checks.check_planned([("a", uniform(6), rows_a), ("b", uniform(3), np.array([[9, 0], [7, 0]]))], 4)


def test_planned_maps_catch_a_write_outside_the_requests_own_blocks() -> None:
    checks.check_planned([("a", _state([0, 1, 2, 3, 4]), np.array([5, 6, 0]))], 4)  # 5 tokens, 2 blocks
    with pytest.raises(InvariantError, match="request a's map reaches 2 blocks, its block-table row holds 1"):
        checks.check_planned([("a", _state([0, 1, 2, 3, 4]), np.array([5, 0, 0]))], 4)  # block 0: vLLM's null
    with pytest.raises(InvariantError, match="reaches 2 blocks"):
        checks.check_planned([("a", _state([0, 1, 2, 3, 4]), np.array([5]))], 4)  # past the row


class _Block:
    def __init__(self, block_id: int, ref_cnt: int = 1) -> None:
        self.block_id, self.ref_cnt, self.is_null = block_id, ref_cnt, block_id == 0


class _Manager:
    def __init__(self, blocks: dict, limit: int | None) -> None:
        self.req_to_blocks, self._limit = blocks, limit

    def block_limit(self, request_id: str) -> int | None:
        return self._limit


def _scheduler(requests, free: int, total: int = 10):
    pool = types.SimpleNamespace(get_num_free_blocks=lambda: free, num_gpu_blocks=total)
    return types.SimpleNamespace(requests=set(requests), kv_cache_manager=types.SimpleNamespace(block_pool=pool),
                                 has_unfinished_requests=lambda: bool(requests))


def test_scheduler_check_catches_caps_aliasing_leaks_and_an_unwhole_pool() -> None:
    fine = _Manager({"a": [_Block(1), _Block(2)], "b": [_Block(3)]}, limit=2)
    checks.check_scheduler(_scheduler({"a", "b"}, free=6), [fine])
    with pytest.raises(InvariantError, match="limit is 1"):
        checks.check_scheduler(_scheduler({"a", "b"}, free=6), [_Manager(fine.req_to_blocks, limit=1)])
    with pytest.raises(InvariantError, match="block 2 is held by a and b"):
        checks.check_scheduler(_scheduler({"a", "b"}, free=6), [_Manager({"a": [_Block(2)], "b": [_Block(2)]}, 2)])
    with pytest.raises(InvariantError, match="gone but holds"):
        checks.check_scheduler(_scheduler({"a"}, free=6), [fine])
    with pytest.raises(InvariantError, match="not back in the pool"):
        checks.check_scheduler(_scheduler(set(), free=8), [_Manager({}, None)])
    checks.check_scheduler(_scheduler(set(), free=9), [_Manager({}, None)])


# The conformance suite runs every policy's preemption and aborts with the checks on; this
# harder batch (a 13-block pool, mixed budgets) repeats it for two layouts with --heavy.
@pytest.mark.heavy
@pytest.mark.parametrize("policy", [{"name": "streaming", "budget": 64, "sinks": 4},
                                    {"name": "h2o", "budget": 64, "recent": 16, "sinks": 4}])
def test_an_engine_with_the_checks_on_runs_a_hard_batch_cleanly(tiny_model, monkeypatch, policy) -> None:
    monkeypatch.setenv(checks.CHECK_ENV, "1")
    rng = np.random.default_rng(11)
    lengths = rng.integers(5, 40, size=12).tolist()  # all fit at first, then grow to their caps
    params = [greedy(int(rng.integers(100, 200)), **({"kv_budget": int(rng.choice([32, 96]))} if i % 2 else {}))
              for i in range(12)]
    with engine(tiny_model, policy, kv_blocks=13, max_model_len=1024, max_num_batched_tokens=128) as llm:
        scheduler = scheduler_of(llm)
        assert scheduler._checking
        most = 0

        def watch() -> None:
            nonlocal most
            most = max([most, *(r.num_preemptions for r in scheduler.requests.values())])

        finished = run_steps(llm, prompts(lengths, seed=12), params, on_step=watch, abort=(5, ["2", "7"]))
        assert set(finished) >= {str(i) for i in range(12)} - {"2", "7"}
        assert all_blocks_free(llm) and most > 0, "the pool was not small enough to preempt anything"
