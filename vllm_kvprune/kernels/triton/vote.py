"""GVote's votes on the GPU: which keys some synthetic query of a KV head's group votes for.

:func:`keep_mask` returns exactly ``GVotePolicy.keep_mask`` (``vllm_kvprune.policies.gvote``):
each synthetic query row ``(s, q)`` of ``synthetic [S, Hq, D]`` votes for the keys of its KV
head ``q // G`` in ``keys [H, P, D]`` whose logit reaches its threshold, the ``budgets[q]``-th
largest logit of the row (a key whose logit equals the threshold is kept, so ties at the
boundary may keep more than ``budget`` keys); a KV head keeps the union over its group and
over the samples, ``[H, P]`` bool.

Split between torch and Triton, and why:

* The logits ``[H, G, S, P]`` are the same torch einsum as the policy's, in fp32. The
  comparison must see the very values the thresholds were taken from: a kernel recomputing
  the logits in another summation order would be off by an ulp here and there and could drop
  the key that *is* a row's threshold. Computing them as the policy does makes the mask
  bit-identical to it on the same device, ties included.
* The thresholds are ``torch.topk`` at the largest budget, then each row's own rank. A
  threshold is a value of the row, so any exact selection gives the same one; torch's
  radix-select top-k is already near the memory roofline on a GPU.
* The Triton kernel fuses ``logits >= threshold`` with the OR over the group and the samples:
  one read of the logits, one byte written per key, instead of a ``[H, G, S, P]`` bool tensor
  and two reductions over it.

Cost: the logits are materialised (``Hq * S * P`` fp32), as in the policy; ``budgets`` is read
on the host once (the range check and top-k's ``k``), one device sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows (group member x sample) and keys one program's tile covers.
_BLOCK_ROWS = 16
_BLOCK_KEYS = 128


@triton.jit
def _vote_kernel(
    logits_ptr, thresholds_ptr, out_ptr,
    samples, num_rows, num_keys,
    logits_stride_h, logits_stride_g, logits_stride_s, logits_stride_p,
    thresholds_stride_h, out_stride_h,
    BLOCK_ROWS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
):
    """Program (h, j): keys ``[j * BLOCK_KEYS, (j + 1) * BLOCK_KEYS)`` of KV head h. Row ``r`` of
    the head is group member ``r // samples``, sample ``r % samples``; ``out[h, p] = 1`` iff
    some row's ``logits[h, g, s, p] >= thresholds[h, r]``."""
    head = tl.program_id(0).to(tl.int64)
    keys = tl.program_id(1) * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    key_ok = keys < num_keys
    votes = tl.zeros([BLOCK_KEYS], tl.int32)
    for first_row in range(0, num_rows, BLOCK_ROWS):
        rows = first_row + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < num_rows
        member = (rows // samples).to(tl.int64)
        sample = (rows % samples).to(tl.int64)
        row_ptrs = logits_ptr + head * logits_stride_h + member * logits_stride_g + sample * logits_stride_s
        logits = tl.load(row_ptrs[:, None] + keys[None, :].to(tl.int64) * logits_stride_p,
                         mask=row_ok[:, None] & key_ok[None, :], other=float("-inf"))
        thresholds = tl.load(thresholds_ptr + head * thresholds_stride_h + rows, mask=row_ok, other=float("inf"))
        hit = (logits >= thresholds[:, None]) & row_ok[:, None] & key_ok[None, :]
        votes = tl.maximum(votes, tl.max(hit.to(tl.int32), axis=0))
    tl.store(out_ptr + head * out_stride_h + keys, votes.to(tl.uint8), mask=key_ok)


def keep_mask(synthetic: torch.Tensor, keys: torch.Tensor, budgets: torch.Tensor, scale: float) -> torch.Tensor:
    """The union of the votes per KV head, ``[H, P]`` bool on the keys' device.

    synthetic: ``[S, Hq, D]`` queries (computed in fp32); keys: ``[H, P, D]``, ``Hq`` a multiple
    of ``H``; budgets: integer ``[Hq]``, each in ``1 .. P``; ``scale`` multiplies the logits.
    Raises ValueError on shapes, dtypes, devices or budgets out of range.
    """
    if synthetic.dim() != 3 or not synthetic.dtype.is_floating_point:
        raise ValueError(f"synthetic must be floating [S, Hq, D], got {synthetic.dtype} {list(synthetic.shape)}")
    if keys.dim() != 3 or not keys.dtype.is_floating_point:
        raise ValueError(f"keys must be floating [H, P, D], got {keys.dtype} {list(keys.shape)}")
    samples, num_q_heads, head_dim = synthetic.shape
    num_kv_heads, num_keys, key_dim = keys.shape
    if key_dim != head_dim:
        raise ValueError(f"synthetic has {head_dim} dims, keys {key_dim}")
    if num_kv_heads == 0 or num_q_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a whole group of {num_kv_heads} KV heads")
    if budgets.dtype.is_floating_point or budgets.dtype.is_complex or budgets.dtype == torch.bool:
        raise ValueError(f"budgets must be an integer tensor, got {budgets.dtype}")
    if tuple(budgets.shape) != (num_q_heads,):
        raise ValueError(f"budgets must be [{num_q_heads}], got {list(budgets.shape)}")
    for name, tensor in (("synthetic", synthetic), ("budgets", budgets)):
        if tensor.device != keys.device:
            raise ValueError(f"{name} is on {tensor.device}, keys on {keys.device}")
    low, high = (int(v) for v in torch.stack([budgets.min(), budgets.max()]).tolist())
    if low < 1 or high > num_keys:
        raise ValueError(f"budgets must lie in 1..{num_keys} (the keys of a head), got {low}..{high}")

    group = num_q_heads // num_kv_heads
    grouped = synthetic.float().view(samples, num_kv_heads, group, head_dim)
    # The policy's own expression, so the logits (and hence the ties) are the same values.
    logits = torch.einsum("shgd,hpd->hgsp", grouped, keys.float()) * scale  # [H, G, S, P]
    top = torch.topk(logits, high, dim=-1).values  # [H, G, S, high], best first
    rank = (budgets.to(torch.int64).view(num_kv_heads, group, 1, 1) - 1).expand(-1, -1, samples, 1)
    thresholds = top.gather(-1, rank).reshape(num_kv_heads, group * samples).contiguous()  # row = g * S + s

    out = torch.zeros(num_kv_heads, num_keys, dtype=torch.uint8, device=keys.device)
    if samples == 0:
        return out.view(torch.bool)
    grid = (num_kv_heads, triton.cdiv(num_keys, _BLOCK_KEYS))
    _vote_kernel[grid](
        logits, thresholds, out,
        samples, group * samples, num_keys,
        logits.stride(0), logits.stride(1), logits.stride(2), logits.stride(3),
        thresholds.stride(0), out.stride(0),
        BLOCK_ROWS=_BLOCK_ROWS, BLOCK_KEYS=_BLOCK_KEYS,
    )
    return out.view(torch.bool)
