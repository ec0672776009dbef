"""FDC's reduced-space attention kernel (C++) against its torch reference, and the reference
against plain dense attention on each head's truncated dims.

Heads of unequal ranks packed in one row, blocks scattered over the pool, mixed batches of
prefill chunks (several queries after earlier context) and decodes, GQA groups 1 to 4, fp32
and bf16, the LPT and the static schedule."""

from __future__ import annotations

import pytest
import torch

from vllm_kvprune import kernels
from vllm_kvprune.kernels.reduced_attention import (
    PackedHeads,
    reduced_attention,
    reduced_attention_reference,
)

BLOCK = 32


def _case(seed: int, group: int, dtype: torch.dtype, query_counts=(5, 1, 1, 12), seq_lens=(20, 33, 1, 40),
          ranks=None):
    """Dense per-sequence keys/values ``[n, H, 32]`` (``[n, H, 64]`` with ``ranks``, the heads'
    K and V ranks) written into a cache of scattered blocks."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = 3
    k_ranks = torch.randint(4, 33, (num_heads,), generator=generator) if ranks is None else torch.tensor(ranks[0])
    v_ranks = torch.randint(4, 33, (num_heads,), generator=generator) if ranks is None else torch.tensor(ranks[1])
    dims = 32 if ranks is None else 64
    heads = PackedHeads.from_ranks(k_ranks, v_ranks)
    width = -(-max(seq_lens) // BLOCK)
    num_blocks = len(seq_lens) * width + 3
    order = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * width]
    block_table = order.view(len(seq_lens), width).to(torch.int32)
    cache = torch.full((num_blocks, BLOCK * heads.row_width), float("nan")).to(dtype)  # unwritten = NaN
    dense = []
    for s, seq_len in enumerate(seq_lens):
        keys = torch.randn(seq_len, num_heads, dims, generator=generator).to(dtype)
        values = torch.randn(seq_len, num_heads, dims, generator=generator).to(dtype)
        positions = torch.arange(seq_len)
        heads.write(cache, block_table[s, positions // BLOCK].long() * BLOCK + positions % BLOCK, keys, values)
        dense.append((keys.float(), values.float()))
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(query_counts), 0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads * group, max(40, dims), generator=generator).to(dtype)
    return query, cache, block_table, starts, torch.tensor(seq_lens, dtype=torch.int32), heads, dense


def _dense(query, starts, heads, dense, scale):
    """Scaled-dot-product attention on each head's truncated dense K/V, causal."""
    group = query.shape[1] // heads.num_heads
    out = torch.zeros(query.shape[0], query.shape[1], 40)
    for s, (keys, values) in enumerate(dense):
        first, last = int(starts[s]), int(starts[s + 1])
        for q_head in range(query.shape[1]):
            h = q_head // group
            kr, vr = int(heads.k_ranks[h]), int(heads.v_ranks[h])
            for i, t in enumerate(range(first, last)):
                visible = keys.shape[0] - (last - first) + i + 1
                logits = keys[:visible, h, :kr] @ query[t, q_head, :kr].float() * scale
                out[t, q_head, :vr] = torch.softmax(logits, 0) @ values[:visible, h, :vr]
    return out


@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_equals_dense_attention_on_truncated_heads(group: int) -> None:
    query, cache, table, starts, lens, heads, dense = _case(group, group, torch.float32)
    expected = _dense(query, starts, heads, dense, 0.2)
    got = reduced_attention_reference(query, cache, table, starts, lens, heads, 0.2, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernels.HAS_EXTENSION, reason="needs the C++ extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("balanced", [True, False])
def test_kernel_matches_reference(dtype: torch.dtype, group: int, balanced: bool) -> None:
    query, cache, table, starts, lens, heads, _ = _case(7 + group, group, dtype)
    expected = reduced_attention_reference(query, cache, table, starts, lens, heads, 0.125, 36)
    got = reduced_attention(query, cache, table, starts, lens, heads, 0.125, 36, balanced=balanced)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not kernels.HAS_EXTENSION, reason="needs the C++ extension")
def test_kernel_decode_batch_with_many_tasks_and_zeroed_tail() -> None:
    counts = (1,) * 24
    lens = tuple(range(3, 3 + 24 * 7, 7))
    query, cache, table, starts, seq_lens, heads, _ = _case(11, 2, torch.float32, counts, lens)
    got = reduced_attention(query, cache, table, starts, seq_lens, heads, 0.3, 40)
    expected = reduced_attention_reference(query, cache, table, starts, seq_lens, heads, 0.3, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for h in range(heads.num_heads):  # dims past a head's V rank are zero, not garbage
        assert (got[:, 2 * h:2 * h + 2, int(heads.v_ranks[h]):] == 0).all()


@pytest.mark.skipif(not kernels.HAS_EXTENSION, reason="needs the C++ extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [3, 8, 9])
def test_kernel_decode_of_wide_heads_matches_reference(dtype: torch.dtype, group: int) -> None:
    """Decodes read keys and values in one pass (online softmax) when the group fits one pass's
    rows (8 on AVX-512, 4 on AVX2; 9 never does): ranks past 32 (two value chunks), sequences
    of many blocks, a last chunk cut mid-block, and a 1-token one."""
    ranks = ([64, 40, 33], [33, 64, 47])
    counts, lens = (1, 1, 1, 1), (300, 97, 1, 64)
    query, cache, table, starts, seq_lens, heads, _ = _case(5 + group, group, dtype, counts, lens, ranks)
    expected = reduced_attention_reference(query, cache, table, starts, seq_lens, heads, 0.125, 64)
    got = reduced_attention(query, cache, table, starts, seq_lens, heads, 0.125, 64)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_write_lays_keys_dims_major_and_values_token_major_per_block() -> None:
    heads = PackedHeads.from_ranks([2, 1], [1, 2])  # row width 6
    # Head by head: head 0's keys (2) and values (1), then head 1's keys (1) and values (2).
    assert heads.k_offsets.tolist() == [0, 3] and heads.v_offsets.tolist() == [2, 4] and heads.row_width == 6
    block = 2
    cache = torch.zeros(2, block * heads.row_width)
    key = torch.tensor([[[1.0, 2.0], [3.0, 0.0]], [[4.0, 5.0], [6.0, 0.0]]])  # [tokens 0-1, H, d]
    value = torch.tensor([[[7.0, 0.0], [8.0, 9.0]], [[10.0, 0.0], [11.0, 12.0]]])
    heads.write(cache, torch.tensor([2, 3]), key, value)  # block 1, tokens 0 and 1
    assert cache[0].eq(0).all()
    # head 0 keys: dim 0 of tokens (0, 1), dim 1 of tokens (0, 1); head 0 values: token 0,
    # token 1 (1 dim); head 1 keys: dim 0; head 1 values: token 0 (2 dims), token 1.
    assert cache[1].tolist() == [1, 4, 2, 5, 7, 10, 3, 6, 8, 9, 11, 12]
    keys, values = heads.read(cache, torch.tensor([3, 2]))
    assert keys[0].tolist() == [[4, 5], [1, 2]] and values[1].tolist() == [[11, 12], [8, 9]]


@pytest.mark.skipif(not kernels.HAS_EXTENSION, reason="needs the C++ extension")
@pytest.mark.parametrize("group", [2, 4, 9])
def test_kernel_prefill_tiles_of_queries_match_reference(group: int) -> None:
    """Long prefill chunks: queries in tiles of about 16 rows (query x group), partial last
    tiles, rows past 8 in a second pass (group 9: one query per tile, 8 + 1 rows)."""
    query, cache, table, starts, lens, heads, _ = _case(20 + group, group, torch.float32, (40, 1, 17), (70, 9, 17))
    expected = reduced_attention_reference(query, cache, table, starts, lens, heads, 0.2, 40)
    got = reduced_attention(query, cache, table, starts, lens, heads, 0.2, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
