"""The policies under vLLM's async scheduling (its default on a GPU), run on this CPU.

vLLM's CPU platform turns async scheduling off; these engines turn it back on after the
platform's config check, and vLLM then runs our `KVPruneAsyncScheduler` over its
`AsyncScheduler` with the uniprocess executor: step N+1 is scheduled (and its blocks
allocated) before step N's output and our worker's report are read, as on a GPU (here the
worker executes each step as it is scheduled, so the order is deterministic). What this
shows on a real engine:

- `h2o` (per-head eviction, moves and mass; a cap read from the scheduler's own counts, which
  include the in-flight placeholder token) gives its reference's greedy tokens;
- `gvote`, whose footprints arrive a step late: a footprint covers one more token, the blocks
  a vote gives back are the row positions the worker names, never a block allocated for the
  step in flight; every step the blocks the worker's map numbers are the scheduler's, and the
  tokens are the reference's; a request whose vote fails finishes with an error alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import engine, runner_of, scheduler_of
from test_streaming_engine import all_blocks_free, greedy, prompts, run_steps, tokens_and_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture
def async_on_cpu(monkeypatch):
    """vLLM's CPU platform config check, then async scheduling back on; the debug mode's
    invariants checked after every step (`engine/checks.py`)."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_then_async(cls, vllm_config):
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(check_then_async))
    monkeypatch.setenv("KVPRUNE_CHECK", "1")  # the debug invariants after every step too


def _run_watching_placeholders(llm, prompt_ids, params, check=None) -> tuple[dict, int]:
    """`run_steps`; also the most in-flight placeholder tokens any request had between steps
    (above 0 only if a step was scheduled before the previous one's output was read)."""
    most = 0

    def on_step() -> None:
        nonlocal most
        most = max([most, *(request.num_output_placeholders for request in scheduler_of(llm).requests.values())])
        if check is not None:
            check()

    return run_steps(llm, prompt_ids, params, on_step=on_step), most


def _assert_tokens(finished, expected) -> None:
    for index, reference in enumerate(expected):
        token_ids, logprobs = tokens_and_logprobs(finished[str(index)])
        assert token_ids == reference.token_ids, index
        assert np.max(np.abs(np.array(logprobs) - np.array(reference.logprobs))) < 1e-3


def test_h2o_under_async_scheduling_matches_the_reference(async_on_cpu, tiny_model, reference_model):
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.engine.scheduler import KVPruneAsyncScheduler
    from vllm_kvprune.reference.h2o import H2OReference

    prompt_ids = prompts((30, 150, 90), seed=11)
    with engine(tiny_model, {"name": "h2o", "budget": 64, "sinks": 4, "prune_interval": 1}, kv_blocks=128) as llm:
        assert isinstance(scheduler_of(llm), KVPruneAsyncScheduler)
        finished, placeholders = _run_watching_placeholders(llm, prompt_ids, [greedy(48)] * len(prompt_ids))
        assert all_blocks_free(llm)
    assert placeholders > 0, "no step was scheduled ahead: async scheduling did not run"
    recent = KVPolicyConfig.from_dict({"name": "h2o", "budget": 64, "sinks": 4}).recent_size
    _assert_tokens(finished, [H2OReference(reference_model, budget=64, recent=recent, sinks=4, prune_interval=1)
                              .generate(prompt, 48, prompt_logprobs=False) for prompt in prompt_ids])


def test_gvote_under_async_scheduling(async_on_cpu, tiny_model, reference_model, monkeypatch):
    from vllm_kvprune.reference.gvote import GVoteReference

    prompt_ids = prompts((180, 260, 330), seed=8)
    settings = {"kv_gvote_p": 0.1, "kv_gvote_samples": 4}
    grown_past_holes = []

    def aligned() -> None:
        """The worker runs a step ahead of what the scheduler has read: every block its map
        uses must be one the scheduler holds for the request, and once the scheduler has
        taken the vote's blocks back, both number the same blocks in the same order."""
        from test_gvote_engine import request_rows

        scheduler, runner = scheduler_of(llm), runner_of(llm)
        for request_id, state in runner.kv_state.requests.items():
            pages = state.map
            if request_id not in scheduler.requests or pages is None or not pages.is_paged:
                continue
            layer_rows = pages.live_row(request_rows(runner, request_id))
            for layer, manager in enumerate(scheduler.kvprune_managers):  # a KV-cache group per layer
                live = [block for block in layer_rows[layer].tolist() if block]
                held = manager.req_to_blocks[request_id]
                real = [block.block_id for block in held if not block.is_null]
                assert set(live[: pages.layer_blocks(0)[layer]]) <= set(real), (request_id, layer, live, real)
                if any(block.is_null for block in held):  # the scheduler has read the vote's holes
                    assert live == real, (request_id, layer, live, real)
                    start, stop = pages.row_holes[layer]
                    if start < stop:
                        grown_past_holes.append(pages.layer_blocks(0)[layer] > start)

    with engine(tiny_model, {"name": "gvote"}, kv_blocks=512) as llm:
        assert runner_of(llm).kv_state.footprint_lookahead == 1
        finished, placeholders = _run_watching_placeholders(llm, prompt_ids, [greedy(120, **settings)] * 3, aligned)
        assert all_blocks_free(llm)
        # Fault containment, whose report now arrives a step late: request "1"'s vote fails; it
        # finishes with an error, the others as above, every block back.
        monkeypatch.setenv("KVPRUNE_FAULT", "score:^1(-|$)")
        failing = run_steps(llm, prompt_ids, [greedy(120, **settings)] * 3)
        monkeypatch.delenv("KVPRUNE_FAULT")
        assert failing["1"].outputs[0].finish_reason == "error"
        assert failing["1"].outputs[0].stop_reason.startswith("kvprune gvote: score failed: InjectedFault")
        for request_id in ("0", "2"):
            assert failing[request_id].outputs[0].token_ids == finished[request_id].outputs[0].token_ids
        assert all_blocks_free(llm)
    assert placeholders > 0, "no step was scheduled ahead: async scheduling did not run"
    assert grown_past_holes and any(grown_past_holes), "no vote gave blocks back, or none grew past them"
    reference = GVoteReference(reference_model, p_nuc=0.1, samples=4)
    _assert_tokens(finished, [reference.generate(prompt, 120, prompt_logprobs=False) for prompt in prompt_ids])
