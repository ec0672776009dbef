"""Timing decode steps of an in-process engine: a batch of prompts decoding together.

Shared by the benchmarks that report time per output token (`tpot`, `lazy-pruning`). A step is
timed only when every request of the batch had its whole prompt in before it and is still
running after it, so each timed step decodes exactly one token of each request; prefill steps
(and decodes of early requests beside a later prompt's prefill) are not timed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from benchmarks import common


def time_decode_steps(llm: Any, prompts: Sequence[Sequence[int]], steps: int,
                      extra_args: dict[str, Any] | None = None, name: str = "timed",
                      before_abort: Callable[[list[str]], None] | None = None) -> dict[str, Any]:
    """`prompts` decoding together for `steps` timed steps, then aborted. Returns the mean wall
    time of the timed steps after the first (`ms`: prune steps included, which is what lazy
    pruning amortizes), their median, and where a policy is on (the worker's `kv_state`) its
    move and planning time per step and the prune events of the first request (steps after
    which it holds fewer tokens than before plus the new one). `before_abort(request ids)` is
    called after the timed steps, while the requests still hold their blocks."""
    from vllm import SamplingParams

    engine, scheduler = llm.llm_engine, common.engine_scheduler(llm)
    kv_state = getattr(common.model_runner(llm), "kv_state", None)  # None under `none`
    longest = max(len(prompt) for prompt in prompts)
    params = SamplingParams(temperature=0, max_tokens=llm.llm_engine.model_config.max_model_len - longest,
                            ignore_eos=True, extra_args=extra_args)
    ids = [engine.add_request(f"{name}-{i}", {"prompt_token_ids": list(prompt)}, params)
           for i, prompt in enumerate(prompts)]

    def computed() -> list[int] | None:  # tokens computed per request; None unless all decode
        requests = [scheduler.requests.get(request_id) for request_id in ids]
        if any(r is None or r.num_computed_tokens < r.num_prompt_tokens for r in requests):
            return None
        return [r.num_computed_tokens for r in requests]

    def first_held() -> int:
        state = kv_state.requests.get(ids[0]) if kv_state is not None else None
        return state.kept_tokens()[1] if state is not None else 0

    timed: list[float] = []
    events, moved, planned = 0, 0.0, 0.0
    limit = steps + 1 + 64 * len(prompts)  # the prefills' steps, generously
    for _ in range(limit):
        if len(timed) > steps:
            break
        before, held = computed(), first_held()
        moves, plans = (kv_state.move_seconds, kv_state.plan_seconds) if kv_state is not None else (0.0, 0.0)
        began = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - began
        after = computed()
        if before is not None and after is not None:
            if any(b + 1 != a for b, a in zip(before, after)):
                raise RuntimeError(f"a timed step computed {[a - b for b, a in zip(before, after)]} tokens per "
                                   "request, not one each")
            timed.append(seconds)
            if kv_state is not None:
                moved += kv_state.move_seconds - moves
                planned += kv_state.plan_seconds - plans
                events += first_held() < held + 1
    if before_abort is not None:
        before_abort(ids)
    engine.abort_request(ids, internal=True)  # add_request returned the internal ids
    while engine.has_unfinished_requests():  # let the aborts reach the worker
        engine.step()
    if len(timed) <= steps:
        raise RuntimeError(f"{len(prompts)} requests decoded together for only {len(timed)} steps; does the pool "
                           "hold all their prompts at once?")
    after_first = timed[1:]
    found: dict[str, Any] = {"ms": 1000 * sum(after_first) / len(after_first),
                             "median_step_ms": 1000 * statistics.median(after_first), "steps": len(after_first)}
    if kv_state is not None:
        found.update(prune_events=events, move_ms_per_step=1000 * moved / len(timed),
                     plan_ms_per_step=1000 * planned / len(timed))
    return found
