"""Needle in a haystack: a sentence with a random 5-digit number put into essay text at a
depth of 0-100% of a 1K-7K token context; the question after it asks for the number.

A hit is an answer (32 greedy tokens, chat template; a base model reads the question after the
haystack and completes "Answer: The special magic number ... is") that contains the number. Prefill is
`full` for every policy: the prompt's last token sees the whole prompt and the cache is
pruned to the budget after it, so the answer's later tokens (the digits come one token each)
read only what the policy kept.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

from benchmarks.accuracy.task import Answer, Case, Task, chat_prompt, essay_token_ids

NEEDLE = "The special magic number is {number}."
QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."
# A base model (no chat template) reads the question and completes this.
BASE_CUE = "Answer: The special magic number mentioned in the text above is"
# Room left in the context for the needle, the question and the chat template.
FRAME_TOKENS = 64


def haystack_with_needle(essay_ids: list[int], tokenizer: Any, context_tokens: int, depth: float,
                         number: int) -> str:
    """About `context_tokens` tokens of essay text with the needle at `depth` (0..1), at the
    first sentence end after that point (so 0% is the very start)."""
    text = tokenizer.decode(essay_ids[:context_tokens])
    at = int(len(text) * depth)
    if 0 < at < len(text):
        boundary = text.find(". ", at)
        at = boundary + 2 if boundary != -1 else at
    return f"{text[:at]}{NEEDLE.format(number=number)} {text[at:]}"


class Needle(Task):
    name = "needle"
    metric = "hit rate"

    def __init__(self, contexts: Sequence[int] = (), depths: Sequence[int] = (), budgets: Sequence[int] | None = None,
                 max_tokens: int = 32) -> None:
        self.contexts, self.depths, self.max_tokens = list(contexts), list(depths), max_tokens
        self.budgets = list(budgets) if budgets else None

    def build(self, tokenizer: Any, rng: random.Random) -> list[Case]:
        essay = essay_token_ids(tokenizer)
        cases = []
        for context in self.contexts:
            for depth in self.depths:
                number = rng.randint(10000, 99999)
                haystack = haystack_with_needle(essay, tokenizer, context - FRAME_TOKENS, depth / 100, number)
                cases.append(Case(self.name, f"c{context}-d{depth}", chat_prompt(tokenizer, f"{haystack}\n\n{QUESTION}", BASE_CUE),
                                  self.max_tokens, {"context": context, "depth": depth, "number": number}))
        return cases

    def score(self, case: Case, answer: Answer) -> dict[str, Any]:
        return {"hit": str(case.facts["number"]) in answer.text}

    def plot(self, records: Sequence[dict[str, Any]], path: Path) -> None:
        from benchmarks.accuracy import report

        report.plot_vs_budget(self, records, path)
        report.plot_heat_maps(records, self.contexts, self.depths, path.with_name(path.stem + "_heatmap.png"))
