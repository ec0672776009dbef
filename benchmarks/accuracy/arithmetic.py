"""Arithmetic word problems at the model's level: one addition or subtraction of numbers up to
30, asked after 16 worked examples of the same form (few-shot, plain completion). A hit is an
answer whose "The answer is N." gives the right N. The examples make the prompt long enough
(about 800 tokens) for the small budgets to prune them.
"""

from __future__ import annotations

import random
import re
from typing import Any

from benchmarks.accuracy.task import Answer, Case, Task, plain_prompt

NAMES = "Tom Anna Ben Lucy Sam Mia Jack Emma".split()
ITEMS = "apples pencils books marbles cookies stickers".split()
ANSWER = re.compile(r"answer is (-?\d+)")


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked step, result)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    first, second = rng.randint(2, 15), rng.randint(2, 15)
    if rng.random() < 0.5:
        return (f"{name} has {first} {item}. {name} gets {second} more {item}. How many {item} does {name} have now?",
                f"{first} + {second} = {first + second}", first + second)
    total = first + second
    return (f"{name} has {total} {item}. {name} gives away {second} {item}. How many {item} does {name} have now?",
            f"{total} - {second} = {first}", first)


class Arithmetic(Task):
    name = "arithmetic"

    def __init__(self, cases: int = 40, shots: int = 16) -> None:
        self.cases, self.shots = cases, shots

    def build(self, tokenizer: Any, rng: random.Random) -> list[Case]:
        cases = []
        for index in range(self.cases):
            examples = [word_problem(rng) for _ in range(self.shots)]
            question, _, result = word_problem(rng)
            text = "".join(f"Question: {q}\nAnswer: {step}. The answer is {r}.\n\n" for q, step, r in examples)
            text += f"Question: {question}\nAnswer:"
            cases.append(Case(self.name, f"q{index}", plain_prompt(tokenizer, text), 20,
                              {"result": result}))
        return cases

    def score(self, case: Case, answer: Answer) -> dict[str, Any]:
        found = ANSWER.search(answer.text.split("Question:")[0])
        return {"hit": bool(found) and int(found.group(1)) == case.facts["result"]}
