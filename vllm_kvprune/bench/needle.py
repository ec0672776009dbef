"""`python -m vllm_kvprune.bench needle`: needle-in-a-haystack retrieval under each policy.

A sentence holding a random 5-digit number ("the needle") is put into Paul Graham essays at
a depth of 10-90% of a 2K-6K token context; the question after the context asks for the
number. A hit is an answer (32 greedy tokens) that contains the number. Every policy sees the
same prompts, on the real model (SmolLM2-135M-Instruct, bf16) with its chat template.

Prefill is `full` for every policy: the prompt's last token attends to the whole prompt, the
cache is pruned to the budget after it, and the rest of the answer is generated from what
each policy kept. So the first answer token is the same for all policies; the number's later
digits (one token each) test the pruned cache.

Engines run one at a time in this process; the table gives hits per context length over the
depths, the JSON every answer.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any, Sequence

NAME = "needle"
DEFAULT_OUT = "results/needle.json"
NEEDLE = "The special magic number is {number}."
QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."


def haystack_with_needle(essay_token_ids: list[int], tokenizer, context_tokens: int, depth: float,
                         number: int) -> str:
    """About `context_tokens` tokens of essay text with the needle at `depth` (0..1), placed
    at the first sentence end after that point."""
    text = tokenizer.decode(essay_token_ids[:context_tokens])
    at = int(len(text) * depth)
    boundary = text.find(". ", at)
    at = boundary + 2 if boundary != -1 else at
    return f"{text[:at]}{NEEDLE.format(number=number)} {text[at:]}"


def build_cases(tokenizer, contexts: Sequence[int], depths: Sequence[int], seed: int) -> list[dict[str, Any]]:
    from vllm_kvprune import assets

    essay_ids = tokenizer(assets.essays_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    cases = []
    for context in contexts:
        for depth in depths:
            number = rng.randint(10000, 99999)
            # Leave room for the needle, the question and the chat template.
            haystack = haystack_with_needle(essay_ids, tokenizer, context - 64, depth / 100, number)
            messages = [{"role": "user", "content": f"{haystack}\n\n{QUESTION}"}]
            prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(prompt_ids, list):  # newer tokenizers return a BatchEncoding
                prompt_ids = prompt_ids["input_ids"]
            cases.append({"context": context, "depth": depth, "number": number, "prompt_ids": list(prompt_ids)})
    return cases


def run_policy(model: str, policy: str, budget: int | None, cases: list[dict[str, Any]],
               args: argparse.Namespace) -> list[dict[str, Any]]:
    """Answers of one engine to every case."""
    from vllm import LLM, SamplingParams

    options: dict[str, Any] = dict(model=model, dtype="bfloat16", enforce_eager=True, block_size=args.block_size,
                                   max_model_len=8192, max_num_seqs=16, enable_prefix_caching=False, seed=0,
                                   kv_cache_memory_bytes=args.pool_gib * 2**30)
    if policy != "none":
        options["additional_config"] = {"kv_policy": {"name": policy, "budget": budget, "sinks": args.sinks}}
    llm = LLM(**options)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        outputs = llm.generate([{"prompt_token_ids": case["prompt_ids"]} for case in cases], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    answers = []
    for case, output in zip(cases, outputs):
        text = output.outputs[0].text
        answers.append({"policy": policy, "budget": budget, "context": case["context"], "depth": case["depth"],
                        "prompt_tokens": len(case["prompt_ids"]), "number": case["number"], "answer": text,
                        "hit": str(case["number"]) in text})
    return answers


def hit_table(answers: list[dict[str, Any]], contexts: Sequence[int]) -> tuple[list[str], list[list[str]]]:
    headers = ["policy", "budget", *[f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts], "all"]
    body = []
    for key in dict.fromkeys((a["policy"], a["budget"]) for a in answers):
        mine = [a for a in answers if (a["policy"], a["budget"]) == key]
        cells = []
        for context in (*contexts, None):
            chosen = [a for a in mine if context is None or a["context"] == context]
            cells.append(f"{sum(a['hit'] for a in chosen)}/{len(chosen)}")
        body.append([key[0], "-" if key[1] is None else str(key[1]), *cells])
    return headers, body


def plot_hits(answers: list[dict[str, Any]], contexts: Sequence[int], path: Path) -> None:
    from vllm_kvprune.bench import common

    figure, axes = common.new_figure(7.0, 4.0)
    keys = list(dict.fromkeys((a["policy"], a["budget"]) for a in answers))
    width = 0.8 / len(keys)
    for index, key in enumerate(keys):
        rates = []
        for context in contexts:
            chosen = [a for a in answers if (a["policy"], a["budget"]) == key and a["context"] == context]
            rates.append(sum(a["hit"] for a in chosen) / len(chosen))
        offset = (index - (len(keys) - 1) / 2) * width
        label = key[0] if key[1] is None else f"{key[0]} {key[1]}"
        axes.bar([i + offset for i in range(len(contexts))], rates, width, label=label)
    axes.set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
    axes.set_ylabel("needle hit rate (over depths)")
    axes.set_ylim(0, 1.05)
    axes.legend(fontsize=7)
    common.save_figure(figure, path)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="needle retrieval: none vs streaming vs paged_eviction",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 6144])
    parser.add_argument("--depths", type=int, nargs="+", default=[10, 30, 50, 70, 90], help="percent")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--policies", nargs="+", default=["streaming", "paged_eviction"],
                        choices=("streaming", "paged_eviction"))
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--pool-gib", type=float, default=1.0, help="KV pool of each engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="answer length; the model tends to restate the question first")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON results path; the plot goes next to it (.png)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kvprune.bench import common

    for name, value in common.ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in this process, one at a time
    from transformers import AutoTokenizer

    from vllm_kvprune import assets

    model = str(assets.real_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model)
    cases = build_cases(tokenizer, args.contexts, args.depths, args.seed)
    engines = [("none", None)] + [(p, b) for p in args.policies for b in args.budgets]
    answers: list[dict[str, Any]] = []
    started = time.perf_counter()
    for policy, budget in engines:
        answers += run_policy(model, policy, budget, cases, args)
        print(f"{policy} {budget or ''}: {sum(a['hit'] for a in answers if (a['policy'], a['budget']) == (policy, budget))}"
              f"/{len(cases)} hits ({time.perf_counter() - started:.0f} s so far)", flush=True)
    headers, body = hit_table(answers, args.contexts)
    common.print_table(headers, body)
    out = Path(args.out)
    settings = {key: getattr(args, key) for key in ("contexts", "depths", "budgets", "policies", "sinks",
                                                     "block_size", "seed", "max_tokens")}
    settings.update(model="SmolLM2-135M-Instruct", dtype="bfloat16", needle=NEEDLE, question=QUESTION,
                    run_s=time.perf_counter() - started)
    common.write_json(out, NAME, settings, answers, table={"headers": headers, "rows": body})
    plot_hits(answers, args.contexts, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
