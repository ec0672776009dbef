"""The GPU attention backend with KV policies over vLLM's TRITON_ATTN (NVIDIA and AMD).

The planning and the work around the kernel are the shared ones (`policy_attention.py`,
`gpu_backend.py`: the physical lengths on the device, no full CUDA graphs of a policy's
attention, the HND layout for head-pages and FDC). What is TRITON_ATTN's own: head-pages
attend each (request, KV head) as its own sequence through vLLM's 2D unified-attention
kernel (the 3D one's scratch is sized for the model's rows, not H times as many).

Which policies run here: those whose `gpu` trait is set (`vllm_kvprune/policies/`). Their score tables (h2o's attention mass,
paged_eviction's token scores) live beside the cache on the device and are written there
in every layer; the victims are chosen when the step is planned (h2o's on the device for
the whole step, one copy back: `kernels/victims.py`). fdc's packed narrow rows are written and read by torch
indexing (`PackedHeads`) and attended by our Triton kernel (`TritonKernels.reduced_attention`).
"""

from __future__ import annotations

import dataclasses

from vllm_kvprune.vllm_hooks import TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadataBuilder
from vllm_kvprune.worker.gpu_backend import DeviceMetadataBuilder, DevicePolicyBackend, DevicePolicyImpl


class KVPruneTritonMetadataBuilder(DeviceMetadataBuilder, TritonAttentionMetadataBuilder):
    """Builds TRITON_ATTN metadata over each request's physical slots."""


class KVPruneTritonImpl(DevicePolicyImpl, TritonAttentionImpl):
    """Executes the step plan in one layer around vLLM's Triton kernels, with ours."""

    def page_metadata(self, attn_metadata, pages, layer_index: int):
        # vLLM's 2D kernel: the 3D (split-keys) one's scratch is sized for the model's rows.
        return dataclasses.replace(super().page_metadata(attn_metadata, pages, layer_index), seq_threshold_3D=None)


class KVPruneTritonBackend(DevicePolicyBackend, TritonAttentionBackend):
    """TRITON_ATTN with KV policies."""

    builder_cls = KVPruneTritonMetadataBuilder
    impl_cls = KVPruneTritonImpl


__all__ = ["KVPruneTritonBackend", "KVPruneTritonImpl", "KVPruneTritonMetadataBuilder"]
