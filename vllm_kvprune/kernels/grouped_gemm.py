"""Grouped GEMMs: many small fp32 products of different shapes, described once and run either by
CUTLASS (``csrc/cutlass``, one launch on a CUDA device) or by torch (a product per group, the
reference and the fallback).

A group ``g`` computes ``D_g = A_g @ B_g`` with ``A_g`` ``[m, k]`` and ``D_g`` ``[m, n]`` row-major
inside some tensor (any leading dimension), and ``B_g`` ``[k, n]`` row-major or column-major (a
matrix read transposed). FDC's projections are such groups: a head's tokens times that head's
rotation cut to its rank (``worker/fdc_projections.py``).

CUTLASS reads 16-byte vectors, so every ``n``, ``k``, leading dimension and element offset must
be a multiple of :data:`ALIGNMENT` and every tensor's address 16-byte aligned:
:meth:`GroupedGemm.check_alignment` says which is not. The torch runner has no such need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvprune.kernels.cutlass_headers import cutlass_include_dir
from vllm_kvprune.kernels.op_library import REPOSITORY, OpLibrary

ALIGNMENT = 4  # fp32 elements in a 16-byte access (kvprune_cutlass::kAlignment)


@dataclass(frozen=True)
class Operand:
    """A row-major (or, for B, possibly column-major) matrix inside ``tensor``'s storage,
    starting ``offset`` elements after ``tensor``'s first, ``ld`` elements between rows (columns)."""

    tensor: torch.Tensor
    offset: int
    ld: int

    def view(self, rows: int, cols: int, column_major: bool = False) -> torch.Tensor:
        strides = (1, self.ld) if column_major else (self.ld, 1)
        return self.tensor.as_strided((rows, cols), strides, self.tensor.storage_offset() + self.offset)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr() + self.offset * self.tensor.element_size()


@dataclass
class GroupedGemm:
    """Groups of ``D = A @ B`` (fp32). ``b_column_major`` holds for every group."""

    b_column_major: bool = False
    sizes: list[tuple[int, int, int]] = field(default_factory=list)  # (m, n, k) per group
    a: list[Operand] = field(default_factory=list)
    b: list[Operand] = field(default_factory=list)
    d: list[Operand] = field(default_factory=list)

    def add(self, m: int, n: int, k: int, a: Operand, b: Operand, d: Operand) -> None:
        self.sizes.append((m, n, k))
        self.a.append(a), self.b.append(b), self.d.append(d)

    def check_alignment(self) -> str | None:
        """Why CUTLASS could not run these groups (None if it can)."""
        for g, ((m, n, k), *operands) in enumerate(zip(self.sizes, self.a, self.b, self.d)):
            if n % ALIGNMENT or k % ALIGNMENT:
                return f"group {g}: n={n}, k={k} are not multiples of {ALIGNMENT}"
            for name, operand in zip("abd", operands):
                if operand.tensor.dtype != torch.float32:
                    return f"group {g}: {name} is {operand.tensor.dtype}, not float32"
                if operand.ld % ALIGNMENT or operand.offset % ALIGNMENT or operand.address % 16:
                    return f"group {g}: {name}'s leading dimension {operand.ld} or address is not 16-byte aligned"
        return None

    def run_torch(self) -> None:
        """Every group as one torch product (fp32)."""
        for (m, n, k), a, b, d in zip(self.sizes, self.a, self.b, self.d):
            torch.mm(a.view(m, k), b.view(k, n, self.b_column_major), out=d.view(m, n))

    def run_cutlass(self) -> None:
        """Every group in one CUTLASS launch on the current stream (see :func:`load_cutlass_ops`)."""
        if not self.sizes:
            return
        if (reason := self.check_alignment()) is not None:
            raise ValueError(f"CUTLASS's grouped GEMM cannot run these groups: {reason}")
        if not load_cutlass_ops():
            raise RuntimeError(f"the CUTLASS ops are not available: {LIBRARY.error}")
        device = self.d[0].tensor.device
        # One pinned host table, one asynchronous copy: addresses and leading dimensions of A, B, D
        # (the op reads them as [3, G] each; `tests/test_fdc_projections.py` checks this contract).
        table = torch.tensor([[o.address for o in self.a], [o.address for o in self.b], [o.address for o in self.d],
                              [o.ld for o in self.a], [o.ld for o in self.b], [o.ld for o in self.d]],
                             dtype=torch.int64)
        sizes = torch.tensor(self.sizes, dtype=torch.int32)
        if device.type == "cuda":
            table, sizes = table.pin_memory(), sizes.pin_memory()
        on_device = table.to(device, non_blocking=True)
        # Row slices of the contiguous [6, G] table: contiguous [3, G] each.
        torch.ops.kvprune_cutlass.grouped_gemm(sizes.to(device, non_blocking=True), sizes, on_device[:3],
                                               on_device[3:], self.b_column_major)


def _cutlass_includes() -> tuple[list[str] | None, str]:
    include, where = cutlass_include_dir()
    return (None, where) if include is None else ([str(include), str(_SOURCES)], "")


_SOURCES = REPOSITORY / "csrc" / "cutlass"
# setup.py builds every .cu of the folder; without a checkout (a wheel) the kernel's path still
# names what is missing.
LIBRARY = OpLibrary("CUTLASS ops", module="vllm_kvprune._cutlass_C", probe="kvprune_cutlass.grouped_gemm",
                    jit_name="kvprune_cutlass_projections",
                    sources=sorted(_SOURCES.glob("*.cu")) or [_SOURCES / "fdc_projections.cu"],
                    extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"], include_dirs=_cutlass_includes)


def load_cutlass_ops() -> bool:
    """Whether ``torch.ops.kvprune_cutlass.grouped_gemm`` is available: from the extension
    ``vllm_kvprune._cutlass_C`` that ``setup.py`` built, else JIT-built from ``csrc/cutlass``
    where a CUDA device, a CUDA torch, nvcc and CUTLASS's headers are. Remembered per process;
    never raises (:func:`cutlass_load_error` says why not)."""
    return LIBRARY.load()


def cutlass_load_error() -> str | None:
    return LIBRARY.error
