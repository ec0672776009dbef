"""Block eviction on the worker, without an engine: K/V built so that the block each layer
must drop is known, through the policy's scorer, the scores per slot and the step plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.worker.layouts.blocks import layer_block_tables
from vllm_kvprune.worker.state import StepRows, WorkerKVState

BLOCK_SIZE, HEADS, HEAD_DIM = 32, 2, 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCK_ROW = np.array([7, 3, 11, 5, 2, 9, 0, 0], np.int32)  # the request's blocks in the pool


def kv_with_weak_block(num_tokens: int, weak_block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-norm keys; values of norm 1..2, except `weak_block`'s tokens, of norm 0.1."""
    rng = torch.Generator().manual_seed(seed)
    key = torch.nn.functional.normalize(torch.randn(num_tokens, HEADS, HEAD_DIM, generator=rng), dim=-1)
    value_norm = 1 + torch.rand(num_tokens, HEADS, 1, generator=rng)
    value_norm[weak_block * BLOCK_SIZE:(weak_block + 1) * BLOCK_SIZE] = 0.1
    value = torch.nn.functional.normalize(torch.randn(num_tokens, HEADS, HEAD_DIM, generator=rng), dim=-1)
    return key, value * value_norm


def worker(budget: int = 128, interval: int = 1, total_kv_heads: int = HEADS, reduce=None, **settings
           ) -> WorkerKVState:
    config = KVPolicyConfig.from_dict({"name": "paged_eviction", "budget": budget, "sinks": 4,
                                       "prune_interval": interval, **settings})
    state = WorkerKVState(config)
    if reduce is not None:
        state.reduce = reduce  # the runner's is vLLM's all-reduce over the tensor-parallel group
    state.bind_cache(LAYERS, num_blocks=16, block_size=BLOCK_SIZE, total_kv_heads=total_kv_heads)
    return state


def plan_step(state: WorkerKVState, num_computed: int, num_new: int, num_prompt: int):
    state.rows = StepRows(["r"], np.array([num_computed]), np.array([num_prompt]), BLOCK_ROW[None], [None])
    return state.plan(np.array([0, num_new]), BLOCK_SIZE)


def write_scores(state: WorkerKVState, plan, kv_per_layer) -> None:
    """What the impl does in each layer: score the new tokens into their planned slots."""
    for layer, (key, value) in enumerate(kv_per_layer):
        state.tables.by_slot[layer, plan.layer_slot_mapping[layer]] = state.policy.token_scores(key, value)


def test_each_layer_drops_its_weakest_block_and_reuses_it_as_the_tail():
    state = worker()
    weak = [2, 1]  # layer 0 must drop local block 2, layer 1 local block 1
    prompt = plan_step(state, 0, 128, 128)
    write_scores(state, prompt, [kv_with_weak_block(128, w, seed=i) for i, w in enumerate(weak)])
    assert not prompt.prefill_compactions, "a prompt of exactly the budget is not pruned"

    step = plan_step(state, 128, 1, 128)
    new_slots = step.layer_slot_mapping[:, 0].numpy()
    for layer, w in enumerate(weak):
        assert new_slots[layer] == BLOCK_ROW[w] * BLOCK_SIZE, "the new token opens the dropped block"
    [(row, order)] = step.block_orders
    assert row == 0 and order.tolist() == [[0, 1, 3, 2], [0, 2, 3, 1]]
    assert step.seq_lens.tolist() == [3 * BLOCK_SIZE + 1]
    logical = state.requests["r"].map.logical
    for layer, w in enumerate(weak):
        held = logical[layer, w * BLOCK_SIZE:(w + 1) * BLOCK_SIZE]
        assert held[0] == 128 and (held[1:] == -1).all(), "the dropped block's tokens are gone"

    tables = layer_block_tables(torch.from_numpy(BLOCK_ROW[None]), step, state.tables)
    assert tables[0, 0, :4].tolist() == BLOCK_ROW[[0, 1, 3, 2]].tolist()
    assert tables[1, 0, :4].tolist() == BLOCK_ROW[[0, 2, 3, 1]].tolist()


@pytest.mark.parametrize("settings, dropped", [({}, 2), ({"sinks": 0, "recent": 0}, 3),
                                               ({"sinks": 0}, 0), ({"recent": 64}, 1)])
def test_sink_block_and_tail_are_never_dropped(settings, dropped):
    """By default the sinks' block and the tail are kept; `sinks: 0, recent: 0` (the paper's
    rule) lets the weakest of all go, the tail included; `recent: 64` keeps two newest blocks."""
    state = worker(**settings)
    prompt = plan_step(state, 0, 128, 128)
    # Weakest to strongest in both layers: the tail (3), the sinks' (0), block 2, block 1.
    kv = []
    for seed in range(2):
        key, value = kv_with_weak_block(128, 0, seed)
        value[3 * BLOCK_SIZE:] *= 0.01
        value[2 * BLOCK_SIZE:3 * BLOCK_SIZE] *= 0.5
        kv.append((key, value))
    write_scores(state, prompt, kv)
    step = plan_step(state, 128, 1, 128)
    assert (step.layer_slot_mapping[:, 0].numpy() == BLOCK_ROW[dropped] * BLOCK_SIZE).all()


def test_lazy_pruning_drops_r_blocks_every_r_fills():
    state = worker(budget=128, interval=2)  # cap 5 blocks
    prompt = plan_step(state, 0, 160, 160)
    assert [c.keep for c in prompt.prefill_compactions] == [128]
    blocks = state.requests["r"].map
    for layer in range(2):  # what the impl records after pruning the prompt
        blocks.set_layer_survivors(layer, np.arange(128))
    evictions = []
    for position in range(160, 160 + 3 * BLOCK_SIZE):
        step = plan_step(state, position, 1, 160)
        slot = int(step.layer_slot_mapping[0, 0])
        state.tables.by_slot[:, slot] = 0.5  # every new token scores low
        evictions.append(int(step.seq_lens[0]))
    # 4 full blocks + the spare: the first fill uses the spare, the next evicts 2 at once.
    assert evictions[0] == 129 and evictions[BLOCK_SIZE] == 3 * BLOCK_SIZE + 1
    assert evictions[2 * BLOCK_SIZE] == 4 * BLOCK_SIZE + 1, "the second freed block needs no eviction"


def test_block_scores_are_reduced_across_tensor_parallel_ranks():
    # The other rank's heads (score sums of the request's 4 blocks, per layer) make block 1
    # the weakest overall and block 2 strong; the worker's reducer adds them in, as vLLM's
    # all-reduce over a group of two ranks would.
    other_rank = torch.tensor([[1.0, 0.0, 50.0, 1.0]] * 2) * BLOCK_SIZE
    state = worker(total_kv_heads=2 * HEADS, reduce=lambda local_sums: local_sums + other_rank)
    prompt = plan_step(state, 0, 128, 128)
    write_scores(state, prompt, [kv_with_weak_block(128, 2, seed=i) for i in range(2)])
    step = plan_step(state, 128, 1, 128)
    assert (step.layer_slot_mapping[:, 0].numpy() == BLOCK_ROW[1] * BLOCK_SIZE).all()


@pytest.mark.parametrize("budget, sinks, recent, message", [(64, 4, None, "at least 96"), (96, 40, None, "at least 128"),
                                                              (64, 0, 64, "at least 96")])
def test_budget_must_leave_an_evictable_block(budget, sinks, recent, message):
    from vllm_kvprune.config import KVConfigError

    config = KVPolicyConfig.from_dict({"name": "paged_eviction", "budget": budget, "sinks": sinks, "recent": recent})
    with pytest.raises(KVConfigError, match=message):
        config.check_engine(BLOCK_SIZE)
    # With nothing protected one block is enough to evict from.
    KVPolicyConfig.from_dict({"name": "paged_eviction", "budget": BLOCK_SIZE, "sinks": 0, "recent": 0}).check_engine(
        BLOCK_SIZE)


def test_block_means_of_many_requests_equal_each_alone():
    """One gather for several requests' blocks (`LayerScores.block_means_many`) gives each the
    very numbers its own read gives: ragged block counts, each layer its own order."""
    state = worker()
    generator = torch.Generator().manual_seed(4)
    state.tables.by_slot.copy_(torch.rand(state.tables.by_slot.shape, generator=generator))
    block_ids = [np.array([[7, 3, 11], [3, 11, 7]]), np.array([[2, 9], [9, 2]]), np.array([[0, 5, 1, 4]] * 2)]
    together = state.tables.block_means_many(block_ids)
    for ids, means in zip(block_ids, together):
        assert torch.equal(means, state.tables.block_means(ids))
        per_block = state.tables.by_slot.view(len(LAYERS), -1, BLOCK_SIZE)
        expected = torch.stack([per_block[layer, torch.from_numpy(ids[layer])].mean(dim=-1) / HEADS
                                for layer in range(len(LAYERS))])
        torch.testing.assert_close(means, expected)


@pytest.mark.parametrize("joint", [True, False])
def test_the_step_reads_its_evicting_requests_block_means_together(monkeypatch, joint):
    """Decode steps of three requests: the planner reads every evicting row's block means in
    one call before planning the rows (`BlockPlanner.search_ahead`), and each request drops
    exactly the blocks it drops alone (and when the joint read fails, `joint=False`, every
    row reads its own and nothing fails)."""
    from vllm_kvprune.worker.layouts.blocks import LayerScores

    calls = {"many": 0, "alone": 0}
    many = LayerScores.block_means_many

    def count_many(self, block_ids):
        calls["many"] += 1
        if not joint:
            raise RuntimeError("the joint read failed")
        return many(self, block_ids)

    def count_alone(self, block_ids):
        calls["alone"] += 1
        return many(self, [block_ids])[0]

    block_rows = np.array([[7, 3, 11, 5, 0], [2, 9, 14, 12, 1], [4, 6, 8, 10, 13]], np.int32)
    prompts, steps = np.array([128, 128, 96]), 40
    inputs = [[kv_with_weak_block(int(p) + steps, weak, seed=10 * i + layer) for layer, weak in enumerate((2, 1))]
              for i, p in enumerate(prompts)]

    def run(request_ids: list[int], counted: bool) -> dict[int, np.ndarray]:
        state = worker()
        if counted:
            monkeypatch.setattr(LayerScores, "block_means_many", count_many)
            monkeypatch.setattr(LayerScores, "block_means", count_alone)
        else:
            monkeypatch.setattr(LayerScores, "block_means_many", many)
            monkeypatch.setattr(LayerScores, "block_means", lambda self, ids: many(self, [ids])[0])
        for offset in range(-1, steps):
            computed = np.array([0 if offset < 0 else prompts[i] + offset for i in request_ids])
            new = np.array([prompts[i] if offset < 0 else 1 for i in request_ids])
            state.rows = StepRows([str(i) for i in request_ids], computed, prompts[request_ids],
                                  block_rows[request_ids], [None] * len(request_ids))
            plan = state.plan(np.concatenate([[0], np.cumsum(new)]), BLOCK_SIZE)
            for layer in range(len(LAYERS)):
                keys, values = (torch.cat([inputs[i][layer][part][c:c + n] for i, c, n in zip(request_ids, computed, new)])
                                for part in range(2))
                state.tables.by_slot[layer, plan.layer_slot_mapping[layer]] = state.policy.token_scores(keys, values)
        for i in request_ids:
            state.requests[str(i)].map.check()
        return {i: state.requests[str(i)].map.logical.copy() for i in request_ids}

    kept = run([0, 1, 2], counted=True)
    # "0" and "1" (full at 128) evict at their first token and 32 later; "2" (96) once full, with them.
    assert calls["many"] == 2 and calls["alone"] == (0 if joint else 5)
    for i in range(3):
        assert np.array_equal(kept[i], run([i], counted=False)[i])


def test_a_token_at_a_time_fills_the_map_as_a_chunk_does():
    # A decode step's single token takes the map's own path (and `is_identity` its cached
    # answer); a chunk of the same tokens, the general one: the maps must agree throughout.
    from vllm_kvprune.worker.block_map import LayerBlockMap

    rng = np.random.default_rng(3)
    for trial in range(30):
        one, chunk = LayerBlockMap(3, 4), LayerBlockMap(3, 4)
        position = 0
        for _ in range(12):
            count = int(rng.integers(1, 9))
            positions = np.arange(position, position + count)
            singles = np.concatenate([one.append(positions[i:i + 1]) for i in range(count)], axis=1)
            assert np.array_equal(singles, chunk.append(positions))
            position += count
            action = rng.integers(3)
            full_blocks = one.num_valid // 4
            if action == 0 and trial % 2 and one.tail_full and full_blocks > 1:
                victims = np.stack([rng.permutation(full_blocks - 1)[:1] + 1 for _ in range(3)])
                one.evict(victims)
                chunk.evict(victims)
            elif action == 1 and trial % 3 == 0 and one.num_valid > 4:
                one.compact(one.num_valid - 2)
                chunk.compact(chunk.num_valid - 2)
            for blocks in (one, chunk):
                fresh = not blocks.free.shape[1] and bool((blocks.order == np.arange(blocks.order.shape[1])).all())
                assert blocks.is_identity() == fresh
            assert np.array_equal(one.order, chunk.order) and np.array_equal(one.free, chunk.free)
            assert np.array_equal(one.logical, chunk.logical)
            one.check()
