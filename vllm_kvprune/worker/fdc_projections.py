"""FDC's four projections around the attention kernel: new keys and values into each head's
reduced space, queries into their KV head's, and the attention's output back to the model's
width. Three ways to run them, chosen by ``KVPRUNE_FDC_PROJECTIONS``:

* ``torch`` (the default): batched einsums over every head's rotation padded to the layer's
  widest rank, in fp32 (cuBLAS on a GPU, without TF32).
* ``triton``: one Triton launch a projection (``kernels/triton/projections.py``), each head at
  its own rank, bf16 activations read as they are; NVIDIA and AMD.
* ``cutlass``: one grouped GEMM a projection (``kernels/grouped_gemm.py``, ``csrc/cutlass``):
  every head's product at its own rank (rounded up to 4), no padding to the widest, no copies of
  the rotations per query head, one launch; fp32-accurate on tensor cores (3xTF32). CUDA only,
  with the ``[gpu]`` extra.

Neither GPU runner is the default: neither has run on a GPU yet (docs/GPU.md).

All return the same values (zero past each head's rank); the widths they return may differ
(CUTLASS's pads to a multiple of 4), which every consumer allows (it reads up to the ranks).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from vllm_kvprune import envs
from vllm_kvprune.config import KVConfigError
from vllm_kvprune.kernels import grouped_gemm
from vllm_kvprune.kernels.grouped_gemm import ALIGNMENT, GroupedGemm, Operand

ENV_VARIABLE = envs.name("FDC_PROJECTIONS")
KINDS = ("torch", "triton", "cutlass")


class FdcProjections(Protocol):
    def keys_values(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[T, H, d]`` reduced: fp32 ``[T, H, >= max k]``, zero past each rank."""

    def queries(self, index: int, query: torch.Tensor) -> torch.Tensor:
        """Queries ``[T, Hq, d]`` in their KV head's reduced space: fp32 ``[T, Hq, >= max k]``."""

    def output_width(self, index: int) -> int:
        """The width the attention's output must have for :meth:`outputs`."""

    def outputs(self, index: int, out: torch.Tensor) -> torch.Tensor:
        """The attention's output ``[T, Hq, output_width]`` (zero past ranks) back: fp32 ``[T, Hq, d]``."""


class EinsumProjections:
    """torch's einsums over rotations ``[H, d, max k]`` (zero columns past each rank)."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self._per_query_head: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys_values(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[index]
        return (torch.einsum("thd,hdk->thk", key.float(), layer.qk_rotation),
                torch.einsum("thd,hdk->thk", value.float(), layer.v_rotation))

    def queries(self, index: int, query: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tqd,qdk->tqk", query.float(), self.per_query_head(index, query.shape[1])[0])

    def output_width(self, index: int) -> int:
        return self.layers[index].v_rotation.shape[-1]

    def outputs(self, index: int, out: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tqk,qdk->tqd", out, self.per_query_head(index, out.shape[1])[1])

    def per_query_head(self, index: int, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query head's copy of its KV head's rotations (``[Hq, d, k]``), made once a layer."""
        cached = self._per_query_head.get(index)
        if cached is None:
            layer = self.layers[index]
            group = num_q_heads // layer.qk_rotation.shape[0]
            cached = (layer.qk_rotation.repeat_interleave(group, dim=0).contiguous(),
                      layer.v_rotation.repeat_interleave(group, dim=0).contiguous())
            self._per_query_head[index] = cached
        return cached


class TritonProjections:
    """One Triton launch a projection (``kernels/triton/projections.py``), each head at its own
    rank, on the einsums' rotations and widths (NVIDIA and AMD)."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        device = layers[0].qk_rotation.device if layers else "cpu"
        ranks = [(layer.heads.k_ranks.to(device, torch.int32), layer.heads.v_ranks.to(device, torch.int32))
                 for layer in layers]
        self.k_ranks, self.v_ranks = [k for k, _ in ranks], [v for _, v in ranks]
        # Keys, values and queries read every dim of a head; the output every reduced V dim.
        self.full = [torch.full_like(k, layer.qk_rotation.shape[1]) for k, layer in zip(self.k_ranks, layers)]

    def keys_values(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm_kvprune.kernels.triton.projections import head_projection

        layer, full = self.layers[index], self.full[index]
        return (head_projection(_last_contiguous(key), layer.qk_rotation, self.k_ranks[index], full,
                                layer.qk_rotation.shape[-1]),
                head_projection(_last_contiguous(value), layer.v_rotation, self.v_ranks[index], full,
                                layer.v_rotation.shape[-1]))

    def queries(self, index: int, query: torch.Tensor) -> torch.Tensor:
        from vllm_kvprune.kernels.triton.projections import head_projection

        layer = self.layers[index]
        return head_projection(_last_contiguous(query), layer.qk_rotation, self.k_ranks[index], self.full[index],
                               layer.qk_rotation.shape[-1])

    def output_width(self, index: int) -> int:
        return self.layers[index].v_rotation.shape[-1]

    def outputs(self, index: int, out: torch.Tensor) -> torch.Tensor:
        from vllm_kvprune.kernels.triton.projections import head_projection

        # The V rotation read transposed: [H, k_v, d] over [H, d, k_v]'s storage.
        rotation = self.layers[index].v_rotation
        return head_projection(_last_contiguous(out), rotation.transpose(1, 2), self.full[index],
                               self.v_ranks[index], rotation.shape[1])


class GroupedProjections:
    """A grouped GEMM a projection, each head at its own rank rounded up to :data:`ALIGNMENT`.

    Invariant: a layer's padded rotations ``[H, d, W]`` (``W`` its widest rank rounded up) are
    zero past each head's rank, so the rounded-up columns compute zeros. ``runner``: ``"cutlass"``
    (one launch; under CUDA-graph capture, where a launch's table of addresses would be frozen,
    torch's products instead) or ``"torch"`` (a product a group: the reference for the groups)."""

    def __init__(self, layers: list, runner: str = "cutlass") -> None:
        self.runner = runner
        self.qk = [_padded(layer.qk_rotation) for layer in layers]
        self.v = [_padded(layer.v_rotation) for layer in layers]
        self.k_widths = [[_round_up(int(rank)) for rank in layer.heads.k_ranks.tolist()] for layer in layers]
        self.v_widths = [[_round_up(int(rank)) for rank in layer.heads.v_ranks.tolist()] for layer in layers]

    def keys_values(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gemm = GroupedGemm()
        reduced = []
        for tokens, rotation, widths in ((key, self.qk[index], self.k_widths[index]),
                                         (value, self.v[index], self.v_widths[index])):
            tokens = tokens.float().contiguous()
            num_tokens, num_heads, head_dim = tokens.shape
            width = rotation.shape[-1]
            out = torch.zeros(num_tokens, num_heads, width, device=tokens.device)
            for h, n in enumerate(widths):
                gemm.add(num_tokens, n, head_dim, Operand(tokens, h * head_dim, num_heads * head_dim),
                         Operand(rotation, h * head_dim * width, width), Operand(out, h * width, num_heads * width))
            reduced.append(out)
        self._run(gemm)
        return reduced[0], reduced[1]

    def queries(self, index: int, query: torch.Tensor) -> torch.Tensor:
        query = query.float().contiguous()
        num_tokens, num_q_heads, head_dim = query.shape
        rotation, widths = self.qk[index], self.k_widths[index]
        width, group = rotation.shape[-1], num_q_heads // len(widths)
        out = torch.zeros(num_tokens, num_q_heads, width, device=query.device)
        gemm = GroupedGemm()
        for q in range(num_q_heads):
            h = q // group
            gemm.add(num_tokens, widths[h], head_dim, Operand(query, q * head_dim, num_q_heads * head_dim),
                     Operand(rotation, h * head_dim * width, width), Operand(out, q * width, num_q_heads * width))
        self._run(gemm)
        return out

    def output_width(self, index: int) -> int:
        return self.v[index].shape[-1]

    def outputs(self, index: int, out: torch.Tensor) -> torch.Tensor:
        out = out.float().contiguous()
        num_tokens, num_q_heads, width = out.shape
        rotation, widths = self.v[index], self.v_widths[index]
        head_dim, group = rotation.shape[1], num_q_heads // len(widths)
        result = torch.empty(num_tokens, num_q_heads, head_dim, device=out.device)
        # B is the V rotation read transposed: element (k, j) of head h at h*d*W + j*W + k.
        gemm = GroupedGemm(b_column_major=True)
        for q in range(num_q_heads):
            h = q // group
            gemm.add(num_tokens, head_dim, widths[h], Operand(out, q * width, num_q_heads * width),
                     Operand(rotation, h * head_dim * width, width),
                     Operand(result, q * head_dim, num_q_heads * head_dim))
        self._run(gemm)
        return result

    def _run(self, gemm: GroupedGemm) -> None:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self.runner == "cutlass" and not capturing:
            gemm.run_cutlass()
        else:
            gemm.run_torch()


def requested_kind() -> str:
    """What ``KVPRUNE_FDC_PROJECTIONS`` asks for (``torch`` when unset)."""
    return envs.get("FDC_PROJECTIONS", "torch")


def refusal(kind: str, platform: str | None = None) -> str | None:
    """Why runner ``kind`` cannot run (None: it can, as far as can be told before its op loads).
    ``platform`` is ``cpu``, ``cuda`` or ``rocm``; None checks the value alone (the front end of
    a policy without FDC refuses a typo, not a GPU runner set on a CPU machine)."""
    if kind not in KINDS:
        return f"{kind!r} is not one of {', '.join(KINDS)}"
    if platform == "cpu" and kind != "torch":
        device = "a CUDA device" if kind == "cutlass" else "a GPU"
        return f"{kind} needs {device}; the cache is on the CPU here (use torch, the default)"
    if platform == "rocm" and kind == "cutlass":
        return "cutlass needs a CUDA device (CUTLASS is NVIDIA's); on ROCm use triton"
    return None


def platform_of(device: torch.device | str) -> str:
    """``cpu``, ``cuda`` or ``rocm`` (torch calls a ROCm device ``cuda``)."""
    kind = torch.device(device).type
    return "rocm" if kind == "cuda" and torch.version.hip else kind


def projections_for(layers: list, device: torch.device | str, kind: str | None = None) -> FdcProjections:
    """The projections ``KVPRUNE_FDC_PROJECTIONS`` (or ``kind``) asks for, on ``device``; raises
    KVConfigError (a ValueError) naming the variable for a kind that cannot run here (never falls back silently).
    The front end refuses the same with :func:`refusal` before the engine starts."""
    kind = kind or requested_kind()
    problem = refusal(kind, platform_of(device))
    if problem is not None:
        raise KVConfigError(ENV_VARIABLE, problem)
    if kind == "torch":
        return EinsumProjections(layers)
    if kind == "triton":
        return TritonProjections(layers)
    if not grouped_gemm.load_cutlass_ops():
        raise KVConfigError(ENV_VARIABLE, f"cutlass: {grouped_gemm.cutlass_load_error()}")
    return GroupedProjections(layers, runner="cutlass")


def _last_contiguous(tokens: torch.Tensor) -> torch.Tensor:
    return tokens if tokens.stride(-1) == 1 else tokens.contiguous()


def _round_up(size: int) -> int:
    return math.ceil(size / ALIGNMENT) * ALIGNMENT


def _padded(rotation: torch.Tensor) -> torch.Tensor:
    """``[H, d, k]`` with zero columns up to a multiple of :data:`ALIGNMENT`, contiguous."""
    width = _round_up(rotation.shape[-1])
    return torch.nn.functional.pad(rotation.float(), (0, width - rotation.shape[-1])).contiguous()
