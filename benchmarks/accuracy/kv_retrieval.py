"""Key-value retrieval: a list of `word-NN: value` lines (4-digit values), then one key again
at the end; the model must copy its value. A hit is a first answer line holding the value.

Plain completion, no chat template: at 135M parameters SmolLM2 follows this copying format
far better than a question (about a third of the answers right without pruning, and the
suite reports that ceiling next to every policy).
"""

from __future__ import annotations

import random
from typing import Any

from benchmarks.accuracy.task import Answer, Case, Task, plain_prompt

KEY_WORDS = ("apple river stone cloud tiger maple candle silver garden rocket violet harbor pepper lantern "
             "meadow falcon copper breeze marble orchid").split()


class KVRetrieval(Task):
    name = "kv_retrieval"

    def __init__(self, cases: int = 40, pairs: int = 64) -> None:
        self.cases, self.pairs = cases, pairs

    def build(self, tokenizer: Any, rng: random.Random) -> list[Case]:
        cases = []
        for index in range(self.cases):
            keys: list[str] = []
            while len(keys) < self.pairs:  # distinct keys, so the answer is unique
                key = f"{rng.choice(KEY_WORDS)}-{rng.randint(10, 99)}"
                if key not in keys:
                    keys.append(key)
            values = [rng.randint(1000, 9999) for _ in keys]
            asked = rng.randrange(self.pairs)
            lines = "\n".join(f"{key}: {value}" for key, value in zip(keys, values))
            text = f"Keys and values:\n{lines}\n\nLookup:\n{keys[asked]}:"
            prompt = plain_prompt(tokenizer, text)
            cases.append(Case(self.name, f"kv{index}", prompt, 8,
                              {"value": values[asked], "depth": round(100 * asked / (self.pairs - 1))}))
        return cases

    def score(self, case: Case, answer: Answer) -> dict[str, Any]:
        first_line = answer.text.strip().split("\n")[0]
        return {"hit": str(case.facts["value"]) in first_line}
