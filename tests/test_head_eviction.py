"""Head-wise eviction (H2O) on the worker, without an engine: the slot map per layer and KV
head, the policy's choices, and the impl's steps (per-head writes, attention mass, prompt
pruning) run on a real cache with keys and queries built so that each head's choice is known."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_kvprune import kernels
from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies.h2o import H2OPolicy
from vllm_kvprune.worker.head_map import SKIP, HeadSlotMap
from vllm_kvprune.worker.kernel_sets import CPUKernels
from vllm_kvprune.worker.layouts import LayerCall
from vllm_kvprune.worker.state import StepRows, WorkerKVState

BLOCK_SIZE, HEADS, HEAD_DIM, NUM_BLOCKS = 32, 2, 64, 8
LAYERS = ["model.layers.0.self_attn.attn"]
BLOCK_ROW = np.array([5, 2, 7, 1, 0, 0], np.int32)  # the request's blocks in the pool


def h2o_config(budget: int, sinks: int, recent: int, interval: int = 1) -> KVPolicyConfig:
    return KVPolicyConfig.from_dict({"name": "h2o", "budget": budget, "sinks": sinks, "recent": recent,
                                     "prune_interval": interval})


# ---- the policy's choices ---------------------------------------------------------------------

def evicted(mass: list[float], logical: list[int], count: int) -> list[int]:
    """One layer and head; slot i holds position logical[i] with mass mass[i]."""
    config = h2o_config(budget=8, sinks=2, recent=2)
    table = torch.tensor(mass)[None, None]
    victims = H2OPolicy().evicted(table, torch.arange(len(mass)), torch.tensor(logical)[None, None], count, 10, config)
    return victims[0, 0].tolist()


def test_evicts_lowest_mass_outside_sinks_and_recent_oldest_first_on_ties():
    logical = [0, 1, 9, 3, 4, 5, 6, 7, 8]  # slot 2 holds the newest but one
    mass = [0.0, 0.0, 0.0, 5.0, 1.0, 1.0, 2.0, 0.5, 3.0]
    # Next position 10: recent = 8, 9 (slots 8, 2); sinks = slots 0, 1.
    assert evicted(mass, logical, 1) == [7]
    # Slots 4 and 5 tie at 1.0: position 4 (older) goes before position 5.
    assert evicted(mass, logical, 2) == [7, 4]
    tied = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert sorted(evicted(tied, [0, 1, 9, 6, 5, 4, 3, 7, 8], 2)) == [5, 6]  # positions 3, 4


@pytest.mark.skipif(not kernels.HAS_EXTENSION and os.environ.get("KVPRUNE_NO_EXT") == "1",
                    reason="built with KVPRUNE_NO_EXT=1")
@pytest.mark.parametrize("n, table_slots", [(200, 1024), (1500, 4096)], ids=["one-task", "split-over-threads"])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_victim_kernel_equals_torch_reference(count, n, table_slots):
    """Random masses with many exact ties, slots scattered in a larger table, positions
    permuted per head (as after in-place replacements), a strided positions view; with 1500
    slots the op splits the (layer, head) pairs over threads."""
    from vllm_kvprune.kernels import reference

    gen = torch.Generator().manual_seed(count)
    layers, heads = 5, 3
    mass = (torch.randint(0, 20, (layers, heads, table_slots), generator=gen) / 4.0).float()
    slots = torch.randperm(table_slots, generator=gen)[:n]
    held = torch.stack([torch.randperm(n + 50, generator=gen)[:n] for _ in range(layers * heads)])
    buffer = torch.full((layers, heads, n + 16), -7, dtype=torch.int64)
    buffer[:, :, :n] = held.view(layers, heads, n)
    logical = buffer[:, :, :n]  # strided, like HeadSlotMap.logical
    args = (count, 240, 4, 30)  # next position, sinks, recent
    expected = reference.lowest_mass_slots(mass, slots, logical, *args)
    assert torch.equal(kernels.lowest_mass_slots(mass, slots, logical, *args), expected)
    chosen = logical.gather(-1, expected)
    assert ((chosen >= 4) & (chosen < 210)).all(), "a sink or a recent token was chosen"


@pytest.mark.skipif(not kernels.HAS_EXTENSION, reason="built with KVPRUNE_NO_EXT=1")
def test_victim_kernel_split_over_threads_fails_for_a_head_with_too_few_tokens():
    """A head in the middle of the op's split (more than one thread's share of its
    (layer, head) pairs) with nothing evictable: the op raises, naming it, in the caller."""
    layers, heads, n = 4, 4, 2000
    mass = torch.rand(layers, heads, n)
    logical = torch.arange(n).expand(layers, heads, n).clone()
    logical[2, 1] = torch.arange(n) % 4  # every token a sink
    with pytest.raises(RuntimeError, match="layer 2 head 1 has 0 evictable tokens"):
        kernels.lowest_mass_slots(mass, torch.arange(n), logical, 1, n, 4, 0)


def test_one_search_for_many_requests_chooses_as_each_alone():
    """The step's requests searched together (`victims.lowest_mass_slots_batched`, what a
    GPU's table takes: padded to one width, ranked in one pass) choose what each request's own
    search chooses: different lengths, counts, sinks and recent windows, many exact ties."""
    from vllm_kvprune.kernels import reference
    from vllm_kvprune.kernels.victims import VictimSearch, lowest_mass_slots_batched

    gen = torch.Generator().manual_seed(0)
    layers, heads, table_slots = 4, 3, 2048
    mass = (torch.randint(0, 12, (layers, heads, table_slots), generator=gen) / 4.0).float()
    pool = torch.randperm(table_slots, generator=gen)
    searches, start = [], 0
    for n, count, sinks, recent in ((200, 1, 4, 30), (57, 3, 0, 8), (120, 8, 2, 1), (9, 1, 1, 2)):
        held = torch.stack([torch.randperm(n + 40, generator=gen)[:n] for _ in range(layers * heads)])
        searches.append(VictimSearch(pool[start:start + n], held.view(layers, heads, n).numpy(), count,
                                     n + 40, sinks, recent))
        start += n
    found = lowest_mass_slots_batched(mass, searches)
    for search, victims in zip(searches, found):
        expected = reference.lowest_mass_slots(mass, search.slots, torch.from_numpy(search.logical), search.count,
                                               search.next_position, search.sinks, search.recent)
        assert torch.equal(victims, expected)
    assert [tuple(v.shape) for v in found] == [(layers, heads, s.count) for s in searches]
    # As the one-request op, too few evictable tokens is an error, not a protected token chosen.
    too_many = dataclasses.replace(searches[3], count=10)  # more than it holds
    with pytest.raises(ValueError, match="fewer than 10 evictable"):
        lowest_mass_slots_batched(mass, [searches[0], too_many])


def test_replace_one_victim_per_head_writes_in_place():
    heads = HeadSlotMap(num_layers=2, num_heads=2)
    heads.append(np.arange(6))
    victims = np.array([[[3], [1]], [[5], [2]]])
    new_slots, sources, destinations = heads.replace(victims, 6)
    assert new_slots.tolist() == [[3, 1], [5, 2]] and sources.shape[1] == 0
    assert heads.logical[0, 0].tolist() == [0, 1, 2, 6, 4, 5] and heads.logical[1, 1].tolist() == [0, 1, 6, 3, 4, 5]
    heads.check()


def test_replace_lazy_fills_holes_from_the_end_per_head():
    heads = HeadSlotMap(num_layers=1, num_heads=2)
    heads.append(np.arange(8))
    new_slots, sources, destinations = heads.replace(np.array([[[1, 2, 6], [5, 6, 7]]]), 8)
    assert new_slots.tolist() == [[1, 5]]
    # head 0: holes 1, 2 below the new end 6; slot 7 survives past it and moves to hole 2.
    assert sources[0, :, 0].tolist() == [7, SKIP] and destinations[0, :, 0].tolist() == [2, SKIP]
    # head 1: every victim is at or past the new end but one: nothing moves.
    assert (destinations[0, :, 1] == SKIP).all()
    assert heads.logical[0].tolist() == [[0, 8, 7, 3, 4, 5], [0, 1, 2, 3, 4, 8]]
    heads.check()


# ---- per-head independence through the impl's steps -------------------------------------------

def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm()


def constructed_prompt(num_tokens: int, favoured: tuple[int, int], seed: int = 0):
    """Queries, keys and values `[T, heads, D]` where every query of head h points at the key
    of token `favoured[h]` and away from the other head's favourite (so its mass there is ~0)."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen) * 0.1
    direction = [unit(torch.randn(HEAD_DIM, generator=gen)) for _ in range(HEADS)]
    query = torch.stack([direction[h].expand(num_tokens, -1) for h in range(HEADS)], dim=1) * 4
    for head in range(HEADS):
        key[favoured[head], head] = direction[head] * 4
        key[favoured[1 - head], head] = -direction[head] * 4
    value = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    return query, key, value


def bare_impl() -> SimpleNamespace:
    """What a plan reads of the impl: the kernels and the layer's shape and scale."""
    return SimpleNamespace(scale=HEAD_DIM ** -0.5, kernels=CPUKernels(), num_heads=HEADS, head_size=HEAD_DIM)


def run_layer_step(state: WorkerKVState, impl, layer, kv_cache, plan, query, key, value,
                   block_rows: np.ndarray = BLOCK_ROW[None]) -> None:
    """What the impl does in one layer through the plan, minus vLLM's own attention kernel
    (whose output H2O does not change): per-head writes, mass accumulation (with the attention
    output where the step is fused), prompt pruning."""
    call = LayerCall(impl, layer, kv_cache, state)
    metadata = SimpleNamespace(block_table=torch.from_numpy(block_rows.astype(np.int32)))
    plan.write(call, key, value, plan.slot_mapping)
    if plan.fused(call):
        plan.attend(call, query, key, value, metadata, torch.empty(len(query), HEADS * HEAD_DIM))
    plan.after_attention(call, query, metadata)


@pytest.mark.parametrize("interval", [1, 4])
def test_each_head_keeps_its_own_heavy_hitter(interval):
    num_prompt, favoured = 80, (10, 20)
    config = h2o_config(budget=48, sinks=2, recent=8, interval=interval)
    state = WorkerKVState(config)
    state.bind_cache(LAYERS, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, total_kv_heads=HEADS)
    layout = kernels.vec_layout(torch.float32, BLOCK_SIZE, HEAD_DIM)
    kv_cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    layer = SimpleNamespace(layer_name=LAYERS[0], isa="vec")
    impl = bare_impl()
    query, key, value = constructed_prompt(num_prompt + 12, favoured)

    def step(num_computed: int, num_new: int):
        state.rows = StepRows(["r"], np.array([num_computed]), np.array([num_prompt]), BLOCK_ROW[None], [None])
        plan = state.plan(np.array([0, num_new]), BLOCK_SIZE)
        span = slice(num_computed, num_computed + num_new)
        run_layer_step(state, impl, layer, kv_cache, plan, query[span], key[span], value[span])
        return plan

    step(0, num_prompt)
    heads = state.requests["r"].map
    assert heads.num_valid == 47
    for computed in range(num_prompt, num_prompt + 12):  # decode: evictions by mass, per head
        step(computed, 1)
        heads.check()
    held = heads.logical[0]
    assert favoured[0] in held[0] and favoured[1] not in held[0], "head 0 keeps token 10, drops token 20"
    assert favoured[1] in held[1] and favoured[0] not in held[1], "head 1 keeps token 20, drops token 10"
    # The cache itself holds, in each head's slots, the keys its map says.
    slots = torch.from_numpy(BLOCK_ROW[np.arange(heads.num_valid) // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                             + np.arange(heads.num_valid) % BLOCK_SIZE)
    cached_key, cached_value = kernels.read_slots(kv_cache, slots, layout)
    for head in range(HEADS):
        expected = key[torch.from_numpy(held[head]), head]
        torch.testing.assert_close(cached_key[:, head], expected)
        torch.testing.assert_close(cached_value[:, head], value[torch.from_numpy(held[head]), head])


@pytest.mark.parametrize("joint", [True, False])
def test_the_step_searches_its_requests_together_and_chooses_as_each_alone(monkeypatch, joint):
    """Decode steps of three requests: the planner searches every evicting row's victims in
    one call before planning the rows (`HeadPlanner.search_ahead`), and the rows keep exactly
    the tokens they keep when each searches alone (the joint search failing, `joint=False`:
    every row then searches for itself, and nothing fails)."""
    from vllm_kvprune.policies.h2o import H2OPolicy as Policy

    calls = {"many": 0, "alone": 0}
    alone, many = Policy.evicted, Policy.evicted_many

    def count_alone(self, *args, **kwargs):
        calls["alone"] += 1
        return alone(self, *args, **kwargs)

    def count_many(self, mass, searches):
        calls["many"] += 1
        if not joint:
            raise RuntimeError("the joint search failed")
        return many(self, mass, searches)

    monkeypatch.setattr(Policy, "evicted", count_alone)
    monkeypatch.setattr(Policy, "evicted_many", count_many)
    block_rows = np.array([[5, 2, 7], [1, 0, 3], [4, 6, 8]], np.int32)
    num_blocks, prompts = 9, np.array([80, 60, 30])
    state = WorkerKVState(h2o_config(budget=40, sinks=2, recent=4))
    state.bind_cache(LAYERS, num_blocks=num_blocks, block_size=BLOCK_SIZE, total_kv_heads=HEADS)
    kv_cache = torch.zeros(num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    layer = SimpleNamespace(layer_name=LAYERS[0], isa="vec")
    impl = bare_impl()
    inputs = [constructed_prompt(int(p) + 10, (5, 9), seed=i) for i, p in enumerate(prompts)]

    def step(num_computed: np.ndarray, num_new: np.ndarray):
        state.rows = StepRows(["a", "b", "c"], num_computed, prompts, block_rows, [None] * 3)
        plan = state.plan(np.concatenate([[0], np.cumsum(num_new)]), BLOCK_SIZE)
        query, key, value = (torch.cat([part[i][c:c + n] for part, c, n in zip(inputs, num_computed, num_new)])
                             for i in range(3))
        run_layer_step(state, impl, layer, kv_cache, plan, query, key, value, block_rows)

    step(np.zeros(3, np.int64), prompts)
    calls.update(many=0, alone=0)
    for offset in range(10):
        step(prompts + offset, np.ones(3, np.int64))
    # "a" and "b" evict at every decode step but the first (their prompts were pruned to 39,
    # the first token fills the budget of 40); "c" (30 tokens) never reaches the budget.
    assert calls == ({"many": 9, "alone": 0} if joint else {"many": 9, "alone": 18})
    kept = {request_id: state.requests[request_id].map.logical.copy() for request_id in "abc"}
    for request_id in "abc":
        state.requests[request_id].map.check()
    # Each request as the only one, each row searching alone: the same tokens kept.
    for index, request_id in enumerate("abc"):
        solo = WorkerKVState(h2o_config(budget=40, sinks=2, recent=4))
        solo.bind_cache(LAYERS, num_blocks=num_blocks, block_size=BLOCK_SIZE, total_kv_heads=HEADS)
        monkeypatch.setattr(Policy, "evicted_many", many)
        solo_cache = torch.zeros_like(kv_cache)
        prompt = int(prompts[index])
        for computed, new in [(0, prompt), *((prompt + i, 1) for i in range(10))]:
            solo.rows = StepRows([request_id], np.array([computed]), prompts[index:index + 1],
                                 block_rows[index:index + 1], [None])
            plan = solo.plan(np.array([0, new]), BLOCK_SIZE)
            query, key, value = (part[computed:computed + new] for part in inputs[index])
            run_layer_step(solo, impl, layer, solo_cache, plan, query, key, value, block_rows[index:index + 1])
        assert np.array_equal(solo.requests[request_id].map.logical, kept[request_id]), request_id


def test_prompt_chunks_take_their_output_from_the_mass_pass():
    """A prompt in two chunks on the CPU's kernel set: each chunk's step is fused (the mass pass
    writes the attention output and vLLM's attention is skipped), its output is causal
    attention over the prompt so far, and the mass table holds each token's summed attention
    columns; a kernel set that does not fuse prompt chunks keeps the platform's attention."""
    num_prompt, first_chunk = 80, 50
    config = h2o_config(budget=128, sinks=2, recent=8)
    state = WorkerKVState(config)
    state.bind_cache(LAYERS, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, total_kv_heads=HEADS)
    kv_cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    layer = SimpleNamespace(layer_name=LAYERS[0], isa="vec")
    impl = bare_impl()
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(num_prompt, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    metadata = SimpleNamespace(block_table=torch.from_numpy(BLOCK_ROW[None].astype(np.int32)))
    # Dense causal attention per head, and each key's column sums: the reference.
    logits = torch.einsum("qhd,khd->hqk", query, key) * impl.scale
    logits = logits.masked_fill(torch.ones(num_prompt, num_prompt, dtype=torch.bool).triu(1), float("-inf"))
    probabilities = logits.softmax(-1)
    expected_output = torch.einsum("hqk,khd->qhd", probabilities, value)
    for start, stop in ((0, first_chunk), (first_chunk, num_prompt)):
        state.rows = StepRows(["r"], np.array([start]), np.array([num_prompt]), BLOCK_ROW[None], [None])
        plan = state.plan(np.array([0, stop - start]), BLOCK_SIZE)
        call = LayerCall(impl, layer, kv_cache, state)
        assert plan.fused(call), "a prompt chunk alone in its step is fused on the CPU"
        unfused = LayerCall(SimpleNamespace(**{**vars(impl), "kernels": type("Unfused", (CPUKernels,),
                                                                               {"fused_prefill_mass": False})()}),
                            layer, kv_cache, state)
        assert not plan.fused(unfused)
        span = slice(start, stop)
        plan.write(call, key[span], value[span], plan.slot_mapping)
        output = torch.full((stop - start, HEADS * HEAD_DIM), float("nan"))
        plan.attend(call, query[span], key[span], value[span], metadata, output)
        torch.testing.assert_close(output.view(-1, HEADS, HEAD_DIM), expected_output[span], rtol=1e-5, atol=1e-5)
        plan.after_attention(call, query[span], metadata)
    slots = torch.from_numpy(BLOCK_ROW[np.arange(num_prompt) // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                             + np.arange(num_prompt) % BLOCK_SIZE)
    torch.testing.assert_close(state.tables.by_slot[0][:, slots], probabilities.sum(1), rtol=1e-5, atol=1e-5)
