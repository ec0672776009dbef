"""FDC's projections in Triton: every head times its own KV head's rotation at that head's own
rank, one launch a projection (``worker/fdc_projections.py``'s ``triton`` runner; CUTLASS's
grouped GEMM is the other, NVIDIA-only, ``csrc/cutlass``).

:func:`head_projection` computes, for each token ``t`` and head ``q`` of ``tokens`` ``[T, Hh, K]``
(``Hh`` a multiple of the rotations' ``H``; head ``q`` belongs to KV head ``h = q // (Hh / H)``)::

    out[t, q, :n[h]] = tokens[t, q, :k[h]] @ rotations[h, :k[h], :n[h]]      (fp32)

and leaves ``out[t, q, n[h]:]`` zero. The four projections are all of this form: keys, values
and queries with ``k = d`` and ``n`` the ranks; the output with the V rotation read transposed,
``k`` the V ranks and ``n = d``. Inputs are loaded in their own dtype (no fp32 copy of bf16
activations first) and multiplied in fp32: 3xTF32 where the GPU's Triton takes it (fp32's
accuracy on tensor cores, as CUTLASS's kernel), else IEEE.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvprune.kernels.triton import device_limits


@triton.jit
def _head_projection_kernel(
    tokens_ptr, rotations_ptr, out_ptr, out_widths_ptr, in_widths_ptr,
    num_tokens, group,
    tokens_stride_t, tokens_stride_h, rotations_stride_h, rotations_stride_k, rotations_stride_n,
    out_stride_t, out_stride_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (i, q, j): tokens [i * BLOCK_M, ...) of head q, output columns [j * BLOCK_N, ...);
    a program whose columns all lie past its head's width does nothing."""
    head = tl.program_id(1).to(tl.int64)
    owner = head // group
    width = tl.load(out_widths_ptr + owner)
    depth = tl.load(in_widths_ptr + owner)
    if tl.program_id(2) * BLOCK_N < width:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < num_tokens, cols < width
        tokens_rows = tokens_ptr + rows.to(tl.int64)[:, None] * tokens_stride_t + head * tokens_stride_h
        rotation = rotations_ptr + owner * rotations_stride_h + cols[None, :] * rotations_stride_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, depth, BLOCK_K):
            dims = start + tl.arange(0, BLOCK_K)
            dim_ok = dims < depth
            a = tl.load(tokens_rows + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            b = tl.load(rotation + dims[:, None] * rotations_stride_k, mask=dim_ok[:, None] & col_ok[None, :],
                        other=0.0)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
        out = out_ptr + rows.to(tl.int64)[:, None] * out_stride_t + head * out_stride_h + cols[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def head_projection(tokens: torch.Tensor, rotations: torch.Tensor, out_widths: torch.Tensor,
                    in_widths: torch.Tensor, out_width: int) -> torch.Tensor:
    """``[T, Hh, out_width]`` fp32 (see the module docstring).

    tokens: ``[T, Hh, >= K]``, any float dtype, contiguous last dimension. rotations: ``[H, K, N]``
    with ``N <= out_width``, any strides (a transposed view reads the V rotation for the
    output). out_widths / in_widths: int32 ``[H]`` on the tokens' device, each at most ``N``
    / ``K``."""
    if tokens.dim() != 3 or rotations.dim() != 3 or tokens.shape[2] < rotations.shape[1]:
        raise ValueError(f"tokens [T, Hh, >= K] must cover rotations [H, K, N], got {list(tokens.shape)} "
                         f"and {list(rotations.shape)}")
    num_tokens, num_heads, _ = tokens.shape
    num_owners = rotations.shape[0]
    if num_heads % num_owners or tokens.stride(2) != 1 or rotations.shape[2] > out_width:
        raise ValueError(f"{num_heads} heads over {num_owners} rotations, tokens' last stride {tokens.stride(2)}, "
                         f"rotations {rotations.shape[2]} wide for an output {out_width} wide")
    for name, widths in (("out_widths", out_widths), ("in_widths", in_widths)):
        if widths.shape != (num_owners,) or widths.dtype != torch.int32 or widths.device != tokens.device:
            raise ValueError(f"{name} must be int32 [{num_owners}] on {tokens.device}, got {widths.dtype} "
                             f"{list(widths.shape)} on {widths.device}")
    out = torch.zeros(num_tokens, num_heads, out_width, dtype=torch.float32, device=tokens.device)
    if num_tokens == 0:
        return out
    limits = device_limits(tokens.device)
    precision = "tf32x3" if "tf32x3" in limits.dot_precisions else "ieee"
    # tl.dot needs 16 at least each way; a decode step has few tokens, a prefill chunk many.
    block_m = 16 if num_tokens <= 16 else 64
    block_n = max(16, min(64, triton.next_power_of_2(rotations.shape[2])))
    grid = (triton.cdiv(num_tokens, block_m), num_heads, triton.cdiv(rotations.shape[2], block_n))
    _head_projection_kernel[grid](
        tokens, rotations, out, out_widths, in_widths,
        num_tokens, num_heads // num_owners,
        tokens.stride(0), tokens.stride(1), rotations.stride(0), rotations.stride(1), rotations.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32, PRECISION=precision,
    )
    return out
