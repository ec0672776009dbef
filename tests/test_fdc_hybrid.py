"""`fdc` on a hybrid model (issue 43): FDC narrows the full-attention layers, the sliding-window
layers stay vLLM's at full width.

- the feature check: a window is no refusal under FDC (on any layer), FDC's format refusals
  hold on the layers it narrows, and a model with no full-attention layer is refused;
- tiny random Gemma-3 (3 sliding layers, window 64, and one full layer; fp32, eager), a
  calibration of its one full layer cut to ranks 12/10 of 32 so the narrowed page is padded:
  vLLM's hybrid groups keep equal pages, the narrowed group's blocks hold twice the tokens, and
  the greedy tokens equal `reference/fdc.py` (logprobs within 1e-3) on prompts past the window,
  where the reference differs from the full cache's;
- `streaming` with `fdc` on the tiny Gemma-3 (`heavy`): `fdc` alone's output with nothing evicted;
- the real Gemma-3-270M (`slow`, `heavy`), eager and in vLLM's default (compiled) mode: the
  served tokens equal the reference's on an essay prompt past its 512-token window, with blocks
  of 128 tokens (the narrowed ones hold more).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import engine, scheduler_of
from test_streaming_engine import all_blocks_free

from vllm_kvprune.fdc import calibration as fdc

PROMPTS = [list(range(100, 190)), [7 * i % 49000 + 3 for i in range(150)]]  # both past the window of 64
NEW_TOKENS = 10


def _layer(name: str, window: int | None = None, softcap: float = 0.0):
    from vllm_kvprune.worker.features import LayerFeatures

    impl = SimpleNamespace(sliding_window=window, logits_soft_cap=softcap)
    return LayerFeatures.of(name, SimpleNamespace(impl=impl))


def test_fdc_refuses_on_the_layers_it_narrows_only() -> None:
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.worker.features import refusal

    for config in (KVPolicyConfig(name="fdc", fdc="cal.safetensors"),
                   KVPolicyConfig(name="streaming", budget=64, fdc="cal.safetensors")):
        assert config.narrow_heads
        hybrid = [_layer("l0", window=512), _layer("l1"), _layer("l2", window=512)]
        assert refusal(config, hybrid) is None
        # A sliding layer's soft-cap is vLLM's kernel's, not FDC's.
        assert refusal(config, [_layer("l0", window=512, softcap=30.0), _layer("l1")]) is None
        assert refusal(config, [_layer("l0", window=512), _layer("l1", softcap=30.0)]) == (
            f"{config.name}: logit soft-capping (l1) is not supported; FDC's kernel does not cap logits")
        assert refusal(config, [_layer("l0", window=512)]) == (
            f"{config.name}: sliding-window attention (l0) is not supported; every layer has a window, "
            "so there is no full-attention layer to prune")


def _generate(llm, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    results = []
    for output in llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [completion.logprobs[i][token].logprob for i, token in enumerate(tokens)]))
    return results


def _groups(llm) -> list:
    return [group.kv_cache_spec for group in scheduler_of(llm).kv_cache_manager.kv_cache_config.kv_cache_groups]


def _assert_matches_reference(model_dir: str, path: str, prompts: list[list[int]], results) -> None:
    """The served tokens are FDC's reference's, logprobs within 1e-3, and the reference is not
    the full cache's (so a layer left whole, or narrowed where it should not be, shows)."""
    from vllm_kvprune.reference.budgeted import BudgetedReference
    from vllm_kvprune.reference.fdc import FdcReference
    from vllm_kvprune.reference.model import load_reference_model

    model = load_reference_model(model_dir)
    reference, full = FdcReference(model, fdc.load(path)), BudgetedReference(model, budget=None)
    apart = 0.0
    for prompt, (tokens, logprobs) in zip(prompts, results):
        expected = reference.generate(prompt, NEW_TOKENS)
        assert tokens == expected.token_ids
        assert max(abs(a - b) for a, b in zip(logprobs, expected.logprobs)) < 1e-3
        whole = full.generate(prompt, NEW_TOKENS)
        apart = max(apart, float(tokens != whole.token_ids),
                    max(abs(a - b) for a, b in zip(expected.logprobs, whole.logprobs)))
    assert apart > 1e-2


def test_tiny_gemma3_full_layer_narrowed_matches_the_reference(tmp_path) -> None:
    from tools.model_zoo import zoo_model_dir

    from vllm_kvprune.engine.spec import FdcSpec
    from vllm_kvprune.vllm_hooks import SlidingWindowSpec

    model = str(zoo_model_dir("gemma3"))
    calibration = fdc.calibrate(model, tokens=512, seq_len=256, seed=0).with_uniform_ranks(12, 10)
    assert calibration.layers == [3] and calibration.num_layers == 1  # its one full-attention layer
    path = tmp_path / "zoo-gemma3.safetensors"
    calibration.save(path)
    with engine(model, {"name": "fdc", "fdc": str(path)}, kv_blocks=160, max_model_len=1024) as llm:
        specs = _groups(llm)
        results = _generate(llm, PROMPTS)
        assert all_blocks_free(llm)
    narrowed = [spec for spec in specs if isinstance(spec, FdcSpec)]
    assert len(narrowed) == 1 and all(type(spec) is SlidingWindowSpec for spec in specs if spec not in narrowed)
    spec = narrowed[0]
    # 2 KV heads x (12 + 10) values a token, a head size of 11: 64 tokens in the 32-token page of
    # the sliding layers (2 x 32 x 2 x 32 values), padded from 64 x 44.
    assert (spec.block_size, spec.head_size, spec.page_size_padded) == (64, 11, 16384)
    assert {s.page_size_bytes for s in specs} == {16384} and {s.block_size for s in specs[:-1]} == {32}
    _assert_matches_reference(model, str(path), PROMPTS, results)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_real_gemma3_matches_the_reference(tmp_path, enforce_eager: bool) -> None:
    """Gemma-3-270M (3 full-attention layers of one KV head of 256), fp32, a calibration of 1024
    tokens at rate 0.1, blocks of 128 tokens: the narrowed group's hold more. Both eager and in
    vLLM's default (compiled) mode, what `vllm serve` runs: the compiled graph of a hybrid model
    calls vLLM's sliding-window backend and ours side by side."""
    from test_gemma_policies import gemma, prompt_ids

    from vllm_kvprune.engine.spec import FdcSpec

    calibration = fdc.calibrate(gemma(), tokens=1024, seq_len=512, seed=0, rate=0.1)
    assert calibration.layers == [5, 11, 17]
    # The widest narrowed row (one KV head: keys and values, even), in 32-token steps of the
    # 128-token page of 2 x 256 values a token.
    widest = max(int(calibration.qk_rank[row].sum() + calibration.v_rank[row].sum()) for row in range(3))
    expected_block = 128 * 512 // (widest + widest % 2) // 32 * 32
    assert expected_block > 128
    path = tmp_path / "gemma.safetensors"
    calibration.save(path)
    prompts = prompt_ids()
    with engine(gemma(), {"name": "fdc", "fdc": str(path)}, kv_blocks=48, block_size=128,
                max_model_len=2048, enforce_eager=enforce_eager) as llm:
        assert (llm.llm_engine.vllm_config.compilation_config.mode == 0) == enforce_eager
        specs = _groups(llm)
        results = _generate(llm, prompts)
    narrowed = [spec for spec in specs if isinstance(spec, FdcSpec)]
    assert len(narrowed) == 1 and narrowed[0].block_size == expected_block
    _assert_matches_reference(gemma(), str(path), prompts, results)


@pytest.mark.heavy
def test_tiny_gemma3_streaming_with_fdc(tmp_path) -> None:
    """`streaming` with `fdc` on the hybrid model: with a budget past every prompt, `fdc` alone's
    tokens and logprobs; with a budget of 64, its narrowed group evicts (other tokens) and every
    block comes back. (The streaming reference evicts in every layer, so it is not the oracle of
    a hybrid model, whose sliding layers stay vLLM's.)"""
    from tools.model_zoo import zoo_model_dir

    from vllm_kvprune.engine.spec import PrunedFdcSpec

    model = str(zoo_model_dir("gemma3"))
    path = tmp_path / "zoo-gemma3.safetensors"
    fdc.calibrate(model, tokens=512, seq_len=256, seed=0).with_uniform_ranks(12, 10).save(path)
    found = {}
    for label, policy in (("fdc", {"name": "fdc"}), ("past", {"name": "streaming", "budget": 512, "sinks": 4}),
                          ("capped", {"name": "streaming", "budget": 64, "sinks": 4})):
        with engine(model, {**policy, "fdc": str(path)}, kv_blocks=160, max_model_len=1024) as llm:
            found[label] = _generate(llm, PROMPTS)
            if label != "fdc":
                assert any(isinstance(spec, PrunedFdcSpec) and spec.block_size == 64 for spec in _groups(llm))
            assert all_blocks_free(llm)
    assert [tokens for tokens, _ in found["past"]] == [tokens for tokens, _ in found["fdc"]]
    assert max(abs(a - b) for (_, mine), (_, alone) in zip(found["past"], found["fdc"])
               for a, b in zip(mine, alone)) < 1e-3
    assert [tokens for tokens, _ in found["capped"]] != [tokens for tokens, _ in found["fdc"]]
