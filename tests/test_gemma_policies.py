"""Every policy on the second real model, Gemma-3-270M (base; `tools/assets_gemma.py`): a hybrid
model (15 sliding-window layers, window 512, and 3 full-attention layers), one KV head of size
256. The policies prune the full-attention group(s) and leave the sliding-window groups to vLLM.
Per policy, as in the model matrix (tests/test_model_matrix.py) but on real weights and real
text: with nothing evicted the greedy tokens and logprobs equal `none`'s; with eviction a
request holds fewer blocks of the policy's groups than the prompt needs (at most its cap where
the policy has one) and every block comes back. `fdc` needs a calibration of the model: it is
served on Gemma-3 against its reference in tests/test_fdc_hybrid.py.

Every case is `--heavy` (about 25-60 s each): CI's one run of the real Gemma-3 is its asset's
check (tests/test_gemma_asset.py: BOS present, a plain prompt answered), and its hybrid layout
runs in CI on the tiny random Gemma-3 (tests/test_model_matrix.py, tests/test_fdc_hybrid.py);
the suite is at its time goal. `h2o` here is the check of the fused prompt mass at a head size
of 256 on real weights: run it with --heavy after touching that kernel."""

from __future__ import annotations

import math

import pytest

from conftest import POLICY_CASES, engine, scheduler_of
from test_model_matrix import POLICIES, assert_policy_group_capped, assert_same_tokens
from test_streaming_engine import all_blocks_free, greedy

NUM_TOKENS = 24
IN_SUITE: tuple[str, ...] = ()  # the suite is at its time goal (see above)


def gemma() -> str:
    from tools import assets

    return str(assets.gemma_model_dir())


_prompts: list[list[int]] = []


def prompt_ids() -> list[list[int]]:
    """An essay past the 512-token window with a question after it (a base model: plain text),
    and a short prompt; both start with <bos>."""
    if not _prompts:
        from transformers import AutoTokenizer

        from tools import assets

        tokenizer = AutoTokenizer.from_pretrained(gemma())
        essay = assets.essays_text()[:3000] + "\n\nThe Eiffel Tower is in the city of"
        _prompts.extend(tokenizer(text).input_ids for text in (essay, "The capital of France is the city of"))
        assert len(_prompts[0]) > 600 and all(ids[0] == tokenizer.bos_token_id for ids in _prompts)
    return _prompts


def gemma_engine(policy: dict | None):
    return engine(gemma(), policy, kv_blocks=160, max_model_len=2048)


_none: list = []


def none_outputs() -> list:
    if not _none:
        with gemma_engine(None) as llm:
            _none.extend(llm.generate([{"prompt_token_ids": p} for p in prompt_ids()], greedy(NUM_TOKENS),
                                      use_tqdm=False))
    return _none


def policy_blocks(llm, request_id: str) -> int:
    """Blocks a request holds in the policy's own KV-cache groups (not the sliding-window ones)."""
    return sum(len([b for b in manager.req_to_blocks.get(request_id, ()) if not b.is_null])
               for manager in scheduler_of(llm).kvprune_managers)


CASES = [pytest.param(name, id=name, marks=() if name in IN_SUITE else (pytest.mark.slow, pytest.mark.heavy))
         for name in POLICIES]


@pytest.mark.slow
@pytest.mark.parametrize("policy_name", CASES)
def test_policy_serves_gemma3(policy_name: str) -> None:
    policy = POLICIES[policy_name]
    expected = none_outputs()
    inputs = [{"prompt_token_ids": p} for p in prompt_ids()]
    essay_blocks = math.ceil(len(prompt_ids()[0]) / 32)
    with gemma_engine(policy) as llm:
        groups = len(scheduler_of(llm).kvprune_managers)
        assert groups >= 1, "the policy must own the full-attention layers' group(s)"
        unpruned = llm.generate(inputs, greedy(NUM_TOKENS, **POLICY_CASES[policy["name"]]["nothing_evicted"]),
                                use_tqdm=False)
        llm.llm_engine.add_request("essay", inputs[0], greedy(NUM_TOKENS))
        held_after_prompt = []
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
            assert_policy_group_capped(llm, policy)
            for request in scheduler_of(llm).running:  # the essay alone (vLLM's own request id)
                if request.num_computed_tokens > request.num_prompt_tokens:
                    held_after_prompt.append(policy_blocks(llm, request.request_id))
        assert held_after_prompt, "the request was never seen decoding"
        assert max(held_after_prompt) < essay_blocks * groups, (
            f"held {max(held_after_prompt)} blocks of the policy's {groups} group(s), the prompt needs "
            f"{essay_blocks} in each")
        assert all_blocks_free(llm)
    assert_same_tokens(unpruned, expected)
    text = unpruned[0].outputs[0].text
    assert "Paris" in text, text
