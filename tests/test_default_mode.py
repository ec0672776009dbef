"""Each policy in the configuration users run: vLLM's default mode (torch.compile, bf16, the
engine core and the worker in processes of their own), on the real model, agreeing with the
eager fp32 in-process engine that the reference-parity tests check.

How: the eager fp32 engine generates; the default-mode engine is then teacher-forced along
those very tokens (`bench.accuracy.forced`), so both score every step after the same prefix
and the policy evicts along the same sequence. Stated tolerance, at every step: the logprob
of fp32's token within `LOGPROB_TOLERANCE`, and the default mode's own top token equal to
fp32's unless fp32's top-1/top-2 margin is under `NEAR_TIE` nats (a near-tie bf16 cannot
resolve). The bounds come from stock vLLM's own: `none` forced the same way moves logprobs by
up to 0.076 (median 0.006) and never changes the top token. `h2o` gets more room: its victims
are the argmins of accumulated attention mass, and bf16 rounding of that mass picks another
victim at near-ties (measured: median 0.008, p99 0.15, max 0.20; the top token still never
changes).
"""

from __future__ import annotations

import pytest

from conftest import BLOCK_SIZE, POLICY_CASES, engine, policy_settings

from vllm_kvprune.policies import REGISTRY

NEAR_TIE = 0.15  # nats
LOGPROB_TOLERANCE = 0.15  # a case's own `tolerance` where its choices are argmins of bf16 sums (h2o)
NUM_TOKENS = 32  # past every default_mode budget (at most 128) with the 100-token prompt too
# Every registered policy at its conformance case's `default_mode` settings (tests/policy_cases.yaml).
POLICIES = [name for name in REGISTRY if name != "none"]


def essay_prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tools import assets

    ids = AutoTokenizer.from_pretrained(model)(assets.essays_text()[:40000])["input_ids"]
    return [ids[start:start + length] for start, length in ((0, 100), (3000, 150), (6000, 200))]


def default_mode_outputs(model: str, policy: dict, prompt_ids: list[list[int]], forced: list[list[int]],
                         monkeypatch) -> list:
    """vLLM's defaults: compiled, the engine core in its own process, bf16 (SmolLM2's dtype);
    each request forced along `forced`, scored at every step (top-2 raw logprobs)."""
    from vllm import LLM, SamplingParams

    from benchmarks.accuracy.forced import FORCED_KEY, ForcedTokens

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # A step of 512 tokens holds the three prompts at once; vLLM's start-up profiling runs one
    # batch of that size, which at the default 4096 takes most of a minute where bf16 is emulated.
    llm = LLM(model=model, block_size=BLOCK_SIZE, max_model_len=4096, kv_cache_memory_bytes=256 * 2**20,
              max_num_batched_tokens=512, additional_config={"kv_policy": policy}, logits_processors=[ForcedTokens])
    try:
        config = llm.llm_engine.model_config
        assert str(config.dtype) == "torch.bfloat16" and not config.enforce_eager
        params = [SamplingParams(temperature=0, max_tokens=len(tokens), ignore_eos=True, logprobs=2,
                                 extra_args={FORCED_KEY: tokens}) for tokens in forced]
        return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()


def top2(step_logprobs: dict) -> tuple[int, float]:
    """(top token, top-1 minus top-2 logprob) of one step's logprobs."""
    ranked = sorted(step_logprobs.items(), key=lambda item: item[1].logprob, reverse=True)
    return ranked[0][0], ranked[0][1].logprob - ranked[1][1].logprob


@pytest.fixture(scope="module")
def real_files(real_model, tmp_path_factory) -> dict[str, str]:
    """`$real_calibration`: FDC's calibration of the real model, made only where a case asks."""
    class Lazy(dict):
        def get(self, key, default=None):
            if key == "$real_calibration" and key not in self:
                from vllm_kvprune.fdc import calibration

                self[key] = str(tmp_path_factory.mktemp("fdc") / "real.safetensors")
                calibration.calibrate(real_model, rate=0.1).save(self[key])
            return super().get(key, default)

    return Lazy()


@pytest.mark.slow
# The suite runs h2o (per-head slots, fused decode mass: the most of our backend under
# torch.compile); a case marked `heavy` repeats the check (--heavy): minutes each where bf16 is
# emulated.
@pytest.mark.parametrize("policy_name", [pytest.param(name, marks=pytest.mark.heavy)
                                         if POLICY_CASES[name]["default_mode"].get("heavy") else name
                                         for name in POLICIES])
def test_default_mode_agrees_with_eager_fp32(real_model, real_files, policy_name, monkeypatch):
    from vllm import SamplingParams

    case = POLICY_CASES[policy_name]["default_mode"]
    policy = policy_settings(policy_name, case["settings"], real_files)
    tolerance = case.get("tolerance", LOGPROB_TOLERANCE)
    prompt_ids = essay_prompts(real_model)
    with engine(real_model, policy, kv_blocks=256) as llm:  # eager, fp32, in-process
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
        expected = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    wanted_tokens = [list(output.outputs[0].token_ids) for output in expected]
    served = default_mode_outputs(real_model, policy, prompt_ids, wanted_tokens, monkeypatch)
    for got, want in zip(served, expected):
        got, want = got.outputs[0], want.outputs[0]
        assert list(got.token_ids) == list(want.token_ids)  # forced
        for step, token in enumerate(want.token_ids):
            deviation = abs(got.logprobs[step][token].logprob - want.logprobs[step][token].logprob)
            assert deviation < tolerance, f"step {step}: logprob off by {deviation:.3f}"
            top, _ = top2(got.logprobs[step])
            _, margin = top2(want.logprobs[step])
            assert top == token or margin < NEAR_TIE, f"step {step}: another top token at fp32 margin {margin:.3f}"
