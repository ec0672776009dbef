"""The contract every registered policy passes (`vllm_kvprune/policies/`), in a real engine on
the tiny model (fp32, eager, the debug invariant mode on: `KVPRUNE_CHECK=1`, so every
step checks caps, slots and blocks). The cases are data (`policy_cases.yaml`), the oracle is
the policy's own reference (`vllm_kvprune.reference.<module>.from_config`): a newly
registered policy runs all of it with no test code of its own.

One engine per policy, shared by every case that differs only in per-request settings, over a
small pool (48 blocks) so that the workloads preempt, and steps of at most 128 tokens so that
prompts are prefilled in chunks:
- requests with different per-request settings in one batch each equal the reference at
  their own settings (token-exact, logprobs within 1e-3);
- with nothing evicted, the output equals `none`'s;
- preemption and recompute: a workload that outgrows the pool is preempted, and every
  request still equals the reference;
- the policy's preemption metric counts what vLLM's does;
- aborts mid-way; after every case every block is back in the pool, and the worker holds no
  state of a request that ended.
Tensor parallelism (`test_tensor_parallel.py`) and vLLM's default mode (`test_default_mode.py`)
read the same cases.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (BLOCK_SIZE, POLICY_CASES as CASES, engine, policy_reference, policy_settings as settings_of,
                      runner_of, scheduler_of)
from test_streaming_engine import all_blocks_free, assert_each_same_as, assert_same_as, greedy, prompts, run_steps

from vllm_kvprune.policies import REGISTRY

POLICIES = [name for name in REGISTRY if name != "none"]
# A case keyed `policy@variant` runs the contract again under engine settings that select
# another layout of the same policy (`snapkv@pyramid`: per-layer budgets on head-pages).
VARIANTS = [key for key in CASES if "@" in key]
PROMPT_LENGTHS = (20, 150, 300)
NUM_TOKENS = 100
# The preemption workload's generations: long enough that its eight requests outgrow the pool.
GROW_TOKENS = 160
POOL_BLOCKS = 48
MAX_MODEL_LEN = 1024  # a request the pool always fits, even one that keeps every token
# Steps of at most this many tokens: prompts are prefilled in chunks (and a policy's `prompt_tail`
# shapes them), as a server under load does.
STEP_TOKENS = 128


def test_every_registered_policy_has_cases():
    assert sorted(key for key in CASES if "@" not in key) == sorted(POLICIES), \
        "tests/policy_cases.yaml lists exactly the registered policies"
    assert {key.split("@")[0] for key in VARIANTS} <= set(POLICIES), "a variant is of a registered policy"


def reference_for(model, config, override: dict | None):
    return policy_reference(model, config.for_request(override), BLOCK_SIZE)


@pytest.fixture(scope="module")
def none_outputs(tiny_model) -> list:
    with engine(tiny_model, None, kv_blocks=POOL_BLOCKS, max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=STEP_TOKENS) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts(PROMPT_LENGTHS)], greedy(NUM_TOKENS),
                            use_tqdm=False)


@pytest.fixture(scope="module", params=POLICIES + VARIANTS)
def policy_run(request, tiny_model, fdc_files, none_outputs):
    """(its case's key, its engine, its engine config, what it serves with nothing evicted):
    one engine per policy or variant, on a small pool (and, first, the engine of
    `nothing_evicted_engine`)."""
    from vllm_kvprune.config import policy_from_vllm_config

    key, case = request.param, CASES[request.param]
    name = key.split("@")[0]
    prompt_ids = [{"prompt_token_ids": p} for p in prompts(PROMPT_LENGTHS)]
    kept_all = None
    if "nothing_evicted_engine" in case:  # no per-request setting says it: an engine of its own
        with engine(tiny_model, settings_of(name, case["nothing_evicted_engine"], fdc_files), kv_blocks=POOL_BLOCKS,
                    max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=STEP_TOKENS) as llm:
            kept_all = llm.generate(prompt_ids, greedy(NUM_TOKENS), use_tqdm=False)
            assert all_blocks_free(llm)
    with engine(tiny_model, settings_of(name, case["engine"], fdc_files), kv_blocks=POOL_BLOCKS,
                max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=STEP_TOKENS, disable_log_stats=False) as llm:
        if kept_all is None:
            kept_all = llm.generate(prompt_ids, greedy(NUM_TOKENS, **case["nothing_evicted"]), use_tqdm=False)
        yield key, llm, policy_from_vllm_config(llm.llm_engine.vllm_config), kept_all


def test_mixed_settings_in_one_batch_each_match_the_reference(policy_run, reference_model):
    name, llm, config, _ = policy_run
    overrides = CASES[name]["mixed"]
    prompt_ids = prompts(PROMPT_LENGTHS)
    requests = [(prompt, override) for override in overrides for prompt in prompt_ids]
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in requests],
                           [greedy(NUM_TOKENS, **override) for _, override in requests], use_tqdm=False)
    assert_each_same_as([reference_for(reference_model, config, override) for _, override in requests], outputs,
                        [prompt for prompt, _ in requests], NUM_TOKENS)
    assert all_blocks_free(llm)


def test_nothing_evicted_equals_none(policy_run, none_outputs):
    _, llm, _, kept_all = policy_run
    for output, expected in zip(kept_all, none_outputs):
        assert_equal_outputs(output, expected)
    assert all_blocks_free(llm)


def assert_equal_outputs(output, expected) -> None:
    got, want = output.outputs[0], expected.outputs[0]
    assert list(got.token_ids) == list(want.token_ids)
    logprobs = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
    wanted = [want.logprobs[i][t].logprob for i, t in enumerate(want.token_ids)]
    assert np.max(np.abs(np.array(logprobs) - np.array(wanted))) < 1e-3


def test_preemption_and_recompute_match_the_reference(policy_run, reference_model):
    """Eight requests that together outgrow the pool: some are preempted and recomputed, and
    every preempted one still equals the reference (the others run as in the mixed batch)."""
    name, llm, config, _ = policy_run
    override = CASES[name]["grow"]
    prompt_ids = prompts((100, 12, 150, 8, 120, 15, 140, 60), seed=5)
    params = [greedy(GROW_TOKENS, **override)] * len(prompt_ids)
    preempted: set[str] = set()

    def watch() -> None:
        # The scheduler's ids are ours with vLLM's random suffix (`-` and 8 characters).
        preempted.update(r.request_id.rsplit("-", 1)[0] for r in scheduler_of(llm).requests.values()
                         if r.num_preemptions)

    before = preemption_counts(llm)
    finished = run_steps(llm, prompt_ids, params, on_step=watch)
    assert preempted, "the workload was meant to outgrow the pool"
    assert preempted <= set(finished) and len(finished) == len(prompt_ids)
    assert_same_as(reference_for(reference_model, config, override), [finished[i] for i in sorted(preempted)],
                   [prompt_ids[int(i)] for i in sorted(preempted)], GROW_TOKENS)
    assert all_blocks_free(llm)
    ours, vllms = (after - start for after, start in zip(preemption_counts(llm), before))
    assert ours == vllms > 0, "the policy's preemption metric counts what vLLM's does"


def preemption_counts(llm) -> tuple[float, float]:
    """(`vllm:kvprune_preemptions`, `vllm:num_preemptions`) so far, from `LLM.get_metrics()`."""
    totals = {"vllm:kvprune_preemptions": 0.0, "vllm:num_preemptions": 0.0}
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals["vllm:kvprune_preemptions"], totals["vllm:num_preemptions"]


def test_aborts_midway_return_every_block(policy_run):
    _, llm, _, _ = policy_run
    prompt_ids = prompts((50, 120, 200, 10, 80, 300), seed=3)
    seen: set[str] = set()
    finished = run_steps(llm, prompt_ids, [greedy(150)] * len(prompt_ids), abort=(30, ["1", "3", "4"]),
                         on_step=lambda: seen.update(scheduler_of(llm).requests))
    assert {"0", "2", "5"} <= set(finished)
    assert all_blocks_free(llm)
    # vLLM tells the worker about finished requests on the next step: after one more, it holds
    # nothing of them.
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2), use_tqdm=False)
    kv_state = runner_of(llm).kv_state
    assert len(seen) == len(prompt_ids) and not set(kv_state.requests) & seen
