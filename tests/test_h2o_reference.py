"""The H2O reference (the oracle of the `h2o` policy): its mass bookkeeping and its
agreement with StreamingLLM when no heavy hitter is kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, 30000, size=length).tolist()


def test_without_heavy_hitters_h2o_is_streaming(reference_model):
    from vllm_kvprune.reference.h2o import H2OReference
    from vllm_kvprune.reference.streaming import StreamingLLMReference

    for interval in (1, 8):
        h2o = H2OReference(reference_model, budget=48, recent=44, sinks=3, prune_interval=interval)
        streaming = StreamingLLMReference(reference_model, budget=48, sinks=3, prune_interval=interval)
        ids = prompt(70)
        assert h2o.generate(ids, 120, prompt_logprobs=False).token_ids == \
            streaming.generate(ids, 120, prompt_logprobs=False).token_ids


def test_mass_adds_up_to_the_queries_seen(reference_model):
    """With nothing evicted, each KV head's total mass is one per query of its group."""
    from vllm_kvprune.reference.h2o import H2OReference

    reference = H2OReference(reference_model, budget=1000, recent=8, prefill="streaming", prefill_chunk=16)
    reference.generate(prompt(40), 20, prompt_logprobs=False)
    group = reference_model.config.num_attention_heads // reference_model.config.num_key_value_heads
    for mass in reference.mass:
        assert torch.allclose(mass.sum(dim=1), torch.full((mass.shape[0],), float(group * reference.tokens_seen)))


def test_heads_keep_their_own_heavy_hitters(reference_model):
    from vllm_kvprune.reference.h2o import H2OReference

    reference = H2OReference(reference_model, budget=32, recent=8, sinks=2)
    output = reference.generate(prompt(60, seed=1), 40, prompt_logprobs=False)
    assert max(output.kept_sizes) == 32
    positions = [reference.cache.positions[layer] for layer in range(reference.num_layers)]
    assert all(p.shape[1] == 31 + 1 or p.shape[1] <= 32 for p in positions)
    assert any(not torch.equal(p[0], p[1]) for p in positions), "every head kept the same tokens"
    for p in positions:  # sinks and the recent window are in every head
        assert (p[:, :2] == torch.arange(2)).all()
        assert (p[:, -8:] == p[0, -8:]).all()
