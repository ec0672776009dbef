"""The CPU attention backend with KV policies: vLLM's CPU_ATTN, given a physical view.

The planning and the impl's work around the kernel are `policy_attention.py`'s, shared with
the GPU wrapper; what is the CPU's own: the C++ kernel set, FDC's metadata (vLLM's CPU kernel
does not run on the narrowed heads) and the schedule vLLM's CPU kernel needs for head-pages.
"""

from __future__ import annotations

import dataclasses

from vllm_kvprune import vllm_hooks
from vllm_kvprune.vllm_hooks import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm_kvprune.worker.kernel_sets import CPUKernels
from vllm_kvprune.worker.policy_attention import PlannedMetadataBuilder, PolicyAttentionImpl, PolicyBackend


class KVPruneMetadataBuilder(PlannedMetadataBuilder, CPUAttentionMetadataBuilder):
    """Builds CPU attention metadata over each request's physical slots."""

    def _build_unplanned(self, common_prefix_len: int, common_attn_metadata, fast_build: bool):
        if self.narrow_heads:
            return _fdc_metadata(common_attn_metadata)
        return super()._build_unplanned(common_prefix_len, common_attn_metadata, fast_build)

    def _build_physical(self, common_prefix_len: int, physical, fast_build: bool):
        # FDC under eviction: FDC's kernel over the physical lengths, the plan carried out on
        # the narrow cache by the impl.
        if self.narrow_heads:
            return _fdc_metadata(physical)
        return super()._build_physical(common_prefix_len, physical, fast_build)

    def schedule_pages(self, pages) -> None:
        """vLLM's kernel schedule for each layer's head-page sequences (one per row and KV
        head: a KV head's query group is the sequence's heads)."""
        group = self.num_heads // self.num_kv_heads
        num_sequences = len(pages.query_start_loc) - 1
        pages.schedules = [
            vllm_hooks.attention_schedule(self, num_sequences, group, 1, seq_lens, pages.query_start_loc)
            for seq_lens in pages.seq_lens
        ]


def _fdc_metadata(common) -> CPUAttentionMetadata:
    """What FDC's kernel reads: vLLM's rows, lengths and block table, with no schedule of
    vLLM's kernel (whose head sizes the narrowed spec would not match)."""
    return CPUAttentionMetadata(
        num_actual_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
        query_start_loc=common.query_start_loc_cpu, max_seq_len=common.max_seq_len,
        seq_lens=common.seq_lens, block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping, scheduler_metadata=None,
    )


class KVPruneImpl(PolicyAttentionImpl, CPUAttentionBackendImpl):
    """Executes the step plan in one layer around vLLM's CPU kernels, with the C++ ops."""

    kernels = CPUKernels()

    def page_metadata(self, attn_metadata, pages, layer_index: int):
        return dataclasses.replace(super().page_metadata(attn_metadata, pages, layer_index),
                                   scheduler_metadata=pages.schedules[layer_index])


class KVPruneCPUBackend(PolicyBackend, CPUAttentionBackend):
    """CPU_ATTN with KV policies."""

    builder_cls = KVPruneMetadataBuilder
    impl_cls = KVPruneImpl


__all__ = ["KVPruneCPUBackend", "KVPruneImpl", "KVPruneMetadataBuilder"]
