"""What every attention wrapper with KV policies shares: the step's plan and its execution.

Backend / MetadataBuilder / Impl, as in vLLM. The builder turns the logical step
(positions, lengths) into a physical one once per step (a plan of the policy's layout,
`worker/layouts/`); the impl hands each layer's cache write and attention to the plan, which
carries it out around vLLM's own kernels (`LayerCall`). RoPE keeps the logical positions
throughout; only `positions: cache` touches keys, and only the sinks'.

The mixins here hold all of that; a platform's wrapper (`backend.py`: vLLM's CPU_ATTN;
`triton_backend.py`, `flash_backend.py`: vLLM's GPU backends) puts them in front of vLLM's
classes and supplies only what differs: its `KernelSet` (`kernel_sets.py`), how physical
lengths reach its kernel, and the metadata of the paths only it runs. With no policy
configured every class behaves exactly like its vLLM parent.

Nothing here is process-wide: the runner binds its worker state to each builder of the
policy's KV-cache group (`bind_worker`), the builder puts the step's plan (which knows that
worker) on the metadata, and the impl reads the plan from the metadata it is handed. Importing
this module imports no vLLM (the specs are imported where used), so the impl's work can be
driven on a GPU machine without vLLM (`tests/test_triton_policy_steps.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_kvprune import vllm_hooks
from vllm_kvprune.config import policy_from_vllm_config
from vllm_kvprune.worker.kernel_sets import KernelSet
from vllm_kvprune.worker.layouts import LayerCall, StepPlan


class PlannedMetadataBuilder:
    """Mixin before a vLLM metadata builder: plans the step and builds the parent's metadata
    over each request's physical slots and lengths.

    Only a group the runner bound (`bind_worker`: the policy's KV-cache group) is planned;
    vLLM's own groups (a hybrid model's sliding-window layers) are built exactly as vLLM builds
    them. Under FDC the group's cache is narrow: its unplanned steps (warm-up, or FDC alone,
    whose `full` layout keeps vLLM's tables) still run through FDC's kernel (a plain
    `StepPlan`)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        from vllm_kvprune.engine.spec import FdcSpec, PrunedFdcSpec

        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.narrow_heads = isinstance(kv_cache_spec, (FdcSpec, PrunedFdcSpec))
        self.kv_state = None  # the runner's WorkerKVState, once bound
        self.table_index = 0  # the group's position among the policy's (its row of the step's tables)

    def bind_worker(self, kv_state, table_index: int = 0) -> None:
        """The runner's worker state: this builder's group is the policy's, at `table_index`
        among them (one group per layer: the layer's index; else 0)."""
        self.kv_state = kv_state
        self.table_index = table_index

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        worker = self.kv_state
        if worker is None:
            return self._build_unplanned(common_prefix_len, common_attn_metadata, fast_build)
        if worker.dummy_runs or worker.policy.layout == "full":
            # Nothing to plan: vLLM's own slots and lengths (FDC's narrow cache still needs its kernel).
            metadata = self._build_unplanned(common_prefix_len, common_attn_metadata, fast_build)
            if self.narrow_heads:
                metadata.kvprune_plan = StepPlan(common_attn_metadata.slot_mapping, common_attn_metadata.seq_lens,
                                                 worker)
            return metadata
        query_start_loc = common_attn_metadata.query_start_loc_cpu.numpy()
        # Planned once per step (the first of the policy's groups to be built); every group's
        # build takes the same plan, in its own block table's slots.
        plan = self._place(worker.plan(query_start_loc[: common_attn_metadata.num_reqs + 1], self.block_size))
        slot_mapping = plan.group_slot_mapping(self.table_index)
        # In place: the forward context hands this very tensor to every layer's cache update.
        common_attn_metadata.slot_mapping[:len(slot_mapping)].copy_(slot_mapping, non_blocking=True)
        physical = dataclasses.replace(common_attn_metadata, seq_lens=self._physical_seq_lens(plan),
                                       max_seq_len=int(plan.seq_lens.max()))
        metadata = self._build_physical(common_prefix_len, physical, fast_build)
        plan.prepare(self, metadata)
        metadata.kvprune_plan = plan
        return metadata

    def _build_unplanned(self, common_prefix_len: int, common_attn_metadata, fast_build: bool):
        """Profiling, warm-up and vLLM's own groups: the parent's metadata."""
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def _build_physical(self, common_prefix_len: int, physical, fast_build: bool):
        """The parent's metadata over the physical lengths."""
        return super().build(common_prefix_len, physical, fast_build)

    def _place(self, plan: StepPlan) -> StepPlan:
        """The plan where the platform's kernels read it (planned on the host)."""
        return plan

    def _physical_seq_lens(self, plan: StepPlan) -> torch.Tensor:
        """The plan's physical lengths where the platform's kernel reads them."""
        return plan.seq_lens

    def schedule_pages(self, pages) -> None:
        """The kernel's schedule for each layer's head-page sequences (platforms that run
        head-page policies)."""
        raise NotImplementedError(f"{type(self).__name__} does not run head-page policies")


class PolicyAttentionImpl:
    """Mixin before a vLLM attention impl: hands each layer's cache write and attention to the
    step's plan, which moves and scores tokens with the platform's `kernels`."""

    kernels: KernelSet

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM builds the impl while it builds the model, under its config.
        config = vllm_hooks.current_vllm_config()
        self.kvprune_active = config is not None and policy_from_vllm_config(config).active

    def fused_rope_kvcache_supported(self) -> bool:
        # The policies write K/V themselves (per head, scored, into planned slots): vLLM's
        # RoPE + cache-write fusion would bypass `do_kv_cache_update`.
        if getattr(self, "kvprune_active", False):
            return False
        return super().fused_rope_kvcache_supported()

    def _plan(self, layer) -> StepPlan | None:
        return getattr(vllm_hooks.layer_metadata(layer.layer_name), "kvprune_plan", None)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        plan = self._plan(layer)
        if plan is None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return
        plan.write(LayerCall(self, layer, kv_cache, plan.worker), key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        plan = getattr(attn_metadata, "kvprune_plan", None)
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        call = LayerCall(self, layer, kv_cache, plan.worker, args, kwargs)
        output = plan.attend(call, query, key, value, attn_metadata, output)
        plan.after_attention(call, query, attn_metadata)
        return output

    # ---- what a plan asks of the impl: vLLM's own work, and the platform's metadata ----------
    def vllm_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's own write of new tokens into `slot_mapping`."""
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def vllm_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        """vLLM's own attention over `attn_metadata`."""
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    def page_metadata(self, attn_metadata, pages, layer_index: int):
        """The step's metadata for one layer's head-page sequences (one per row and KV head)."""
        return dataclasses.replace(
            attn_metadata, num_actual_tokens=self.num_kv_heads * pages.num_tokens,
            query_start_loc=pages.query_start_loc, seq_lens=pages.seq_lens[layer_index],
            block_table=pages.block_tables[layer_index], max_seq_len=pages.max_seq_lens[layer_index])


class PolicyBackend:
    """Mixin before a vLLM attention backend (which keeps its name, so vLLM's selection logic
    is unchanged): the policies' builder and impl. The policy's KV-cache spec is the runner's
    (`KVPruneRunnerMixin.get_kv_cache_spec`)."""

    builder_cls: type
    impl_cls: type

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls
