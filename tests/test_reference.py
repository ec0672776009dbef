"""Tests of the StreamingLLM reference (the oracle the engine is tested against).

Fast tests build a tiny random Llama in-process.  Three independent checks back the reference:

* with nothing evicted it equals Hugging Face's own incremental decode (``DynamicCache``);
* with eviction and ``positions="original"`` it equals one Hugging Face forward over the whole
  sequence with a custom 4D mask in which row i allows exactly the tokens token i attended to
  when it was processed (a token's K/V depend only on its own mask row and, recursively, on the
  rows of the tokens it sees, so one masked forward reproduces the incremental run exactly);
* in both position modes it equals a deliberately simple implementation below (a python list of
  per-token ``(position, per-layer k, v)`` entries, a token-at-a-time loop, its own RoPE and
  per-head attention, and a ``list.pop`` eviction loop).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from vllm_kvprune.reference import (  # noqa: E402
    ContiguousKVCache,
    StreamingLLMReference,
    forward_step,
    lowest_scores_first,
)

LP_TOL = 1e-4
VOCAB = 512


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices (conftest)


def make_tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """Random Llama: 3 layers, hidden 128, 4 q heads / 2 kv heads (GQA), head_dim 32.  Larger
    init std and a scaled lm_head so attention is far from uniform and greedy logits are not
    near-ties."""
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        initializer_range=0.15, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("eager")
    model.eval()
    model.requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return make_tiny_model()


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------
# independent checks
# ---------------------------------------------------------------------------------------------


def hf_incremental(model, ids: list[int], n_new: int):
    """Greedy decode with Hugging Face's own forward and DynamicCache."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        plp = torch.log_softmax(out.logits[0].float(), -1)
        prompt_lp = [None] + [float(plp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
        logits = out.logits[0, -1].float()
        toks, lps = [], []
        for t in range(n_new):
            tok = int(logits.argmax())
            toks.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            if t == n_new - 1:
                break
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[0, -1].float()
    return toks, lps, prompt_lp


def chunks_of(prompt_len: int, prefill: str, chunk: int) -> list[int]:
    if prefill == "full":
        return [prompt_len]
    return [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)]


def simulate_visible(total: int, steps: list[int], budget, sinks: int, interval: int):
    """Positions each token attends to (itself included), and the decode kept sizes, from the
    rule applied to a plain python list of positions."""
    cache: list[int] = []
    rows: list[list[int]] = []
    sizes: list[int] = []
    p = 0
    for q in steps:
        if budget is not None and len(cache) + q > budget + interval - 1 and len(cache) > budget - 1:
            while len(cache) > budget - 1:
                cache.pop(sinks)
        chunk = list(range(p, p + q))
        for i in range(q):
            rows.append(cache + chunk[: i + 1])
        cache += chunk
        sizes.append(len(cache))
        p += q
    assert p == total
    return rows, sizes


def masked_full_forward(model, seq: list[int], rows: list[list[int]]) -> torch.Tensor:
    """One Hugging Face forward over ``seq`` where token i sees exactly ``rows[i]``."""
    t = len(seq)
    mask = torch.full((1, 1, t, t), torch.finfo(torch.float32).min)
    for i, row in enumerate(rows):
        mask[0, 0, i, row] = 0.0
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), attention_mask=mask, position_ids=torch.arange(t)[None])
    return out.logits[0].float()


class ListStreaming:
    """Deliberately simple StreamingLLM: a python list of per-token entries, one token at a time.

    Each entry holds the token's absolute position and, per layer, its K (post-RoPE at the
    absolute position for "original", raw for "cache") and V.  Eviction pops the oldest non-sink
    entry until the rule is met.  In "cache" mode keys are rotated at their list index at every
    use and the query at its own list index.  RoPE and attention are written out per head here.
    """

    def __init__(self, model, budget, sinks, interval, positions, prefill, chunk):
        self.m, self.b, self.s, self.r = model, budget, sinks, interval
        self.positions, self.prefill, self.chunk = positions, prefill, chunk
        cfg = model.config
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = cfg.head_dim
        theta = cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.d, 2).float() / self.d))

    def rope(self, x: torch.Tensor, pos) -> torch.Tensor:  # x [..., n, d] or [d]; pos int or [n]
        ang = torch.as_tensor(pos, dtype=torch.float32)[..., None] * self.inv_freq
        c, s = ang.cos(), ang.sin()
        half = self.d // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def evict_for(self, q: int) -> None:
        if self.b is not None and len(self.entries) + q > self.b + self.r - 1 and len(self.entries) > self.b - 1:
            while len(self.entries) > self.b - 1:
                self.entries.pop(self.s)

    def token(self, tok: int) -> torch.Tensor:
        m = self.m.model
        h = m.embed_tokens.weight[tok]
        entry = {"pos": self.pos, "k": [], "v": []}
        self.entries.append(entry)
        me = len(self.entries) - 1
        qpos = self.pos if self.positions == "original" else me
        group = self.hq // self.hkv
        for li, layer in enumerate(m.layers):
            at = layer.self_attn
            x = layer.input_layernorm(h)
            q = self.rope(at.q_proj(x).view(self.hq, self.d), qpos)
            k = at.k_proj(x).view(self.hkv, self.d)
            v = at.v_proj(x).view(self.hkv, self.d)
            entry["k"].append(self.rope(k, self.pos) if self.positions == "original" else k)
            entry["v"].append(v)
            heads = []
            for hh in range(self.hq):
                g = hh // group
                keys = torch.stack([e["k"][li][g] for e in self.entries])
                if self.positions == "cache":
                    keys = self.rope(keys, torch.arange(len(self.entries)))
                vals = torch.stack([e["v"][li][g] for e in self.entries])
                w = torch.softmax(keys @ q[hh] / math.sqrt(self.d), dim=0)
                heads.append(w @ vals)
            h = h + at.o_proj(torch.cat(heads))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.pos += 1
        return self.m.lm_head(m.norm(h)).float()

    @torch.no_grad()
    def generate(self, ids: list[int], n_new: int):
        self.entries, self.pos = [], 0
        prompt_lp: list[float | None] = [None]
        logits = None
        i = 0
        for q in chunks_of(len(ids), self.prefill, self.chunk):
            self.evict_for(q)
            for tok in ids[i : i + q]:
                if logits is not None:
                    prompt_lp.append(float(torch.log_softmax(logits, -1)[tok]))
                logits = self.token(tok)
            i += q
        toks, lps, sizes = [], [], []
        for t in range(n_new):
            tok = int(logits.argmax())
            toks.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            if t == n_new - 1:
                break
            self.evict_for(1)
            logits = self.token(tok)
            sizes.append(len(self.entries))
        return toks, lps, prompt_lp, sizes


def assert_close_lists(a, b, tol=LP_TOL, what=""):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, (what, i)
        else:
            assert abs(x - y) <= tol, f"{what}[{i}]: {x} vs {y}"


def assert_same_generation(ref_out, toks, lps, what=""):
    if ref_out.token_ids != toks:
        i = next(j for j, (a, b) in enumerate(zip(ref_out.token_ids, toks)) if a != b)
        pytest.fail(f"{what}: tokens differ at {i} (reference margin {ref_out.margins[i]:.4g})")
    assert_close_lists(ref_out.logprobs, lps, what=what + " logprobs")


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(budget=None),
        dict(budget=200, sinks=4),
        dict(budget=None, positions="cache"),
        dict(budget=200, sinks=4, positions="cache", prefill="streaming", prefill_chunk=7),
    ],
    ids=["none", "big-budget", "none-cache-pos", "big-budget-cache-streaming"],
)
def test_matches_hf_without_eviction(model, kw):
    ids = prompt(30)
    toks, lps, plp = hf_incremental(model, ids, 40)
    out = StreamingLLMReference(model, **kw).generate(ids, 40)
    assert_same_generation(out, toks, lps, str(kw))
    assert_close_lists(out.prompt_logprobs, plp, what="prompt logprobs")
    assert min(out.margins) > 1e-3  # the tiny model is not tie-prone
    assert out.kept_sizes == list(range(31, 31 + 39))


@pytest.mark.parametrize("interval", [1, 8])
@pytest.mark.parametrize("prefill", ["full", "streaming"])
@pytest.mark.parametrize("plen", [10, 40])
def test_kept_sizes_follow_rule(model, interval, prefill, plen):
    budget, sinks, chunk, n_new = 16, 4, 6, 30
    ref = StreamingLLMReference(model, budget=budget, sinks=sinks, prune_interval=interval,
                                prefill=prefill, prefill_chunk=chunk)
    out = ref.generate(prompt(plen), n_new)
    steps = chunks_of(plen, prefill, chunk) + [1] * (n_new - 1)
    _, sizes = simulate_visible(plen + n_new - 1, steps, budget, sinks, interval)
    n_prefill_steps = len(chunks_of(plen, prefill, chunk))
    assert out.kept_sizes == sizes[n_prefill_steps:]
    # closed forms
    if interval == 1:
        assert out.kept_sizes == [min(plen + t + 1, budget) for t in range(n_new - 1)]
    else:
        assert max(out.kept_sizes) == budget + interval - 1
        tail = out.kept_sizes[-2 * interval:]
        assert sorted(set(tail)) == list(range(budget, budget + interval))
        # every drop goes back to exactly B
        for a, b in zip(out.kept_sizes, out.kept_sizes[1:]):
            assert b == a + 1 or b == budget
    # and the cache really holds the sinks plus the most recent tokens
    kept = ref.cache.token_positions()
    last = plen + n_new - 2
    assert kept[:sinks] == list(range(sinks))
    assert kept[sinks:] == list(range(last - len(kept) + sinks + 1, last + 1))
    for layer in range(ref.num_layers):
        assert ref.cache.k[layer].shape == (2, len(kept), 32)


CASES = [
    # budget, sinks, interval, prefill, chunk, prompt length
    (16, 4, 1, "full", 1, 40),
    (16, 4, 8, "streaming", 6, 40),
    (12, 0, 3, "streaming", 1, 20),
    (16, 2, 1, "full", 1, 10),
    (10, 9, 2, "streaming", 25, 30),  # S = B - 1, chunk longer than B
]


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}S{c[1]}R{c[2]}-{c[3]}{c[4]}-P{c[5]}" for c in CASES])
def test_original_positions_equal_masked_full_forward(model, case):
    budget, sinks, interval, prefill, chunk, plen = case
    n_new = 35
    ids = prompt(plen, seed=plen)
    out = StreamingLLMReference(model, budget=budget, sinks=sinks, prune_interval=interval,
                                prefill=prefill, prefill_chunk=chunk).generate(ids, n_new)
    seq = ids + out.token_ids[:-1]
    steps = chunks_of(plen, prefill, chunk) + [1] * (n_new - 1)
    rows, _ = simulate_visible(len(seq), steps, budget, sinks, interval)
    assert any(len(r) < i + 1 for i, r in enumerate(rows)), "case must evict"
    logits = masked_full_forward(model, seq, rows)
    lp = torch.log_softmax(logits, -1)
    toks = [int(x) for x in logits[plen - 1 :].argmax(-1)]
    lps = [float(lp[plen - 1 + t, toks[t]]) for t in range(n_new)]
    assert_same_generation(out, toks, lps, f"masked {case}")
    plp = [None] + [float(lp[i, ids[i + 1]]) for i in range(plen - 1)]
    assert_close_lists(out.prompt_logprobs, plp, what="prompt logprobs")

    # eviction is real: the full-cache run differs
    full = StreamingLLMReference(model, budget=None).generate(ids, n_new)
    differs = full.token_ids != out.token_ids or max(abs(a - b) for a, b in zip(full.logprobs, out.logprobs)) > 1e-2
    assert differs


LIST_CASES = [
    (16, 4, 1, "original", "full", 1, 30),
    (16, 4, 1, "cache", "full", 1, 30),
    (12, 4, 5, "cache", "streaming", 4, 30),
    (12, 2, 1, "cache", "streaming", 1, 20),
    (8, 7, 3, "cache", "streaming", 11, 20),
]


@pytest.mark.parametrize("case", LIST_CASES, ids=[f"B{c[0]}S{c[1]}R{c[2]}-{c[3]}-{c[4]}{c[5]}" for c in LIST_CASES])
def test_equals_simple_list_implementation(model, case):
    budget, sinks, interval, positions, prefill, chunk, plen = case
    n_new = 30
    ids = prompt(plen, seed=7)
    kw = dict(budget=budget, sinks=sinks, prune_interval=interval, positions=positions,
              prefill=prefill, prefill_chunk=chunk)
    out = StreamingLLMReference(model, **kw).generate(ids, n_new)
    toks, lps, plp, sizes = ListStreaming(model, budget, sinks, interval, positions, prefill, chunk).generate(ids, n_new)
    assert_same_generation(out, toks, lps, f"list {case}")
    assert_close_lists(out.prompt_logprobs, plp, what="prompt logprobs")
    assert out.kept_sizes == sizes


def test_cache_positions_vs_original(model):
    ids, n_new = prompt(24, seed=3), 40

    def run(**kw):
        return StreamingLLMReference(model, **kw).generate(ids, n_new)

    # nothing evicted: identical
    a, b = run(budget=100, positions="original"), run(budget=100, positions="cache")
    assert_same_generation(a, b.token_ids, b.logprobs, "no eviction")
    # sinks + eviction: the sinks' distances differ, so the outputs differ
    a, b = run(budget=12, sinks=4, positions="original"), run(budget=12, sinks=4, positions="cache")
    assert a.token_ids != b.token_ids or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-2
    # no sinks: the kept window is contiguous, relative distances are the same in both modes
    for kw in (dict(prune_interval=1), dict(prune_interval=4, prefill="streaming", prefill_chunk=5)):
        a = run(budget=12, sinks=0, positions="original", **kw)
        b = run(budget=12, sinks=0, positions="cache", **kw)
        assert_same_generation(a, b.token_ids, b.logprobs, f"S=0 {kw}")
        assert_close_lists(a.prompt_logprobs, b.prompt_logprobs, what="S=0 prompt logprobs")
        full = run(budget=None)
        assert full.token_ids != a.token_ids or max(abs(x - y) for x, y in zip(full.logprobs, a.logprobs)) > 1e-2


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize("interval", [1, 4])
def test_streaming_prefill_c1_equals_token_by_token(model, positions, interval):
    ids = prompt(40, seed=11)
    kw = dict(budget=12, sinks=4, prune_interval=interval, positions=positions)
    out = StreamingLLMReference(model, prefill="streaming", prefill_chunk=1, **kw).generate(ids, 3)
    # decode the prompt one token at a time through the public step() API
    ref = StreamingLLMReference(model, **kw)
    ref.reset()
    lps: list[float | None] = [None]
    for i, tok in enumerate(ids):
        h = ref.step([tok]).hidden
        logits = ref.model.lm_head(h[-1]).float()
        if i + 1 < len(ids):
            lps.append(float(torch.log_softmax(logits, -1)[ids[i + 1]]))
    assert_close_lists(out.prompt_logprobs, lps, tol=1e-6, what="prompt logprobs")
    assert out.token_ids[0] == int(logits.argmax())
    # and the streaming prompt logprobs differ from the full-prefill ones (eviction is real)
    full = StreamingLLMReference(model, prefill="full", **kw).generate(ids, 1)
    assert max(abs(a - b) for a, b in zip(full.prompt_logprobs[1:], out.prompt_logprobs[1:])) > 1e-2


def test_attention_probabilities_match_hf(model):
    ids = prompt(12)
    cache = ContiguousKVCache(model.config.num_hidden_layers)
    out = forward_step(model, ids[:8], cache, torch.arange(8), output_attentions=True)
    out2 = forward_step(model, ids[8:], cache, torch.arange(8, 12), output_attentions=True)
    with torch.no_grad():
        hf = model(input_ids=torch.tensor([ids]), output_attentions=True)
    for layer in range(model.config.num_hidden_layers):
        a = hf.attentions[layer][0]  # [Hq, 12, 12]
        assert torch.allclose(out.attentions[layer], a[:, :8, :8], atol=1e-5)
        assert torch.allclose(out2.attentions[layer], a[:, 8:, :], atol=1e-5)
        assert torch.allclose(out2.attentions[layer].sum(-1), torch.ones(4, 4), atol=1e-5)
    logits = model.lm_head(out2.hidden).float()
    assert torch.allclose(logits, hf.logits[0, 8:].float(), atol=1e-4)


def test_cache_keep_preserves_order_and_supports_heads():
    cache = ContiguousKVCache(2)
    for layer in range(2):
        k = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
        cache.append(layer, k, -k, torch.arange(6))
    cache.keep(torch.tensor([4, 0, 2]))  # any order in, cache order out
    assert cache.token_positions() == [0, 2, 4]
    assert torch.equal(cache.k[1][0, :, 0], torch.tensor([0.0, 6.0, 12.0]))
    cache.keep(torch.tensor([[2, 0], [1, 2]]))  # per KV head
    assert cache.token_positions(0, 0) == [0, 4] and cache.token_positions(0, 1) == [2, 4]
    assert torch.equal(cache.v[0][1, :, 0], -torch.tensor([24.0, 30.0]))
    assert len(cache) == 2
    cache.append(0, torch.zeros(2, 1, 3), torch.zeros(2, 1, 3), torch.tensor([9]))
    with pytest.raises(RuntimeError):
        len(cache)


def test_tie_rule_oldest_first():
    order = lowest_scores_first(torch.tensor([3.0, 1.0, 1.0, 0.5, 1.0]))
    assert order.tolist() == [3, 1, 2, 4, 0]


def test_validation(model):
    with pytest.raises(ValueError):
        StreamingLLMReference(model, budget=4, sinks=4)
    with pytest.raises(ValueError):
        StreamingLLMReference(model, budget=8, prune_interval=0)
    with pytest.raises(ValueError):
        StreamingLLMReference(model, budget=8, positions="relative")
    with pytest.raises(ValueError):
        StreamingLLMReference(model, budget=8, prefill="chunked")
    out = StreamingLLMReference(model, budget=1, sinks=0).generate(prompt(5), 4)
    assert out.kept_sizes == [1, 1, 1]


# ---------------------------------------------------------------------------------------------
# slow: the real model (needs tools.assets and the converted SmolLM2 folder)
# ---------------------------------------------------------------------------------------------


def _asset_dir(name: str):
    try:
        from tools import assets  # type: ignore
    except Exception:
        return None
    try:
        path = getattr(assets, name)()
    except Exception:
        return None
    return path if path and os.path.isdir(str(path)) else None


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny_model_dir", "real_model_dir"])
def test_assets_model_matches_hf_and_masked(which):
    path = _asset_dir(which)
    if path is None:
        pytest.skip(f"assets.{which}() not available")
    from vllm_kvprune.reference import load_reference_model

    m = load_reference_model(path)
    ids = prompt(40, seed=5)
    ids = [i % m.config.vocab_size for i in ids]
    toks, lps, _ = hf_incremental(m, ids, 24)
    out = StreamingLLMReference(m, budget=None).generate(ids, 24)
    assert_same_generation(out, toks, lps, f"{which} no eviction")
    budget, sinks, interval = 24, 4, 4
    out = StreamingLLMReference(m, budget=budget, sinks=sinks, prune_interval=interval).generate(ids, 24)
    seq = ids + out.token_ids[:-1]
    rows, _ = simulate_visible(len(seq), [40] + [1] * 23, budget, sinks, interval)
    lp = torch.log_softmax(masked_full_forward(m, seq, rows), -1)
    toks = [int(x) for x in lp[39:].argmax(-1)]
    assert_same_generation(out, toks, [float(lp[39 + t, toks[t]]) for t in range(24)], f"{which} masked")
