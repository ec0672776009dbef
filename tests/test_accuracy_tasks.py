"""The accuracy suite's parts that need no engine: task builders, scores, kvpress's matched
ratio, the tables, and teacher forcing as vLLM's sampler drives it."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from benchmarks.accuracy import report
from benchmarks.accuracy.arithmetic import Arithmetic
from benchmarks.accuracy.kv_retrieval import KVRetrieval
from benchmarks.accuracy.kvpress_side import compression_ratio
from benchmarks.accuracy.needle import NEEDLE, Needle
from benchmarks.accuracy.perplexity import Perplexity
from benchmarks.accuracy.task import Answer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tools import assets

    return AutoTokenizer.from_pretrained(str(assets.real_model_dir()))


def build(task, tokenizer, seed):
    return task.build(tokenizer, random.Random(seed))


def test_a_base_model_reads_plain_text_after_its_bos(tokenizer):
    """Gemma-3-270M (`--model Gemma-3-270M`) has no chat template and needs its <bos>: the
    needle's prompt is the haystack, the question and the start of the answer as plain text;
    kv_retrieval's and arithmetic's start with <bos> too. SmolLM2 (chat) gains no token."""
    from transformers import AutoTokenizer

    from benchmarks.accuracy.needle import BASE_CUE, QUESTION
    from tools import assets

    gemma = AutoTokenizer.from_pretrained(str(assets.gemma_model_dir()))
    assert gemma.chat_template is None
    needle = build(Needle([1024], [50]), gemma, 0)[0]
    text = gemma.decode(needle.prompt_ids)
    assert needle.prompt_ids[0] == gemma.bos_token_id and needle.prompt_ids.count(gemma.bos_token_id) == 1
    assert text.endswith(f"{QUESTION}\n{BASE_CUE}") and "<start_of_turn>" not in text
    assert str(needle.facts["number"]) in text
    for task in (KVRetrieval(2, 8), Arithmetic(2, 2)):
        ids = build(task, gemma, 0)[0].prompt_ids
        assert ids[0] == gemma.bos_token_id and ids.count(gemma.bos_token_id) == 1
    assert tokenizer("")["input_ids"] == []  # SmolLM2: the cases are what they were


@pytest.mark.parametrize("make", [lambda: Perplexity(2, 256), lambda: Needle([1024], [0, 50, 100]),
                                  lambda: KVRetrieval(4, 16), lambda: Arithmetic(4, 4)])
def test_cases_follow_the_seed(tokenizer, make):
    first, again, other = build(make(), tokenizer, 0), build(make(), tokenizer, 0), build(make(), tokenizer, 1)
    assert first == again
    assert [c.prompt_ids for c in first] != [c.prompt_ids for c in other]


def test_needle_sits_at_its_depth_and_context_fits(tokenizer):
    cases = build(Needle([1024, 2048], [0, 50, 100]), tokenizer, 0)
    for case in cases:
        text = tokenizer.decode(case.prompt_ids)
        needle = NEEDLE.format(number=case.facts["number"])
        assert text.count(needle) == 1
        assert case.facts["context"] - 100 < len(case.prompt_ids) <= case.facts["context"]
        at = text.index(needle) / len(text)
        assert abs(at - 0.9 * case.facts["depth"] / 100) < 0.12, (case.case_id, at)  # the question follows


def test_kv_retrieval_asks_a_key_with_one_value(tokenizer):
    for case in build(KVRetrieval(6, 32), tokenizer, 0):
        text = tokenizer.decode(case.prompt_ids)
        asked = text.rsplit("\n", 1)[1].removesuffix(":")
        lines = dict(line.split(": ") for line in text.split("\n") if re.fullmatch(r"\w+-\d+: \d+", line))
        assert len(lines) == 32 and lines[asked] == str(case.facts["value"])


def test_arithmetic_examples_are_right_and_scored(tokenizer):
    for case in build(Arithmetic(5, 6), tokenizer, 0):
        text = tokenizer.decode(case.prompt_ids)
        for a, op, b, c in re.findall(r"(\d+) ([+-]) (\d+) = (\d+)\. The answer is", text):
            assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(c)
        task, result = Arithmetic(), case.facts["result"]
        assert task.score(case, Answer([], f" x = {result}. The answer is {result}.\n\nQuestion: 1"))["hit"]
        assert not task.score(case, Answer([], f" The answer is {result + 1}.\n\nQuestion: The answer is {result}"))["hit"]


def test_perplexity_scores_forced_tokens_only(tokenizer):
    task = Perplexity(1, 300)
    (case,) = build(task, tokenizer, 0)
    from benchmarks.accuracy.task import essay_token_ids

    start = case.facts["start"]
    assert case.prompt_ids + case.forced_ids == essay_token_ids(tokenizer)[start:start + 300]
    assert len(case.prompt_ids) == 1 and case.max_tokens == 299
    logprobs = [-1.0] * 299
    scored = task.score(case, Answer(case.forced_ids, "", logprobs))
    assert task.aggregate([scored]) == pytest.approx(math.e)
    with pytest.raises(RuntimeError, match="forced"):
        task.score(case, Answer(case.forced_ids[:-1] + [0], "", logprobs))


@pytest.mark.parametrize("prompt_tokens", [130, 333, 601, 1000, 2047])
def test_kvpress_keeps_exactly_budget_minus_one(prompt_tokens):
    for kept in range(1, prompt_tokens, 7):
        ratio = compression_ratio(prompt_tokens, kept)
        assert int(prompt_tokens * (1 - ratio)) == kept  # StreamingLLMPress's rule
        assert max(1, int(prompt_tokens * (1 - ratio))) == kept  # ScorerPress's compute_n_kept


def test_side_by_side_compares_the_same_cases():
    task = KVRetrieval()

    def records(system, method, budget, hits):
        # memory: ours holds 10 blocks under none and 4 at budget 128; kvpress stores 32 of 100 prompt tokens
        memory = ({"kv_blocks": 10 if budget is None else 4} if system == report.OURS
                  else {"prompt_tokens": 100, **({} if budget is None else {"kv_stored": 32})})
        return [{"task": task.name, "case_id": f"kv{i}", "system": system, "method": method, "budget": budget,
                 "hit": hit, "answer": f" {i}{hit}", **memory} for i, hit in enumerate(hits)]

    mine = (records(report.OURS, "none", None, [1, 1, 0, 1]) + records(report.OURS, "streaming", 128, [1, 0, 0, 0])
            + records(report.KVPRESS, "none", None, [1, 1]) + records(report.KVPRESS, "StreamingLLMPress", 128, [0, 1]))
    timings = [{"system": report.OURS, "method": "streaming", "task": task.name, "seconds": 9.0, "runs": 4,
                "cases": "all"},
               {"system": report.OURS, "method": "streaming", "task": task.name, "seconds": 2.0, "runs": 2,
                "cases": "kvpress"},
               {"system": report.KVPRESS, "method": "StreamingLLMPress", "task": task.name, "seconds": 3.0, "runs": 2,
                "cases": "kvpress"}]
    headers, rows = report.side_by_side(task, mine, {"streaming": "StreamingLLMPress"}, timings)
    by_budget = {row[0]: dict(zip(headers, row)) for row in rows}
    # on kv0 and kv1 one side hit and the other missed: no answer is the same
    assert rows[1] == ["128", "streaming", "50%", "1.00", "40%", "StreamingLLMPress", "50%", "1.50", "32%", "0/2"]
    assert by_budget[report.FULL_CACHE]["same answer"] == "2/2" and rows[0][2] == "100%"
    headers, rows = report.budget_table(task, mine, [128])
    assert rows[0] == [report.OURS, "none", "4", "75%", "-"] and rows[1] == [report.OURS, "streaming", "4", "-", "25%"]
    assert rows[3] == [report.KVPRESS, "StreamingLLMPress", "2", "-", "50%"]


def test_forced_tokens_follow_the_batch():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from benchmarks.accuracy.forced import FORCED_KEY, ForcedTokens

    processor = ForcedTokens(None, torch.device("cpu"), False)
    outputs_a, outputs_b, outputs_free = [], [7], []
    forced_a = SamplingParams(max_tokens=3, extra_args={FORCED_KEY: [5, 6, 9]})
    forced_b = SamplingParams(max_tokens=2, extra_args={FORCED_KEY: [1, 2]})
    processor.update_state(BatchUpdate(3, [], [(0, forced_a, [0], outputs_a), (1, SamplingParams(), [0], outputs_free),
                                               (2, forced_b, [0], outputs_b)], []))
    logits = processor.apply(torch.randn(3, 10))
    assert logits[0].argmax() == 5 and logits[2].argmax() == 2 and torch.isfinite(logits[1]).all()
    outputs_a.append(5)
    processor.update_state(BatchUpdate(3, [2], [], [(0, 2, MoveDirectionality.SWAP)]))
    logits = processor.apply(torch.randn(3, 10))
    assert logits[2].argmax() == 6 and torch.isfinite(logits[0]).all()  # nothing forced is left in row 0
    with pytest.raises(ValueError, match="max_tokens"):
        ForcedTokens.validate_params(SamplingParams(max_tokens=4, extra_args={FORCED_KEY: [1, 2]}))


def test_hybrid_memory_is_compared_over_the_full_attention_layers():
    """On a hybrid model ours leave the sliding layers to vLLM while kvpress cuts them too: the
    side by side reads both over the full-attention layers (`*_full`), the memory table shows
    both readings, and the per-layer share counts the sliding layers in blocks of the model."""
    from benchmarks.accuracy import memory

    task = KVRetrieval()
    # none holds 18 model blocks (4 of them the full-attention layers'); at 256, 15.5 (1.5 full)
    ours = [{"task": task.name, "case_id": "kv0", "system": report.OURS, "method": method, "budget": budget,
             "hit": 1, "answer": " 1", "kv_blocks": blocks, "kv_blocks_full": full}
            for method, budget, blocks, full in (("none", None, 18.0, 4.0), ("streaming", 256, 15.5, 1.5))]
    theirs = [{"task": task.name, "case_id": "kv0", "system": report.KVPRESS, "method": method, "budget": budget,
               "hit": 1, "answer": " 1", "prompt_tokens": 730, "kv_stored": stored, "kv_stored_full": stored}
              for method, budget, stored in (("none", None, 730.0), ("StreamingLLMPress", 256, 255.0))]
    headers, rows = report.side_by_side(task, ours + theirs, {"streaming": "StreamingLLMPress"}, [])
    row = dict(zip(headers, rows[1]))
    assert row["memory, % of full"] == "38%" and row["memory, % of full (stored)"] == "35%"
    headers, rows = memory.memory_table(task, memory.points(task, ours))
    streaming = dict(zip(headers, rows[1]))
    assert streaming["% of none"] == "86.1%" and streaming["% of none, full-attention layers"] == "37.5%"
    plain = [{**r, "kv_blocks_full": r["kv_blocks"]} for r in ours]  # one kind of layer: one reading
    assert "% of none, full-attention layers" not in memory.memory_table(task, memory.points(task, plain))[0]


def test_kvpress_budget_binds_the_full_attention_layers_of_a_hybrid_model():
    from benchmarks.accuracy.kvpress_side import full_attention_layers
    from tools import assets

    assert full_attention_layers(str(assets.gemma_model_dir())) == {5, 11, 17}
    assert full_attention_layers(str(assets.real_model_dir())) == set(range(30))
