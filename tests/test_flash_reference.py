"""The torch references of FlashAttention's two ops (`support/flash_reference.py`), which stand in
for vLLM's FLASH_ATTN kernels when the FLASH_ATTN wrapper runs in a CPU engine
(`test_gpu_wrapper.py`): checked against our own kernel references on the same cache, through
the very views FLASH_ATTN's impl makes of it."""

from __future__ import annotations

import pytest
import torch

from support.flash_reference import flash_attn_varlen_reference, reshape_and_cache_flash_reference
from vllm_kvprune.kernels import reference
from vllm_kvprune.kernels.layout import gpu_layout

NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, GROUP = 12, 2, 4, 8, 3


def _cache(hnd: bool) -> torch.Tensor:
    """A layer cache `[num_blocks, H, block_size, 2D]` with NHD or HND strides, as vLLM lays it out."""
    if hnd:
        return torch.randn(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE).transpose(1, 2)


def _views(kv_cache: torch.Tensor):
    """FLASH_ATTN's impl: `(B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D))`."""
    return kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)


@pytest.mark.parametrize("hnd", [False, True])
def test_the_cache_write_reference_writes_what_ours_writes(hnd):
    torch.manual_seed(0)
    cache = _cache(hnd)
    expected = cache.contiguous().clone()  # our references read a contiguous (HND) cache
    key, value = torch.randn(7, NUM_KV_HEADS, HEAD_SIZE), torch.randn(7, NUM_KV_HEADS, HEAD_SIZE)
    slots = torch.tensor([5, 0, -1, 47, 13, 22])  # one token of padding past the slots, one -1
    reshape_and_cache_flash_reference(key, value, *_views(cache), slots, "auto")
    real = slots >= 0
    reference.write_slots(key[:6][real], value[:6][real], expected, slots[real],
                          gpu_layout(cache.dtype, BLOCK_SIZE, HEAD_SIZE))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_the_attention_reference_attends_as_our_mass_reference(hnd, softcap):
    """A prompt from its start, a later chunk and a decode token in one batch: each query sees
    its row's keys up to its own position (queries aligned to the end of the keys)."""
    torch.manual_seed(1)
    cache = _cache(hnd)
    query_lens, seq_lens = [5, 3, 1], [5, 11, 9]
    block_table = torch.randperm(NUM_BLOCKS)[:9].view(3, 3).int()
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), NUM_KV_HEADS * GROUP, HEAD_SIZE)
    out = torch.empty_like(query)
    keys, values = _views(cache)
    flash_attn_varlen_reference(q=query, k=keys, v=values, out=out, cu_seqlens_q=starts,
                                seqused_k=torch.tensor(seq_lens, dtype=torch.int32), block_table=block_table,
                                softmax_scale=0.3, causal=True, softcap=softcap, window_size=[-1, -1],
                                max_seqlen_q=5, max_seqlen_k=11, fa_version=2)
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    key_counts = torch.cat([torch.arange(s - q + 1, s + 1) for q, s in zip(query_lens, seq_lens)])
    expected = torch.empty_like(query)
    mass = torch.zeros(NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE)
    reference.attention_mass(query, cache.contiguous(), gpu_layout(cache.dtype, BLOCK_SIZE, HEAD_SIZE), block_table, rows,
                             key_counts, 0.3, mass, expected, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_references_refuse_what_they_do_not_implement():
    cache = _cache(False)
    keys, values = _views(cache)
    query = torch.randn(1, NUM_KV_HEADS, HEAD_SIZE)
    common = dict(q=query, k=keys, v=values, out=torch.empty_like(query), cu_seqlens_q=torch.tensor([0, 1]),
                  seqused_k=torch.tensor([1]), block_table=torch.zeros(1, 1, dtype=torch.int32), softmax_scale=1.0)
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_attn_varlen_reference(**common, window_size=[3, 0])
    with pytest.raises(NotImplementedError, match="s_aux"):
        flash_attn_varlen_reference(**common, s_aux=torch.zeros(NUM_KV_HEADS))
    with pytest.raises(NotImplementedError, match="fp8"):
        reshape_and_cache_flash_reference(query, query, keys, values, torch.tensor([0]), "fp8")
