"""FDC on the worker: each layer's rotations and packed head widths, and the three steps around
the attention kernel (project the keys/values written, project the queries, turn the output
back).

Per layer `l` and KV head `h` (calibration file, `vllm_kvprune.fdc.calibration`): the Q/K
rotation `R[l, h]` cut to its first `k_h` columns, the V rotation `R_v[l, h]` cut to `k_v,h`.
The cache stores, per token, every head's `k_h` key dims and `k_v,h` value dims side by side
(`PackedHeads`), so a layer needs `sum_h (k_h + k_v,h)` values per token. Each layer's spec
gets its own head size: its row rounded up to a multiple of `2 * H` (`layer_widths`), so the
pool's memory follows the mean width over layers (vLLM puts layers of one kind but different
widths in one KV-cache group, `UniformTypeKVCacheSpecs`, a block's bytes the sum of theirs).

On a hybrid model the calibration holds its full-attention layers only (`FdcCalibration.layers`):
`layers` and `layer_widths` are rows of those, and every method taking a `layer` takes the model
layer's index (`row`). Those layers share one narrowed spec whose blocks hold more tokens in the
sliding layers' page (`hybrid_block`).

Under tensor parallelism each rank narrows the KV heads it holds with their own rotations, and
a layer's rows are as wide as that layer's widest rank's (`worker/tensor_parallel.py`): every
rank reports the same pages, so they agree on the number of blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_kvprune.fdc import calibration as fdc
from vllm_kvprune.kernels.reduced_attention import PackedHeads, reduced_attention
from vllm_kvprune.worker.fdc_projections import EinsumProjections, FdcProjections, projections_for
from vllm_kvprune.worker.tensor_parallel import kv_head_range


@dataclass(frozen=True)
class FdcLayer:
    """One layer's cut rotations (fp32) and packing."""

    heads: PackedHeads
    qk_rotation: torch.Tensor  # [H, d, max k_h], columns past a head's rank are zero
    v_rotation: torch.Tensor  # [H, d, max k_v,h]


class FdcLayers:
    """Every layer's FDC, from a calibration file checked against the served model."""

    def __init__(self, path: str, model_dir: str | None, rank: int = 0, world_size: int = 1,
                 keys_by_token: bool = False) -> None:
        """`keys_by_token`: the packed layout the platform's attention kernel reads
        (`KernelSet.fdc_keys_by_token`)."""
        calibration = fdc.load(path, model_dir)
        self.calibration = calibration
        self.head_dim = calibration.head_dim
        # This rank's global KV heads (all of them without tensor parallelism).
        self.kv_heads = kv_head_range(calibration.num_kv_heads, rank, world_size)
        self.num_kv_heads = len(self.kv_heads)
        self.layers = [self._layer(calibration, index, self.kv_heads, keys_by_token)
                       for index in range(calibration.num_layers)]
        every_rank = {kv_head_range(calibration.num_kv_heads, other, world_size) for other in range(world_size)}
        granule = 2 * self.num_kv_heads
        # Per layer: the widest rank's packed row, rounded up to a head size.
        self.layer_widths = [
            math.ceil(max(PackedHeads.from_ranks(calibration.qk_rank[index][list(heads)],
                                                 calibration.v_rank[index][list(heads)]).row_width
                          for heads in every_rank) / granule) * granule
            for index in range(calibration.num_layers)]
        # Model layer -> row of `layers` (every layer, or a hybrid model's full-attention ones).
        self.rows = calibration.rows
        # The four projections around attention (`worker/fdc_projections.py`): torch's einsums
        # until `to()` picks what KVPRUNE_FDC_PROJECTIONS asks for on the cache's device.
        self.projections: FdcProjections = EinsumProjections(self.layers)

    @staticmethod
    def _layer(calibration: fdc.FdcCalibration, index: int, kv_heads: range, keys_by_token: bool) -> FdcLayer:
        heads = list(kv_heads)
        k_ranks, v_ranks = calibration.qk_rank[index][heads], calibration.v_rank[index][heads]
        dims = torch.arange(calibration.head_dim)
        qk = calibration.qk_rotation[index][heads].float()[:, :, : int(k_ranks.max())]
        qk = qk * (dims[: qk.shape[-1]] < k_ranks[:, None]).float()[:, None, :]
        v = calibration.v_rotation[index][heads].float()[:, :, : int(v_ranks.max())]
        v = v * (dims[: v.shape[-1]] < v_ranks[:, None]).float()[:, None, :]
        return FdcLayer(PackedHeads.from_ranks(k_ranks, v_ranks, keys_by_token), qk.contiguous(), v.contiguous())

    def to(self, device: torch.device | str) -> FdcLayers:
        """The rotations moved beside the cache (a GPU's), once at load, and the projections
        KVPRUNE_FDC_PROJECTIONS names (ValueError if they cannot run there); in place."""
        self.layers = [FdcLayer(layer.heads, layer.qk_rotation.to(device), layer.v_rotation.to(device))
                       for layer in self.layers]
        self.projections = projections_for(self.layers, device)
        return self

    def row(self, layer: int) -> int:
        """Model layer `layer`'s row (KeyError for a layer FDC leaves whole)."""
        return self.rows[layer]

    def layer_head_size(self, layer: int) -> int:
        """The head size model layer `layer`'s spec gets: `2 * H * head_size` values per token."""
        return self.layer_widths[self.row(layer)] // (2 * self.num_kv_heads)

    def hybrid_block(self, page_values: int, block_size: int, granule: int = 32) -> tuple[int, int]:
        """On a hybrid model: (tokens per block, head size) of the narrowed layers' one spec, so
        that a block fits in the sliding layers' page of `page_values` values (vLLM's hybrid
        groups share one pool of equal pages). Every narrowed layer takes the widest one's row
        (one spec, one KV-cache group); the block holds as many of those rows as fit, a multiple
        of `granule` tokens (the CPU kernel reads keys 32 at a time within a block) and at
        least `block_size` (the full width's); the rest of the page is padding."""
        head_size = self.spec_head_size
        width = 2 * self.num_kv_heads * head_size
        tokens = max(block_size, page_values // width // granule * granule)
        return tokens, head_size

    @property
    def spec_head_size(self) -> int:
        """The widest layer's head size: what a spec gets before it is narrowed per layer."""
        return max(self.layer_widths) // (2 * self.num_kv_heads)

    def kv_fraction(self) -> float:
        """Per-token cache size over the uncompressed one's (as the pool allocates it: the
        mean over the narrowed layers of each layer's padded width)."""
        return sum(self.layer_widths) / (len(self.layer_widths) * 2 * self.num_kv_heads * self.head_dim)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slots: torch.Tensor, block_size: int, *, writer) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce the new tokens' keys/values `[T, H, d]` and store them at `slots`; returns the
        reduced keys and values (fp32, `[T, H, >= max k]`, zero past each head's rank), for a
        policy that scores what is cached. `writer`: the platform's narrow write
        (`KernelSet.write_narrow`, which skips slot -1)."""
        layer = self.row(layer)
        reduced_keys, reduced_values = self.projections.keys_values(layer, key, value)
        writer(self.layers[layer].heads, blocks_of(kv_cache), slots, reduced_keys, reduced_values, block_size)
        return reduced_keys, reduced_values

    def copy(self, layer: int, kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
             block_size: int) -> None:
        """Move whole narrow tokens from `src_slots` to `dst_slots` (an eviction's compaction),
        staged: every source is read before any destination is written, so the sets may overlap.
        Bit-exact: read in fp32, written back in the cache's own dtype."""
        heads = self.layers[self.row(layer)].heads
        cache = blocks_of(kv_cache)
        keys, values = heads.read(cache, src_slots, block_size)
        width_k, width_v = max(k.shape[1] for k in keys), max(v.shape[1] for v in values)
        padded_keys = torch.zeros(len(src_slots), heads.num_heads, width_k, device=cache.device)
        padded_values = torch.zeros(len(src_slots), heads.num_heads, width_v, device=cache.device)
        for h, (key, value) in enumerate(zip(keys, values)):
            padded_keys[:, h, : key.shape[1]] = key
            padded_values[:, h, : value.shape[1]] = value
        heads.write(cache, dst_slots, padded_keys, padded_values, block_size=block_size)

    def attend(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int,
               attention=reduced_attention) -> torch.Tensor:
        """Attention of queries `[T, Hq, d]` in the reduced space; returns `[T, Hq, d]` fp32.
        `attention`: the platform's kernel (`KernelSet.reduced_attention`: the C++ op, or
        Triton's on a GPU), with `kernels.reduced_attention`'s arguments."""
        layer = self.row(layer)
        reduced = self.projections.queries(layer, query)
        cache = blocks_of(kv_cache)
        out = attention(reduced.to(cache.dtype), cache, block_table, query_start_loc, seq_lens,
                        self.layers[layer].heads, scale, self.projections.output_width(layer), block_size=block_size)
        return self.projections.outputs(layer, out)


def blocks_of(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's layer cache `[num_blocks, H, block_size, 2 * head_size]` as FDC's blocks
    `[num_blocks, block_size * width]` (the same bytes: `2 H head_size` is the layer's width).
    A page padded to a hybrid model's sliding layers' (`page_size_padded`: vLLM's view steps
    over the padding) is one row of the whole page, padding included: the kernels take the row
    length as the block stride and leave the rest of a block unused."""
    num_blocks, stride = kv_cache.shape[0], kv_cache.stride(0)
    if kv_cache.is_contiguous():
        return kv_cache.view(num_blocks, -1)
    available = kv_cache.untyped_storage().nbytes() // kv_cache.element_size() - kv_cache.storage_offset()
    if not kv_cache[0].is_contiguous() or stride < kv_cache[0].numel() or num_blocks * stride > available:
        raise ValueError(f"fdc: a layer cache of shape {tuple(kv_cache.shape)} and strides {kv_cache.stride()} "
                         "is not one row of pages")
    return kv_cache.as_strided((num_blocks, stride), (stride, 1))
