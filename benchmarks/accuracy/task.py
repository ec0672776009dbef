"""What every accuracy task is: cases built from a seed, and a score per answer.

A case is one prompt (token ids) with what its score needs; a task builds its cases, scores
one answer, and turns many scores into one number per method and budget. The runners
(`ours.py`, `kvpress_side.py`) know nothing of the tasks beyond this.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Case:
    task: str
    case_id: str
    prompt_ids: list[int]
    max_tokens: int
    # What the score needs (the expected answer) and what the tables group by (context, depth).
    facts: dict[str, Any] = field(default_factory=dict)
    # Teacher forcing: the tokens every decode step must emit (perplexity).
    forced_ids: list[int] | None = None


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None


class Task:
    """One accuracy task. Subclasses set the class attributes and override `build` and `score`."""

    name: str = ""
    metric: str = "accuracy"  # the column title of its tables
    lower_is_better: bool = False
    # kvpress compresses only the prompt; a task that needs eviction during decoding says no.
    kvpress_can_run: bool = True
    # The budgets this task runs at: its own (a long-prompt task may run fewer), else the
    # suite's, filled in by the suite before anything runs.
    budgets: list[int] | None = None

    def build(self, tokenizer: Any, rng: random.Random) -> list[Case]:
        raise NotImplementedError

    def score(self, case: Case, answer: Answer) -> dict[str, Any]:
        """The fields this answer adds to its record (at least `hit`, or what `aggregate` reads)."""
        raise NotImplementedError

    def record(self, case: Case, system: str, method: str, budget: int | None, answer: Answer) -> dict[str, Any]:
        """One answer as it goes to the JSON: who answered, at what budget, and its score."""
        fields = {"task": self.name, "case_id": case.case_id, "system": system, "method": method, "budget": budget,
                  "prompt_tokens": len(case.prompt_ids), "facts": case.facts}
        if case.forced_ids is None:  # forced answers are the text itself; not worth storing
            fields["answer"] = answer.text
        return {**fields, **self.score(case, answer)}

    def aggregate(self, records: Sequence[dict[str, Any]]) -> float:
        """One number for a method at one budget: the hit rate, unless a task says otherwise."""
        return sum(r["hit"] for r in records) / len(records)

    def format(self, value: float) -> str:
        return f"{100 * value:.0f}%"

    def plot(self, records: Sequence[dict[str, Any]], path: Path) -> None:
        from benchmarks.accuracy import report

        report.plot_vs_budget(self, records, path)


def chat_prompt(tokenizer: Any, text: str, base_cue: str = "") -> list[int]:
    """`text` as the user turn of the model's chat template, ready for the answer; a base model
    (no chat template) gets the plain text followed by `base_cue`, the start of its answer."""
    if tokenizer.chat_template is None:
        return plain_prompt(tokenizer, f"{text}\n{base_cue}" if base_cue else text)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # newer tokenizers: BatchEncoding


def plain_prompt(tokenizer: Any, text: str) -> list[int]:
    """`text` as plain tokens, after the model's own start token where its tokenizer adds one
    (Gemma's <bos>, without which it degenerates; SmolLM2's adds none)."""
    prefix = tokenizer("")["input_ids"]
    return list(prefix) + tokenizer(text, add_special_tokens=False)["input_ids"]


@functools.lru_cache(maxsize=1)
def essay_token_ids(tokenizer: Any) -> list[int]:
    """All essays as token ids (tokenized once: several tasks cut their text from them)."""
    from tools import assets

    return tokenizer(assets.essays_text(), add_special_tokens=False)["input_ids"]
