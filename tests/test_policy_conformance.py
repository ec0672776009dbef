"""The contract every registered policy passes (`vllm_kvprune/policies/`), in a real engine on
the tiny model (fp32, eager, the debug invariant mode on: `VLLM_KVPRUNE_CHECK=1`, so every
step checks caps, slots and blocks). The cases are data (`policy_cases.yaml`), the oracle is
the policy's own reference (`vllm_kvprune.reference.<module>.from_config`): a newly
registered policy runs all of it with no test code of its own.

One engine per policy, shared by every case that differs only in per-request settings, over a
small pool (48 blocks) so that the workloads preempt:
- requests with different per-request settings in one batch each equal the reference at
  their own settings (token-exact, logprobs within 1e-3);
- with nothing evicted, the output equals `none`'s;
- preemption and recompute: a workload that outgrows the pool is preempted, and every
  request still equals the reference;
- aborts mid-way; after every case every block is back in the pool.
Tensor parallelism (`test_tensor_parallel.py`) and vLLM's default mode (`test_default_mode.py`)
read the same cases.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BLOCK_SIZE, POLICY_CASES as CASES, engine, policy_settings as settings_of, scheduler_of
from test_streaming_engine import all_blocks_free, assert_same_as, greedy, prompts, run_steps

from vllm_kvprune.policies import REGISTRY

POLICIES = [name for name in REGISTRY if name != "none"]
PROMPT_LENGTHS = (20, 150, 300)
NUM_TOKENS = 200
POOL_BLOCKS = 48
MAX_MODEL_LEN = 1024  # a request the pool always fits, even one that keeps every token


def test_every_registered_policy_has_cases():
    assert sorted(CASES) == sorted(POLICIES), "tests/policy_cases.yaml lists exactly the registered policies"


def reference_for(model, config, override: dict | None):
    import importlib

    config = config.for_request(override)
    return importlib.import_module(f"vllm_kvprune.reference.{config.policy.reference}").from_config(
        model, config, BLOCK_SIZE)


@pytest.fixture(scope="module")
def none_outputs(tiny_model) -> list:
    with engine(tiny_model, None, kv_blocks=POOL_BLOCKS, max_model_len=MAX_MODEL_LEN) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts(PROMPT_LENGTHS)], greedy(NUM_TOKENS),
                            use_tqdm=False)


@pytest.fixture(scope="module", params=POLICIES)
def policy_run(request, tiny_model, fdc_files, none_outputs):
    """(policy name, its engine, its engine config): one engine per policy, on a small pool."""
    from vllm_kvprune.config import policy_from_vllm_config

    name = request.param
    with engine(tiny_model, settings_of(name, CASES[name]["engine"], fdc_files), kv_blocks=POOL_BLOCKS,
                max_model_len=MAX_MODEL_LEN) as llm:
        yield name, llm, policy_from_vllm_config(llm.llm_engine.vllm_config)


def test_mixed_settings_in_one_batch_each_match_the_reference(policy_run, reference_model):
    name, llm, config = policy_run
    overrides = CASES[name]["mixed"]
    prompt_ids = prompts(PROMPT_LENGTHS)
    requests = [(prompt, override) for override in overrides for prompt in prompt_ids]
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in requests],
                           [greedy(NUM_TOKENS, **override) for _, override in requests], use_tqdm=False)
    for (prompt, override), output in zip(requests, outputs):
        assert_same_as(reference_for(reference_model, config, override), [output], [prompt], NUM_TOKENS)
    assert all_blocks_free(llm)


def test_nothing_evicted_equals_none(policy_run, none_outputs, tiny_model, fdc_files):
    name, llm, _ = policy_run
    case = CASES[name]
    prompt_ids = prompts(PROMPT_LENGTHS)
    if "nothing_evicted" in case:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                               greedy(NUM_TOKENS, **case["nothing_evicted"]), use_tqdm=False)
    else:  # an engine of its own: no per-request setting says it (opened once this policy's is closed)
        pytest.skip("checked by test_nothing_evicted_engine_equals_none")
    for output, expected in zip(outputs, none_outputs):
        assert_equal_outputs(output, expected)


@pytest.mark.parametrize("name", [name for name in POLICIES if "nothing_evicted_engine" in CASES[name]])
def test_nothing_evicted_engine_equals_none(name, none_outputs, tiny_model, fdc_files):
    settings = settings_of(name, CASES[name]["nothing_evicted_engine"], fdc_files)
    with engine(tiny_model, settings, kv_blocks=POOL_BLOCKS, max_model_len=MAX_MODEL_LEN) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(PROMPT_LENGTHS)], greedy(NUM_TOKENS),
                               use_tqdm=False)
        assert all_blocks_free(llm)
    for output, expected in zip(outputs, none_outputs):
        assert_equal_outputs(output, expected)


def assert_equal_outputs(output, expected) -> None:
    got, want = output.outputs[0], expected.outputs[0]
    assert list(got.token_ids) == list(want.token_ids)
    logprobs = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
    wanted = [want.logprobs[i][t].logprob for i, t in enumerate(want.token_ids)]
    assert np.max(np.abs(np.array(logprobs) - np.array(wanted))) < 1e-3


def test_preemption_and_recompute_match_the_reference(policy_run, reference_model):
    """Eight requests that together outgrow the pool: some are preempted and recomputed, and
    every one still equals the reference."""
    name, llm, config = policy_run
    override = CASES[name]["grow"]
    prompt_ids = prompts((100, 12, 150, 8, 120, 15, 140, 60), seed=5)
    params = [greedy(NUM_TOKENS, **override)] * len(prompt_ids)
    most = 0

    def watch() -> None:
        nonlocal most
        most = max([most, *(r.num_preemptions for r in scheduler_of(llm).requests.values())])

    finished = run_steps(llm, prompt_ids, params, on_step=watch)
    assert most > 0, "the workload was meant to outgrow the pool"
    for i, prompt in enumerate(prompt_ids):
        assert_same_as(reference_for(reference_model, config, override), [finished[str(i)]], [prompt], NUM_TOKENS)
    assert all_blocks_free(llm)


def test_aborts_midway_return_every_block(policy_run):
    _, llm, _ = policy_run
    prompt_ids = prompts((50, 120, 200, 10, 80, 300), seed=3)
    finished = run_steps(llm, prompt_ids, [greedy(150)] * len(prompt_ids), abort=(30, ["1", "3", "4"]))
    assert {"0", "2", "5"} <= set(finished)
    assert all_blocks_free(llm)
