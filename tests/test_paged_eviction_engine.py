"""The `paged_eviction` policy in real vLLM engines, beyond the conformance suite's contract
(tests/test_policy_conformance.py: parity, mixed settings, preemption, aborts): block size 64,
per-layer block invariants, the paper's rule beside ours, the real model."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import engine, runner_of, scheduler_of
from test_streaming_engine import all_blocks_free, assert_caps_after_prompt, assert_same_as, greedy, prompts, run_steps

SINKS = 4
# Prompts shorter and longer than the budget; generations of at least 4x the budget.
PROMPT_LENGTHS = (20, 150, 300)


def assert_matches_reference(outputs, prompt_ids, model, num_tokens: int, **policy) -> None:
    from vllm_kvprune.reference.paged_eviction import PagedEvictionReference

    assert_same_as(PagedEvictionReference(model, **policy), outputs, prompt_ids, num_tokens)


def engine_policy(budget: int, interval: int = 1, sinks: int = SINKS) -> dict:
    return {"name": "paged_eviction", "budget": budget, "sinks": sinks, "prune_interval": interval}


PARITY_CASES = [(32, 96, 1), (32, 96, 2), (64, 192, 1), (64, 192, 2)]


# The suite runs block size 64 at R = 2 (the conformance suite, tests/test_policy_conformance.py,
# runs 32 at R = 1 and 2 beside the other contracts); --heavy, all four.
SUITE_CASES = {(64, 192, 2)}


@pytest.mark.parametrize("block_size, budget, interval", [
    pytest.param(*case, id=f"bs{case[0]}-B{case[1]}-R{case[2]}", marks=() if case in SUITE_CASES else pytest.mark.heavy)
    for case in PARITY_CASES])
def test_parity_with_reference(tiny_model, reference_model, block_size, budget, interval):
    num_tokens = 2 * budget  # every request outgrows its budget, most of them by a budget again
    prompt_ids = prompts(PROMPT_LENGTHS)
    with engine(tiny_model, engine_policy(budget, interval), block_size=block_size,
                kv_blocks=512 * 32 // block_size) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(num_tokens), use_tqdm=False)
    assert_matches_reference(outputs, prompt_ids, reference_model, num_tokens, budget=budget,
                             block_size=block_size, sinks=SINKS, prune_interval=interval)


def check_invariants(llm, seen_layer_orders: list[bool]) -> None:
    """Cap after the prompt (scheduler); in every layer, no slot held twice and each request's
    tokens inside its own blocks (worker)."""
    assert_caps_after_prompt(llm)
    scheduler, runner = scheduler_of(llm), runner_of(llm)
    block_size = scheduler.cache_config.block_size
    owners: list[dict[int, str]] = []
    for request_id, state in runner.kv_state.requests.items():
        if request_id not in runner.requests:
            continue
        blocks = state.map
        block_row = np.array(runner.requests[request_id].block_ids[0])
        offsets = np.arange(blocks.num_valid)
        seen_layer_orders.append(bool((blocks.order != blocks.order[0]).any()))
        for layer in range(blocks.num_layers):
            local_blocks = blocks.order[layer][offsets // block_size]
            assert (local_blocks < len(block_row)).all(), "a layer reads a block the request does not hold"
            global_slots = block_row[local_blocks] * block_size + offsets % block_size
            while len(owners) <= layer:
                owners.append({})
            for slot in global_slots.tolist():
                assert slot not in owners[layer], f"layer {layer}: slot {slot} held twice"
                owners[layer][slot] = request_id


@pytest.fixture(scope="class")
def paged_llm(tiny_model):
    with engine(tiny_model, engine_policy(96), kv_blocks=512) as llm:
        yield llm


class TestSharedEngine:
    """Tests that share one engine; it is closed when the class ends, before any other opens."""

    def test_invariants_during_a_mixed_batch(self, paged_llm):
        rng = np.random.default_rng(1)
        lengths = rng.integers(3, 400, size=24).tolist()
        prompt_ids = prompts(lengths, seed=2)
        params = [greedy(int(rng.integers(20, 300)), **({"kv_budget": int(rng.choice([96, 128, 200]))}
                                                         if i % 2 else {})) for i in range(24)]
        seen_layer_orders: list[bool] = []
        finished = run_steps(paged_llm, prompt_ids, params,
                             on_step=lambda: check_invariants(paged_llm, seen_layer_orders))
        assert len(finished) == 24
        assert all(len(finished[str(i)].outputs[0].token_ids) == params[i].max_tokens for i in range(24))
        assert all_blocks_free(paged_llm)
        assert any(seen_layer_orders), "layers were expected to evict different blocks"

    def test_papers_rule_next_to_ours_matches_the_reference(self, paged_llm, reference_model):
        """Per request, `kv_sinks: 0, kv_recent: 0` is the paper's own rule (every block a
        candidate, the newest included) beside our default in one batch, each matching the
        reference at its settings."""
        prompt_ids = prompts(PROMPT_LENGTHS, seed=5)
        num_tokens = 2 * 96
        papers = dict(kv_sinks=0, kv_recent=0)
        outputs = paged_llm.generate([{"prompt_token_ids": p} for p in prompt_ids * 2],
                                     [greedy(num_tokens, **papers)] * len(prompt_ids) + [greedy(num_tokens)] * len(
                                         prompt_ids), use_tqdm=False)
        assert_matches_reference(outputs[:len(prompt_ids)], prompt_ids, reference_model, num_tokens, budget=96,
                                 block_size=32, sinks=0, recent=0)
        assert_matches_reference(outputs[len(prompt_ids):], prompt_ids, reference_model, num_tokens, budget=96,
                                 block_size=32, sinks=SINKS)
        assert all(a.outputs[0].token_ids != b.outputs[0].token_ids
                   for a, b in zip(outputs[1:len(prompt_ids)], outputs[len(prompt_ids) + 1:])), \
            "the two rules were expected to keep different blocks on the pruned prompts"
        assert all_blocks_free(paged_llm)

    def test_budget_override_too_small_is_refused(self, paged_llm):
        from vllm.exceptions import VLLMValidationError

        with pytest.raises(VLLMValidationError, match="kv_budget"):
            paged_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8, kv_budget=64), use_tqdm=False)
        [output] = paged_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 8


@pytest.mark.slow
@pytest.mark.parametrize("block_size, budget, interval", [(32, 128, 1), pytest.param(64, 256, 2, marks=pytest.mark.heavy)])
def test_parity_real_model(real_model, block_size, budget, interval):
    from vllm_kvprune.reference.model import load_reference_model

    num_tokens = budget  # the prompt is cut at its end, then a block is evicted each time the blocks fill
    prompt_ids = prompts((400,), seed=7)
    with engine(real_model, engine_policy(budget, interval), block_size=block_size,
                kv_blocks=256 * 32 // block_size) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(num_tokens), use_tqdm=False)
    assert_matches_reference(outputs, prompt_ids, load_reference_model(real_model), num_tokens,
                             budget=budget, block_size=block_size, sinks=SINKS, prune_interval=interval)
