"""The `h2o` policy in real vLLM engines, beyond the conformance suite's contract
(tests/test_policy_conformance.py: parity, mixed settings, preemption, aborts): the invariants of
per-head slot maps (sinks and recent window kept by every head, heads that differ), H2O's own
gather-and-append baseline, the real model."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import engine, runner_of, scheduler_of
from test_streaming_engine import all_blocks_free, assert_caps_after_prompt, assert_same_as, greedy, prompts, run_steps

SINKS = 2
# Prompts shorter and longer than the budget; generations of at least 4x the budget.
PROMPT_LENGTHS = (20, 150, 300)


def engine_policy(budget: int, interval: int = 1, recent: int | None = None, sinks: int = SINKS) -> dict:
    return {"name": "h2o", "budget": budget, "sinks": sinks, "prune_interval": interval, "recent": recent}


def reference_for(model, budget: int, interval: int = 1, recent: int | None = None, sinks: int = SINKS):
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.reference.h2o import H2OReference

    config = KVPolicyConfig.from_dict(engine_policy(budget, interval, recent, sinks))
    return H2OReference(model, budget=budget, recent=config.recent_size, sinks=sinks, prune_interval=interval)


PARITY_CASES = [(64, 1, None), (64, 8, None), (96, 1, 16), (96, 8, 16)]
# The conformance suite (tests/test_policy_conformance.py) covers both prune intervals and a recent
# window beside the default one, in one batch; --heavy, all four here again.
SUITE_CASES: set = set()


@pytest.mark.parametrize("budget, interval, recent", [
    pytest.param(*case, id=f"B{case[0]}-R{case[1]}-recent{case[2]}",
                 marks=() if case in SUITE_CASES else pytest.mark.heavy) for case in PARITY_CASES])
def test_parity_with_reference(tiny_model, reference_model, budget, interval, recent):
    num_tokens = 2 * budget  # every request outgrows its budget, most of them by a budget again
    prompt_ids = prompts(PROMPT_LENGTHS)
    with engine(tiny_model, engine_policy(budget, interval, recent)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(num_tokens), use_tqdm=False)
    assert_same_as(reference_for(reference_model, budget, interval, recent), outputs, prompt_ids, num_tokens)


def check_invariants(llm, heads_differ: list[bool]) -> None:
    """Cap after the prompt (scheduler); per layer and head, no slot held twice, every token
    inside its request's own blocks, sinks and the recent window kept by every head (worker)."""
    assert_caps_after_prompt(llm)
    scheduler, runner = scheduler_of(llm), runner_of(llm)
    block_size = scheduler.cache_config.block_size
    owners: set[int] = set()
    for request_id, state in runner.kv_state.requests.items():
        if request_id not in runner.requests:
            continue
        heads, config = state.map, state.config
        heads.check()
        request = scheduler.requests.get(request_id)
        if request is not None and request.num_computed_tokens >= request.num_prompt_tokens:
            assert heads.num_valid <= config.max_cached
        block_row = np.array(runner.requests[request_id].block_ids[0])
        local = np.arange(heads.num_valid)
        assert (local // block_size < len(block_row)).all(), "a head reads a block the request does not hold"
        for slot in (block_row[local // block_size] * block_size + local % block_size).tolist():
            assert slot not in owners, f"slot {slot} held by two requests"
            owners.add(slot)
        held = np.sort(heads.logical, axis=2)
        if heads.num_valid >= config.budget - 1:
            sinks = min(config.sinks, heads.num_valid)
            assert (held[:, :, :sinks] == np.arange(sinks)).all(), "a head lost a sink"
            newest = held[0, 0, -1]
            window = np.arange(newest - config.recent_size + 1, newest + 1)
            assert (held[:, :, held.shape[2] - len(window):] == window).all(), "a head lost a recent token"
        heads_differ.append(bool((heads.logical != heads.logical[:, :1]).any()))


@pytest.fixture(scope="class")
def h2o_llm(tiny_model):
    with engine(tiny_model, engine_policy(96), kv_blocks=512) as llm:
        yield llm


class TestSharedEngine:
    """Tests that share one engine; it is closed when the class ends, before any other opens."""

    def test_invariants_during_a_mixed_batch(self, h2o_llm):
        rng = np.random.default_rng(1)
        lengths = rng.integers(3, 400, size=24).tolist()
        prompt_ids = prompts(lengths, seed=2)
        params = [greedy(int(rng.integers(20, 300)), **({"kv_budget": int(rng.choice([64, 128, 200]))}
                                                         if i % 2 else {})) for i in range(24)]
        heads_differ: list[bool] = []
        finished = run_steps(h2o_llm, prompt_ids, params, on_step=lambda: check_invariants(h2o_llm, heads_differ))
        assert len(finished) == 24
        assert all(len(finished[str(i)].outputs[0].token_ids) == params[i].max_tokens for i in range(24))
        assert all_blocks_free(h2o_llm)
        assert any(heads_differ), "heads were expected to keep different tokens"

    def test_gather_and_append_baseline_keeps_the_same_tokens(self, h2o_llm, reference_model, monkeypatch):
        """The benchmarks' baseline (`KVPRUNE_SHIFT_APPEND=1`): each head gathers its
        survivors to the front in order and appends (in place, the new token would take a
        victim's slot, out of order), keeping what the reference keeps, moves recorded."""
        from vllm_kvprune.worker.layouts.heads import HeadPlanner

        monkeypatch.setattr(HeadPlanner, "gather_and_append", True)
        kv_state = runner_of(h2o_llm).kv_state
        prompt_ids, num_tokens = prompts((20, 90), seed=7), 2 * 96  # under the budget: no prefill pruning
        in_order: list[bool] = []

        def record() -> None:
            check_invariants(h2o_llm, [])
            for state in kv_state.requests.values():
                if state.map is not None and not state.map.is_identity:
                    in_order.append(bool((np.diff(state.map.logical, axis=2) > 0).all()))

        moved_before = kv_state.move_seconds
        finished = run_steps(h2o_llm, prompt_ids, [greedy(num_tokens)] * len(prompt_ids), on_step=record)
        assert_same_as(reference_for(reference_model, 96), [finished[str(i)] for i in range(len(prompt_ids))],
                       prompt_ids, num_tokens)
        assert in_order and all(in_order) and kv_state.move_seconds > moved_before
        assert all_blocks_free(h2o_llm)

    def test_bad_recent_override_is_refused(self, h2o_llm):
        from vllm.exceptions import VLLMValidationError

        with pytest.raises(VLLMValidationError, match="kv_recent"):
            h2o_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8, kv_recent=200), use_tqdm=False)
        [output] = h2o_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 8


@pytest.mark.slow
@pytest.mark.parametrize("budget, interval", [(128, 1), pytest.param(128, 8, marks=pytest.mark.heavy)])
def test_parity_real_model(real_model, budget, interval):
    from vllm_kvprune.reference.model import load_reference_model

    num_tokens = budget  # the prompt is cut at its end, then every decode step evicts
    prompt_ids = prompts((400,), seed=7)
    with engine(real_model, engine_policy(budget, interval), kv_blocks=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(num_tokens), use_tqdm=False)
    assert_same_as(reference_for(load_reference_model(real_model), budget, interval), outputs, prompt_ids, num_tokens)
