"""The kernels an attention wrapper runs on a layer's cache, one set per platform.

The wrappers (`backend.py` on CPU, `triton_backend.py` on GPU) share the step planning and
everything the impl does around vLLM's attention kernel; what differs is which kernels move,
write, read and score tokens in the cache. Both sets take the same arguments (a layer, its
cache `[num_blocks, H, block_size, 2 * head_size]`, slots from the step plan) and both are
tested against the same torch references (`kernels.reference`).

- `CPUKernels`: the C++ extension (`vllm_kvprune.kernels`) over the cache layout vLLM's CPU
  kernel uses for this layer's ISA (probed once per shape).
- `TritonKernels`: the Triton kernels (`vllm_kvprune.kernels.triton`) over vLLM's GPU layout
  (HND or NHD strides, read from the tensor). Plans are built on the host; their index tensors
  are copied to the cache's device here, without a sync, and the kernels skip their range
  checks (a check reads slots back to the host), since the worker's own maps made the slots.
"""

from __future__ import annotations

import torch

from vllm_kvprune import kernels
from vllm_kvprune.kernels import _unit_last_stride


class KernelSet:
    """What the impl needs besides vLLM's own kernels. Slots are global slot indices
    (`block * block_size + offset`), `[n]` or per KV head `[n, H]`; -1 is skipped."""

    # FDC's packed layout this set's `reduced_attention` reads (`PackedHeads.keys_by_token`).
    fdc_keys_by_token = False
    # Whether a step with prompt chunks takes its attention output from `attention_mass` (one
    # pass for output and mass) instead of the platform's attention kernel and a mass pass
    # after it; decode-only steps always do.
    fused_prefill_mass = False

    def write_slots(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """New K/V `[T, H, D]` into `slots`, in place."""
        raise NotImplementedError

    def copy_slots(self, layer, kv_cache: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Whole tokens from `sources` to `destinations`, every source read before any write."""
        raise NotImplementedError

    def read_slots(self, layer, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[n, H, D]` held in `slots`."""
        raise NotImplementedError

    def store_token_scores(self, layer, key: torch.Tensor, value: torch.Tensor, scores_row: torch.Tensor,
                           slots: torch.Tensor, policy) -> None:
        """paged_eviction: each new token's score (`policy.token_scores`) into `scores_row` at
        its slot (one layer's row of the score table)."""
        scores_row[slots] = policy.token_scores(key, value)

    def attention_mass(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       query_rows: torch.Tensor, key_counts: torch.Tensor, scale: float, mass: torch.Tensor,
                       output: torch.Tensor | None, softcap: float) -> None:
        """H2O's attention mass added per slot (and the attention output when `output` is given);
        the arguments are `kernels.attention_mass`'s."""
        raise NotImplementedError

    def reduced_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, heads, scale: float,
                          output_width: int, block_size: int) -> torch.Tensor:
        """FDC's attention over its packed narrow cache; `kernels.reduced_attention`'s arguments."""
        raise NotImplementedError

    def write_narrow(self, heads, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, block_size: int) -> None:
        """FDC's reduced keys/values `[n, H, >= rank]` into the packed cache `[num_blocks,
        values]` at `slots` `[n]` (`PackedHeads.write`'s arguments), skipping slot -1. Here
        the real rows are found first, which on a GPU would be a sync per layer."""
        real = slots >= 0
        if not bool(real.all()):
            keys, values, slots = keys[real], values[real], slots[real]
        heads.write(cache, slots, keys, values, block_size=block_size)


class CPUKernels(KernelSet):
    """The C++ ops over the layout of vLLM's CPU kernel for the layer's ISA."""

    @staticmethod
    def layout(layer, kv_cache: torch.Tensor):
        _, _, block_size, packed = kv_cache.shape
        return kernels.probe_layout(kv_cache.dtype, block_size, packed // 2, layer.isa)

    def write_slots(self, layer, key, value, kv_cache, slots) -> None:
        kernels.write_slots(key, value, kv_cache, slots, self.layout(layer, kv_cache))

    def copy_slots(self, layer, kv_cache, sources, destinations) -> None:
        kernels.copy_slots(kv_cache, sources, destinations, self.layout(layer, kv_cache))

    def read_slots(self, layer, kv_cache, slots):
        return kernels.read_slots(kv_cache, slots, self.layout(layer, kv_cache))

    # The C++ op scores a prompt chunk's queries in blocks and splits them over the cores: its
    # output and mass take about the time of vLLM's CPU attention alone (`benchmarks ttft`).
    fused_prefill_mass = True

    def attention_mass(self, layer, query, kv_cache, block_table, query_rows, key_counts, scale, mass, output,
                       softcap) -> None:
        kernels.attention_mass(query, kv_cache, self.layout(layer, kv_cache), block_table, query_rows, key_counts,
                               scale, mass, output, softcap=softcap)

    def reduced_attention(self, query, kv_cache, block_table, query_start_loc, seq_lens, heads, scale, output_width,
                          block_size):
        from vllm_kvprune.kernels.reduced_attention import reduced_attention

        return reduced_attention(query, kv_cache, block_table, query_start_loc, seq_lens, heads, scale, output_width,
                                 block_size=block_size)


class TritonKernels(KernelSet):
    """The Triton kernels over vLLM's GPU cache layout; index tensors still on the host go to
    the cache's device here (`StepPlan.to_device` has moved the per-layer ones once a step)."""

    # Keys token-major: FDC's decode at 50% dims 0.162 ms vs 0.219 dims-major (H100, batch 32 x
    # 4096, bf16; results/gpu/kernels_h100.json).
    fdc_keys_by_token = True

    @staticmethod
    def _on(kv_cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if index.device != kv_cache.device:
            index = index.to(kv_cache.device, non_blocking=True)
        return index if index.dtype == torch.int64 else index.to(torch.int64)

    def write_slots(self, layer, key, value, kv_cache, slots) -> None:
        from vllm_kvprune.kernels.triton import slot_ops

        slot_ops.write_slots(_unit_last_stride(key), _unit_last_stride(value), kv_cache, self._on(kv_cache, slots),
                             check_range=False)

    def copy_slots(self, layer, kv_cache, sources, destinations) -> None:
        from vllm_kvprune.kernels.triton import slot_ops

        slot_ops.copy_slots(kv_cache, self._on(kv_cache, sources), self._on(kv_cache, destinations),
                            check_range=False)

    def read_slots(self, layer, kv_cache, slots):
        from vllm_kvprune.kernels.triton import slot_ops

        return slot_ops.read_slots(kv_cache, self._on(kv_cache, slots), check_range=False)

    def store_token_scores(self, layer, key, value, scores_row, slots, policy) -> None:
        # The policy's expression (sum over heads of ||V|| / ||K||) fused in one launch; tested
        # against `PagedEvictionPolicy.token_scores`.
        from vllm_kvprune.kernels.triton import block_scores

        block_scores.store_token_scores(_unit_last_stride(key), _unit_last_stride(value), scores_row,
                                        self._on(scores_row, slots), check_range=False)

    def attention_mass(self, layer, query, kv_cache, block_table, query_rows, key_counts, scale, mass, output,
                       softcap) -> None:
        from vllm_kvprune.kernels.triton import attention_mass

        attention_mass.attention_mass(query, kv_cache, block_table.to(kv_cache.device, torch.int32),
                                      self._on(kv_cache, query_rows), self._on(kv_cache, key_counts), scale, mass,
                                      output, softcap)

    def reduced_attention(self, query, kv_cache, block_table, query_start_loc, seq_lens, heads, scale, output_width,
                          block_size):
        # The layout the layer's `PackedHeads` writes (token-major keys here). No key splits:
        # `choose_key_splits`' pick was slower than none at batch 32 on the H100 (docs/GPU.md).
        from vllm_kvprune.kernels.triton import reduced_attention

        return reduced_attention.reduced_attention(query, kv_cache, block_table.to(kv_cache.device),
                                                   self._on(kv_cache, query_start_loc), self._on(kv_cache, seq_lens),
                                                   heads, scale, output_width, block_size=block_size,
                                                   keys_by_token=heads.keys_by_token)

    def write_narrow(self, heads, cache, slots, keys, values, block_size) -> None:
        # One launch that skips slot -1 in the kernel: no host read of the slots per layer.
        from vllm_kvprune.kernels.triton import packed_slots

        packed_slots.write_packed(heads, cache, self._on(cache, slots), keys, values, block_size)
