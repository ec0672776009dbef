"""The worker's slot maps and the scheduler's chunking rule, without an engine."""

import numpy as np
import pytest

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.engine.scheduler import chunk_tokens
from vllm_kvprune.policies.streaming import StreamingPolicy
from vllm_kvprune.worker.slot_map import SlotMap
from vllm_kvprune.worker.state import RequestKVState, _PlanBuilder


def test_replace_one_victim_overwrites_in_place():
    slots = SlotMap()
    slots.append(np.arange(10))
    new_slot, (sources, destinations) = slots.replace(np.array([4]), 10)
    assert new_slot == 4 and len(sources) == 0
    assert slots.logical.tolist() == [0, 1, 2, 3, 10, 5, 6, 7, 8, 9]


def test_replace_many_victims_keeps_a_dense_prefix():
    rng = np.random.default_rng(0)
    for _ in range(200):
        slots = SlotMap()
        n = int(rng.integers(2, 40))
        slots.append(rng.permutation(100)[:n])
        victims = rng.permutation(n)[: int(rng.integers(1, n + 1))]
        before = dict(enumerate(slots.logical.tolist()))
        new_slot, (sources, destinations) = slots.replace(victims, 1000)
        # Apply the moves to a model of the cache and compare with the map.
        cache = dict(before)
        moved = {int(d): cache[int(s)] for s, d in zip(sources, destinations)}
        cache.update(moved)
        cache[new_slot] = 1000
        assert slots.num_valid == n - len(victims) + 1
        assert [cache[i] for i in range(slots.num_valid)] == slots.logical.tolist()
        survivors = set(before.values()) - {before[int(v)] for v in victims}
        assert set(slots.logical.tolist()) == survivors | {1000}
        slots.check()


def test_streaming_survivors_and_victims():
    policy = StreamingPolicy()
    config = KVPolicyConfig.from_dict({"name": "streaming", "budget": 8, "sinks": 2})
    logical = np.array([0, 1, 9, 3, 4, 5, 6, 7, 8, 2])
    assert logical[policy.survivors(logical, 7, config)].tolist() == [0, 1, 5, 6, 7, 8, 9]
    assert sorted(logical[policy.victims(logical, 3, config)].tolist()) == [2, 3, 4]


def test_streaming_one_victim_is_the_oldest_non_sink():
    # A decode step's single victim takes its own path; the general one (count 2) agrees.
    policy, rng = StreamingPolicy(), np.random.default_rng(1)
    for sinks in (0, 2, 4):
        config = KVPolicyConfig.from_dict({"name": "streaming", "budget": 64, "sinks": sinks})
        for _ in range(100):
            logical = rng.permutation(200)[: int(rng.integers(3, 60))]
            assert policy.victims(logical, 1, config).tolist() == policy.victims(logical, 2, config)[:1].tolist()
    only_sinks = KVPolicyConfig.from_dict({"name": "streaming", "budget": 8, "sinks": 4})
    assert len(policy.victims(np.array([2, 0, 1]), 1, only_sinks)) == 0


def _run(config: KVPolicyConfig, prompt: int, steps: int) -> list[int]:
    """Physical keys seen per step when one request runs prompt then decode steps."""
    state = RequestKVState(config=config, policy=StreamingPolicy(), map=SlotMap())
    block_row = np.arange(1000)
    seen, computed = [], 0
    while computed < prompt + steps:
        chunk = chunk_tokens(config, prompt, computed, prompt + steps - computed)
        builder = _PlanBuilder(block_size=32)
        builder.add_row(state, 0, computed, chunk, prompt, block_row)
        plan = builder.finish()
        seen.append(int(plan.seq_lens[0]))
        assert len(set(plan.slot_mapping.tolist())) == chunk
        computed += chunk
    return seen


@pytest.mark.parametrize("interval", [1, 8])
def test_decode_keys_follow_the_rule(interval):
    config = KVPolicyConfig.from_dict({"name": "streaming", "budget": 64, "sinks": 4, "prune_interval": interval})
    seen = _run(config, prompt=100, steps=200)
    assert seen[0] == 100  # full prefill attends to the whole prompt
    decode = seen[1:]
    assert max(decode) == 64 + interval - 1 and min(decode) == 64
    if interval == 1:
        assert set(decode) == {64}


def test_streaming_prefill_runs_in_budget_plus_chunk():
    config = KVPolicyConfig.from_dict({"name": "streaming", "budget": 64, "sinks": 4, "prefill": "streaming",
                                       "prefill_chunk": 48})
    seen = _run(config, prompt=500, steps=10)
    assert max(seen) <= 63 + 48
    assert chunk_tokens(config, 500, 96, 1000) == 48 and chunk_tokens(config, 500, 480, 100) == 20


def test_chunk_rule_past_the_prompt_is_one_token():
    config = KVPolicyConfig.from_dict({"name": "streaming", "budget": 64})
    assert chunk_tokens(config, 100, 0, 4096) == 100  # a resumed request re-prefills its prompt first
    assert chunk_tokens(config, 100, 100, 50) == 1  # then replays its outputs one by one


def test_no_chunk_ends_within_the_policys_prompt_tail(monkeypatch):
    """A policy whose `prompt_tail` is 64 (it scores the prompt with its last 64 queries): a
    chunk ends either at the prompt's end or at least 64 tokens before it; a step with room
    for less than what is left runs none of it (vLLM schedules the request later)."""
    config = KVPolicyConfig.from_dict({"name": "h2o", "budget": 128})
    monkeypatch.setattr(type(config.policy), "prompt_tail", lambda self, config: 64)
    assert chunk_tokens(config, 300, 0, 128) == 128  # 172 left: fine
    assert chunk_tokens(config, 300, 128, 128) == 108  # would leave 44: stops 64 before the end
    assert chunk_tokens(config, 300, 236, 40) == 0  # 64 left, room for 40: waits
    assert chunk_tokens(config, 300, 236, 128) == 64  # the last 64 together
    assert chunk_tokens(config, 50, 0, 30) == 0 and chunk_tokens(config, 50, 0, 128) == 50  # shorter than the tail
    assert chunk_tokens(config, 300, 300, 5) == 1  # past the prompt: one token
