"""Our side: one vLLM engine per policy runs every task's cases at every budget.

The budget is a per-request setting (`kv_budget`), so one engine serves all budgets of a
policy at once (and `gvote` all its `kv_gvote_p` / `kv_gvote_samples` settings); tasks run
one after another so each gets its own wall time. Each answer's record carries the KV memory
its request held while answering, read from vLLM's block pool (`kv_blocks`): the x-axis on
which budget-free `gvote` and the budgeted policies meet.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from benchmarks import common
from benchmarks.accuracy.forced import FORCED_KEY, ForcedTokens
from benchmarks.accuracy.kvpress_side import matched_runs
from benchmarks.accuracy.report import BUDGET_FREE, OURS, default_setting
from benchmarks.accuracy.task import Answer, Case, Task
from benchmarks.accuracy.variants import VARIANTS

# Policies that keep every token (fdc narrows them instead): one run per case, no budget.
WHOLE_CACHE = tuple(name for name in common.policies(budgeted=False) if name not in common.budget_free())
ENGINE_OPTIONS: dict[str, Any] = dict(dtype="bfloat16", block_size=32, max_model_len=8192, max_num_seqs=32,
                                      enable_prefix_caching=False, seed=0)


@dataclass(frozen=True)
class Run:
    """One request of a policy's sweep: a case at a budget (None: none, or budget-free), with the
    per-request `kv_*` settings that make it so."""

    case: Case
    budget: int | None
    settings: dict[str, Any] = field(default_factory=dict)


def gvote_settings(p_values: Sequence[float], sample_counts: Sequence[int]) -> list[dict[str, Any]]:
    """The paper's two sweeps (Fig. 7 and 8): every `p` at the default sample count, every
    sample count at the default `p`; the default setting once."""
    default_p, default_samples = default_setting()
    points = [(p, default_samples) for p in p_values] + [(default_p, s) for s in sample_counts]
    points.append((default_p, default_samples))
    return [{"kv_gvote_p": p, "kv_gvote_samples": s} for p, s in dict.fromkeys(points)]


def policy_runs(policy: str, task: Task, cases: Sequence[Case], gvote: Sequence[dict[str, Any]]) -> list[Run]:
    """What one policy runs of a task: `none` once per case, a budgeted policy at each of the
    task's budgets, a budget-free one at each setting. Teacher-forced tasks (perplexity: a
    one-token prompt) give a vote nothing to choose from, so budget-free policies skip them."""
    if policy in WHOLE_CACHE:
        return [Run(case, None) for case in cases]
    if policy in BUDGET_FREE:
        return [] if any(c.forced_ids is not None for c in cases) else [
            Run(case, None, dict(setting)) for setting in gvote for case in cases]
    variant = VARIANTS[policy].settings if policy in VARIANTS else {}
    return [Run(case, budget, {"kv_budget": budget, **variant}) for budget in task.budgets for case in cases]


def build_engine(model: str, policy: str, budget: int | None, sinks: int, pool_gib: float,
                 policy_config: dict[str, Any] | None = None, **overrides: Any):
    """`overrides`: engine options that replace ENGINE_OPTIONS' (`dtype`, `enforce_eager`);
    `policy_config`: the whole `kv_policy` config, instead of one made from the arguments."""
    from vllm import LLM

    engine_settings = VARIANTS[policy].engine if policy in VARIANTS else {}
    policy = VARIANTS[policy].policy if policy in VARIANTS else policy
    options = dict(ENGINE_OPTIONS, model=model, kv_cache_memory_bytes=int(pool_gib * 2**30),
                   logits_processors=[ForcedTokens], **overrides)
    if policy_config is not None:
        options["additional_config"] = {"kv_policy": dict(policy_config)}
    elif policy != "none":
        options["additional_config"] = {"kv_policy": {**common.engine_policy(policy, budget, sinks),
                                                      **engine_settings}}
    return LLM(**options)


def full_block_size(scheduler: Any) -> int:
    """Tokens per block of the full-attention layers' KV-cache group(s) (not a sliding window's)."""
    from vllm_kvprune.engine.scheduler import growing_managers

    return max(manager.kv_cache_spec.block_size for manager in growing_managers(scheduler))


def sampling_params(case: Case, settings: dict[str, Any]):
    from vllm import SamplingParams

    extra = dict(settings)
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


@dataclass(frozen=True)
class Measured:
    """A run's output and the KV memory its request held while answering: the mean, over its
    decode steps, of the blocks it holds in vLLM's block pool after the step, and for a
    head-page request also of the blocks per layer averaged over layers (what it would hold
    with a block table per layer). None if it decoded nothing after its first token."""

    output: Any
    blocks: float | None
    blocks_per_layer: float | None
    blocks_full: float | None  # `blocks` over the full-attention layers (a hybrid model's sliding windows left out)


def generate_measured(llm: Any, runs: Sequence[Run], progress: bool = True) -> list[Measured]:
    """Every run through the engine, step by step as `LLM.generate` does, measured."""
    from tqdm import tqdm

    from vllm_kvprune.engine.scheduler import growing_share, held_growing_blocks, held_model_blocks
    from vllm_kvprune.worker.head_page_map import HeadPageMap

    engine, scheduler = llm.llm_engine, common.engine_scheduler(llm)
    kv_state = getattr(common.model_runner(llm), "kv_state", None)  # None under `none`
    index_of = {engine.add_request(str(i), {"prompt_token_ids": run.case.prompt_ids},
                                   sampling_params(run.case, run.settings)): i for i, run in enumerate(runs)}
    outputs: dict[int, Any] = {}
    pruned_share = growing_share(scheduler)
    held: dict[int, list[float]] = defaultdict(list)
    per_layer: dict[int, list[float]] = defaultdict(list)
    held_full: dict[int, list[float]] = defaultdict(list)
    with tqdm(total=len(runs), disable=not progress) as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[int(output.request_id)] = output
                    bar.update()
            for request in scheduler.running:  # past the prompt: the memory the answer is made from
                if request.num_computed_tokens > request.num_prompt_tokens:
                    index = index_of[request.request_id]
                    held[index].append(held_model_blocks(scheduler, request.request_id))
                    held_full[index].append(held_growing_blocks(scheduler, request.request_id))
                    state = kv_state.requests.get(request.request_id) if kv_state is not None else None
                    if state is not None and isinstance(state.map, HeadPageMap):  # head-pages (gvote)
                        # Its layers' mean in blocks of the whole model, beside what vLLM's own
                        # groups (a hybrid model's sliding windows) hold.
                        per_layer[index].append(held[index][-1] - held_full[index][-1]
                                                + state.map.mean_layer_blocks() * pruned_share)

    def mean(values: list) -> float | None:
        return statistics.mean(values) if values else None

    return [Measured(outputs[i], mean(held[i]), mean(per_layer[i]), mean(held_full[i])) for i in range(len(runs))]


def run_policy(model: str, policy: str, work: Sequence[tuple[Task, list[Case]]],
               sinks: int, pool_gib: float, kvpress_work: Sequence[tuple[Task, list[Case]]] = (),
               gvote: Sequence[dict[str, Any]] = (), policy_config: dict[str, Any] | None = None,
               **overrides: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records and timings of one policy (`none`: the full cache, budget None) on every task;
    each record with the KV blocks its request held (`kv_blocks`) and its per-request settings.
    The runs kvpress makes of `kvpress_work` are then timed again on their own, so the two
    sides' wall times cover the same prompts and budgets. Every timing carries the engine's pool
    size in blocks (`pool_blocks`), so narrower blocks show as more of them, and in tokens of the
    full-attention layers (`pool_full_tokens`: blocks times their group's tokens per block, which
    FDC raises on a hybrid model, whose groups share one page size)."""
    all_budgets = {b for task, _ in work for b in task.budgets}
    llm = build_engine(model, policy, max(all_budgets) if policy not in WHOLE_CACHE else None, sinks, pool_gib,
                       policy_config, **overrides)
    scheduler = common.engine_scheduler(llm)
    pool_blocks = scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    pool_full_tokens = pool_blocks * full_block_size(scheduler)
    records, timings = [], []
    try:
        for task, cases in work:
            runs = policy_runs(policy, task, cases, gvote)
            if not runs:
                continue
            print(f"[{OURS} {policy}] {task.name}: {len(runs)} runs", flush=True)
            started = time.perf_counter()
            measured = generate_measured(llm, runs)
            seconds = time.perf_counter() - started
            timings.append({"system": OURS, "method": policy, "task": task.name, "seconds": seconds, "runs": len(runs),
                            "cases": "all", "pool_blocks": pool_blocks, "pool_full_tokens": pool_full_tokens})
            for run, result in zip(runs, measured):
                record = task.record(run.case, OURS, policy, run.budget, answer_of(result.output))
                record["kv_blocks"] = result.blocks
                record["kv_blocks_full"] = result.blocks_full
                if result.blocks_per_layer is not None:
                    record["kv_blocks_per_layer"] = result.blocks_per_layer
                record.update({key.removeprefix("kv_"): value for key, value in run.settings.items()
                               if key != "kv_budget"})
                records.append(record)
        if policy in BUDGET_FREE or (policy in VARIANTS and not VARIANTS[policy].kvpress):
            kvpress_work = ()  # no press keeps tokens by a vote, or by an ablation of ours
        variant = VARIANTS[policy].settings if policy in VARIANTS else {}
        for task, cases in kvpress_work:
            runs = [Run(case, budget, {} if budget is None else {"kv_budget": budget, **variant})
                    for case, budget in matched_runs(cases, None if policy == "none" else task.budgets)]
            print(f"[{OURS} {policy}] {task.name}: timing kvpress's {len(runs)} runs", flush=True)
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": run.case.prompt_ids} for run in runs],
                         [sampling_params(run.case, run.settings) for run in runs], use_tqdm=False)
            timings.append({"system": OURS, "method": policy, "task": task.name, "runs": len(runs),
                            "seconds": time.perf_counter() - started, "cases": "kvpress"})
    finally:
        common.shutdown(llm)
        del llm
    return records, timings
