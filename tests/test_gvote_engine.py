"""The `gvote` policy in real vLLM engines: the same keep sets per (layer, KV head) and the
same greedy tokens as the reference, blocks held equal to what the kept lengths need (read
from vLLM's block pool), no head-page mapped twice, every block back after finish, abort
and preemption."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BLOCK_SIZE, engine, runner_of, scheduler_of
from test_streaming_engine import all_blocks_free, greedy, prompts, run_steps, tokens_and_logprobs
from vllm_kvprune.worker.head_page_map import global_head_pages

PROMPT_LENGTHS = (20, 150, 300)
GEN = 40
# The tiny random model attends almost uniformly, so p = 0.95 keeps nearly everything; a
# lower threshold makes the heads' kept lengths differ.
SPARSE = {"kv_gvote_p": 0.6, "kv_gvote_samples": 4}


def snapshot_keep_sets(llm, keep_sets: dict) -> None:
    """Each request's kept prompt positions per (layer, KV head), once it has voted."""
    runner = runner_of(llm)
    for request_id, state in runner.kv_state.requests.items():
        pages = state.map
        if pages is not None and pages.is_paged and request_id not in keep_sets:
            num_prompt = pages.num_uniform
            keep_sets[request_id] = [[pages.kept_positions(layer, head)[: _prompt_part(pages, layer, head,
                                                                                        num_prompt)]
                                      for head in range(pages.num_heads)] for layer in range(pages.num_layers)]


def _prompt_part(pages, layer: int, head: int, num_prompt: int) -> int:
    return int((pages.kept_positions(layer, head) < num_prompt).sum())


def request_rows(runner, request_id: str) -> np.ndarray:
    """The request's block-table rows in the worker, one per KV-cache group of the policy
    (one per layer), 0-padded to one width `[groups, width]`."""
    block_ids = runner.requests[request_id].block_ids
    rows = [block_ids[group] for group in runner.policy_groups]
    width = max(len(row) for row in rows)
    return np.array([list(row) + [0] * (width - len(row)) for row in rows], np.int64)


def check_invariants(llm) -> None:
    """Scheduler: between steps a voted request holds what its kept tokens need, layer by layer
    (one KV-cache group each), at most what they need with the next token too (allocated
    before that step), nothing more. Worker: no head-page of the pool is mapped by two heads
    or two requests."""
    scheduler, runner = scheduler_of(llm), runner_of(llm)
    assert len(runner.policy_groups) == len(scheduler.kvprune_managers) == runner.kv_state.tables.num_layers
    owners: dict[int, str] = {}
    for request_id, state in runner.kv_state.requests.items():
        pages = state.map
        if request_id not in runner.requests or pages is None or not pages.is_paged:
            continue
        layer_rows = pages.live_row(request_rows(runner, request_id))
        if request_id in scheduler.requests:
            held = scheduler.held_blocks(request_id)
            assert pages.blocks_needed(0).sum() <= held <= pages.blocks_needed(1).sum(), (request_id, held)
            # The blocks the worker's map numbers are the ones the scheduler holds for it, in
            # order, layer by layer: after a vote gives blocks back, later ones are not read
            # from stale ids.
            for layer, manager in enumerate(scheduler.kvprune_managers):
                real = [block.block_id for block in manager.req_to_blocks[request_id] if not block.is_null]
                assert layer_rows[layer, : len(real)].tolist() == real, (request_id, layer, real)
                assert len(real) <= pages.layer_blocks(1)[layer], (request_id, layer, real)
        pages.check()
        for layer in range(pages.num_layers):
            count = -(-pages.lengths[layer] // pages.block_size)
            table = pages.page_table(layer, int(count.max()))
            held = np.concatenate([table[head, : count[head]] for head in range(pages.num_heads)])
            assert (held // pages.num_heads < np.count_nonzero(layer_rows[layer])).all(), \
                "a head reads a block it does not hold"
            # Each layer's blocks are its own: a pool head-page is mapped once over every layer.
            for page in global_head_pages(layer_rows[layer], held, pages.num_heads).tolist():
                assert page not in owners, f"head-page {page} (layer {layer}) mapped twice"
                owners[page] = request_id


def assert_parity(llm, reference_model, prompt_ids: list[list[int]], settings: dict) -> None:
    """The served keep sets per (layer, KV head) and greedy tokens equal the reference's."""
    from vllm_kvprune.reference.gvote import GVoteReference

    keep_sets: dict = {}
    finished = run_steps(llm, prompt_ids, [greedy(GEN, **settings)] * len(prompt_ids),
                         on_step=lambda: snapshot_keep_sets(llm, keep_sets))
    reference = GVoteReference(reference_model, p_nuc=settings.get("kv_gvote_p", 0.95),
                               samples=settings.get("kv_gvote_samples", 8))
    lengths_differ = False
    assert len(finished) == len(prompt_ids)
    for request_id, output in finished.items():
        prompt = prompt_ids[int(request_id)]
        expected = reference.generate(prompt, GEN, prompt_logprobs=False)
        # The worker keys requests by vLLM's internal id: the user's id and a suffix.
        [served] = [kept for internal, kept in keep_sets.items() if internal.split("-")[0] == request_id]
        for layer, heads in enumerate(reference.kept_positions):
            for head, positions in enumerate(heads):
                assert served[layer][head].tolist() == positions.tolist(), (request_id, layer, head)
        lengths_differ |= bool((reference.kept_lengths != reference.kept_lengths[0, 0]).any())
        token_ids, logprobs = tokens_and_logprobs(output)
        assert token_ids == expected.token_ids
        assert np.max(np.abs(np.array(logprobs) - np.array(expected.logprobs))) < 1e-3
    assert lengths_differ, "every head kept the same number of tokens: the test proves little"


@pytest.fixture(scope="class")
def gvote_llm(tiny_model):
    with engine(tiny_model, {"name": "gvote"}, kv_blocks=512, disable_log_stats=False) as llm:
        yield llm


class TestSharedEngine:
    """Tests that share one engine; it is closed when the class ends."""

    def test_keep_sets_equal_the_references(self, gvote_llm, reference_model):
        """Beyond the conformance suite's tokens: the same kept positions in every layer and KV head."""
        assert_parity(gvote_llm, reference_model, prompts(PROMPT_LENGTHS, seed=3), SPARSE)

    def test_invariants_blocks_and_release(self, gvote_llm):
        rng = np.random.default_rng(4)
        lengths = rng.integers(3, 400, size=16).tolist()
        prompt_ids = prompts(lengths, seed=5)
        params = [greedy(int(rng.integers(10, 80)), **(SPARSE if i % 2 else {})) for i in range(16)]
        finished = run_steps(gvote_llm, prompt_ids, params, on_step=lambda: check_invariants(gvote_llm),
                             abort=(6, ["1", "3", "8"]))
        assert set(finished) >= {str(i) for i in range(16)} - {"1", "3", "8"}
        assert all_blocks_free(gvote_llm)
        gvote_llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2), use_tqdm=False)
        assert not runner_of(gvote_llm).kv_state.requests or all(
            rid in runner_of(gvote_llm).requests for rid in runner_of(gvote_llm).kv_state.requests)

    def test_blocks_given_back_by_the_vote_stay_aligned(self, gvote_llm):
        """A vote that keeps few tokens gives blocks back; decoding then needs new ones. The
        worker's append-only row keeps the given-back ids, so its map must skip them: every
        step, the blocks it numbers are exactly the scheduler's (`check_invariants`)."""
        runner = runner_of(gvote_llm)
        grown_past_holes = []

        def watch() -> None:
            check_invariants(gvote_llm)
            for state in runner.kv_state.requests.values():
                holes = state.map.row_holes if state.map is not None else None
                if holes is not None and (holes[:, 0] < holes[:, 1]).any():
                    gave_back = holes[:, 0] < holes[:, 1]
                    grown_past_holes.append(bool((state.map.layer_blocks(0) > holes[:, 0])[gave_back].any()))

        finished = run_steps(gvote_llm, prompts((180, 260, 330, 390), seed=8),
                             [greedy(120, kv_gvote_p=0.1, kv_gvote_samples=4)] * 4, on_step=watch)
        assert len(finished) == 4
        assert grown_past_holes and any(grown_past_holes), "no vote gave blocks back, or none grew past them"
        assert all_blocks_free(gvote_llm)

    def test_metrics_split_every_cached_token_into_kept_and_evicted(self, gvote_llm):
        """`LLM.get_metrics()`: per request, kept (mean over heads) + evicted = tokens cached,
        and the most any head kept is at least the mean (heads keep different counts)."""
        prompt_ids, gen = prompts((300, 120), seed=8), 30
        before = kvprune_totals(gvote_llm)
        gvote_llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(gen, **SPARSE), use_tqdm=False)
        after = kvprune_totals(gvote_llm)

        def grew(key):
            return after.get(key, 0.0) - before.get(key, 0.0)

        cached = sum(len(p) + gen - 1 for p in prompt_ids)
        evicted, kept = grew(("vllm:kvprune_tokens_evicted", None)), grew(("vllm:kvprune_request_kept_tokens", "mean"))
        # vLLM's reader gives counters as integers (a mean's fraction is cut off before and after)
        assert evicted > 0 and abs(cached - (evicted + kept)) < 1
        assert grew(("vllm:kvprune_request_kept_tokens", "max")) > kept
        # the policy's time per step by phase: planning, the vote, the kept K/V moved into head-pages
        seconds = step_seconds_by_phase(gvote_llm)
        assert set(seconds) == {"plan", "score", "move"} and all(value > 0 for value in seconds.values())

    def test_a_failed_vote_fails_its_request_alone(self, gvote_llm, monkeypatch):
        """Fault containment (worker/faults.py): the vote fails for one request of a batch; it
        finishes with an error naming the policy, the others with the tokens they get when
        nothing fails, and every block comes back."""
        prompt_ids = prompts((200, 90, 250, 40), seed=11)
        params = [greedy(25, **SPARSE)] * len(prompt_ids)
        clean = run_steps(gvote_llm, prompt_ids, params)
        before = kvprune_totals(gvote_llm)
        monkeypatch.setenv("KVPRUNE_FAULT", "score:^2(-|$)")  # request "2" (vLLM may add a suffix)
        failing = run_steps(gvote_llm, prompt_ids, params)
        monkeypatch.delenv("KVPRUNE_FAULT")
        for request_id, output in failing.items():
            if request_id == "2":
                assert output.outputs[0].finish_reason == "error"
                assert output.outputs[0].stop_reason.startswith("kvprune gvote: score failed: InjectedFault")
            else:
                assert output.outputs[0].finish_reason == "length"
                assert output.outputs[0].token_ids == clean[request_id].outputs[0].token_ids
        assert set(failing) == set(clean)
        assert all_blocks_free(gvote_llm)
        gvote_llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2), use_tqdm=False)
        assert not any(state.failure for state in runner_of(gvote_llm).kv_state.requests.values())
        after = kvprune_totals(gvote_llm)
        assert after[("vllm:kvprune_requests_failed", None)] - before.get(("vllm:kvprune_requests_failed", None), 0) == 1

    def test_bad_per_request_settings_are_refused(self, gvote_llm):
        from vllm.exceptions import VLLMValidationError

        for bad in ({"kv_gvote_p": 0}, {"kv_gvote_p": 1.5}, {"kv_gvote_samples": 0}, {"kv_budget": 64}):
            with pytest.raises(VLLMValidationError, match=next(iter(bad))):
                gvote_llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2, **bad), use_tqdm=False)


def kvprune_totals(llm) -> dict:
    """Our metrics from `LLM.get_metrics()`, summed over labels but `heads`: a counter's or
    gauge's value, a histogram's sum."""
    from vllm.v1.metrics.reader import Histogram

    totals: dict = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kvprune_") or metric.name == "vllm:num_preemptions":
            key = (metric.name, metric.labels.get("heads"))
            totals[key] = totals.get(key, 0.0) + (metric.sum if isinstance(metric, Histogram) else metric.value)
    return totals


def step_seconds_by_phase(llm) -> dict[str, float]:
    """`vllm:kvprune_step_seconds` from `LLM.get_metrics()`: the histogram's sum per phase."""
    from vllm.v1.metrics.reader import Histogram

    return {metric.labels["phase"]: metric.sum for metric in llm.get_metrics()
            if metric.name == "vllm:kvprune_step_seconds" and isinstance(metric, Histogram)}


def test_a_request_near_max_model_len_after_its_vote_gave_blocks_back(tiny_model, reference_model):
    """The worker's block-table row is append-only: a vote's given-back positions stay in it,
    and the blocks the kept tokens take later come after them, so a request that grows toward
    `max_model_len` reaches past vLLM's row width (`cdiv(max_model_len, block_size)`). The
    policy's spec widens the row (`KVPruneSpec.max_num_blocks_per_req`); without that the
    worker's table overflowed and the engine died. The tokens are the reference's."""
    from vllm_kvprune.reference.gvote import GVoteReference

    prompt = prompts((300,), seed=13)[0]
    new_tokens = 512 - 300 - 2
    with engine(tiny_model, {"name": "gvote"}, kv_blocks=64, max_model_len=512) as llm:
        runner = runner_of(llm)
        widest = []

        def watch() -> None:
            for request_id, state in runner.kv_state.requests.items():
                if request_id in runner.requests and state.map is not None and state.map.row_holes is not None:
                    widest.append((request_rows(runner, request_id).shape[1], tuple(state.map.row_holes.min(axis=0))))

        finished = run_steps(llm, [prompt], [greedy(new_tokens, kv_gvote_p=0.1, kv_gvote_samples=4)], on_step=watch)
        assert all_blocks_free(llm)
    positions, holes = max(widest)
    assert holes[0] < holes[1] and positions > 512 // BLOCK_SIZE, (positions, holes)  # past vLLM's own width
    expected = GVoteReference(reference_model, p_nuc=0.1, samples=4).generate(prompt, new_tokens,
                                                                             prompt_logprobs=False)
    token_ids, logprobs = tokens_and_logprobs(finished["0"])
    assert token_ids == expected.token_ids
    assert np.max(np.abs(np.array(logprobs) - np.array(expected.logprobs))) < 1e-3


@pytest.mark.slow
def test_parity_real_model(real_model):
    """SmolLM2 (fp32), the paper's defaults: its sharper attention keeps far fewer tokens."""
    from vllm_kvprune.reference.model import load_reference_model

    with engine(real_model, {"name": "gvote"}, kv_blocks=256) as llm:
        assert_parity(llm, load_reference_model(real_model), prompts((400,), seed=7), {})
