"""Admission that cannot stall: every request is served, or refused at once saying why, and
nothing waits forever or holds up the queue behind it (issue: a 2,800-token prompt on a
2,048-token pool under `prefill: full` stalled the server)."""

from __future__ import annotations

import time

import pytest

from conftest import engine, scheduler_of
from test_streaming_engine import all_blocks_free, greedy, prompts

from vllm_kvprune.frontend import FRONT_END

POOL_BLOCKS = 64  # 2,048 tokens of 32
LONG_PROMPT = 2800


# ---- the rule ------------------------------------------------------------------------------
def test_peak_blocks_follow_the_prefill_mode() -> None:
    from vllm_kvprune.config import KVPolicyConfig

    full = KVPolicyConfig.from_dict({"name": "streaming", "budget": 128})
    streaming = KVPolicyConfig.from_dict({"name": "streaming", "budget": 128, "prefill": "streaming"})
    assert full.cap_blocks(32) == 5
    assert full.peak_blocks(32, 4096, LONG_PROMPT) == 88  # the whole prompt, before pruning
    assert full.peak_blocks(32, 4096, 40) == 5  # a short prompt: the cap
    assert full.peak_blocks(32, 4096) == 5  # prompt unknown: what the settings alone need
    assert streaming.peak_blocks(32, 4096, LONG_PROMPT) == 12  # budget - 1 + chunk 256 = 383 tokens
    assert streaming.peak_blocks(32, 200, LONG_PROMPT) == 7  # never more than max_model_len needs


def test_checks_name_the_setting_and_the_remedy() -> None:
    from vllm_kvprune import admission
    from vllm_kvprune.config import KVConfigError, KVPolicyConfig

    full = KVPolicyConfig.from_dict({"name": "streaming", "budget": 128})
    admission.check_prompt_fits(full, 2048, 32, POOL_BLOCKS)  # exactly the pool: fits
    with pytest.raises(KVConfigError) as error:
        admission.check_prompt_fits(full, LONG_PROMPT, 32, POOL_BLOCKS)
    assert error.value.setting == "prompt" and "88 KV blocks" in str(error.value)
    assert "--kv-prefill streaming" in str(error.value)
    big = full.for_request({"kv_budget": 4000})
    with pytest.raises(KVConfigError) as error:
        admission.check_request_fits(big, {"kv_budget": 4000}, 32, 4096, POOL_BLOCKS)
    assert error.value.setting == "kv_budget" and "126 KV blocks" in str(error.value)
    hint = admission.memory_hint(big, 32, 4096)
    assert hint.startswith("kv_policy streaming: one request needs 126 KV blocks") and "--kv-budget" in hint


# ---- in engines ----------------------------------------------------------------------------
@pytest.fixture(scope="class")
def small_pool_llm(tiny_model):
    with engine(tiny_model, {"name": "streaming", "budget": 128, "sinks": 4}, kv_blocks=POOL_BLOCKS + 1) as llm:
        yield llm


class TestSmallPoolFullPrefill:
    """The issue's configuration: 2,048-token pool, max_model_len 4,096, prefill: full."""

    def test_a_prompt_longer_than_the_pool_is_refused_at_once(self, small_pool_llm):
        from vllm.exceptions import VLLMValidationError

        started = time.perf_counter()
        with pytest.raises(VLLMValidationError, match="prompt: 2800 tokens are cached whole"):
            small_pool_llm.generate([{"prompt_token_ids": prompts((LONG_PROMPT,))[0]}], greedy(8), use_tqdm=False)
        assert time.perf_counter() - started < 5
        [short] = small_pool_llm.generate([{"prompt_token_ids": prompts((40,))[0]}], greedy(8), use_tqdm=False)
        assert len(short.outputs[0].token_ids) == 8

    def test_a_prompt_as_long_as_the_pool_is_served(self, small_pool_llm):
        [output] = small_pool_llm.generate([{"prompt_token_ids": prompts((POOL_BLOCKS * 32,))[0]}], greedy(100),
                                           use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 100  # and the generation runs past the pool
        assert all_blocks_free(small_pool_llm)

    def test_an_override_that_could_never_fit_is_refused(self, small_pool_llm):
        from vllm.exceptions import VLLMValidationError

        with pytest.raises(VLLMValidationError, match="kv_budget"):
            small_pool_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8, kv_budget=4000), use_tqdm=False)
        [output] = small_pool_llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8, kv_budget=1024),
                                           use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 8


    def test_an_unchecked_bad_override_fails_alone_in_the_engine(self, small_pool_llm, monkeypatch):
        # A front end without the plugin's checks (here: switched off) hands the engine a bad
        # override: that request finishes with an error naming it; the engine and the next go on.
        monkeypatch.setattr(FRONT_END, "policy", None)
        bad, good = small_pool_llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10]}],
                                            [greedy(8, kv_budget=0), greedy(8)], use_tqdm=False)
        assert bad.outputs[0].finish_reason == "error" and not bad.outputs[0].token_ids
        assert "kv_budget" in str(bad.outputs[0].stop_reason)
        assert len(good.outputs[0].token_ids) == 8
        assert all_blocks_free(small_pool_llm)


def test_streaming_prefill_serves_the_long_prompt_from_the_small_pool(tiny_model):
    policy = {"name": "streaming", "budget": 128, "sinks": 4, "prefill": "streaming"}
    with engine(tiny_model, policy, kv_blocks=POOL_BLOCKS + 1) as llm:
        core, most_held = llm.llm_engine, 0
        core.add_request("long", {"prompt_token_ids": prompts((LONG_PROMPT,))[0]}, greedy(50))
        core.add_request("short", {"prompt_token_ids": prompts((30,))[0]}, greedy(50))
        finished = {}
        while core.has_unfinished_requests():
            finished.update({output.request_id: output for output in core.step() if output.finished})
            most_held = max([most_held, *(scheduler_of(llm).held_blocks(r) for r in scheduler_of(llm).requests)])
        assert all_blocks_free(llm)
    assert {len(output.outputs[0].token_ids) for output in finished.values()} == {50}
    assert most_held <= 12  # budget - 1 + prefill_chunk tokens, never the whole prompt


def test_start_up_refuses_a_pool_that_cannot_hold_one_request(tiny_model):
    with pytest.raises(ValueError, match=r"kv_policy streaming: one request needs 126 KV blocks.*--kv-budget"):
        with engine(tiny_model, {"name": "streaming", "budget": 4000}, kv_blocks=POOL_BLOCKS + 1):
            pass


def test_a_long_request_preempted_under_pressure_comes_back_and_finishes(tiny_model, reference_model):
    """A request 500 tokens into an 800-token generation on a 384-token pool is preempted by
    higher-priority ones; it must be re-admitted with its cap, not its whole replayed sequence
    (which no pool this size could ever hold), and recompute exactly."""
    from vllm_kvprune.reference.streaming import StreamingLLMReference

    [long_prompt, *short] = prompts((20, 15, 25, 18, 22), seed=12)
    policy = {"name": "streaming", "budget": 64, "sinks": 4}
    with engine(tiny_model, policy, kv_blocks=12 + 1, scheduling_policy="priority") as llm:
        core, finished, step, started, preempted = llm.llm_engine, {}, 0, time.perf_counter(), 0
        core.add_request("long", {"prompt_token_ids": long_prompt}, greedy(800), priority=10)
        while core.has_unfinished_requests():
            finished.update({output.request_id: output for output in core.step() if output.finished})
            step += 1
            if step == 450:
                for i, prompt in enumerate(short):
                    core.add_request(f"short{i}", {"prompt_token_ids": prompt}, greedy(150), priority=0)
            # The engine core knows the request by its id plus a suffix vLLM adds.
            for request_id, request in scheduler_of(llm).requests.items():
                if request_id.startswith("long-"):
                    preempted = max(preempted, request.num_preemptions)
            assert time.perf_counter() - started < 300, "a request is waiting forever"
        assert all_blocks_free(llm)
    assert preempted > 0, "the long request was meant to be preempted"
    assert len(finished) == 5
    expected = StreamingLLMReference(reference_model, budget=64, sinks=4).generate(long_prompt, 800,
                                                                                   prompt_logprobs=False)
    assert list(finished["long"].outputs[0].token_ids) == expected.token_ids


def test_a_request_that_fits_no_pool_of_a_hybrid_model_finishes_with_an_error():
    """Gemma 2: the front end sees only the policy's group; the scheduler also counts the
    sliding-window group and finishes at once a request whose total need exceeds the pool,
    so the request behind it is served."""
    from tools.model_zoo import zoo_model_dir

    with engine(str(zoo_model_dir("gemma2")), {"name": "streaming", "budget": 64, "sinks": 4}, kv_blocks=40 + 1,
                max_num_batched_tokens=512) as llm:
        scheduler = scheduler_of(llm)
        policy_blocks = scheduler.usable_blocks - 1  # fits the front end's view, not the pool
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts((policy_blocks * 32, 20), seed=3)],
                               greedy(20), use_tqdm=False)
        assert time.perf_counter() - started < 30
        assert all_blocks_free(llm)
    assert outputs[0].outputs[0].finish_reason == "error" and not outputs[0].outputs[0].token_ids
    assert outputs[1].outputs[0].finish_reason == "length" and len(outputs[1].outputs[0].token_ids) == 20
