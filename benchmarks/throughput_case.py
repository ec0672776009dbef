"""One case of `python -m benchmarks throughput` (see there): what is measured, and the
child process that measures it, one engine in a fresh interpreter.

    python -m benchmarks.throughput_case SPEC_JSON RESULT_JSON

The parent (`throughput.py`) plans the cases and writes each one's spec; this module builds the
engine, warms it up, times the batches, samples the scheduler after every step and writes the
result. Nothing here decides what is run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks import common


def _composes_with_fdc(name: str) -> bool:
    from vllm_kvprune.policies import REGISTRY

    return REGISTRY[name].composes_with_fdc

# From the registry's traits: the budgeted policies, those that choose their own memory per
# request (one case each, no budget), those that keep every token, each narrower (the pool's
# bytes hold more blocks: one case), and each budgeted one that FDC's narrow heads compose with.
BUDGETED = common.policies(none=False, budgeted=True)
BUDGET_FREE = common.budget_free()
KEEP_ALL = tuple(name for name in common.policies(none=False, budgeted=False) if name not in BUDGET_FREE)
WITH_FDC = tuple(f"{name}+fdc" for name in BUDGETED if _composes_with_fdc(name))

# ---- what is measured ------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A batch of requests and the KV pool it runs on."""

    num_requests: int
    prompt_tokens: int
    gen_tokens: int
    pool_blocks: int
    repeats: int = 1  # timed batches on one engine; the best is reported

    @property
    def request_tokens(self) -> int:
        return self.prompt_tokens + self.gen_tokens


@dataclass(frozen=True)
class EngineSettings:
    """What every engine of a run shares."""

    model: str
    dtype: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    sinks: int
    fdc: str | None = None  # FDC's calibration file (the `fdc` policy)

    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (K and V)."""
        config = json.loads((Path(self.model) / "config.json").read_text())
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        element = 4 if self.dtype == "float32" else 2
        return 2 * config["num_hidden_layers"] * heads * head_dim * self.block_size * element


@dataclass(frozen=True)
class Case:
    """One engine: a policy (and budget) on a workload."""

    setting: str
    policy: str
    budget: int | None
    workload: Workload
    max_num_seqs: int | None = None  # overrides the engine's (None: keep it)
    matched_to: str | None = None  # the budget-free policy whose measured memory set this budget

    @property
    def label(self) -> str:
        budget = "" if self.budget is None else f" budget {self.budget}"
        matched = "" if self.matched_to is None else f" (at {self.matched_to}'s memory)"
        return f"{self.setting}: {self.policy}{budget}{matched}"

    def cap_blocks(self, block_size: int, sinks: int = 4) -> int | None:
        """Blocks a request keeps after its prompt (None: unbounded); prune interval 1."""
        if self.budget is None:
            return None
        from vllm_kvprune.config import KVPolicyConfig

        return KVPolicyConfig(name=self.base_policy, budget=self.budget, sinks=sinks).cap_blocks(block_size)

    @property
    def base_policy(self) -> str:
        """The eviction policy (`streaming` of `streaming+fdc`)."""
        return self.policy.removesuffix("+fdc")


@dataclass
class BatchStats:
    """What one timed batch did, sampled after every engine step."""

    output_tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time over the batch: less sensitive to a busy box
    steps: int = 0
    running_sum: int = 0
    peak_running: int = 0
    peak_blocks: float = 0  # blocks of the whole model (a group per layer: layer pages over the layers)
    peak_request_blocks: float = 0  # most blocks one request held once past its prompt (the same unit)
    request_blocks_sum: int = 0  # blocks held by requests past their prompt, summed over samples
    request_samples: int = 0  # (request, step) samples of those
    preemptions: int = 0
    plan_s: float = 0.0  # worker time spent planning steps (slot maps, victims)
    score_s: float = 0.0  # worker time spent keeping token scores (H2O's attention mass)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s if self.cpu_s else 0.0

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0

    @property
    def mean_request_blocks(self) -> float:
        """Mean blocks a decoding request held: a budget-free policy's memory per request."""
        return self.request_blocks_sum / self.request_samples if self.request_samples else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_cpu_s": self.tokens_per_cpu_s,
            "mean_running": self.mean_running,
            "mean_request_blocks": self.mean_request_blocks,
            "plan_share": self.plan_s / self.wall_s if self.wall_s else 0.0,
            "score_share": self.score_s / self.wall_s if self.wall_s else 0.0,
        }


# ---- the child: one engine, one case ---------------------------------------------------
def build_llm(engine: EngineSettings, case: Case):
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=engine.model,
        dtype=engine.dtype,
        enforce_eager=True,
        block_size=engine.block_size,
        max_model_len=engine.max_model_len,
        max_num_seqs=case.max_num_seqs or engine.max_num_seqs,
        kv_cache_memory_bytes=case.workload.pool_blocks * engine.block_bytes(),
        enable_prefix_caching=False,
        seed=0,
    )
    settings = common.engine_policy(case.base_policy, case.budget, engine.sinks, engine.fdc)
    if settings is not None:
        if case.policy in WITH_FDC:
            settings["fdc"] = engine.fdc
        kwargs["additional_config"] = {"kv_policy": settings}
    return LLM(**kwargs)


def essay_prompts(tokenizer, num_requests: int, prompt_tokens: int) -> list[list[int]]:
    """Consecutive, distinct windows of essay tokens, one per request."""
    from tools import assets

    needed = num_requests * prompt_tokens
    text = assets.essays_text()
    chars = needed * 6
    token_ids: list[int] = []
    while len(token_ids) < needed and chars < 4 * len(text):
        token_ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        chars *= 2
    if len(token_ids) < needed:
        token_ids = (token_ids * (needed // max(len(token_ids), 1) + 1))[:needed]
    return [token_ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(num_requests)]


def sampling_params(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def sample_step(scheduler, stats: BatchStats, preemptions: dict[str, int]) -> None:
    """Fold the scheduler's state after one step into the batch's stats."""
    from vllm_kvprune.engine.scheduler import held_model_blocks, model_block_shares

    pool = scheduler.kv_cache_manager.block_pool
    # In blocks of the whole model (a KV-cache group per layer: layer pages over the layers).
    used_blocks = (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) * min(model_block_shares(scheduler))
    running = scheduler.running
    stats.steps += 1
    stats.running_sum += len(running)
    stats.peak_running = max(stats.peak_running, len(running))
    stats.peak_blocks = max(stats.peak_blocks, used_blocks)
    for request in running:
        # One step after its prompt a bounded request has been trimmed to its cap.
        if request.num_computed_tokens > request.num_prompt_tokens:
            held = held_model_blocks(scheduler, request.request_id)
            stats.peak_request_blocks = max(stats.peak_request_blocks, held)
            stats.request_blocks_sum += held
            stats.request_samples += 1
    for request_id, request in scheduler.requests.items():
        preemptions[request_id] = max(preemptions.get(request_id, 0), request.num_preemptions)


class ProgressFile:
    """Output tokens generated so far, written by the child about once a second for the
    parent's progress bar (the child's own output goes to a log)."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self.offset = 0  # tokens of earlier batches on this engine
        self.written_at = 0.0

    def report(self, tokens: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self.written_at < 1.0):
            return
        staged = self.path.with_suffix(".tmp")
        staged.write_text(str(self.offset + tokens))
        staged.replace(self.path)
        self.written_at = now


def tokens_in_flight(scheduler) -> int:
    return sum(request.num_output_tokens for request in scheduler.requests.values())


def run_batch(llm, prompts: Sequence[list[int]], gen_tokens: int, tag: str, progress: ProgressFile) -> BatchStats:
    """Add every request, step the engine until all are done, sample after each step."""
    engine = llm.llm_engine
    scheduler = common.engine_scheduler(llm)
    params = sampling_params(gen_tokens)
    stats = BatchStats()
    preemptions: dict[str, int] = {}
    plan_before, score_before = worker_seconds(llm)
    start, start_cpu = time.perf_counter(), time.process_time()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": list(prompt)}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                stats.output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
        sample_step(scheduler, stats, preemptions)
        progress.report(stats.output_tokens + tokens_in_flight(scheduler))
    stats.wall_s = time.perf_counter() - start
    stats.cpu_s = time.process_time() - start_cpu
    plan_after, score_after = worker_seconds(llm)
    stats.plan_s, stats.score_s = plan_after - plan_before, score_after - score_before
    stats.preemptions = sum(preemptions.values())
    progress.offset += stats.output_tokens
    progress.report(0, force=True)
    return stats


def worker_seconds(llm) -> tuple[float, float]:
    """Seconds the (in-process) worker has spent planning steps and keeping scores so far."""
    state = getattr(common.model_runner(llm), "kv_state", None)  # vLLM's own runner without a policy
    return (state.plan_seconds, state.score_seconds) if state is not None else (0.0, 0.0)


def warm_up(llm, prompt: list[int]) -> None:
    llm.generate([{"prompt_token_ids": list(prompt)}], sampling_params(64), use_tqdm=False)


def run_case(engine: EngineSettings, case: Case, progress: ProgressFile) -> dict[str, Any]:
    """Build the engine, warm it up, time `repeats` batches; the fastest is the result."""
    workload = case.workload
    llm = build_llm(engine, case)
    prompts = essay_prompts(llm.get_tokenizer(), workload.num_requests, workload.prompt_tokens)
    warm_up(llm, prompts[0])
    batches = [
        run_batch(llm, prompts, workload.gen_tokens, f"batch{repeat}", progress)
        for repeat in range(workload.repeats)
    ]
    best = max(batches, key=lambda batch: batch.tokens_per_s)
    from vllm_kvprune.engine.scheduler import model_block_shares

    scheduler = common.engine_scheduler(llm)
    pool = scheduler.kv_cache_manager.block_pool
    return {
        **best.to_dict(),
        # In blocks of the whole model (a KV-cache group per layer: layer pages over the layers).
        "usable_pool_blocks": (pool.num_gpu_blocks - 1) * min(model_block_shares(scheduler)),
        "all_tokens_per_s": [batch.tokens_per_s for batch in batches],
    }


def child_main(spec_path: str, result_path: str) -> None:
    # The engine must run in this process for its scheduler to be sampled: set before
    # vLLM is imported (the parent also puts it in the child's environment).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = json.loads(Path(spec_path).read_text())
    engine = EngineSettings(**spec["engine"])
    case_fields = dict(spec["case"])
    case = Case(**{**case_fields, "workload": Workload(**case_fields["workload"])})
    result = run_case(engine, case, ProgressFile(spec.get("progress")))
    Path(result_path).write_text(json.dumps(result))

if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
