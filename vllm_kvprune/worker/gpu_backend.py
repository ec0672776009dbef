"""What vLLM's GPU attention backends share under a KV policy (TRITON_ATTN, FLASH_ATTN).

Both backends address the same cache (logical `[num_blocks, num_kv_heads, block_size,
2 * head_size]`, NHD or HND strides), so one kernel set serves both: our Triton kernels
(`TritonKernels`) move, write and read tokens, and vLLM's own kernels write the new tokens
and attend. A backend's file (`triton_backend.py`, `flash_backend.py`) puts these mixins in
front of vLLM's classes and adds only the metadata its own kernel reads for head-pages.

- the physical lengths go to the device through a buffer the builder owns, written in place
  each step (a fixed address: nothing the step hands vLLM changes shape or place);
- CUDA graphs: vLLM captures full graphs only of steps whose attention metadata it can
  replay. Our impl runs host logic around the kernel (the plan's moves, sink re-anchoring),
  so the policy's layers declare `AttentionCGSupport.NEVER`; vLLM then runs attention
  eagerly between piecewise graphs of the rest of the model (its `PIECEWISE` mode). With no
  policy the builder reports vLLM's own support, unchanged;
- layout: gvote's head-pages need each block's KV heads outermost (`[num_blocks * H, 1,
  block_size, 2D]` must be a view) and fdc's packed rows view each block as one row, so
  under either the worker asks vLLM for the HND layout (`LBHNC`, `KVPruneWorkerMixin`);
  vLLM's GPU kernels read strides.
"""

from __future__ import annotations

import torch

from vllm_kvprune.config import policy_from_vllm_config
from vllm_kvprune.engine.spec import KVPruneSpec
from vllm_kvprune.vllm_hooks import AttentionCGSupport
from vllm_kvprune.worker.kernel_sets import TritonKernels
from vllm_kvprune.worker.layouts import StepPlan
from vllm_kvprune.worker.policy_attention import PlannedMetadataBuilder, PolicyAttentionImpl, PolicyBackend


class DeviceMetadataBuilder(PlannedMetadataBuilder):
    """Mixin before a GPU backend's metadata builder: the plan and the physical lengths on
    the builder's device."""

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

    def schedule_pages(self, pages) -> None:
        """vLLM's GPU kernels need no schedule of their own for the head-page sequences."""


class DevicePolicyImpl(PolicyAttentionImpl):
    """Mixin before a GPU backend's impl: the plan carried out with our Triton kernels."""

    kernels = TritonKernels()


class DevicePolicyBackend(PolicyBackend):
    """Mixin before a GPU backend: the policies' builder and impl. The HND layout head-pages
    and FDC need is asked for by the worker (`KVPruneWorkerMixin.get_supported_kv_cache_layouts`)."""


__all__ = ["DeviceMetadataBuilder", "DevicePolicyBackend", "DevicePolicyImpl"]
