"""The supported-model matrix (docs/MODELS.md), on tiny random models of each architecture
(`tools.model_zoo`): every (architecture, policy) pair either serves exactly what
`none` serves while nothing is evicted, and matches the reference implementation with
eviction where the reference covers the architecture, or refuses at start-up with one line
naming the policy, the feature and a layer. No crash, no silent difference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import POLICY_CASES, engine, policy_reference, scheduler_of
from test_streaming_engine import all_blocks_free, assert_same_as, greedy, prompts

from vllm_kvprune.policies import REGISTRY

# Every registered policy at its conformance case's settings (tests/policy_cases.yaml), but those
# that need a calibration of each model (fdc: tests/test_fdc_engine.py serves Qwen2 and Qwen3),
# `streaming` with positions inside the cache, and a spread budget of `snapkv` and of `h2o`.
POLICIES = {name: {"name": name, **POLICY_CASES[name]["engine"]} for name in REGISTRY
            if name != "none" and not any(str(value).startswith("$") for value in POLICY_CASES[name]["engine"].values())}
POLICIES["streaming-cache"] = {**POLICIES["streaming"], "positions": "cache"}
# A budget spread by layer or head runs on head-pages with a KV-cache group per layer.
POLICIES["snapkv-pyramid"] = {**POLICIES["snapkv"], "allocation": "pyramid"}
POLICIES["h2o-adaptive"] = {**POLICIES["h2o"], "allocation": "adaptive"}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi", "llama3", "gptj", "cohere", "mistral", "gemma2", "gemma3",
                 "bloom", "gptoss", "llama-fp8")
# The attention feature (`worker/features.py`) of the architectures that have one a policy may refuse.
FEATURES = {"gemma2": "softcap", "gptoss": "sinks"}
FEATURE_NAMES = {"softcap": "logit soft-capping", "sinks": "attention sinks"}
# (architecture, policy) -> the feature named in the start-up refusal: what no policy runs with,
# what each policy's traits refuse (its `model_refusals`), and what its own model check refuses.
REFUSED = {
    **{("mistral", policy): "sliding-window attention" for policy in POLICIES},
    **{("bloom", policy): "ALiBi" for policy in POLICIES},
    **{("llama-fp8", policy): "KV cache dtype fp8" for policy in POLICIES},
    **{(architecture, label): FEATURE_NAMES[feature] for architecture, feature in FEATURES.items()
       for label, policy in POLICIES.items() if feature in REGISTRY[policy["name"]].model_refusals},
    ("phi", "gvote"): "attention without a plain rotary embedding",
    # Phi runs on vLLM's Transformers backend: transformers applies its (partial) RoPE, so no
    # rotation of vLLM's can re-anchor the sinks.
    ("phi", "streaming-cache"): "positions: cache with no rotary embedding found",
}
# Architectures whose decoder the reference forward implements (Llama-style: RMSNorm, q/k/v/o
# projections with or without bias, optional q/k norms, NeoX RoPE with the model's scaling).
REFERENCE_COVERS = ("llama", "qwen2", "qwen3", "llama3")
PROMPT_LENGTHS = (40, 150)
NUM_TOKENS = 48  # the 150-token prompt is past every budget; past streaming's 64 the 40-token one evicts in decode


def model_dir(architecture: str) -> str:
    from tools import assets
    from tools.model_zoo import zoo_model_dir

    return str(assets.tiny_model_dir() if architecture == "llama" else zoo_model_dir(architecture))


def engine_args(architecture: str) -> dict:
    from tools.model_zoo import ZOO

    return dict(ZOO[architecture].engine_args) if architecture in ZOO else {}


def zoo_engine(architecture: str, policy: dict | None):
    return engine(model_dir(architecture), policy, kv_blocks=256, **engine_args(architecture))


_none_outputs: dict[str, list] = {}


def none_outputs(architecture: str) -> list:
    """What plain vLLM serves for the matrix prompts (one engine per architecture)."""
    if architecture not in _none_outputs:
        with zoo_engine(architecture, None) as llm:
            _none_outputs[architecture] = llm.generate(
                [{"prompt_token_ids": p} for p in prompts(PROMPT_LENGTHS)], greedy(NUM_TOKENS), use_tqdm=False)
    return _none_outputs[architecture]


def reference_for(architecture: str, policy: dict):
    """The policy's own reference on the architecture's model."""
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.reference.model import load_reference_model

    return policy_reference(load_reference_model(model_dir(architecture)), KVPolicyConfig.from_dict(policy), 32)


def assert_same_tokens(outputs, expected) -> None:
    for output, wanted in zip(outputs, expected):
        got, want = output.outputs[0], wanted.outputs[0]
        assert list(got.token_ids) == list(want.token_ids)
        logprobs = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        wanted_logprobs = [want.logprobs[i][t].logprob for i, t in enumerate(want.token_ids)]
        assert np.max(np.abs(np.array(logprobs) - np.array(wanted_logprobs))) < 1e-3


def assert_policy_group_capped(llm, policy: dict) -> None:
    """Past its prompt a request holds at most its cap in the policy's own KV-cache group
    (a hybrid model's sliding-window groups are vLLM's)."""
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.engine.manager import KVPruneManager

    scheduler = scheduler_of(llm)
    config = KVPolicyConfig.from_dict(policy)
    if config.reports_footprint:
        return  # no cap: test_gvote_engine checks blocks against the kept lengths
    cap = config.cap_blocks(32)
    for request in scheduler.running:
        if request.num_computed_tokens > request.num_prompt_tokens:
            for manager in scheduler.kvprune_managers:
                assert isinstance(manager, KVPruneManager)
                held = [b for b in manager.req_to_blocks.get(request.request_id, ()) if not b.is_null]
                assert len(held) <= cap


# The quick subset (-m "not slow") keeps the suite's refusals, one reference-covered architecture and
# one hybrid one.
QUICK = ("qwen2", "gemma2")
# The suite serves every policy on those two and `streaming` on every other architecture, with its
# sinks re-anchored by the layer's RoPE (`streaming-cache`; plain `streaming` where there is no
# RoPE): that is where an architecture's attention features meet our path (RoPE style, norms,
# biases, windows). The tiny Llama is the engine tests' own model, served there at every setting.
# The other policies on the other architectures repeat the engine tests' checks on more models
# (--heavy). Every refusal particular to a policy always runs.
SUITE_POLICY = "streaming-cache"


def _in_suite(architecture: str, policy: str) -> bool:
    if architecture == "llama":  # the engine tests' own model: tests/test_streaming_engine.py serves it
        return False
    if policy == SUITE_POLICY:
        return True
    return policy == "streaming" and (architecture, SUITE_POLICY) in REFUSED


# A spread budget (head-pages, a group per layer) runs in the suite on one quick architecture
# each: soft-capping (Gemma 2) under snapkv's, Qwen2's biases under h2o's mass.
SPREAD_IN_SUITE = {"snapkv-pyramid": "gemma2", "h2o-adaptive": "qwen2"}


# Architectures that no policy runs on: the refusal is one check for every policy, so the suite
# asks two policies (one on shared block tables, one on a KV-cache group per layer), the rest
# with --heavy.
REFUSED_FOR_ALL = ("mistral", "bloom", "llama-fp8")
REFUSAL_IN_SUITE = ("streaming", "snapkv-pyramid")


def _marks(architecture: str, policy: str) -> tuple:
    if (architecture, policy) in REFUSED:
        return (pytest.mark.heavy,) if architecture in REFUSED_FOR_ALL and policy not in REFUSAL_IN_SUITE else ()
    if policy in SPREAD_IN_SUITE and architecture != SPREAD_IN_SUITE[policy]:
        return (pytest.mark.slow, pytest.mark.heavy)
    if architecture in QUICK:
        return ()
    return (pytest.mark.slow,) if _in_suite(architecture, policy) else (pytest.mark.slow, pytest.mark.heavy)


CASES = [pytest.param(architecture, policy, id=f"{architecture}-{policy}", marks=_marks(architecture, policy))
         for architecture in ARCHITECTURES for policy in POLICIES]


@pytest.mark.parametrize("architecture, policy_name", CASES)
def test_matrix(architecture: str, policy_name: str) -> None:
    from vllm_kvprune.worker.features import UnsupportedModelError

    policy = POLICIES[policy_name]
    refused = REFUSED.get((architecture, policy_name))
    if refused is not None:
        with pytest.raises(UnsupportedModelError) as error:
            with zoo_engine(architecture, policy):
                pass
        message = str(error.value)
        assert "\n" not in message
        assert message.startswith(f"{policy['name']}: {refused} (") and ") is not supported" in message
        return
    expected = none_outputs(architecture)
    prompt_ids = prompts(PROMPT_LENGTHS)
    inputs = [{"prompt_token_ids": p} for p in prompt_ids]
    with zoo_engine(architecture, policy) as llm:
        unpruned = llm.generate(inputs, greedy(NUM_TOKENS, **POLICY_CASES[policy["name"]]["nothing_evicted"]),
                                use_tqdm=False)
        pruned = []
        for prompt in inputs:  # step by step, checking the cap of the policy's group
            llm.llm_engine.add_request(str(len(pruned)), prompt, greedy(NUM_TOKENS))
            while llm.llm_engine.has_unfinished_requests():
                finished = [output for output in llm.llm_engine.step() if output.finished]
                assert_policy_group_capped(llm, policy)
                pruned.extend(finished)
        assert all_blocks_free(llm)
    assert_same_tokens(unpruned, expected)
    if architecture in REFERENCE_COVERS:
        assert_same_as(reference_for(architecture, policy), pruned, prompt_ids, NUM_TOKENS)
    else:
        assert any(list(p.outputs[0].token_ids) != list(e.outputs[0].token_ids) for p, e in zip(pruned, expected)), \
            "the budget was meant to evict"
