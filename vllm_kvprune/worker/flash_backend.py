"""The GPU attention backend with KV policies over vLLM's FLASH_ATTN.

FLASH_ATTN addresses the cache TRITON_ATTN does (the same logical shape, K then V in the last
dimension, NHD or HND strides), so the shared planning, the impl's work and our Triton
kernels (`gpu_backend.py`) serve it unchanged; vLLM's FlashAttention kernels write the new
tokens into the planned slots and attend over the physical lengths. What is FLASH_ATTN's own:

- FA3's ahead-of-time scheduler metadata is computed by vLLM's builder for the step's rows,
  over the physical lengths (which it reads from the metadata we hand it). Head-pages attend
  `num_kv_heads` times as many sequences with other lengths, so their metadata carries none
  and FA schedules them itself;
- FA's split count stays vLLM's (0, its own heuristic: there are no full CUDA graphs of a
  policy's attention, so none is preallocated).

Refused at start-up: decode context parallelism (`plugin.py`, for every backend), and FA4's
head-size-256 kernel (Blackwell), which wants exact-width block tables and page-aligned
lengths that the policies' per-layer tables and head-pages were not built for
(`KVPruneFlashImpl.policy_refusal`, read by the worker's feature check).
"""

from __future__ import annotations

import dataclasses

from vllm_kvprune.vllm_hooks import FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadataBuilder
from vllm_kvprune.worker.gpu_backend import DeviceMetadataBuilder, DevicePolicyBackend, DevicePolicyImpl


class KVPruneFlashMetadataBuilder(DeviceMetadataBuilder, FlashAttentionMetadataBuilder):
    """Builds FLASH_ATTN metadata over each request's physical slots."""


class KVPruneFlashImpl(DevicePolicyImpl, FlashAttentionImpl):
    """Executes the step plan in one layer around vLLM's FlashAttention kernels, with ours."""

    def policy_refusal(self) -> str | None:
        """What this layer's FA kernel would run that the policies do not honour (None: nothing)."""
        return "FlashAttention 4's head-size-256 kernel" if self.fa4_hd256 else None

    def page_metadata(self, attn_metadata, pages, layer_index: int):
        # The step's FA3 schedule is for its rows; the head-page sequences are scheduled by FA.
        return dataclasses.replace(super().page_metadata(attn_metadata, pages, layer_index), scheduler_metadata=None)


class KVPruneFlashBackend(DevicePolicyBackend, FlashAttentionBackend):
    """FLASH_ATTN with KV policies."""

    builder_cls = KVPruneFlashMetadataBuilder
    impl_cls = KVPruneFlashImpl


__all__ = ["KVPruneFlashBackend", "KVPruneFlashImpl", "KVPruneFlashMetadataBuilder"]
