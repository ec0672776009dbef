"""Budgets that differ by layer (`pyramid`) or by head (`adaptive`): the engine's rules
(`policies/allocation.py`) against the reference's plain ones, and `snapkv` and `h2o` served with
them in a real engine (head-pages, a KV-cache group per layer): the kept positions of every layer and
KV head and the greedy tokens equal the reference's, each layer holds the blocks its own kept
tokens need (read from vLLM's pool), every block comes back, and a request cannot switch
between one block table and head-pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import BLOCK_SIZE, engine, policy_reference, runner_of, scheduler_of
from test_gvote_engine import check_invariants, snapshot_keep_sets
from test_streaming_engine import all_blocks_free, greedy, prompts, run_steps, tokens_and_logprobs
from vllm_kvprune.config import KVConfigError, KVPolicyConfig
from vllm_kvprune.policies import allocation
from vllm_kvprune.reference import allocation as reference

GEN = 30
BUDGET = 96  # window 64: each head of each layer chooses 31 on average outside the window


@pytest.mark.parametrize("seed", range(6))
def test_the_rules_equal_the_references(seed):
    """Random scores, some tied (rounded to a coarse grid, so ties go by age, then head)."""
    rng = np.random.default_rng(seed)
    heads, outside = int(rng.integers(1, 5)), int(rng.integers(5, 60))
    scores = torch.from_numpy(np.round(rng.random((heads, outside)) * 8) / 8).float()
    for mean_chosen in (0, 1, outside // 3, outside - 1, outside):
        for window in (1, 8, 64):
            got = allocation.adaptive_keep(scores, mean_chosen, window)
            assert torch.equal(got, reference.adaptive_chosen(scores, mean_chosen, window)), (mean_chosen, window)
            assert int(got.sum()) == heads * min(mean_chosen, outside)
        counts = allocation.pyramid_counts(mean_chosen, outside, 7)
        assert counts == [reference.pyramid_count(mean_chosen, outside, layer, 7) for layer in range(7)]
        assert torch.equal(allocation.keep_best(scores, counts[2]),
                           reference.best_of_each_head(scores, [counts[2]] * heads))


@pytest.mark.parametrize("mean_chosen,available,layers", [(31, 236, 4), (31, 40, 4), (900, 1000, 30), (5, 6, 30),
                                                          (200, 7000, 30), (50, 100, 1)])
def test_a_pyramid_keeps_uniforms_total(mean_chosen, available, layers):
    counts = allocation.pyramid_counts(mean_chosen, available, layers)
    assert all(a >= b for a, b in zip(counts, counts[1:])), "more in the lower layers"
    assert max(counts) <= available
    assert abs(sum(counts) - layers * mean_chosen) <= layers / 2, "the same total as uniform, up to rounding"
    if layers > 1 and 2 * mean_chosen - mean_chosen / allocation.PYRAMID_BETA <= available:
        assert counts[0] > mean_chosen > counts[-1]


def test_adaptive_gives_every_head_its_floor():
    scores = torch.zeros(4, 200)
    scores[0] = 1.0  # head 0 outscores every other: only the floor keeps theirs
    keep = allocation.adaptive_keep(scores, 100, window=8)
    floor = int(allocation.ADAPTIVE_FLOOR * 108) - 8  # the window covers the first 8 of 21
    assert int(keep.sum()) == 400 and int(keep[0].sum()) == 200
    assert int(keep[1:].sum(dim=1).min()) >= floor > 0
    # Without the floor the others' tied zeros would go by age alone: their newest 200 in all.
    scores[1:, :floor] = -1.0  # their oldest are now their worst: kept by the floor only
    assert not allocation.adaptive_keep(scores, 100, window=8)[1:, :floor].any()


def test_a_request_cannot_switch_layouts():
    uniform = KVPolicyConfig.from_dict({"name": "snapkv", "budget": 96})
    pyramid = KVPolicyConfig.from_dict({"name": "snapkv", "budget": 96, "allocation": "pyramid"})
    assert uniform.policy.layout == "heads" and pyramid.policy.layout == "head_pages"
    assert pyramid.policy.per_layer_tables and pyramid.for_request({"kv_allocation": "adaptive"}).allocation == \
        "adaptive"
    for engine_config, asked in ((uniform, "pyramid"), (uniform, "adaptive"), (pyramid, "uniform")):
        with pytest.raises(KVConfigError, match="kv_allocation"):
            engine_config.for_request({"kv_allocation": asked})
    with pytest.raises(KVConfigError, match="kv_prune_interval"):
        pyramid.for_request({"kv_prune_interval": 4})
    with pytest.raises(KVConfigError, match="allocation.*tensor_parallel_size 2"):
        KVPolicyConfig.from_dict({"name": "snapkv", "budget": 96, "allocation": "adaptive"}).check_engine(
            BLOCK_SIZE, tensor_parallel_size=2)
    pyramid.check_engine(BLOCK_SIZE, tensor_parallel_size=2)  # per head: each rank decides its own
    with pytest.raises(KVConfigError, match="allocation"):
        KVPolicyConfig.from_dict({"name": "streaming", "budget": 96, "allocation": "pyramid"})


ENGINES = {"snapkv": {"name": "snapkv", "budget": BUDGET, "allocation": "pyramid"},
           "h2o": {"name": "h2o", "budget": BUDGET, "sinks": 2, "allocation": "adaptive"}}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def spread_llm(request, tiny_model):
    """An engine of a spread budget (a KV-cache group per layer of head-pages), per scorer."""
    with engine(tiny_model, ENGINES[request.param], kv_blocks=512, disable_log_stats=False) as llm:
        yield request.param, llm


@pytest.mark.parametrize("allocation_name", ["pyramid", "adaptive"])
def test_keep_sets_and_tokens_equal_the_references(spread_llm, reference_model, allocation_name):
    name, llm = spread_llm
    prompt_ids = prompts((20, 150, 300), seed=7)
    settings = {"kv_allocation": allocation_name}
    keep_sets: dict = {}
    finished = run_steps(llm, prompt_ids, [greedy(GEN, **settings)] * len(prompt_ids),
                         on_step=lambda: snapshot_keep_sets(llm, keep_sets))
    config = KVPolicyConfig.from_dict({**ENGINES[name], "allocation": allocation_name})
    oracle = policy_reference(reference_model, config, BLOCK_SIZE)
    lengths = []
    for request_id, output in finished.items():
        expected = oracle.generate(prompt_ids[int(request_id)], GEN, prompt_logprobs=False)
        [served] = [kept for internal, kept in keep_sets.items() if internal.split("-")[0] == request_id]
        for layer, keep in enumerate(oracle.prompt_keep):
            for head in range(keep.shape[0]):
                assert served[layer][head].tolist() == keep[head].nonzero()[:, 0].tolist(), (request_id, layer, head)
        lengths.append(torch.stack([keep.sum(dim=1) for keep in oracle.prompt_keep]))
        token_ids, logprobs = tokens_and_logprobs(output)
        assert token_ids == expected.token_ids
        assert np.max(np.abs(np.array(logprobs) - np.array(expected.logprobs))) < 1e-3
    longest = lengths[-1]  # the 300-token prompt: [layers, heads]
    if allocation_name == "pyramid":
        assert (longest[:-1] > longest[1:]).all(), "each layer keeps less than the one below"
    else:
        assert (longest != longest[:, :1]).any(), "the heads of a layer keep different counts"
    assert all_blocks_free(llm)


def test_each_layer_holds_what_its_budget_needs(spread_llm):
    """Every step: blocks held per layer = what that layer's kept tokens need (the scheduler's
    own groups), no head-page mapped twice; after the prompt a pyramid request holds less than
    the fullest layer's need times the layers (what one table would hold)."""
    name, llm = spread_llm
    held_after_prompt: dict[str, tuple[int, int]] = {}

    def watch() -> None:
        check_invariants(llm)
        scheduler, runner = scheduler_of(llm), runner_of(llm)
        for request_id, state in runner.kv_state.requests.items():
            pages = state.map
            if request_id in scheduler.requests and pages is not None and pages.is_paged:
                held_after_prompt.setdefault(request_id, (scheduler.held_blocks(request_id),
                                                          int(pages.layer_blocks(0).max()) * pages.num_layers))

    prompt_ids = prompts((400, 700, 33), seed=9)
    params = [greedy(20, kv_allocation=name) for name in ("pyramid", "adaptive", "pyramid")]
    finished = run_steps(llm, prompt_ids, params, on_step=watch, abort=(3, ["2"]))
    assert {"0", "1"} <= set(finished)
    # The pyramid request: its layers keep fewer tokens per head from the lowest to the highest
    # (snapkv: 124, 105, 85, 66: 4 + 4 + 3 + 3 blocks) where one table would hold the fullest
    # layer's count in every layer. (The adaptive one's heads differ within each layer; each
    # layer's need, rounded to whole head-pages, is checked above.)
    [(held, one_table)] = [held for request_id, held in held_after_prompt.items() if request_id.split("-")[0] == "0"]
    assert held < one_table, (name, held, one_table)
    assert any(request_id.split("-")[0] == "1" for request_id in held_after_prompt)
    assert all_blocks_free(llm)
