"""`fdc` served by vLLM against the FDC reference (tiny Llama, fp32, eager).

- adaptive ranks (rate 0.1): the same greedy tokens as `reference/fdc.py`, logprobs within
  1e-3, for prompts that cross block boundaries, batched with each other;
- every rank at the head size: the same tokens as the full-cache reference (`none`);
- the pool: vLLM's KV-cache spec reports each layer's own narrowed per-token size, so the same
  bytes hold proportionally more blocks, following the mean width over layers (counted from the
  engine's own pool);
- per-request overrides of a budget are refused; a calibration of another model is refused
  before the engine starts, naming the setting;
- vLLM's compiled mode (no --enforce-eager) gives the eager run's tokens;
- `streaming` with `fdc` (FDC's "KF-F"): the streaming reference given FDC's head transform,
  token for token, with the prompt pruned after it (`prefill: full`) or while it streams in;
  the pool holds the narrow blocks and each request at most the streaming cap of them;
- `paged_eviction` with `fdc`: the PagedEviction reference given the same transform, scoring
  the reduced keys and values it caches.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import engine, make_llm, page_bytes, scheduler_of

from vllm_kvprune.fdc import calibration as fdc
from vllm_kvprune.reference.fdc import FdcReference, FdcTransform
from vllm_kvprune.reference.paged_eviction import PagedEvictionReference
from vllm_kvprune.reference.streaming import StreamingLLMReference

pytestmark = pytest.mark.slow

PROMPTS = [list(range(100, 160)), list(range(300, 340)), [7 * i % 49000 + 3 for i in range(100)]]
NEW_TOKENS = 10
KV_BLOCKS = 160  # above the 129 blocks one max_model_len (4096) request needs at full width


@pytest.fixture(scope="module")
def calibrations(tiny_model, tmp_path_factory) -> dict[str, tuple]:
    folder = tmp_path_factory.mktemp("fdc")
    adaptive = fdc.calibrate(tiny_model, tokens=256, seq_len=128, seed=0, rate=0.1)
    full = adaptive.with_uniform_ranks(adaptive.head_dim, adaptive.head_dim)
    files = {}
    for name, calibration in (("adaptive", adaptive), ("full", full)):
        path = folder / f"{name}.safetensors"
        calibration.save(path)
        files[name] = (str(path), calibration)
    return files


def _generate(llm, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [completion.logprobs[i][token].logprob for i, token in enumerate(tokens)]))
    return results


def _assert_matches(results, references) -> None:
    for (tokens, logprobs), expected in zip(results, references):
        assert tokens == expected.token_ids
        assert max(abs(a - b) for a, b in zip(logprobs, expected.logprobs)) < 1e-3


@pytest.fixture(scope="module")
def adaptive_run(tiny_model, calibrations):
    path, _ = calibrations["adaptive"]
    with engine(tiny_model, {"name": "fdc", "fdc": path}, kv_blocks=KV_BLOCKS) as llm:
        pool_blocks = scheduler_of(llm).kv_cache_manager.block_pool.num_gpu_blocks
        results = _generate(llm)
    return results, pool_blocks


def test_the_pool_holds_more_narrow_blocks_for_the_same_bytes(adaptive_run, calibrations, tiny_model) -> None:
    _, calibration = calibrations["adaptive"]
    options = dict(dtype="float32", block_size=32)
    pool_bytes = KV_BLOCKS * page_bytes(tiny_model, options)
    heads = calibration.num_kv_heads
    # Each layer's row (its packed width) rounded up to a head size of its own: 2 H values.
    layer_widths = [math.ceil(int(calibration.qk_rank[layer].sum() + calibration.v_rank[layer].sum()) / (2 * heads))
                    * 2 * heads for layer in range(calibration.num_layers)]
    assert len(set(layer_widths)) > 1  # the layers differ, so the widest would hold fewer blocks
    narrow_page = 32 * sum(layer_widths) * 4
    pool_blocks = adaptive_run[1]
    assert pool_blocks == pool_bytes // narrow_page
    assert pool_blocks > pool_bytes // (32 * max(layer_widths) * 4 * calibration.num_layers)
    assert pool_blocks > KV_BLOCKS  # the full-width pool of the same bytes


def test_budget_override_and_a_foreign_calibration_are_refused(adaptive_run, calibrations, real_model) -> None:
    path, _ = calibrations["adaptive"]
    with pytest.raises(ValueError, match="kv_policy.fdc: .*made for a model of"):
        make_llm(real_model, {"name": "fdc", "fdc": path})
    from vllm_kvprune.config import KVConfigError, KVPolicyConfig

    policy = KVPolicyConfig(name="fdc", fdc=path).validated()
    with pytest.raises(KVConfigError, match="kv_budget: policy 'fdc' keeps every token"):
        policy.for_request({"kv_budget": 64})
    assert torch.equal(fdc.load(path).qk_rank, calibrations["adaptive"][1].qk_rank)


def test_real_model_matches_the_reference(real_model, tmp_path) -> None:
    """SmolLM2-135M (30 layers, 9 query / 3 KV heads of 64), fp32, a calibration of 1024 tokens."""
    from vllm_kvprune.reference.model import load_reference_model

    calibration = fdc.calibrate(real_model, tokens=1024, seq_len=512, seed=0, rate=0.05)
    path = tmp_path / "real.safetensors"
    calibration.save(path)
    prompts = PROMPTS[:2]
    with engine(real_model, {"name": "fdc", "fdc": str(path)}, kv_blocks=200) as llm:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    model = load_reference_model(real_model)
    for prompt, output in zip(prompts, outputs):
        expected = FdcReference(model, calibration).generate(prompt, NEW_TOKENS, prompt_logprobs=False)
        completion = output.outputs[0]
        assert list(completion.token_ids) == expected.token_ids
        logprobs = [completion.logprobs[i][token].logprob for i, token in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(logprobs, expected.logprobs)) < 1e-3


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_other_architectures_match_the_reference(name: str, tmp_path) -> None:
    """Tiny random Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms), fp32."""
    from tools.model_zoo import zoo_model_dir
    from vllm_kvprune.reference.model import load_reference_model

    model = str(zoo_model_dir(name))
    calibration = fdc.calibrate(model, tokens=256, seq_len=128, seed=0, rate=0.1)
    assert (calibration.qk_rank < calibration.head_dim).any()
    path = tmp_path / f"{name}.safetensors"
    calibration.save(path)
    with engine(model, {"name": "fdc", "fdc": str(path)}, kv_blocks=160) as llm:
        results = _generate(llm)
    reference = load_reference_model(model)
    _assert_matches(results, [FdcReference(reference, calibration).generate(prompt, NEW_TOKENS, prompt_logprobs=False)
                              for prompt in PROMPTS])


@pytest.mark.parametrize("prefill", ["full", "streaming"])
def test_streaming_with_fdc_matches_the_reference(prefill, tiny_model, calibrations, reference_model,
                                                  adaptive_run) -> None:
    path, calibration = calibrations["adaptive"]
    streaming = {"name": "streaming", "budget": 48, "sinks": 4, "prefill": prefill, "prefill_chunk": 32}
    with engine(tiny_model, {**streaming, "fdc": path}, kv_blocks=KV_BLOCKS) as llm:
        manager = scheduler_of(llm).kv_cache_manager
        pool_blocks = manager.block_pool.num_gpu_blocks
        results = _generate(llm)
        held_after = manager.block_pool.get_num_free_blocks()
    assert pool_blocks == adaptive_run[1]  # the same narrow blocks as fdc alone
    assert held_after == pool_blocks - 1  # every block back (vLLM keeps its null block)
    references = [StreamingLLMReference(reference_model, budget=48, sinks=4, prefill=prefill, prefill_chunk=32,
                                        head_transform=FdcTransform(calibration))
                  .generate(prompt, NEW_TOKENS, prompt_logprobs=False) for prompt in PROMPTS]
    # The prompts outgrow the budget (60 and 100 tokens) or their generation does (40 + 10).
    assert all(len(prompt) + NEW_TOKENS > 48 for prompt in PROMPTS)
    _assert_matches(results, references)


def test_paged_eviction_with_fdc_matches_the_reference(tiny_model, calibrations, reference_model,
                                                       adaptive_run) -> None:
    """Block eviction over narrow blocks: each layer keeps its best prompt tokens and drops its
    lowest-scored block, scored by ||V|| / ||K|| of the reduced vectors it stores."""
    path, calibration = calibrations["adaptive"]
    # 130 tokens: the prompt is pruned to the budget, then a block goes at the first decode;
    # 90 tokens: a block goes when the decode fills the cap (3 blocks); 40: nothing goes.
    prompts = [[5 * i % 47000 + 11 for i in range(130)], list(range(500, 590)), PROMPTS[1]]
    paged = {"name": "paged_eviction", "budget": 96, "sinks": 4}
    with engine(tiny_model, {**paged, "fdc": path}, kv_blocks=KV_BLOCKS) as llm:
        manager = scheduler_of(llm).kv_cache_manager
        pool_blocks = manager.block_pool.num_gpu_blocks
        results = _generate(llm, prompts)
        held_after = manager.block_pool.get_num_free_blocks()
    assert pool_blocks == adaptive_run[1]
    assert held_after == pool_blocks - 1
    transform = FdcTransform(calibration)
    references = [PagedEvictionReference(reference_model, budget=96, block_size=32, sinks=4, head_transform=transform)
                  .generate(prompt, NEW_TOKENS, prompt_logprobs=False) for prompt in prompts]
    unpruned = [FdcReference(reference_model, calibration).generate(prompt, NEW_TOKENS, prompt_logprobs=False)
                for prompt in prompts[:2]]
    # The eviction cannot be missing unnoticed: it changes what both long prompts score.
    assert all(full.logprobs != pruned.logprobs for full, pruned in zip(unpruned, references))
    _assert_matches(results, references)


def test_compiled_mode_matches_the_reference(tiny_model, calibrations, reference_model) -> None:
    """Without --enforce-eager vLLM compiles the model around the attention layers; FDC's
    projections live inside the attention backend, which the compiled graph calls as is."""
    path, calibration = calibrations["adaptive"]
    with engine(tiny_model, {"name": "fdc", "fdc": path}, kv_blocks=KV_BLOCKS, enforce_eager=False) as llm:
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager
        assert llm.llm_engine.vllm_config.compilation_config.mode != 0  # compiled
        results = _generate(llm)
    references = [FdcReference(reference_model, calibration).generate(prompt, NEW_TOKENS, prompt_logprobs=False)
                  for prompt in PROMPTS]
    _assert_matches(results, references)
