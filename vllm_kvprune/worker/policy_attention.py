"""What every attention wrapper with KV policies shares: the step's plan and its execution.

Backend / MetadataBuilder / Impl, as in vLLM. The builder turns the logical step
(positions, lengths) into a physical one once per step (`StepPlan`); the impl carries
it out in every layer: moves before the new tokens are written, the write itself
(vLLM's own op, into the planned slots), then the stock attention kernel over physical
lengths, and the compaction after a prompt's last chunk. RoPE keeps the logical
positions throughout; only `positions: cache` touches keys, and only the sinks'.

The two mixins here hold all of that; a platform's wrapper (`backend.py`: vLLM's CPU_ATTN;
`triton_backend.py`: vLLM's TRITON_ATTN) puts them in front of vLLM's classes and supplies
only what differs: its `KernelSet` (`kernel_sets.py`), how physical lengths reach its kernel,
and the metadata of the paths only it runs. With no policy configured every class behaves
exactly like its vLLM parent. Importing this module imports no vLLM (the specs are imported
where used), so the impl's work can be driven on a GPU machine without vLLM
(`tests/test_triton_policy_steps.py`).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import torch

from vllm_kvprune import vllm_hooks
from vllm_kvprune.config import policy_from_vllm_config
from vllm_kvprune.worker import faults, runtime
from vllm_kvprune.worker.head_map import SKIP
from vllm_kvprune.worker.head_page_map import global_head_slots
from vllm_kvprune.worker.kernel_sets import KernelSet
from vllm_kvprune.worker.state import StepPlan

# Decode-only steps of head-wise policies compute attention and mass in one pass of our
# kernel (measured faster than vLLM's attention followed by a mass pass); 0 keeps vLLM's
# attention and adds the mass pass, for comparing the two.
FUSED_DECODE_MASS = os.environ.get("VLLM_KVPRUNE_FUSED_MASS", "1") == "1"


class PlannedMetadataBuilder:
    """Mixin before a vLLM metadata builder: plans the step and builds the parent's metadata
    over each request's physical slots and lengths."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        from vllm_kvprune.engine.spec import FdcSpec, KVPruneSpec, PrunedFdcSpec

        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Only the policy's KV-cache group is planned; vLLM's own groups (a hybrid model's
        # sliding-window layers) are built exactly as vLLM builds them.
        self.policy_active = policy_from_vllm_config(vllm_config).active and isinstance(kv_cache_spec, KVPruneSpec)
        self.narrow_heads = isinstance(kv_cache_spec, (FdcSpec, PrunedFdcSpec))

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        worker_state = runtime.worker_state() if self.policy_active else None
        if worker_state is None or worker_state.dummy_runs:
            return self._build_unplanned(common_prefix_len, common_attn_metadata, fast_build)
        query_start_loc = common_attn_metadata.query_start_loc_cpu.numpy()
        plan = self._place(worker_state.plan(query_start_loc[: common_attn_metadata.num_reqs + 1], self.block_size))
        num_tokens = len(plan.slot_mapping)
        # In place: the forward context hands this very tensor to every layer's cache update.
        common_attn_metadata.slot_mapping[:num_tokens].copy_(plan.slot_mapping, non_blocking=True)
        physical = dataclasses.replace(common_attn_metadata, seq_lens=self._physical_seq_lens(plan),
                                       max_seq_len=int(plan.seq_lens.max()))
        metadata = self._build_physical(common_prefix_len, physical, fast_build)
        if plan.page_attention is not None:
            self._schedule_pages(plan.page_attention)
        metadata.kvprune_plan = plan
        metadata.kvprune_layer_tables = _layer_block_tables(metadata.block_table, plan, worker_state)
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

    def _schedule_pages(self, pages) -> None:
        """The kernel's schedule for each layer's head-page sequences (platforms that run
        head-page policies)."""
        raise NotImplementedError(f"{type(self).__name__} does not run head-page policies")


def _layer_block_tables(block_table: torch.Tensor, plan: StepPlan, worker_state) -> torch.Tensor | None:
    """`[layers, rows, cols]`: each layer's block table, rows reordered where its blocks are.

    Only the columns the kernel reads this step are built (the blocks below the longest
    physical `seq_len`, and every block a reordered row names: at most a prompt's or a
    cap's), not vLLM's `max_model_len` width."""
    if not plan.block_orders:
        return None
    num_layers = worker_state.scores.num_layers
    block_size = worker_state.scores.block_size
    width = max(-(-int(plan.seq_lens.max()) // block_size), *(int(order.max()) + 1 for _, order in plan.block_orders))
    block_table = block_table[:, : min(width, block_table.shape[1])]
    columns = torch.arange(block_table.shape[1]).expand(num_layers, block_table.shape[0], -1).clone()
    for row, order in plan.block_orders:
        columns[:, row, : order.shape[1]] = torch.from_numpy(order)
    return block_table.expand(num_layers, -1, -1).gather(2, columns.to(block_table.device, non_blocking=True))


class PolicyAttentionImpl:
    """Mixin before a vLLM attention impl: executes the step plan in one layer around the
    parent's kernels, moving and scoring tokens with the platform's `kernels`."""

    kernels: KernelSet

    def fused_rope_kvcache_supported(self) -> bool:
        # The policies write K/V themselves (per head, scored, into planned slots): vLLM's
        # RoPE + cache-write fusion would bypass `do_kv_cache_update`.
        worker_state = runtime.worker_state()
        if worker_state is not None and worker_state.engine_config.active:
            return False
        return super().fused_rope_kvcache_supported()

    def _plan(self, layer) -> StepPlan | None:
        return getattr(vllm_hooks.layer_metadata(layer.layer_name), "kvprune_plan", None)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        narrow = _fdc_layers(kv_cache)
        if narrow is not None:
            self._write_narrow(layer, key, value, kv_cache, slot_mapping, narrow)
            return
        plan = self._plan(layer)
        if plan is not None and plan.layer_slot_mapping is not None:
            self._write_scored(layer, key, value, kv_cache, plan)
            return
        if plan is not None and plan.head_slot_mapping is not None:
            self._write_per_head(layer, key, value, kv_cache, plan)
            return
        if plan is not None and plan.page_slot_mapping is not None:
            self._write_head_pages(layer, key, value, kv_cache, plan)
            return
        if plan is not None:
            for state, token_index in plan.sink_captures:
                # Sinks may arrive over several steps (a prompt shorter than `sinks`).
                captured = (key[token_index].clone(), value[token_index].clone())
                earlier = state.sink_kv.get(layer.layer_name)
                if earlier is not None:
                    captured = (torch.cat([earlier[0], captured[0]]), torch.cat([earlier[1], captured[1]]))
                state.sink_kv[layer.layer_name] = captured
            if plan.pre_moves is not None or plan.sink_anchors:  # a step that moves nothing records no time
                started = time.perf_counter()
                if plan.pre_moves is not None:
                    self.kernels.copy_slots(layer, kv_cache, *plan.pre_moves)
                if plan.sink_anchors:
                    self._reanchor_sinks(layer, kv_cache, plan)
                _moved_since(started)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def _write_narrow(self, layer, key, value, kv_cache, slot_mapping, narrow) -> None:
        """FDC's narrow heads: the plan's moves, then the new tokens reduced into their slots
        (a block policy's own per-layer slots, each token's score taken from what is stored)."""
        layer_index = vllm_hooks.layer_index(layer.layer_name)
        plan = self._plan(layer)
        if plan is not None and plan.pre_moves is not None:
            self._copy_slots(layer, kv_cache, *plan.pre_moves)
        scored = plan is not None and plan.layer_slot_mapping is not None
        # vLLM's slot mapping may hold -1 (a padded batch), which the kernel set's narrow write
        # skips; a block policy's own slots are all real (its planner gives every token one).
        slots = plan.layer_slot_mapping[layer_index] if scored else slot_mapping
        num_tokens = len(slots)
        reduced_keys, reduced_values = narrow.write(layer_index, key[:num_tokens], value[:num_tokens], kv_cache,
                                                    slots, _block_size(kv_cache), writer=self.kernels.write_narrow)
        if scored:
            worker_state = runtime.worker_state()
            worker_state.scores.by_slot[layer_index, slots] = worker_state.policy.token_scores(reduced_keys,
                                                                                              reduced_values)

    def _copy_slots(self, layer, kv_cache, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Move whole tokens between slots of this layer's cache (staged: sources read first),
        at full width or FDC's narrow one; timed as the step's `move` phase."""
        if len(sources) == 0:
            return
        started = time.perf_counter()
        narrow = _fdc_layers(kv_cache)
        if narrow is not None:
            narrow.copy(vllm_hooks.layer_index(layer.layer_name), kv_cache, sources, destinations,
                        _block_size(kv_cache))
        else:
            self.kernels.copy_slots(layer, kv_cache, sources, destinations)
        _moved_since(started)

    def _write_scored(self, layer, key, value, kv_cache, plan: StepPlan) -> None:
        """Block policies: this layer's own slots, and each new token's score beside it."""
        worker_state = runtime.worker_state()
        layer_index = _layer_index(layer)
        slots = plan.layer_slot_mapping[layer_index]
        num_tokens = len(slots)
        key, value = key[:num_tokens], value[:num_tokens]
        self.kernels.store_token_scores(layer, key, value, worker_state.scores.by_slot[layer_index], slots,
                                        worker_state.policy)
        super().do_kv_cache_update(layer, key, value, kv_cache, slots)

    def _write_per_head(self, layer, key, value, kv_cache, plan: StepPlan) -> None:
        """Head-wise policies: lazy-pruning moves first, then each new token's K/V of every
        head into that head's own slot (a victim's, in place), starting with no mass."""
        mass = runtime.worker_state().scores
        layer_index = _layer_index(layer)
        if plan.head_moves is not None:
            started = time.perf_counter()
            sources, destinations = plan.head_moves[0][layer_index], plan.head_moves[1][layer_index]
            self.kernels.copy_slots(layer, kv_cache, sources, destinations)
            mass.move(layer_index, sources, destinations)
            _moved_since(started)
        slots = plan.head_slot_mapping[layer_index]
        num_tokens = len(slots)
        self.kernels.write_slots(layer, key[:num_tokens], value[:num_tokens], kv_cache, slots)
        mass.reset(layer_index, slots)

    def _write_head_pages(self, layer, key, value, kv_cache, plan: StepPlan) -> None:
        """Head-page policies: each new token's K/V of every head into that head's own page."""
        slots = plan.page_slot_mapping[_layer_index(layer)]  # [T, H]
        num_tokens, num_heads = slots.shape
        pages = _head_page_view(kv_cache)
        self.kernels.write_slots(layer, key[:num_tokens].reshape(num_tokens * num_heads, 1, -1),
                                 value[:num_tokens].reshape(num_tokens * num_heads, 1, -1), pages, slots.reshape(-1))

    def _attend_head_pages(self, layer, query, kv_cache, attn_metadata, plan: StepPlan, output) -> None:
        """Every row's KV head as its own sequence over head-pages: queries permuted to
        `[H, T, G, D]` so each sequence's queries are contiguous, vLLM's kernel, then back."""
        pages, layer_index = plan.page_attention, _layer_index(layer)
        num_tokens, num_kv_heads = pages.num_tokens, self.num_kv_heads
        group = self.num_heads // num_kv_heads
        grouped = query[:num_tokens].reshape(num_tokens, num_kv_heads, group, self.head_size)
        sequences = grouped.transpose(0, 1).contiguous().view(num_kv_heads * num_tokens, group, self.head_size)
        attended = torch.empty_like(sequences)
        metadata = self._page_metadata(attn_metadata, pages, layer_index)
        super().forward(layer, sequences, None, None, _head_page_view(kv_cache), metadata, attended)
        output[:num_tokens].view(num_tokens, num_kv_heads, group, self.head_size).copy_(
            attended.view(num_kv_heads, num_tokens, group, self.head_size).transpose(0, 1))

    def _page_metadata(self, attn_metadata, pages, layer_index: int):
        """The step's metadata for one layer's head-page sequences (one per row and KV head)."""
        return dataclasses.replace(
            attn_metadata, num_actual_tokens=self.num_kv_heads * pages.num_tokens,
            query_start_loc=pages.query_start_loc, seq_lens=pages.seq_lens[layer_index],
            block_table=pages.block_tables[layer_index], max_seq_len=pages.max_seq_lens[layer_index])

    def _vote(self, layer, query, kv_cache, plan: StepPlan) -> None:
        """After a prompt's last chunk has attended: this layer's vote, and each head's kept
        tokens packed into the layer's first head-pages (sources are read before any write)."""
        worker_state = runtime.worker_state()
        started = time.perf_counter()
        paged_layers = worker_state.scores
        layer_index = _layer_index(layer)
        voter = paged_layers.voters[layer.layer_name]
        block_size, num_heads = kv_cache.shape[2], kv_cache.shape[1]
        sources, destinations = [], []
        for vote in faults.live(plan.votes):
            state = vote.state
            with faults.contained(state, "score"):
                faults.inject("score", state.request_id)
                prompt = np.arange(vote.num_prompt)
                prompt_slots = vote.block_row[prompt // block_size].astype(np.int64) * block_size + prompt % block_size
                keys, _ = self.kernels.read_slots(layer, kv_cache, torch.from_numpy(prompt_slots))  # [P, H, D]
                keep = voter.vote(state.config, state.policy, query[vote.last_token].float(), keys.transpose(0, 1),
                                  state.hidden_sum[layer_index], state.hidden_sumsq[layer_index],
                                  int(state.hidden_count[layer_index]))
                moved_from, moved_to = state.pages.apply_layer_vote(layer_index, keep)
                sources.append(global_head_slots(vote.block_row, moved_from, num_heads, block_size))
                destinations.append(global_head_slots(vote.block_row, moved_to, num_heads, block_size))
                if state.pages.is_paged:
                    state.hidden_sum = state.hidden_sumsq = state.hidden_count = None  # the prompt is done
        worker_state.score_seconds += time.perf_counter() - started
        if sources:
            started = time.perf_counter()
            self.kernels.copy_slots(layer, _head_page_view(kv_cache), torch.from_numpy(np.concatenate(sources)),
                                    torch.from_numpy(np.concatenate(destinations)))
            _moved_since(started)

    def _accumulate_mass(self, layer, query, kv_cache, attn_metadata, plan: StepPlan,
                         output: torch.Tensor | None = None) -> None:
        """Add this step's attention probabilities to each kept token's mass, per KV head, in
        one kernel pass that holds one query's logits at a time; with `output`, the same pass
        computes the attention output too (decode-only steps: no second pass over the keys)."""
        worker_state = runtime.worker_state()
        started = time.perf_counter()
        queries = plan.mass_queries
        query = query[: len(queries.tokens)] if queries.decode_only else query[queries.tokens]
        self.kernels.attention_mass(layer, query, kv_cache, attn_metadata.block_table, queries.rows,
                                    queries.key_counts, self.scale, worker_state.scores.by_slot[_layer_index(layer)],
                                    output, _softcap(self))
        worker_state.score_seconds += time.perf_counter() - started

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        plan = getattr(attn_metadata, "kvprune_plan", None)
        layer_tables = getattr(attn_metadata, "kvprune_layer_tables", None)
        if layer_tables is not None:
            attn_metadata = dataclasses.replace(attn_metadata, block_table=layer_tables[_layer_index(layer)])
        narrow = _fdc_layers(kv_cache)
        if narrow is not None and attn_metadata is not None:
            num_tokens = attn_metadata.num_actual_tokens
            attended = narrow.attend(vllm_hooks.layer_index(layer.layer_name), query[:num_tokens], kv_cache,
                                     attn_metadata.block_table, attn_metadata.query_start_loc,
                                     attn_metadata.seq_lens, self.scale, _block_size(kv_cache),
                                     attention=self.kernels.reduced_attention)
            output[:num_tokens].view(num_tokens, self.num_heads, self.head_size).copy_(attended)
            self._after_attention(layer, kv_cache, plan)
            return output
        if plan is not None and plan.mass_queries is not None and plan.mass_queries.decode_only \
                and FUSED_DECODE_MASS:
            num_tokens = len(plan.mass_queries.tokens)
            self._accumulate_mass(layer, query, kv_cache, attn_metadata, plan,
                                  output=output[:num_tokens].view(num_tokens, self.num_heads, self.head_size))
            return output
        if plan is not None and plan.page_attention is not None:
            self._attend_head_pages(layer, query, kv_cache, attn_metadata, plan, output)
        else:
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if plan is not None and plan.votes:
            self._vote(layer, query, kv_cache, plan)
        if plan is not None and plan.mass_queries is not None:
            self._accumulate_mass(layer, query, kv_cache, attn_metadata, plan)
        self._after_attention(layer, kv_cache, plan)
        return output

    def _after_attention(self, layer, kv_cache, plan: StepPlan | None) -> None:
        """Once every query of the step has attended: the plan's moves, and the prompts that
        this layer prunes now that they have been attended to in full."""
        if plan is None:
            return
        if plan.post_moves is not None:
            self._copy_slots(layer, kv_cache, *plan.post_moves)
        if plan.prefill_compactions:
            if plan.head_slot_mapping is not None:
                self._prune_prompts_per_head(layer, kv_cache, plan)
            else:
                self._prune_prompts(layer, kv_cache, plan)

    def _prune_prompts(self, layer, kv_cache, plan: StepPlan) -> None:
        """After a prompt's last chunk has attended to all of it: keep each prompt's best
        tokens of this layer, in order, in its first slots (scores move with them)."""
        worker_state = runtime.worker_state()
        started = time.perf_counter()
        scores = worker_state.scores
        layer_index = _layer_index(layer)
        block_size = _block_size(kv_cache)
        sources, destinations = [], []
        for compaction in faults.live(plan.prefill_compactions):
            state, slots = compaction.state, compaction.prompt_slots
            with faults.contained(state, "score"):
                faults.inject("score", state.request_id)
                token_means = scores.token_means(layer_index, slots)
                kept = state.policy.prefill_survivors(token_means, compaction.keep, state.config, block_size)
                state.blocks.set_layer_survivors(layer_index, kept.numpy())
                sources.append(slots[kept])
                destinations.append(slots[: compaction.keep])
        worker_state.score_seconds += time.perf_counter() - started
        if not sources:
            return
        sources, destinations = torch.cat(sources), torch.cat(destinations)
        moved = sources != destinations
        sources, destinations = sources[moved], destinations[moved]
        self._copy_slots(layer, kv_cache, sources, destinations)
        scores.by_slot[layer_index, destinations] = scores.by_slot[layer_index, sources]

    def _prune_prompts_per_head(self, layer, kv_cache, plan: StepPlan) -> None:
        """After a prompt's last chunk has attended to all of it: each KV head of this layer
        keeps its own `keep` tokens, in order, in the prompt's first slots (mass follows)."""
        worker_state = runtime.worker_state()
        started = time.perf_counter()
        mass = worker_state.scores
        layer_index = _layer_index(layer)
        sources, destinations = [], []
        for compaction in faults.live(plan.prefill_compactions):
            state, slots, keep = compaction.state, compaction.prompt_slots, compaction.keep
            with faults.contained(state, "score"):
                faults.inject("score", state.request_id)
                kept = state.policy.prefill_survivors(mass.by_slot[layer_index], slots, keep, state.config)
                state.heads.set_layer_survivors(layer_index, kept.numpy())
                source = slots[kept].T  # [keep, heads]
                destination = slots[:keep, None].expand_as(source).clone()
                destination[source == destination] = SKIP
                sources.append(source)
                destinations.append(destination)
        worker_state.score_seconds += time.perf_counter() - started
        if not sources:
            return
        started = time.perf_counter()
        sources, destinations = torch.cat(sources), torch.cat(destinations)
        self.kernels.copy_slots(layer, kv_cache, sources, destinations)
        mass.move(layer_index, sources, destinations)
        _moved_since(started)

    def _reanchor_sinks(self, layer, kv_cache, plan: StepPlan) -> None:
        keys, values, shifts, slots = [], [], [], []
        for anchor in plan.sink_anchors:
            sink_keys, sink_values = anchor.state.sink_kv[layer.layer_name]
            index = torch.from_numpy(anchor.sink_positions)
            keys.append(sink_keys[index])
            values.append(sink_values[index])
            shifts.append(torch.full((len(index),), anchor.shift, dtype=torch.int64))
            slots.append(anchor.sink_slots)
        rotate = runtime.worker_state().sink_rotations[layer.layer_name]
        rotated = rotate(torch.cat(keys), torch.cat(shifts))
        self.kernels.write_slots(layer, rotated, torch.cat(values), kv_cache, torch.cat(slots))


def _moved_since(started: float) -> None:
    """Count the time since `started` as moving K/V (the metrics' `phase="move"`)."""
    runtime.worker_state().move_seconds += time.perf_counter() - started


def _fdc_layers(kv_cache: torch.Tensor):
    """The worker's FDC layers when this cache is FDC's (narrower than the model's heads)."""
    worker_state = runtime.worker_state()
    narrow = worker_state.fdc if worker_state is not None else None
    return narrow if narrow is not None and kv_cache.numel() else None


def _block_size(kv_cache: torch.Tensor) -> int:
    """Tokens per block of a layer cache `[num_blocks, H, block_size, 2 * head_size]`."""
    return kv_cache.shape[2]


def _head_page_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The layer cache as one KV head per page, `[num_blocks * H, 1, block_size, 2D]`."""
    num_blocks, num_heads, block_size, packed = kv_cache.shape
    return kv_cache.view(num_blocks * num_heads, 1, block_size, packed)


def _softcap(impl) -> float:
    """The layer's logit soft-cap (0: none); vLLM's impl stores 0 for none. A bare impl
    (the worker-level tests drive these methods without vLLM) has none."""
    return float(getattr(impl, "logits_soft_cap", 0) or 0)


def _layer_index(layer) -> int:
    """The layer's row in the per-layer plan tensors and score tables (scored policies)."""
    return runtime.worker_state().scores.layer_index[layer.layer_name]



class PolicyBackend:
    """Mixin before a vLLM attention backend (which keeps its name, so vLLM's selection logic
    is unchanged): the policies' builder and impl, and the policies' spec for their layers."""

    builder_cls: type
    impl_cls: type

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def customize_spec(cls, spec):
        return policy_spec(super().customize_spec(spec))


def policy_spec(spec):
    """The spec the policy's layers get in place of vLLM's (`customize_spec`): the capped
    spec, or FDC's narrowed one. Only full attention is capped; any other spec (a sliding
    window) stays vLLM's."""
    from vllm_kvprune.engine.spec import FdcSpec, KVPruneSpec, PrunedFdcSpec
    from vllm_kvprune.vllm_hooks import FullAttentionSpec

    # Called by the model runner, outside any config context: ask the runner's state.
    worker_state = runtime.worker_state()
    if type(spec) is not FullAttentionSpec or worker_state is None or not worker_state.engine_config.active:
        return spec
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if worker_state.fdc is not None:
        # Narrower heads: the pool counts the packed reduced K/V a token really takes;
        # under an eviction policy the request is capped too.
        narrow_size = worker_state.fdc.spec_head_size
        spec_cls = FdcSpec if worker_state.engine_config.name == "fdc" else PrunedFdcSpec
        return spec_cls(**{**fields, "head_size": narrow_size, "head_size_v": narrow_size})
    return KVPruneSpec(**fields)
