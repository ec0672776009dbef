"""Streaming perplexity (StreamingLLM's evaluation): essay text fed one token per decode step
through the bounded cache, so the policy evicts inside the text as it goes.

The prompt is the segment's first token; the rest is teacher-forced (`forced.py`) and each
step's log-probability of the true next token comes from the raw logits. kvpress prunes only
prompts, so it has no counterpart here.
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

from benchmarks.accuracy.task import Answer, Case, Task, essay_token_ids

WINDOW = 256  # tokens per entry of the NLL-by-position profile kept in the JSON


class Perplexity(Task):
    name = "perplexity"
    metric = "perplexity"
    lower_is_better = True
    kvpress_can_run = False

    def __init__(self, segments: int = 4, tokens: int = 2048) -> None:
        self.segments, self.tokens = segments, tokens

    def build(self, tokenizer: Any, rng: random.Random) -> list[Case]:
        essay = essay_token_ids(tokenizer)
        stride = len(essay) // self.segments
        if stride < self.tokens:
            raise ValueError(f"the essays hold {len(essay)} tokens, too few for {self.segments} x {self.tokens}")
        cases = []
        for index in range(self.segments):  # one segment from each equal part, at a seeded offset
            start = index * stride + rng.randrange(stride - self.tokens + 1)
            segment = essay[start:start + self.tokens]
            cases.append(Case(self.name, f"segment{index}", segment[:1], len(segment) - 1,
                              {"start": start, "tokens": len(segment)}, forced_ids=segment[1:]))
        return cases

    def score(self, case: Case, answer: Answer) -> dict[str, Any]:
        if answer.token_ids != case.forced_ids or answer.logprobs is None:
            raise RuntimeError(f"{case.case_id}: the engine did not follow the forced tokens")
        nll = [-value for value in answer.logprobs]
        profile = [sum(nll[i:i + WINDOW]) / len(nll[i:i + WINDOW]) for i in range(0, len(nll), WINDOW)]
        return {"nll_sum": sum(nll), "scored_tokens": len(nll), "nll_by_window": profile}

    def aggregate(self, records: Sequence[dict[str, Any]]) -> float:
        return math.exp(sum(r["nll_sum"] for r in records) / sum(r["scored_tokens"] for r in records))

    def format(self, value: float) -> str:
        return f"{value:.2f}"
