"""Real tensor parallelism: vLLM's multiprocessing executor with two ranks on this CPU (one core
each, `VLLM_CPU_OMP_THREADS_BIND="0|1"`), the tiny model (2 KV heads: one per rank), every
policy against the same engine at one rank:

- greedy fp32 tokens equal;
- the choices each rank made, recorded by the debug mode when a request ends
  (`RequestKVState.kept_choices`, read back with `collective_rpc`), equal to one process's
  for the heads the rank holds: `streaming` (positions) and `paged_eviction` (block scores
  added over the ranks) the same positions on both ranks, `h2o` and `gvote` each KV head its
  own (decided on the rank that holds it), `fdc` every token on both (its rotations cut to
  each rank's heads).

`worker/tensor_parallel.py` says what the ranks agree on; its report merge is tested here
too, on the reports two ranks would send.
"""

from __future__ import annotations

import pytest
from conftest import POLICY_CASES, engine, policy_settings

from vllm_kvprune import vllm_hooks
from vllm_kvprune.policies import REGISTRY
from vllm_kvprune.worker import tensor_parallel

pytestmark = pytest.mark.slow

# A long prompt (evicted down to the budget while generating) and a short one (never full).
PROMPTS = [list(range(5, 205)), list(range(300, 340))]
NEW_TOKENS = 60
# Every registered policy, at its conformance case's settings (tests/policy_cases.yaml: its
# `tensor_parallel` entry where the engine's would evict nothing here, and `heavy` where the
# check repeats another's mechanism and runs only with --heavy).
POLICIES = [name for name in REGISTRY if name != "none"]
# The conformance suite's variants (`policy@variant`) whose engine settings TP takes (a spread
# budget over a layer's heads, `adaptive`, is refused: test_adaptive_is_refused_with_two_ranks).
VARIANTS = [key for key, case in POLICY_CASES.items() if "@" in key and case["engine"].get("allocation") != "adaptive"]
# The choices every rank must make alike (not per head).
SHARED_CHOICES = {"slots", "blocks"}


def tp_case(name: str) -> tuple[dict, bool]:
    """(settings, heavy) of a policy's tensor-parallel check."""
    case = POLICY_CASES[name]
    tp = case.get("tensor_parallel") or {}
    return tp.get("settings", case["engine"]), bool(tp.get("heavy"))


def _run(model: str, policy: dict, tensor_parallel_size: int, monkeypatch) -> tuple[list, list[dict]]:
    """(tokens per prompt, each rank's `ended_choices`) of one engine."""
    from vllm import SamplingParams

    if tensor_parallel_size > 1:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tensor_parallel_size)))
    with engine(model, policy, kv_blocks=256, block_size=32, max_model_len=1024,
                tensor_parallel_size=tensor_parallel_size) as llm:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                              extra_args={"kv_report": True}), use_tqdm=False)
        # The worker hears a request ended at the next step: one more request makes that step.
        llm.generate([{"prompt_token_ids": [11, 12]}], SamplingParams(max_tokens=1), use_tqdm=False)
        ranks = llm.collective_rpc("kvprune_ended_choices")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    # The request's KV statistics come back in its output (asked for with kv_report).
    report = outputs[0].kv_transfer_params["kvprune"]
    assert report["policy"] == policy["name"]
    if REGISTRY[policy["name"]].layout != "full":  # nothing evicted: vLLM's own manager holds its blocks
        assert report["blocks_without_policy"] == -(-(len(PROMPTS[0]) + NEW_TOKENS - 1) // 32)
        assert report["blocks_held"] < report["blocks_without_policy"], report
        assert report["kept_tokens_max"] < len(PROMPTS[0]) + NEW_TOKENS, report
    return [list(output.outputs[0].token_ids) for output in outputs], sorted(ranks, key=lambda rank: rank["rank"])


def _by_prompt(choices: dict) -> dict[int, tuple[str, list]]:
    """Ended requests by prompt index (offline request ids are "<index>-<suffix>")."""
    return {int(request_id.split("-")[0]): choice for request_id, choice in choices.items()}


@pytest.mark.parametrize("key", [pytest.param(name, marks=pytest.mark.heavy) if tp_case(name)[1] else name
                                 for name in POLICIES + VARIANTS])
def test_two_ranks_match_one_process(key: str, tiny_model, fdc_files, monkeypatch) -> None:
    name = key.split("@")[0]
    policy = policy_settings(name, tp_case(key)[0], fdc_files)
    one_tokens, (one,) = _run(tiny_model, policy, 1, monkeypatch)
    two_tokens, ranks = _run(tiny_model, policy, 2, monkeypatch)
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert two_tokens == one_tokens
    if REGISTRY[name].layout == "full":
        assert not one["choices"], f"{key} keeps every token: no map to record"
        return
    reference = _by_prompt(one["choices"])
    assert {0, 1} <= set(reference)
    per_rank = [_by_prompt(rank["choices"]) for rank in ranks]
    total = [len(prompt) + NEW_TOKENS - 1 for prompt in PROMPTS]  # positions cached at the end
    for index, (kind, kept) in ((index, reference[index]) for index in (0, 1)):
        for rank, choices in enumerate(per_rank):
            rank_kind, rank_kept = choices[index]
            assert rank_kind == kind
            if kind in SHARED_CHOICES:
                assert rank_kept == kept, (key, index, rank)
            else:  # per layer, the rank's own KV heads: one each here (2 heads over 2 ranks)
                assert [layer[rank:rank + 1] for layer in kept] == rank_kept, (key, index, rank)
    assert any(len(head) < total[0] for head in _per_head(reference[0])), \
        f"{key} evicted nothing from the long prompt: the test would not see a wrong choice"


def test_adaptive_is_refused_with_two_ranks(tiny_model) -> None:
    """A budget split over all of a layer's KV heads needs them in one process: refused at
    start-up, naming the setting."""
    with pytest.raises(ValueError, match="allocation.*tensor_parallel_size 2"):
        with engine(tiny_model, {"name": "h2o", "budget": 96, "allocation": "adaptive"}, kv_blocks=256,
                    tensor_parallel_size=2):
            pass


def _per_head(choice: tuple[str, list]) -> list[list[int]]:
    kind, kept = choice
    if kind == "slots":
        return [kept]
    if kind == "blocks":
        return kept
    return [head for layer in kept for head in layer]


def test_report_merge_takes_the_widest_rank_and_every_failure(monkeypatch) -> None:
    """The scheduler reads the first rank's output only: a head-page request gets, in each of its
    KV-cache groups (one per layer), the blocks its widest rank needs there, a request failed on
    rank 1 fails, kept tokens average over the ranks."""
    first = {"failed": {}, "kept": {"a": (10.0, 12), "b": (4.0, 4)}, "seconds": {"plan": 0.1, "score": 0.2, "move": 0.0},
             "footprints": {"a": [3, 4], "b": [1, 1]}}
    second = {"failed": {"b": "score: boom"}, "kept": {"a": (20.0, 30)}, "seconds": {"plan": 0.3, "score": 0.1, "move": 0.0},
              "footprints": {"a": [5, 2]}}
    monkeypatch.setattr(vllm_hooks, "tp_all_gather_object", lambda report: [first, second])
    merged = tensor_parallel.merged_report(first)
    assert merged["footprints"] == {"a": [5, 4], "b": [1, 1]}
    assert merged["failed"] == {"b": "score: boom"}
    assert merged["kept"] == {"a": (15.0, 30)}
    assert merged["seconds"] == {"plan": 0.3, "score": 0.2, "move": 0.0}
    monkeypatch.setattr(vllm_hooks, "tp_all_gather_object", lambda report: [report])
    assert tensor_parallel.merged_report(first) is first


@pytest.mark.parametrize(("heads", "world", "expected"), [
    (8, 2, [range(0, 4), range(4, 8)]), (2, 2, [range(0, 1), range(1, 2)]), (2, 4, [range(0, 1), range(0, 1),
                                                                                      range(1, 2), range(1, 2)])])
def test_kv_head_range_is_vllms_split(heads: int, world: int, expected: list[range]) -> None:
    assert [tensor_parallel.kv_head_range(heads, rank, world) for rank in range(world)] == expected
    with pytest.raises(ValueError, match="split"):
        tensor_parallel.kv_head_range(6, 0, 4)
