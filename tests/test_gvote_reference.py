"""The GVote reference (the oracle of the `gvote` policy): the vectorized keep mask against a
loop-by-loop implementation, the step budget against a brute-force top-p count, keeping
everything equals the full cache, seeded reproducibility, per-head variety, and decode that
really ignores the pruned tokens.

A tiny random Llama with a large init std (6 query heads / 2 KV heads) attends sharply enough
that p = 0.95 prunes a good part of a 60-token prompt."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from vllm_kvprune.reference.gvote import (  # noqa: E402
    GVoteReference,
    _query_projection,
    future_rope,
    gvote_keep_mask,
    layer_generator,
    synthetic_queries,
)
from vllm_kvprune.reference.budgeted import BudgetedReference  # noqa: E402
from vllm_kvprune.reference.model import ContiguousKVCache, forward_step, rope_cos_sin, rotate  # noqa: E402

VOCAB = 512
PROMPT = 60


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices (conftest)


def _finish(model):
    model.eval()
    model.requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # greedy logits far from ties
    return model


def tiny_llama(init_std: float) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      initializer_range=init_std, tie_word_embeddings=False)
    torch.manual_seed(0)
    return _finish(LlamaForCausalLM(cfg))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(0.25)


@pytest.fixture(scope="module")
def soft_model() -> LlamaForCausalLM:
    """Near-uniform attention: no fp32 probability is lost below the cumulative sum's rounding,
    so p = 1 really makes every budget P (with sharp attention it does not)."""
    return tiny_llama(0.06)


@pytest.fixture(scope="module")
def qwen3() -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      initializer_range=0.25, tie_word_embeddings=False)
    torch.manual_seed(0)
    return _finish(Qwen3ForCausalLM(cfg))


def prompt(n: int = PROMPT, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------
# the keep mask on random tensors
# ---------------------------------------------------------------------------------------------


def loop_keep_mask(q_last, keys, hidden, weight, avg_cos, avg_sin, scale, p_nuc, samples, generator):
    """GVote written one query head and one sample at a time (float64 statistics, python
    top-p loop, explicit rotate-half, torch.topk).  Returns the mask, the budgets and the
    rotated synthetic queries ``[S, Hq, D]``."""
    num_kv_heads, num_keys, head_dim = keys.shape
    num_q_heads = q_last.shape[0]
    group = num_q_heads // num_kv_heads
    budgets = []
    for hq in range(num_q_heads):
        logits = torch.stack([q_last[hq] @ keys[hq // group, j] for j in range(num_keys)]) * scale
        probs = sorted(torch.softmax(logits, dim=0).tolist(), reverse=True)
        total, below = 0.0, 0
        for p in probs:
            total += p
            below += total < p_nuc
        budgets.append(min(below + 1, num_keys))

    rows = hidden.double()
    mean = rows.sum(dim=0) / rows.shape[0]
    std = (((rows - mean) ** 2).sum(dim=0) / (rows.shape[0] - 1)).sqrt()
    noise = torch.randn((samples, hidden.shape[1]), generator=generator, dtype=torch.float32)
    half = head_dim // 2
    keep = torch.zeros(num_kv_heads, num_keys, dtype=torch.bool)
    queries = torch.empty(samples, num_q_heads, head_dim)
    for s in range(samples):
        h = mean.float() + std.float() * noise[s]
        q_all = (weight @ h).view(num_q_heads, head_dim)
        for hq in range(num_q_heads):
            q = q_all[hq]
            rotated = torch.empty(head_dim)
            for i in range(half):
                rotated[i] = q[i] * avg_cos[i] - q[i + half] * avg_sin[i]
                rotated[i + half] = q[i + half] * avg_cos[i + half] + q[i] * avg_sin[i + half]
            queries[s, hq] = rotated
            logits = keys[hq // group] @ rotated * scale
            keep[hq // group, torch.topk(logits, budgets[hq]).indices] = True
    return keep, torch.tensor(budgets), queries


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("p_nuc", [0.5, 0.9])
def test_keep_mask_matches_loop_implementation(group, p_nuc):
    g = torch.Generator().manual_seed(10 * group + int(10 * p_nuc))
    num_kv_heads, head_dim, num_keys, hidden_size, samples, future = 2, 16, 40, 24, 5, 16
    num_q_heads = num_kv_heads * group
    q_last = torch.randn(num_q_heads, head_dim, generator=g) * 1.5
    keys = torch.randn(num_kv_heads, num_keys, head_dim, generator=g) * 1.5
    hidden = torch.randn(num_keys, hidden_size, generator=g) * torch.rand(hidden_size, generator=g) \
        + torch.randn(hidden_size, generator=g)
    weight = torch.randn(num_q_heads * head_dim, hidden_size, generator=g) * 0.5
    # rotate-half RoPE averaged over `future` positions after the prompt
    freqs = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(num_keys, num_keys + future, dtype=torch.float32)[:, None] * freqs
    angles = torch.cat([angles, angles], dim=-1)
    avg_cos, avg_sin = angles.cos().mean(0), angles.sin().mean(0)
    scale = head_dim**-0.5

    def project(h):
        return (h @ weight.T).view(h.shape[0], num_q_heads, head_dim)

    keep, budgets = gvote_keep_mask(q_last, keys, hidden, project, avg_cos, avg_sin, scale, p_nuc, samples,
                                    torch.Generator().manual_seed(7))
    expected_keep, expected_budgets, expected_queries = loop_keep_mask(
        q_last, keys, hidden, weight, avg_cos, avg_sin, scale, p_nuc, samples, torch.Generator().manual_seed(7))
    queries = synthetic_queries(hidden, project, avg_cos, avg_sin, samples, torch.Generator().manual_seed(7))
    torch.testing.assert_close(queries, expected_queries, rtol=1e-5, atol=1e-5)
    assert budgets.tolist() == expected_budgets.tolist()
    assert keep.dtype == torch.bool and keep.shape == (num_kv_heads, num_keys)
    assert torch.equal(keep, expected_keep)
    assert not keep.all(), "everything kept: the comparison proves little"
    assert (budgets > 1).any()


def test_step_budget_is_the_smallest_top_p_set(model):
    """Brute force over every subset of a 9-token prompt: the budget is the size of the
    smallest set of keys whose attention mass reaches p."""
    ids = prompt(9, seed=4)
    for p_nuc in (0.3, 0.6, 0.9, 0.95):
        reference = GVoteReference(model, p_nuc=p_nuc, samples=2)
        reference.generate(ids, 1, prompt_logprobs=False)
        capture: dict = {}
        cache = ContiguousKVCache(len(model.model.layers))
        forward_step(model, ids, cache, torch.arange(len(ids)), capture=capture)
        for layer, attn in enumerate(layer.self_attn for layer in model.model.layers):
            q_last, keys = capture["query"][layer][:, -1], cache.k[layer]
            group = q_last.shape[0] // keys.shape[0]
            for hq in range(q_last.shape[0]):
                probs = torch.softmax(keys[hq // group] @ q_last[hq] * attn.scaling, dim=0).double().tolist()
                smallest = min(len(subset) for size in range(1, len(ids) + 1)
                               for subset in itertools.combinations(range(len(ids)), size)
                               if sum(probs[j] for j in subset) >= p_nuc)
                assert int(reference.step_budgets[layer][hq]) == smallest, (p_nuc, layer, hq)


# ---------------------------------------------------------------------------------------------
# the driver on a tiny model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, future", [(0, 16), (3, 5)])
def test_driver_follows_the_conventions(model, seed, future):
    """Each layer's keep set is gvote_keep_mask on what one forward over the prompt gives: the
    last prompt token's query, the post-RoPE keys, the q_proj inputs, RoPE averaged over
    positions P .. P + future - 1, the layer's scale, noise seeded with seed + 7919 * layer."""
    ids = prompt()
    reference = GVoteReference(model, seed=seed, future=future, samples=3)
    reference.generate(ids, 1, prompt_logprobs=False)
    capture: dict = {}
    cache = ContiguousKVCache(len(model.model.layers))
    forward_step(model, ids, cache, torch.arange(len(ids)), capture=capture)
    cos, sin = rope_cos_sin(model, torch.arange(len(ids), len(ids) + future), capture["q_input"][0])
    for layer, decoder in enumerate(model.model.layers):
        attn = decoder.self_attn
        keep, budgets = gvote_keep_mask(capture["query"][layer][:, -1], cache.k[layer], capture["q_input"][layer],
                                        _query_projection(attn), cos.mean(0), sin.mean(0), attn.head_dim**-0.5,
                                        0.95, 3, torch.Generator().manual_seed(seed + 7919 * layer))
        assert torch.equal(budgets, reference.step_budgets[layer])
        for head in range(keep.shape[0]):
            assert torch.equal(keep[head].nonzero()[:, 0], reference.kept_positions[layer][head]), (layer, head)


@pytest.mark.parametrize("attention", ["soft", "sharp"])
def test_keeping_everything_equals_the_full_cache(request, attention):
    model = request.getfixturevalue("soft_model" if attention == "soft" else "model")
    ids = prompt()
    reference = GVoteReference(model, p_nuc=1.0, samples=2)
    got = reference.generate(ids, 20)
    assert all((budgets == len(ids)).all() for budgets in reference.step_budgets)
    assert (reference.kept_lengths == len(ids)).all()
    assert all(torch.equal(positions, torch.arange(len(ids))) for heads in reference.kept_positions
               for positions in heads)
    full = BudgetedReference(model, budget=None).generate(ids, 20)
    assert got.token_ids == full.token_ids
    assert got.logprobs == full.logprobs
    assert got.prompt_logprobs == full.prompt_logprobs
    assert got.kept_sizes == full.kept_sizes == [len(ids) + t + 1 for t in range(19)]


def test_keep_sets_follow_the_seed(model):
    ids = prompt()
    first = GVoteReference(model, seed=0)
    out = first.generate(ids, 5, prompt_logprobs=False)
    again = GVoteReference(model, seed=0)
    assert again.generate(ids, 5, prompt_logprobs=False).token_ids == out.token_ids
    other = GVoteReference(model, seed=1)
    other.generate(ids, 5, prompt_logprobs=False)
    same, differ = True, False
    for layer in range(len(first.kept_positions)):
        for a, b, c in zip(first.kept_positions[layer], again.kept_positions[layer], other.kept_positions[layer]):
            same &= torch.equal(a, b)
            differ |= not torch.equal(a, c)
    assert same and differ
    # generate resets: the same instance votes the same way again
    kept = [[p.clone() for p in heads] for heads in first.kept_positions]
    first.generate(ids, 2, prompt_logprobs=False)
    assert all(torch.equal(a, b) for x, y in zip(kept, first.kept_positions) for a, b in zip(x, y))
    # and the layers draw different noise
    assert not torch.equal(torch.randn(4, generator=layer_generator(0, 0)),
                           torch.randn(4, generator=layer_generator(0, 1)))


def test_heads_keep_their_own_lengths(model):
    ids = prompt()
    reference = GVoteReference(model)
    out = reference.generate(ids, 6, prompt_logprobs=False)
    lengths = reference.kept_lengths
    num_layers, num_kv_heads = lengths.shape
    assert (num_layers, num_kv_heads) == (2, 2) and lengths.dtype == torch.long
    assert len(set(lengths.flatten().tolist())) > 1, "every head kept the same number of tokens"
    assert ((lengths >= 1) & (lengths <= len(ids))).all()
    assert (lengths < len(ids)).any(), "nothing pruned"
    for layer in range(num_layers):
        budgets = reference.step_budgets[layer].view(num_kv_heads, -1)
        for head in range(num_kv_heads):
            kept = reference.kept_positions[layer][head]
            assert kept.dtype == torch.long and len(kept) == lengths[layer, head]
            assert torch.equal(kept, torch.unique(kept)) and kept.min() >= 0 and kept.max() < len(ids)
            # the union holds at least one vote of the largest budget, at most every vote
            assert budgets[head].max() <= len(kept) <= min(len(ids), reference.samples * int(budgets[head].sum()))
    mean = float(lengths.float().mean())
    assert out.kept_sizes == [mean + t + 1 for t in range(5)]


def test_decode_ignores_the_pruned_tokens(model):
    """Perturbing the value of a pruned prompt token changes no decode output; perturbing a
    kept one does (and the prompt's own outputs are computed on the full cache)."""
    ids = prompt()
    layer, head = 1, 0

    def decode(perturb):
        reference = GVoteReference(model)
        reference.reset()
        prefill = reference.step(ids)
        if perturb is not None:
            with torch.inference_mode():  # the cache holds inference tensors
                reference.cache.v[layer][head, perturb] += 5.0
        hidden = [reference.step([token]).hidden for token in prompt(4, seed=9)]
        return reference, prefill.hidden, torch.cat(hidden)

    reference, prefill, base = decode(None)
    kept = reference.kept_positions[layer][head]
    pruned = sorted(set(range(len(ids))) - set(kept.tolist()))
    assert pruned, "the head pruned nothing"
    assert torch.equal(decode(pruned[len(pruned) // 2])[2], base)
    assert torch.equal(decode(pruned)[2], base)
    assert not torch.allclose(decode(int(kept[len(kept) // 2]))[2], base, atol=1e-4)
    assert torch.equal(decode(None)[1], prefill)


# ---------------------------------------------------------------------------------------------
# plumbing: projection (Llama and Qwen3's q_norm), averaged RoPE, short prompts, validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["model", "qwen3"])
def test_projection_reproduces_the_models_queries(which, request):
    """The synthetic-query path, fed the real q_proj inputs and rotated at the real positions,
    gives back the model's own post-RoPE queries."""
    net = request.getfixturevalue(which)
    ids = prompt(12)
    capture: dict = {}
    forward_step(net, ids, ContiguousKVCache(len(net.model.layers)), torch.arange(len(ids)), capture=capture)
    cos, sin = rope_cos_sin(net, torch.arange(len(ids)), capture["q_input"][0])
    for layer, decoder_layer in enumerate(net.model.layers):
        x = capture["q_input"][layer]
        assert x.shape == (len(ids), net.config.hidden_size)
        queries = rotate(_query_projection(decoder_layer.self_attn)(x).transpose(0, 1), cos, sin)
        torch.testing.assert_close(queries, capture["query"][layer], rtol=1e-5, atol=1e-5)


def test_future_rope_is_the_mean_over_the_next_positions(model):
    like = torch.zeros(1)
    avg_cos, avg_sin = future_rope(model, 30, 16, like)
    cos = torch.stack([rope_cos_sin(model, torch.tensor([p]), like)[0][0] for p in range(30, 46)])
    sin = torch.stack([rope_cos_sin(model, torch.tensor([p]), like)[1][0] for p in range(30, 46)])
    torch.testing.assert_close(avg_cos, cos.mean(0))
    torch.testing.assert_close(avg_sin, sin.mean(0))
    # the fastest RoPE pair (period ~6 tokens) is damped, the slowest is not
    assert abs(avg_cos[0]) < 0.2 and abs(avg_cos[7]) > 0.9


def test_qwen3_and_a_one_token_prompt(qwen3):
    reference = GVoteReference(qwen3, p_nuc=0.9)
    out = reference.generate(prompt(), 4)
    assert ((reference.kept_lengths >= 1) & (reference.kept_lengths <= PROMPT)).all()
    assert len(out.token_ids) == 4
    single = reference.generate([5], 3)  # no spread to fit: every sample is the mean
    assert (reference.kept_lengths == 1).all() and len(single.token_ids) == 3


def test_validation(model):
    for bad in ({"p_nuc": 0.0}, {"p_nuc": 1.5}, {"samples": 0}, {"future": 0}, {"samples": 2.0}):
        with pytest.raises(ValueError):
            GVoteReference(model, **bad)
    cache = ContiguousKVCache(2)
    with pytest.raises(ValueError, match="one mask per layer"):
        forward_step(model, [1, 2], cache, torch.arange(2), key_keep=[torch.ones(2, 2, dtype=torch.bool)])


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("p_nuc", [0.5, 0.9, 1.0])
def test_engine_vote_equals_reference(group, p_nuc):
    """The engine's vote (`GVotePolicy`: one top-k at the largest budget) and the
    reference's (rank-based, as the paper's listing) choose the same keys."""
    from vllm_kvprune.policies.gvote import GVotePolicy
    from vllm_kvprune.reference.gvote import nucleus_budgets, vote_keep_mask

    generator = torch.Generator().manual_seed(group * 100 + int(p_nuc * 10))
    kv_heads, num_keys, head_dim, samples = 2, 57, 16, 5
    keys = torch.randn(kv_heads, num_keys, head_dim, generator=generator)
    query = 2 * torch.randn(kv_heads * group, head_dim, generator=generator)
    synthetic = torch.randn(samples, kv_heads * group, head_dim, generator=generator)
    scale = head_dim ** -0.5
    budgets = GVotePolicy.step_budgets(query, keys, scale, p_nuc)
    assert torch.equal(budgets, nucleus_budgets(query, keys, scale, p_nuc))
    assert torch.equal(GVotePolicy.keep_mask(synthetic, keys, budgets, scale),
                       vote_keep_mask(synthetic, keys, budgets, scale))
