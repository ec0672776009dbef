"""The `streaming` policy in real vLLM engines: parity with the reference implementation,
the engine-core invariants, per-request budgets, preemption and aborts."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BLOCK_SIZE, engine, runner_of, scheduler_of

BUDGET = 64
SINKS = 4
CHUNK = 48
GEN = 2 * BUDGET  # every request outgrows the budget, the longer prompts by it again
PROMPT_LENGTHS = (5, 100, 150)


def prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30000, size=n).tolist() for n in lengths]


def greedy(max_tokens: int = GEN, **extra_args):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          extra_args=extra_args or None)


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    token_ids = list(completion.token_ids)
    return token_ids, [completion.logprobs[i][t].logprob for i, t in enumerate(token_ids)]


def assert_matches_reference(outputs, prompt_ids, model, **policy):
    from vllm_kvprune.reference.streaming import StreamingLLMReference

    assert_same_as(StreamingLLMReference(model, **policy), outputs, prompt_ids, GEN)


def assert_same_as(reference, outputs, prompt_ids, num_tokens: int) -> None:
    """The engine's greedy tokens equal the reference's, logprobs within 1e-3 (the prompts'
    reference generations run side by side: `generate_each`)."""
    _assert_each_matches(reference.generate_each(prompt_ids, num_tokens), outputs, prompt_ids)


def assert_each_same_as(references, outputs, prompt_ids, num_tokens: int) -> None:
    """`assert_same_as` with a reference of its own for each output (one object each)."""
    from vllm_kvprune.reference.budgeted import generate_together

    _assert_each_matches(generate_together(list(zip(references, prompt_ids)), num_tokens), outputs, prompt_ids)


def _assert_each_matches(expected_outputs, outputs, prompt_ids) -> None:
    for prompt, output, expected in zip(prompt_ids, outputs, expected_outputs, strict=True):
        token_ids, logprobs = tokens_and_logprobs(output)
        first_diff = next((i for i, (a, b) in enumerate(zip(token_ids, expected.token_ids)) if a != b), None)
        assert first_diff is None, (
            f"prompt of {len(prompt)}: first different token at step {first_diff}; "
            f"the reference's top-1/top-2 margin there is {expected.margins[first_diff]:.2e}"
        )
        assert np.max(np.abs(np.array(logprobs) - np.array(expected.logprobs))) < 1e-3


PARITY_CASES = [
    (positions, interval, prefill)
    for positions in ("original", "cache")
    for interval in (1, 8)
    for prefill in ("full", "streaming")
]


# The suite runs a set that covers every pair of settings (the conformance suite,
# tests/test_policy_conformance.py, runs ("original", 1 and 8, "full")); --heavy, all eight.
SUITE_CASES = {("original", 8, "streaming"), ("cache", 1, "streaming"), ("cache", 8, "full")}


@pytest.mark.parametrize("positions, interval, prefill", [
    pytest.param(*case, id=f"{case[0]}-R{case[1]}-{case[2]}", marks=() if case in SUITE_CASES else pytest.mark.heavy)
    for case in PARITY_CASES])
def test_parity_with_reference(tiny_model, reference_model, positions, interval, prefill):
    policy = dict(budget=BUDGET, sinks=SINKS, prune_interval=interval, positions=positions, prefill=prefill,
                  prefill_chunk=CHUNK)
    prompt_ids = prompts()
    with engine(tiny_model, {"name": "streaming", **policy}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(), use_tqdm=False)
    assert_matches_reference(outputs, prompt_ids, reference_model, **policy)


@pytest.mark.parametrize("interval", [pytest.param(1, marks=pytest.mark.heavy), 8])
def test_prompt_shorter_than_the_sinks(tiny_model, reference_model, interval):
    """The sinks then arrive over several decode steps; each step's capture must add to the last."""
    policy = dict(budget=BUDGET, sinks=SINKS, prune_interval=interval, positions="cache")
    prompt_ids = prompts((2, 1, 3), seed=8)
    with engine(tiny_model, {"name": "streaming", **policy}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(), use_tqdm=False)
    assert_matches_reference(outputs, prompt_ids, reference_model, **policy)


@pytest.fixture(scope="class")
def streaming_llm(tiny_model):
    with engine(tiny_model, {"name": "streaming", "budget": BUDGET, "sinks": SINKS}, kv_blocks=512) as llm:
        yield llm


def run_steps(llm, prompt_ids, params, on_step=None, abort=None) -> dict[str, object]:
    """Drive the engine step by step; `on_step()` after each step, `abort` = (step, ids)."""
    core = llm.llm_engine
    for i, (prompt, sampling) in enumerate(zip(prompt_ids, params)):
        core.add_request(str(i), {"prompt_token_ids": prompt}, sampling)
    finished, step = {}, 0
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
        if abort is not None and step == abort[0]:
            core.abort_request(abort[1])
        if on_step is not None:
            on_step()
    return finished


def run_counting_preemptions(llm, prompt_ids, params, check) -> tuple[dict[str, object], int]:
    """`run_steps` with `check()` after every step; also the most preemptions any request had."""
    most = 0

    def watch() -> None:
        nonlocal most
        most = max([most, *(r.num_preemptions for r in scheduler_of(llm).requests.values())])
        check()

    return run_steps(llm, prompt_ids, params, on_step=watch), most


def assert_caps_after_prompt(llm) -> None:
    """The scheduler's half of the invariants: a request past its prompt holds at most its
    policy's cap of blocks."""
    scheduler = scheduler_of(llm)
    block_size = scheduler.cache_config.block_size
    for request in scheduler.running:
        policy = scheduler.request_policies[request.request_id]
        if request.num_computed_tokens > request.num_prompt_tokens:
            assert scheduler.held_blocks(request.request_id) <= policy.cap_blocks(block_size)


def check_invariants(llm) -> None:
    """Cap after prefill (scheduler), no slot held twice (worker)."""
    assert_caps_after_prompt(llm)
    runner = runner_of(llm)
    owners: dict[int, str] = {}
    for request_id, state in runner.kv_state.requests.items():
        if request_id not in runner.requests:
            continue
        block_ids = np.array(runner.requests[request_id].block_ids[0])
        slots = np.arange(state.map.num_valid)
        global_slots = block_ids[slots // BLOCK_SIZE] * BLOCK_SIZE + slots % BLOCK_SIZE
        for slot in global_slots.tolist():
            assert slot not in owners, f"slot {slot} held by {owners[slot]} and {request_id}"
            owners[slot] = request_id


def all_blocks_free(llm) -> bool:
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # block 0 is the null block


class TestSharedEngine:
    """Tests that share one engine; it is closed when the class ends, before any other opens."""

    @pytest.mark.parametrize("shift_and_append", [False, True])
    def test_shift_and_append_baseline_keeps_the_same_tokens(self, streaming_llm, reference_model, monkeypatch,
                                                             shift_and_append):
        """The benchmarks' baseline (`KVPRUNE_SHIFT_APPEND=1`): a decode eviction shifts the
        survivors down and appends, so the slots hold the window in order and every eviction
        moves tokens; in place (EQUIP) the new token takes the victim's slot and nothing moves.
        The baseline keeps what the reference keeps (in place: the parity tests above). Prompts
        under the budget: no prefill compaction."""
        from vllm_kvprune.worker.layouts.tokens import TokenPlanner

        monkeypatch.setattr(TokenPlanner, "shift_and_append", shift_and_append)
        kv_state = runner_of(streaming_llm).kv_state
        prompt_ids, num_tokens = prompts((20, 63), seed=7), 2 * BUDGET
        in_order: list[bool] = []

        def record() -> None:
            for state in kv_state.requests.values():
                if state.map is not None and state.map.num_valid == BUDGET:
                    in_order.append(bool((np.diff(state.map.logical) > 0).all()))

        moved_before = kv_state.move_seconds
        finished = run_steps(streaming_llm, prompt_ids, [greedy(num_tokens)] * len(prompt_ids), on_step=record)
        if shift_and_append:
            from vllm_kvprune.reference.streaming import StreamingLLMReference

            assert_same_as(StreamingLLMReference(reference_model, budget=BUDGET, sinks=SINKS),
                           [finished[str(i)] for i in range(len(prompt_ids))], prompt_ids, num_tokens)
        assert in_order and all(in_order) == shift_and_append and any(in_order)
        assert (kv_state.move_seconds > moved_before) == shift_and_append
        assert all_blocks_free(streaming_llm)

    def test_bad_request_override_raises_and_engine_goes_on(self, streaming_llm):
        from vllm.exceptions import VLLMValidationError

        with pytest.raises(VLLMValidationError, match="kv_budget"):
            streaming_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8, kv_budget=0), use_tqdm=False)
        [output] = streaming_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8, kv_budget=64), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 8


def test_request_longer_than_the_whole_pool_completes(tiny_model, reference_model):
    """8 blocks hold 256 tokens; the request runs 700 tokens (stock vLLM would refuse max_model_len)."""
    from vllm_kvprune.reference.streaming import StreamingLLMReference

    [prompt] = prompts((60,), seed=6)
    with engine(tiny_model, {"name": "streaming", "budget": BUDGET, "sinks": SINKS}, kv_blocks=8 + 1) as llm:
        [output] = llm.generate([{"prompt_token_ids": prompt}], greedy(640), use_tqdm=False)
        assert all_blocks_free(llm)
    expected = StreamingLLMReference(reference_model, budget=BUDGET, sinks=SINKS).generate(
        prompt, 640, prompt_logprobs=False)
    assert list(output.outputs[0].token_ids) == expected.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("positions, interval, prefill", [
    pytest.param("original", 1, "full", marks=pytest.mark.heavy), ("cache", 8, "streaming")])
def test_parity_real_model(real_model, positions, interval, prefill):
    from vllm_kvprune.reference.model import load_reference_model

    policy = dict(budget=BUDGET, sinks=SINKS, prune_interval=interval, positions=positions, prefill=prefill,
                  prefill_chunk=CHUNK)
    prompt_ids = prompts((150,), seed=7)
    with engine(real_model, {"name": "streaming", **policy}, kv_blocks=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(), use_tqdm=False)
    assert_matches_reference(outputs, prompt_ids, load_reference_model(real_model), **policy)
