"""Our side: one vLLM engine per policy runs every task's cases at every budget.

The budget is a per-request setting (`kv_budget`), so one engine serves all budgets of a
policy at once; tasks run one after another so each gets its own wall time.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from vllm_kvprune.bench import common
from vllm_kvprune.bench.accuracy.forced import FORCED_KEY, ForcedTokens
from vllm_kvprune.bench.accuracy.kvpress_side import matched_runs
from vllm_kvprune.bench.accuracy.report import OURS
from vllm_kvprune.bench.accuracy.task import Answer, Case, Task

ENGINE_OPTIONS: dict[str, Any] = dict(dtype="bfloat16", block_size=32, max_model_len=8192, max_num_seqs=32,
                                      enable_prefix_caching=False, seed=0)


def build_engine(model: str, policy: str, budget: int | None, sinks: int, pool_gib: float,
                 **overrides: Any):
    """`overrides`: engine options that replace ENGINE_OPTIONS' (`dtype`, `enforce_eager`)."""
    from vllm import LLM

    options = dict(ENGINE_OPTIONS, model=model, kv_cache_memory_bytes=int(pool_gib * 2**30),
                   logits_processors=[ForcedTokens], **overrides)
    if policy != "none":
        options["additional_config"] = {"kv_policy": {"name": policy, "budget": budget, "sinks": sinks}}
    return LLM(**options)


def sampling_params(case: Case, budget: int | None):
    from vllm import SamplingParams

    extra: dict[str, Any] = {} if budget is None else {"kv_budget": budget}
    if case.forced_ids is not None:
        extra[FORCED_KEY] = case.forced_ids
    return SamplingParams(temperature=0, max_tokens=case.max_tokens, logprobs=0 if case.forced_ids else None,
                          ignore_eos=case.forced_ids is not None, extra_args=extra or None)


def answer_of(output: Any) -> Answer:
    completion = output.outputs[0]
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
    return Answer(list(completion.token_ids), completion.text, logprobs)


def run_policy(model: str, policy: str, work: Sequence[tuple[Task, list[Case]]],
               sinks: int, pool_gib: float, kvpress_work: Sequence[tuple[Task, list[Case]]] = (),
               **overrides: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records and timings of one policy (`none`: the full cache, budget None) on every task.
    The runs kvpress makes of `kvpress_work` are then timed again on their own, so the two
    sides' wall times cover the same prompts and budgets."""
    all_budgets = {b for task, _ in work for b in task.budgets}
    llm = build_engine(model, policy, max(all_budgets) if policy != "none" else None, sinks, pool_gib, **overrides)
    records, timings = [], []
    try:
        for task, cases in work:
            run_budgets: list[int | None] = [None] if policy == "none" else list(task.budgets)
            runs = [(case, budget) for budget in run_budgets for case in cases]
            print(f"[{OURS} {policy}] {task.name}: {len(runs)} runs", flush=True)
            started = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": case.prompt_ids} for case, _ in runs],
                                   [sampling_params(case, budget) for case, budget in runs], use_tqdm=True)
            seconds = time.perf_counter() - started
            timings.append({"system": OURS, "method": policy, "task": task.name, "seconds": seconds, "runs": len(runs),
                            "cases": "all"})
            for (case, budget), output in zip(runs, outputs):
                records.append(task.record(case, OURS, policy, budget, answer_of(output)))
        for task, cases in kvpress_work:
            runs = matched_runs(cases, None if policy == "none" else task.budgets)
            print(f"[{OURS} {policy}] {task.name}: timing kvpress's {len(runs)} runs", flush=True)
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": case.prompt_ids} for case, _ in runs],
                         [sampling_params(case, budget) for case, budget in runs], use_tqdm=False)
            timings.append({"system": OURS, "method": policy, "task": task.name, "runs": len(runs),
                            "seconds": time.perf_counter() - started, "cases": "kvpress"})
    finally:
        common.shutdown(llm)
        del llm
    return records, timings

