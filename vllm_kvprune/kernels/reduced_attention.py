"""FDC's attention in the reduced space, over a paged cache of packed, unequal-width heads.

A layer's KV heads keep their own numbers of dimensions (K: its Q/K rank, V: its V rank),
packed side by side in each block (:class:`PackedHeads`): no head is padded to the widest, so
a block is ``block_size`` times the sum of the ranks. Inside a block, head ``h``'s keys are
dims-major (dim ``d`` of the block's tokens is contiguous, so a block's logits are vector
FMAs) and its values token-major (a token's value is one contiguous vector).
:func:`reduced_attention` attends projected queries ``[T, Hq, QW]`` (query head ``q`` uses the
first ``k_rank`` dims of its KV head ``q // G``) over the cache ``[blocks, block_size * W]``
and returns reduced outputs ``[T, Hq, VW]`` fp32 (each head's first ``v_rank`` dims, the rest
zero), causal within each sequence as vLLM's ``query_start_loc`` / ``seq_lens`` describe.

The C++ op (``torch.ops.kvprune.reduced_attention``) deals (sequence, KV head) tasks to the
threads longest first (FDC §5.3's LPT schedule; ``balanced=False``: in order, equal counts);
:func:`reduced_attention_reference` is the plain-torch version it is tested against and the
fallback without the extension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvprune import kernels


@dataclass(frozen=True)
class PackedHeads:
    """Where each KV head's dims sit in a token's row: head by head, each head's keys then its
    values. A (sequence, head) task of the kernel so reads one contiguous span of each block
    (``block_size * (k_rank + v_rank)`` values); with all keys first, then all values, its keys
    and values were two spans far apart, and the 50%-dims decode was 17% slower (bench
    fdc-attention, SmolLM2's shape, 16 x 4096 tokens, bf16, Xeon)."""

    k_ranks: torch.Tensor  # [H] int32
    v_ranks: torch.Tensor  # [H] int32
    k_offsets: torch.Tensor  # [H] int64
    v_offsets: torch.Tensor  # [H] int64
    row_width: int  # sum of all ranks
    # Keys token-major inside a block, as values are (token t's dims at `block_size * k_offset
    # + t * k_rank`): the layout our Triton kernel reads fastest (docs/GPU.md); the C++ op
    # reads the default, dims-major.
    keys_by_token: bool = False

    @classmethod
    def from_ranks(cls, k_ranks, v_ranks, keys_by_token: bool = False) -> "PackedHeads":
        k_ranks = torch.as_tensor(k_ranks, dtype=torch.int32)
        v_ranks = torch.as_tensor(v_ranks, dtype=torch.int32)
        widths = k_ranks.long() + v_ranks.long()
        k_offsets = torch.cumsum(widths, 0) - widths
        v_offsets = k_offsets + k_ranks.long()
        return cls(k_ranks, v_ranks, k_offsets, v_offsets, int(k_ranks.sum() + v_ranks.sum()), keys_by_token)

    @property
    def num_heads(self) -> int:
        return int(self.k_ranks.shape[0])

    def columns(self, block_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """Per packed column, made once per block size and device and kept: each key column's
        head and dim, its offset in a block (``block_size * (k_offset + dim)``, or token-major
        ``block_size * k_offset + dim``) and token stride (1, or token-major its head's
        k_rank); each value column's head, dim, offset (``block_size * v_offset + dim``) and
        token stride (its head's v_rank)."""
        cached = self.__dict__.setdefault("_columns_by_block_size", {})
        device = torch.device(device)
        if (block_size, device) in cached:
            return cached[(block_size, device)]
        if block_size not in cached:
            key_heads = torch.repeat_interleave(torch.arange(self.num_heads), self.k_ranks.long())
            key_dims = torch.cat([torch.arange(int(r)) for r in self.k_ranks])
            value_heads = torch.repeat_interleave(torch.arange(self.num_heads), self.v_ranks.long())
            value_dims = torch.cat([torch.arange(int(r)) for r in self.v_ranks])
            if self.keys_by_token:
                key_columns = block_size * self.k_offsets[key_heads] + key_dims
                key_strides = self.k_ranks.long()[key_heads]
            else:
                key_columns = block_size * (self.k_offsets[key_heads] + key_dims)
                key_strides = torch.ones_like(key_columns)
            cached[block_size] = (key_heads, key_dims, key_columns, key_strides, value_heads, value_dims,
                                  block_size * self.v_offsets[value_heads] + value_dims,
                                  self.v_ranks.long()[value_heads])
        cached[(block_size, device)] = tuple(column.to(device) for column in cached[block_size])
        return cached[(block_size, device)]

    def _positions(self, slots: torch.Tensor, block_size: int, block_stride: int):
        """Flat element indices of the given slots' keys ``[n, sum k]`` and values ``[n, sum v]``
        in a cache viewed as ``[num_blocks * block_stride]`` (a block holds at least
        ``block_size * row_width`` values; the rest of it, if any, is unused)."""
        slots = slots.long()
        base = (slots // block_size) * block_stride
        within = slots % block_size
        key_heads, _, key_columns, key_strides, _, _, value_columns, value_strides = self.columns(block_size,
                                                                                                  slots.device)
        keys = base[:, None] + key_columns[None, :] + within[:, None] * key_strides[None, :]
        values = base[:, None] + value_columns[None, :] + within[:, None] * value_strides[None, :]
        return keys, values, key_heads

    def block_size_of(self, kv_cache: torch.Tensor, block_size: int | None) -> int:
        block_size = block_size or kv_cache.shape[1] // self.row_width
        if block_size * self.row_width > kv_cache.shape[1]:
            raise ValueError(f"blocks of {kv_cache.shape[1]} values cannot hold {block_size} rows of {self.row_width}")
        return block_size

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              block_size: int | None = None) -> None:
        """Store reduced keys/values ``[n, H, >= rank]`` of ``n`` tokens at ``slots`` of a cache
        ``[num_blocks, >= block_size * row_width]`` (``block_size`` default: as many as fit)."""
        block_size = self.block_size_of(kv_cache, block_size)
        keys, values, _ = self._positions(slots.to(kv_cache.device), block_size, kv_cache.shape[1])
        flat = kv_cache.view(-1)
        key_heads, key_dims, _, _, value_heads, value_dims, _, _ = self.columns(block_size, kv_cache.device)
        flat[keys.reshape(-1)] = key[:, key_heads, key_dims].reshape(-1).to(flat.dtype)
        flat[values.reshape(-1)] = value[:, value_heads, value_dims].reshape(-1).to(flat.dtype)

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor,
             block_size: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each head's keys ``[n, k_rank]`` and values ``[n, v_rank]`` at ``slots`` (fp32)."""
        block_size = self.block_size_of(kv_cache, block_size)
        keys, values, _ = self._positions(slots.to(kv_cache.device), block_size, kv_cache.shape[1])
        flat = kv_cache.view(-1)
        key_rows, value_rows = flat[keys].float(), flat[values].float()
        key_split = torch.split(key_rows, self.k_ranks.tolist(), dim=1)
        value_split = torch.split(value_rows, self.v_ranks.tolist(), dim=1)
        return list(key_split), list(value_split)


def reduced_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, heads: PackedHeads, scale: float,
                      output_width: int, balanced: bool = True, block_size: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[T, Hq, QW]`` over ``kv_cache`` ``[blocks, block_size * W]``;
    returns ``[T, Hq, output_width]`` fp32 (see the module docstring)."""
    output = torch.empty(query.shape[0], query.shape[1], output_width, dtype=torch.float32)
    block_size = heads.block_size_of(kv_cache, block_size)
    if kernels.HAS_EXTENSION and not heads.keys_by_token:  # the C++ op reads dims-major keys
        torch.ops.kvprune.reduced_attention(query.contiguous(), kv_cache.contiguous(), block_table, query_start_loc,
                                            seq_lens, heads.k_ranks, heads.v_ranks, heads.k_offsets,
                                            heads.v_offsets, block_size, float(scale), output, balanced)
        return output
    return reduced_attention_reference(query, kv_cache, block_table, query_start_loc, seq_lens, heads, scale,
                                       output_width, block_size)


def reduced_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, heads: PackedHeads,
                                scale: float, output_width: int, block_size: int | None = None) -> torch.Tensor:
    """The same in plain torch, a sequence and a head at a time (fp32)."""
    num_tokens, num_q_heads, _ = query.shape
    group = num_q_heads // heads.num_heads
    block_size = heads.block_size_of(kv_cache, block_size)
    output = torch.zeros(num_tokens, num_q_heads, output_width, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        first, last = starts[s], starts[s + 1]
        num_queries = last - first
        positions = torch.arange(seq_len)
        slots = block_table[s, positions // block_size].long() * block_size + positions % block_size
        head_keys, head_values = heads.read(kv_cache, slots, block_size)
        # Query i sees the keys before the sequence's new tokens and new tokens 0..i.
        visible = positions[None, :] <= (seq_len - num_queries + torch.arange(num_queries))[:, None]
        for h in range(heads.num_heads):
            k_rank, v_rank = int(heads.k_ranks[h]), int(heads.v_ranks[h])
            keys, values = head_keys[h], head_values[h]
            queries = query[first:last, h * group:(h + 1) * group, :k_rank].float()  # [n, G, k]
            logits = torch.einsum("ngk,jk->gnj", queries, keys) * scale
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            output[first:last, h * group:(h + 1) * group, :v_rank] = torch.einsum("gnj,jv->ngv", probs, values)
    return output
