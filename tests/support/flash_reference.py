"""Torch references of the two FlashAttention ops vLLM's FLASH_ATTN backend calls.

vLLM's CPU build has no FlashAttention kernels. Tests run vLLM's FLASH_ATTN backend classes
(its metadata builder and impl, with our policy wrapper in front) in a CPU engine by giving
them these in place of `flash_attn_varlen_func` and `reshape_and_cache_flash`
(`gpu_on_cpu.py`, under `KVPRUNE_TRITON_ON_CPU=FLASH_ATTN`). They implement what vLLM
relies on of the two ops, and refuse every option they do not implement:

- the cache is the views FLASH_ATTN's impl makes of a layer cache, `[num_blocks, block_size,
  num_kv_heads, head_size]` for keys and for values (any strides);
- a query sequence `b` is `q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`; it attends the first
  `seqused_k[b]` tokens of its blocks (`block_table[b]`), causally with the queries aligned
  to the end of the keys (query `i` of `n_q` sees keys `j <= seqused_k[b] - n_q + i`), heads
  grouped as GQA, logits scaled then soft-capped (`softcap * tanh(x / softcap)`).
"""

from __future__ import annotations

import torch


def flash_attn_varlen_reference(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                                softmax_scale: float, causal: bool = True, softcap: float = 0.0,
                                window_size: list[int] | None = None, alibi_slopes=None, s_aux=None,
                                dynamic_causal=None, mask_mod=None, **ignored) -> torch.Tensor:
    """Paged variable-length attention into `out` (`[tokens, num_heads, head_size]`); the
    other keyword arguments vLLM passes (lengths' maxima, descales, the FA3 schedule, split
    counts, the FA version) do not change the result of an unquantized cache."""
    unsupported = {"alibi_slopes": alibi_slopes, "s_aux": s_aux, "dynamic_causal": dynamic_causal,
                   "mask_mod": mask_mod}
    for name, given in unsupported.items():
        if given is not None:
            raise NotImplementedError(f"flash_attn_varlen_reference: {name} is not implemented")
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"flash_attn_varlen_reference: window_size {window_size} is not implemented")
    block_size, num_kv_heads, head_size = k.shape[1:]
    group = q.shape[1] // num_kv_heads
    starts, key_counts = cu_seqlens_q.tolist(), seqused_k.tolist()
    for row, key_count in enumerate(key_counts[: len(starts) - 1]):
        first, last = starts[row], starts[row + 1]
        if last == first:
            continue
        blocks = block_table[row, : -(-key_count // block_size)].long()
        keys = k[blocks].reshape(-1, num_kv_heads, head_size)[:key_count].float().repeat_interleave(group, 1)
        values = v[blocks].reshape(-1, num_kv_heads, head_size)[:key_count].float().repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", q[first:last].float(), keys) * softmax_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if causal:
            num_queries = last - first
            visible = torch.arange(key_count)[None, :] <= (key_count - num_queries + torch.arange(num_queries))[:, None]
            logits = logits.masked_fill(~visible.to(logits.device), float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), values).to(out.dtype)
    return out


def reshape_and_cache_flash_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                                      k_scale=None, v_scale=None) -> None:
    """Token `i`'s K/V (`[tokens, num_kv_heads, head_size]`) into slot `slot_mapping[i]` of the
    cache views (`slot = block * block_size + offset`); slot -1 (padding) is skipped, and the
    tokens past `len(slot_mapping)` too, as vLLM's op does."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"reshape_and_cache_flash_reference: kv_cache_dtype {kv_cache_dtype}")
    slots = slot_mapping.long()
    real = slots >= 0
    block_size = key_cache.shape[1]
    blocks, offsets = slots[real] // block_size, slots[real] % block_size
    key_cache[blocks, offsets] = key[: len(slots)][real].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[: len(slots)][real].to(value_cache.dtype)


__all__ = ["flash_attn_varlen_reference", "reshape_and_cache_flash_reference"]
