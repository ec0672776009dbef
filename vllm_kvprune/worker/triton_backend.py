"""The GPU attention backend with KV policies: vLLM's TRITON_ATTN, given a physical view.

The same planning and the same work around the kernel as the CPU wrapper
(`policy_attention.py`); what is the GPU's own:

- the kernel set: our Triton kernels (`TritonKernels`) move, write and read tokens in vLLM's
  GPU cache layout; vLLM's own Triton kernels write the new tokens and attend;
- the physical lengths go to the device through a buffer the builder owns, written in place
  each step (a fixed address: nothing the step hands vLLM changes shape or place);
- CUDA graphs: vLLM captures full graphs only of steps whose attention metadata it can
  replay. Our impl runs host logic around the kernel (the plan's moves, sink re-anchoring),
  so the policy's layers declare `AttentionCGSupport.NEVER`; vLLM then runs attention
  eagerly between piecewise graphs of the rest of the model (its `PIECEWISE` mode), and
  the slot mapping and lengths it reads are filled in place before each step. With no
  policy the builder reports vLLM's own support, unchanged.

Which policies run here: `plugin.GPU_POLICIES`. Their score tables (h2o's attention mass,
paged_eviction's token scores) live beside the cache on the device and are written there
in every layer; the victims are chosen on the host when the step is planned, from only the
planned requests' slots copied back. gvote's head-pages need each block's KV heads
outermost (`[num_blocks * H, 1, block_size, 2D]` must be a view), so with a head-page
policy the backend asks vLLM for the HND layout (`LBHNC`); vLLM's unified attention reads
strides, and attends each (request, KV head) as its own sequence through its 2D kernel
(the 3D one's scratch is sized for the model's rows, not H times as many). fdc (its packed
layout) asks for the same layout: its packed narrow rows view each block as one row, written
and read by torch indexing (`PackedHeads`) and attended by our Triton kernel
(`TritonKernels.reduced_attention`).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_kvprune import vllm_hooks
from vllm_kvprune.config import policy_from_vllm_config
from vllm_kvprune.engine.spec import KVPruneSpec
from vllm_kvprune.vllm_hooks import (
    AttentionCGSupport,
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from vllm_kvprune.worker import runtime
from vllm_kvprune.worker.kernel_sets import TritonKernels
from vllm_kvprune.worker.policy_attention import PlannedMetadataBuilder, PolicyAttentionImpl, PolicyBackend
from vllm_kvprune.worker.state import StepPlan


class KVPruneTritonMetadataBuilder(PlannedMetadataBuilder, TritonAttentionMetadataBuilder):
    """Builds TRITON_ATTN metadata over each request's physical slots."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # One row per request the scheduler may run: the physical lengths vLLM's kernel reads.
        self.physical_seq_lens = torch.zeros(vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32,
                                             device=device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if policy_from_vllm_config(vllm_config).active and isinstance(kv_cache_spec, KVPruneSpec):
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def _place(self, plan: StepPlan) -> StepPlan:
        return plan.to_device(self.device)

    def _physical_seq_lens(self, plan: StepPlan) -> torch.Tensor:
        num_rows = len(plan.seq_lens)
        lengths = self.physical_seq_lens[:num_rows]
        lengths.copy_(plan.seq_lens, non_blocking=True)
        return lengths

    def _schedule_pages(self, pages) -> None:
        """vLLM's Triton kernel needs no schedule of its own for the head-page sequences."""


class KVPruneTritonImpl(PolicyAttentionImpl, TritonAttentionImpl):
    """Executes the step plan in one layer around vLLM's Triton kernels, with ours."""

    kernels = TritonKernels()

    def _page_metadata(self, attn_metadata, pages, layer_index: int):
        # vLLM's 2D kernel: the 3D (split-keys) one's scratch is sized for the model's rows.
        return dataclasses.replace(super()._page_metadata(attn_metadata, pages, layer_index), seq_threshold_3D=None)


class KVPruneTritonBackend(PolicyBackend, TritonAttentionBackend):
    """TRITON_ATTN with KV policies."""

    builder_cls = KVPruneTritonMetadataBuilder
    impl_cls = KVPruneTritonImpl

    @classmethod
    def supported_kv_cache_layouts(cls):
        """HND (`LBHNC`) under a head-page policy, whose view needs a block's heads outermost,
        and under FDC, whose packed rows view each block as one row (`fdc_layers.blocks_of`);
        otherwise vLLM's choice. Asked in the worker once the model is loaded."""
        worker_state = runtime.worker_state()
        if worker_state is not None and worker_state.engine_config.active and (
                worker_state.engine_config.narrow_heads or worker_state.policy.granularity == "headpage"):
            return (vllm_hooks.KVCacheLayout.LBHNC,)
        return super().supported_kv_cache_layouts()


__all__ = ["KVPruneTritonBackend", "KVPruneTritonImpl", "KVPruneTritonMetadataBuilder"]
