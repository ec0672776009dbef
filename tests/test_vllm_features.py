"""vLLM's sampling features under a policy, in one engine (`streaming`, budget 64, the tiny
model, prompts longer than the budget so every request evicts): each gives what it gives
without a policy in shape, greedy children agree with a lone request, and every block comes
back. The features a policy refuses are in test_offline_errors.py."""

from __future__ import annotations

import pytest

from conftest import engine
from test_streaming_engine import all_blocks_free, prompts

pytestmark = pytest.mark.slow

POLICY = {"name": "streaming", "budget": 64, "sinks": 4}
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def llm(tiny_model):
    with engine(tiny_model, POLICY, kv_blocks=128, max_model_len=1024) as llm:
        yield llm


def _tokens(output, index: int = 0) -> list[int]:
    return list(output.outputs[index].token_ids)


def test_parallel_sampling_children_each_keep_their_own_cache(llm):
    """`n = 3` children are three requests in the engine, each with its own slots; vLLM seeds
    child i with `seed + i`, so each must answer what one request alone answers with that seed."""
    from vllm import SamplingParams

    def sampled(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True)

    prompt = {"prompt_token_ids": prompts((150,))[0]}
    children = llm.generate([prompt], sampled(3, 7), use_tqdm=False)[0]
    assert len(children.outputs) == 3
    alone = llm.generate([prompt] * 3, [sampled(1, 7 + index) for index in range(3)], use_tqdm=False)
    assert sorted(_tokens(children, index) for index in range(3)) == sorted(_tokens(output) for output in alone)
    assert len({tuple(_tokens(output)) for output in alone}) == 3  # the seeds differ, so do the answers
    assert all_blocks_free(llm)


def test_prompt_logprobs_cover_the_whole_prompt(llm):
    """Prompt logprobs come from the prefill, before anything is evicted."""
    from vllm import SamplingParams

    prompt = prompts((150,), seed=1)[0]
    output = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    assert all(prompt[i] in output.prompt_logprobs[i] for i in range(1, len(prompt)))
    assert all_blocks_free(llm)


def test_structured_output_holds_past_the_budget(llm):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    choices = ["alpha beta gamma", "delta epsilon"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts((120, 200), seed=2)],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                          structured_outputs=StructuredOutputsParams(choice=choices)),
                           use_tqdm=False)
    assert all(output.outputs[0].text in choices for output in outputs), [o.outputs[0].text for o in outputs]
    assert all_blocks_free(llm)


def test_beam_search_runs_every_beam_to_its_length(llm):
    """vLLM's beam search sends each beam as a new request of the prompt plus its tokens."""
    from vllm.sampling_params import BeamSearchParams

    prompt = prompts((100,), seed=3)[0]
    output = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=12,
                                                                              ignore_eos=True))[0]
    assert len(output.sequences) == 2
    assert all(len(sequence.tokens) == len(prompt) + 12 for sequence in output.sequences)
    assert all_blocks_free(llm)
