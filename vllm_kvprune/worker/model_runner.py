"""The model runners, telling the KV state which requests sit in which rows.

`KVPruneRunnerMixin` is everything the policies need of a runner; it goes before vLLM's CPU
runner here and before its GPU runner in `gpu_worker.py` (vLLM's CPU runner is a subclass of
its GPU runner, so both have every method the mixin overrides)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from vllm_kvprune import envs, metrics, vllm_hooks
from vllm_kvprune.config import policy_from_vllm_config
from vllm_kvprune.engine.spec import FdcSpec, KVPruneSpec, LayerKVPruneSpec, PrunedFdcSpec
from vllm_kvprune.vllm_hooks import CPUModelRunner, FullAttentionSpec, SlidingWindowSpec
from vllm_kvprune.worker import tensor_parallel
from vllm_kvprune.worker.features import LayerFeatures, UnsupportedModelError, refusal
from vllm_kvprune.worker.layouts.head_pages import PagedLayers
from vllm_kvprune.worker.positions import sink_rotation
from vllm_kvprune.worker.state import StepRows, WorkerKVState
from vllm_kvprune.worker.voting import LayerVoter, gather_hidden

logger = logging.getLogger("vllm_kvprune")


class KVPruneRunnerMixin:
    """Before a vLLM model runner: checks the model's attention against the policy,
    publishes each step's rows and forgets finished requests."""

    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self.kv_state = WorkerKVState(policy_from_vllm_config(vllm_config))
        self.kv_state.footprint_lookahead = int(bool(vllm_hooks.async_scheduling(vllm_config)))
        self.kv_state.reduce = vllm_hooks.tp_all_reduce
        # The KV-cache groups whose layers the policy prunes, in vLLM's order: one, or one per
        # layer (`Policy.per_layer_tables`); their block tables are the ones planned.
        self.policy_groups: list[int] = []

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if self.kv_state.policy is not None:
            self._check_attention_features()
        if self.kv_state.engine_config.narrow_heads:
            self._load_fdc()

    def _load_fdc(self) -> None:
        """The calibration's rotations and widths, checked against the weights being served."""
        from pathlib import Path

        from vllm_kvprune.worker.fdc_layers import FdcLayers

        model_dir = self.model_config.model
        rank, world_size = vllm_hooks.tp_rank_and_size()
        layers = vllm_hooks.attention_layers(self.vllm_config)
        # The packed layout the platform's attention kernel reads (our impls carry a kernel set).
        kernel_set = getattr(next(iter(layers.values())).impl, "kernels", None) if layers else None
        fdc = FdcLayers(self.kv_state.engine_config.fdc, model_dir if Path(model_dir).is_dir() else None,
                        rank, world_size, keys_by_token=getattr(kernel_set, "fdc_keys_by_token", False))
        total_kv_heads = self.model_config.get_total_num_kv_heads()
        # The layers FDC narrows: the full-attention ones (a hybrid model's sliding-window layers
        # stay vLLM's at full width), which the calibration must name, in order.
        narrowed = {vllm_hooks.layer_index(name): layer for name, layer in layers.items()
                    if LayerFeatures.of(name, layer).pruned}
        if fdc.calibration.layers != sorted(narrowed) or fdc.calibration.num_kv_heads != total_kv_heads or any(
                layer.impl.num_kv_heads != fdc.num_kv_heads or layer.impl.head_size != fdc.head_dim
                for layer in narrowed.values()):
            split = f" ({fdc.num_kv_heads} per tensor-parallel rank of {world_size})" if world_size > 1 else ""
            raise UnsupportedModelError(
                f"fdc: the calibration is for layers {_spans(fdc.calibration.layers)} of "
                f"{fdc.calibration.num_kv_heads} KV heads{split} of size {fdc.head_dim}; the model's full-attention "
                f"layers are {_spans(sorted(narrowed))} of {total_kv_heads} KV heads of size "
                f"{next(iter(layers.values())).impl.head_size}")
        self.kv_state.fdc = fdc.to(self.device)
        logger.info("kvprune: fdc narrows the KV heads of %d of %d layers (rate %s): a token takes %.1f%% of its "
                    "full cache there (packed widths, each layer's rounded up to a head size of its own)",
                    len(narrowed), len(layers), fdc.calibration.settings.get("rate"), 100 * fdc.kv_fraction())

    def get_kv_cache_spec(self):
        """vLLM's per-layer specs, the policy's layers' replaced by the policy's: the capped
        `KVPruneSpec`, or under FDC its narrowed spec (`FdcSpec` alone, `PrunedFdcSpec` under an
        eviction policy's cap) with each layer's head size at its own packed width, so the
        pool follows the mean width. A policy whose layers keep different amounts
        (`per_layer_tables`) gives each layer a spec of its own (`LayerKVPruneSpec`: one KV-cache
        group per layer). Only full attention is the policy's; any other spec (a sliding window)
        stays vLLM's. On a hybrid model FDC's layers share one spec whose block holds more tokens
        in the sliding layers' page (`FdcLayers.hybrid_block`): vLLM's groups share one pool of
        equal pages."""
        specs = super().get_kv_cache_spec()
        config, fdc = self.kv_state.engine_config, self.kv_state.fdc
        if not config.active:
            return specs
        other_pages = {spec.page_size_bytes for spec in specs.values() if type(spec) is not FullAttentionSpec}
        replaced = {}
        for name, spec in specs.items():
            if type(spec) is FullAttentionSpec:
                fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
                if self._per_layer_tables():
                    spec = LayerKVPruneSpec(**fields, layer=len(replaced))
                elif fdc is None:
                    spec = KVPruneSpec(**fields)
                else:
                    spec_cls = FdcSpec if config.policy.layout == "full" else PrunedFdcSpec
                    spec = spec_cls(**{**fields, **_narrowed_fields(fdc, spec, name, other_pages)})
            replaced[name] = spec
        return replaced

    def _per_layer_tables(self) -> bool:
        """One KV-cache group per layer (the policy's trait); `KVPRUNE_ONE_TABLE=1`, for the
        benchmarks only, keeps one table for every layer, to measure what the groups cost."""
        return self.kv_state.policy is not None and self.kv_state.policy.per_layer_tables \
            and envs.get("ONE_TABLE") != "1"

    def _check_attention_features(self) -> None:
        """Refuse, in one line, a model whose attention the policy cannot honour; keep each
        pruned layer's RoPE for `positions: cache`."""
        config = self.kv_state.engine_config
        layers = [LayerFeatures.of(name, module) for name, module in vllm_hooks.attention_layers(self.vllm_config).items()]
        if not layers:
            raise UnsupportedModelError(f"{config.name}: the model has no attention layer to prune")
        rotations = {}

        def rope_ok(layer_name: str) -> str | None:
            rotations[layer_name], why = sink_rotation(self.model, layer_name)
            return why

        problem = refusal(config, layers, rope_ok)
        if problem is None:
            problem = config.policy.check_model(self.model, [layer.name for layer in layers if layer.pruned])
        if problem is not None:
            raise UnsupportedModelError(problem)
        self.kv_state.sink_rotations = rotations

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self.kv_state.policy is None:
            return
        name = self.kv_state.engine_config.name
        if self.kv_state.policy.layout == "full":
            self._check_fdc_groups(kv_cache_config)
            for index in range(len(kv_cache_config.kv_cache_groups)):
                self._bind_builders(index)
            return
        specs = [vllm_hooks.group_spec(group) for group in kv_cache_config.kv_cache_groups]
        groups = [index for index, spec in enumerate(specs) if isinstance(spec, KVPruneSpec)]
        for group, spec in zip(kv_cache_config.kv_cache_groups, specs):
            # Left to vLLM: sliding windows (bounded by their window); anything else would
            # run uncapped beside the policy.
            if not isinstance(spec, (KVPruneSpec, SlidingWindowSpec)):
                raise UnsupportedModelError(
                    f"{name}: {type(spec).__name__} layers ({list(group.layer_names)[0]}) are not supported")
        self._check_policy_groups(kv_cache_config, groups)
        self.policy_groups = groups
        layer_names = [layer for index in groups for layer in kv_cache_config.kv_cache_groups[index].layer_names]
        windowed = [(g, s) for g, s in zip(kv_cache_config.kv_cache_groups, specs) if isinstance(s, SlidingWindowSpec)]
        if windowed:
            logger.info("kvprune: %s prunes the %d full-attention layers; %d sliding-window layers (window %s) "
                        "keep vLLM's own cache", name, len(layer_names),
                        sum(len(g.layer_names) for g, _ in windowed), sorted({s.sliding_window for _, s in windowed}))
        spec = specs[groups[0]]
        self.kv_state.bind_cache(layer_names, kv_cache_config.num_blocks, spec.block_size,
                                 self.model_config.get_total_num_kv_heads(), spec.num_kv_heads, self.device)
        for position, group in enumerate(groups):
            self._bind_builders(group, position)
        if isinstance(self.kv_state.tables, PagedLayers):
            # Layer i's blocks are group i's when each layer has its own (else every layer's are group 0's).
            self.kv_state.tables.group_of_layer = np.arange(len(layer_names)) if len(groups) > 1 \
                else np.zeros(len(layer_names), np.int64)
            if self.kv_state.policy.gathers_hidden_states:
                self._attach_voters(self.kv_state.tables)

    def _check_policy_groups(self, kv_cache_config, groups: list[int]) -> None:
        """The pruned layers fall into one KV-cache group, or (`per_layer_tables`) one each."""
        name, per_layer = self.kv_state.engine_config.name, self._per_layer_tables()
        sizes = [len(kv_cache_config.kv_cache_groups[index].layer_names) for index in groups]
        if per_layer and groups and max(sizes) == 1:
            return
        if not per_layer and len(groups) == 1:
            return
        names = [list(kv_cache_config.kv_cache_groups[i].layer_names)[0] for i in groups]
        expected = "one per layer" if per_layer else "exactly one"
        raise UnsupportedModelError(
            f"{name}: KV-cache groups: the pruned layers fall into {len(groups)} groups of {sizes} layers "
            f"(first layers {names}); {expected} is supported")

    def _bind_builders(self, group: int, position: int = 0) -> None:
        """The metadata builders of one of the policy's KV-cache groups plan with this runner's
        state; `position`: the group's among the policy's (its row in the step's stacked tables)."""
        for builder in vllm_hooks.metadata_builders(self, group):
            builder.bind_worker(self.kv_state, position)

    @staticmethod
    def _check_fdc_groups(kv_cache_config) -> None:
        """The full-attention layers narrowed, in groups of FDC's spec (vLLM plans its block
        tables); a hybrid model's sliding-window groups stay vLLM's."""
        narrowed = 0
        for group in kv_cache_config.kv_cache_groups:
            spec = vllm_hooks.group_spec(group)
            narrowed += isinstance(spec, FdcSpec)
            if not isinstance(spec, (FdcSpec, SlidingWindowSpec)):
                raise UnsupportedModelError(
                    f"fdc: {type(spec).__name__} layers ({list(group.layer_names)[0]}) are not supported")
        if not narrowed:
            raise UnsupportedModelError("fdc: no KV-cache group of full-attention layers to narrow")

    def _attach_voters(self, paged_layers: PagedLayers) -> None:
        """Per pruned layer: its query path for synthetic queries, and a hook on its query
        projection that gathers the prompt's statistics (the input the projection reads)."""
        layers = vllm_hooks.attention_layers(self.vllm_config)
        paged_layers.dtype = self.model_config.dtype
        for layer_name, layer_index in paged_layers.layer_index.items():
            owner = self.model.get_submodule(layer_name.rsplit(".", 1)[0])
            impl = layers[layer_name].impl
            paged_layers.voters[layer_name] = LayerVoter(layer_index, owner, impl.num_heads, impl.head_size,
                                                         impl.scale, paged_layers)

            def hook(module, args, layer_index=layer_index, layer_name=layer_name):
                gather_hidden(self.kv_state, layer_index, layer_name, args[0])

            owner.qkv_proj.register_forward_pre_hook(hook)

    def sample_tokens(self, *args, **kwargs):
        output = super().sample_tokens(*args, **kwargs)
        if self.kv_state.engine_config.active and vllm_hooks.is_step_output(output):
            report = self.kv_state.settle_holes(
                tensor_parallel.merged_report(self.kv_state.step_report(metrics.enabled())))
            output = vllm_hooks.attach_step_report(output, report)
        return output

    def _update_states(self, scheduler_output):
        # A preempted request lost its blocks; it re-prefills from scratch when resumed.
        for request_id in vllm_hooks.ended_requests(scheduler_output):
            self.kv_state.drop(request_id)
        return super()._update_states(scheduler_output)

    def _dummy_run(self, *args, **kwargs):
        # Profiling and warm-up batches have no requests behind their rows: not planned.
        self.kv_state.dummy_runs += 1
        try:
            return super()._dummy_run(*args, **kwargs)
        finally:
            self.kv_state.dummy_runs -= 1

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, *args, **kwargs):
        if not self.policy_groups or self.kv_state.dummy_runs:
            return super()._build_attention_metadata(num_tokens, num_reqs, max_query_len, *args, **kwargs)
        req_ids, num_computed, num_prompt, block_rows, extra_args = vllm_hooks.batch_rows(
            self, num_reqs, self.policy_groups)
        self.kv_state.rows = StepRows(req_ids=req_ids, num_computed=num_computed, num_prompt=num_prompt,
                                      block_rows=block_rows, extra_args=extra_args)
        try:
            return super()._build_attention_metadata(num_tokens, num_reqs, max_query_len, *args, **kwargs)
        finally:
            self.kv_state.rows = None


def _narrowed_fields(fdc, spec, name: str, other_pages: set[int]) -> dict:
    """The fields FDC changes in a full-attention layer's spec: its own head size, or on a
    hybrid model (other specs' pages beside it) the one spec of `FdcLayers.hybrid_block`, its
    page padded to theirs so vLLM's hybrid groups keep equal pages."""
    if not other_pages:
        size = fdc.layer_head_size(vllm_hooks.layer_index(name))
        return {"head_size": size, "head_size_v": size}
    page = max(other_pages)
    dtype_bytes = spec.page_size_bytes // (2 * spec.block_size * spec.num_kv_heads * spec.head_size)
    block_size, size = fdc.hybrid_block(page // dtype_bytes, spec.block_size)
    fields = {"block_size": block_size, "head_size": size, "head_size_v": size}
    if 2 * block_size * spec.num_kv_heads * size * dtype_bytes != page:
        fields["page_size_padded"] = page
    return fields


def _spans(layers: list[int]) -> str:
    """Layer indices for a message: `0-29`, or the list where they are not one span."""
    if layers and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return str(layers)


class KVPruneCPUModelRunner(KVPruneRunnerMixin, CPUModelRunner):
    """vLLM's CPU runner with the policies' hooks."""
