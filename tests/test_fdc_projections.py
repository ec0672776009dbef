"""FDC's projections as grouped GEMMs (`worker/fdc_projections.py`, `kernels/grouped_gemm.py`)
against torch's einsums, the path FdcLayers has always run.

On this CPU the groups run through torch (`runner="torch"`, a product a group), which checks
everything the CUDA path shares with it: each head's operands (offsets, leading dimensions, the
V rotation read column-major), the ranks rounded up to 4 (the rounded-up columns must compute
zeros), GQA's query heads reading their KV head's rotation, strided inputs, and that every group
CUTLASS would get passes its alignment check. On a CUDA device with the CUTLASS op built
(`scripts/gpu_check.sh`), the same groups run in one CUTLASS launch a projection and must agree.
The compile check (`tools/cutlass_check.py`) compiles the CUTLASS kernel for real GPUs here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from vllm_kvprune.fdc.calibration import FdcCalibration
from vllm_kvprune.kernels import grouped_gemm
from vllm_kvprune.kernels.grouped_gemm import GroupedGemm, Operand
from vllm_kvprune.worker import fdc_projections
from vllm_kvprune.worker.fdc_layers import FdcLayers, blocks_of
from vllm_kvprune.worker.fdc_projections import EinsumProjections, GroupedProjections

HEAD_DIM = 16
K_RANKS = ((5, 16, 9), (3, 1, 8))  # per layer, per KV head: not multiples of 4, full width, 1
V_RANKS = ((12, 7, 16), (2, 11, 4))
GROUP = 3  # query heads per KV head


def _fdc(device: str = "cpu") -> FdcLayers:
    generator = torch.Generator().manual_seed(3)
    layers, heads = len(K_RANKS), len(K_RANKS[0])
    rotation = torch.linalg.qr(torch.randn(layers, heads, HEAD_DIM, HEAD_DIM, generator=generator)).Q
    v_rotation = torch.linalg.qr(torch.randn(layers, heads, HEAD_DIM, HEAD_DIM, generator=generator)).Q
    singular = torch.linspace(1, 0, HEAD_DIM).expand(layers, heads, -1).contiguous()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fdc.safetensors"
        FdcCalibration(rotation, singular, v_rotation, singular.clone(), torch.tensor(K_RANKS, dtype=torch.int32),
                       torch.tensor(V_RANKS, dtype=torch.int32), settings={}).save(path)
        return FdcLayers(str(path), None).to(device)


def _tokens(num_tokens: int, heads: int, dtype: torch.dtype, seed: int, strided: bool = False) -> torch.Tensor:
    """[T, heads, d]; `strided`: a column slice of a wider row, as vLLM's k of a fused qkv is."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, heads + 2, HEAD_DIM, generator=generator).to(dtype)
    return wide[:, 1:heads + 1] if strided else wide[:, :heads].contiguous()


def _agree(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    """Equal on the expected's width and zero past it."""
    width = expected.shape[-1]
    torch.testing.assert_close(actual[..., :width], expected, atol=tolerance, rtol=tolerance)
    assert not actual[..., width:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_grouped_projections_match_the_einsums(dtype: torch.dtype, strided: bool) -> None:
    fdc = _fdc()
    einsum, grouped = EinsumProjections(fdc.layers), GroupedProjections(fdc.layers, runner="torch")
    heads = fdc.num_kv_heads
    for index in range(len(K_RANKS)):
        key, value = _tokens(7, heads, dtype, 1, strided), _tokens(7, heads, dtype, 2, strided)
        for actual, expected in zip(grouped.keys_values(index, key, value), einsum.keys_values(index, key, value)):
            _agree(actual, expected)
        query = _tokens(7, heads * GROUP, dtype, 3, strided)
        _agree(grouped.queries(index, query), einsum.queries(index, query))
        # An attention output: zero past each query head's V rank, at each path's width.
        out = torch.randn(7, heads * GROUP, grouped.output_width(index), generator=torch.Generator().manual_seed(4))
        v_ranks = torch.tensor(V_RANKS[index]).repeat_interleave(GROUP)
        out *= (torch.arange(out.shape[-1]) < v_ranks[:, None]).float()
        assert grouped.output_width(index) >= einsum.output_width(index)
        torch.testing.assert_close(grouped.outputs(index, out),
                                   einsum.outputs(index, out[..., : einsum.output_width(index)].contiguous()),
                                   atol=1e-5, rtol=1e-5)


def test_every_group_cutlass_gets_is_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups the projections build pass the check CUTLASS's kernel needs, strided inputs
    and odd ranks included; a check that refuses nothing would pass this, so the next test
    shows it refuses."""
    checked = []
    run_torch = GroupedGemm.run_torch

    def checking(gemm: GroupedGemm) -> None:
        checked.append(gemm.check_alignment())
        run_torch(gemm)

    monkeypatch.setattr(GroupedGemm, "run_torch", checking)
    fdc = _fdc()
    grouped = GroupedProjections(fdc.layers, runner="torch")
    key = _tokens(5, fdc.num_kv_heads, torch.bfloat16, 1, strided=True)
    grouped.keys_values(1, key, key)
    grouped.outputs(1, torch.zeros(5, fdc.num_kv_heads * GROUP, grouped.output_width(1)))
    grouped.queries(0, _tokens(5, fdc.num_kv_heads * GROUP, torch.float32, 3, strided=True))
    assert checked == [None, None, None]


def test_alignment_check_names_what_cutlass_cannot_read() -> None:
    matrix = torch.zeros(8, 8)
    aligned = Operand(matrix, 0, 8)

    def single(m, n, k, a=aligned, b=aligned, d=aligned) -> str | None:
        gemm = GroupedGemm()
        gemm.add(m, n, k, a, b, d)
        return gemm.check_alignment()

    assert single(8, 8, 8) is None
    assert "n=5" in single(8, 5, 8)
    assert "k=6" in single(8, 8, 6)
    assert "a's leading dimension 6" in single(4, 4, 4, a=Operand(matrix, 0, 6))
    assert "b's leading dimension" in single(4, 4, 4, b=Operand(matrix, 2, 8))
    assert "float32" in single(4, 4, 4, d=Operand(matrix.half(), 0, 8))


def test_fdc_layers_attend_the_same_through_either_projections() -> None:
    """The whole layer (write, queries, the C++ reduced attention at the grouped width, output)
    gives the einsums' output with the grouped projections."""
    fdc = _fdc()
    heads, block_size, num_tokens = fdc.num_kv_heads, 32, 40
    width = fdc.layer_widths[0]
    cache = torch.zeros(4, heads, block_size, width // heads)
    key, value = _tokens(num_tokens, heads, torch.float32, 1), _tokens(num_tokens, heads, torch.float32, 2)
    query = _tokens(num_tokens, heads * GROUP, torch.float32, 3)
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    # Two sequences of 20 tokens (a prefill each), in blocks 0-1 and 2-3.
    slots = torch.cat([torch.arange(20), 64 + torch.arange(20)])
    starts, lengths = torch.tensor([0, 20, 40], dtype=torch.int32), torch.tensor([20, 20], dtype=torch.int32)
    outputs = []
    for projections in (EinsumProjections(fdc.layers), GroupedProjections(fdc.layers, runner="torch")):
        fdc.projections = projections
        cache.zero_()
        fdc.write(0, key, value, cache, slots, block_size,
                  writer=lambda h, rows, s, k, v, bs: h.write(rows, s, k, v, block_size=bs))
        outputs.append((blocks_of(cache).clone(), fdc.attend(0, query, cache, table, starts, lengths, 0.25, block_size)))
    # The same values cached, to fp32 rounding: the two paths' matrix products may sum in
    # another order (on an AVX-512 machine they differ in the last bit of a few hundred values).
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=1e-5, rtol=1e-5)


def test_projections_refuse_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = _fdc().layers
    assert isinstance(fdc_projections.projections_for(layers, "cpu"), EinsumProjections)
    monkeypatch.setenv(fdc_projections.ENV_VARIABLE, "cublas")
    with pytest.raises(ValueError, match="KVPRUNE_FDC_PROJECTIONS: 'cublas' is not one of torch, triton, cutlass"):
        fdc_projections.projections_for(layers, "cpu")
    monkeypatch.setenv(fdc_projections.ENV_VARIABLE, "triton")
    with pytest.raises(ValueError, match="KVPRUNE_FDC_PROJECTIONS: triton needs a GPU; the cache is on the CPU"):
        fdc_projections.projections_for(layers, "cpu")
    monkeypatch.setenv(fdc_projections.ENV_VARIABLE, "cutlass")
    with pytest.raises(ValueError, match="KVPRUNE_FDC_PROJECTIONS: cutlass needs a CUDA device"):
        fdc_projections.projections_for(layers, "cpu")


@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUTLASS's grouped GEMM runs on a CUDA device")
def test_cutlass_groups_match_torch_on_the_gpu() -> None:
    if not grouped_gemm.load_cutlass_ops():
        pytest.fail(f"a CUDA device but no CUTLASS op: {grouped_gemm.cutlass_load_error()}")
    fdc = _fdc("cuda")
    on_torch, on_cutlass = (GroupedProjections(fdc.layers, runner=runner) for runner in ("torch", "cutlass"))
    heads = fdc.num_kv_heads
    for num_tokens in (1, 33, 300):
        key = _tokens(num_tokens, heads, torch.bfloat16, 1, strided=True).cuda()
        query = _tokens(num_tokens, heads * GROUP, torch.bfloat16, 3).cuda()
        for index in range(len(K_RANKS)):
            for actual, expected in zip(on_cutlass.keys_values(index, key, key), on_torch.keys_values(index, key, key)):
                torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)  # 3xTF32: fp32's accuracy
            reduced = on_cutlass.queries(index, query)
            torch.testing.assert_close(reduced, on_torch.queries(index, query), atol=2e-5, rtol=2e-5)
            out = reduced[..., : on_cutlass.output_width(index)]
            torch.testing.assert_close(on_cutlass.outputs(index, out), on_torch.outputs(index, out),
                                       atol=2e-5, rtol=2e-5)


def _op_on_raw_memory(problem_sizes, problem_sizes_host, addresses, leading, b_column_major) -> None:
    """What `csrc/cutlass/fdc_projections_op.cu` does with its arguments, on the CPU: group g's
    A, B, D at addresses[0|1|2][g] with leading dimensions leading[0|1|2][g], sizes (m, n, k)."""
    import ctypes

    import numpy as np

    assert torch.equal(problem_sizes, problem_sizes_host) and problem_sizes.dtype == torch.int32
    for g, (m, n, k) in enumerate(problem_sizes_host.tolist()):
        def matrix(row: int, rows: int, cols: int, column_major: bool = False) -> np.ndarray:
            ld = int(leading[row, g])
            count = (cols - 1) * ld + rows if column_major else (rows - 1) * ld + cols
            flat = np.ctypeslib.as_array((ctypes.c_float * max(count, 1)).from_address(int(addresses[row, g])))
            strides = (4, 4 * ld) if column_major else (4 * ld, 4)
            return np.lib.stride_tricks.as_strided(flat, (rows, cols), strides)

        matrix(2, m, n)[...] = matrix(0, m, k) @ matrix(1, k, n, b_column_major)


def test_the_address_table_is_what_the_cutlass_op_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_cutlass`'s table of addresses, leading dimensions and sizes, read as the op's binding
    reads it (raw memory on the CPU, in place of the CUDA op), gives torch's groups' results."""
    library = torch.library.Library("kvprune_cutlass_contract", "DEF")
    library.define("grouped_gemm(Tensor problem_sizes, Tensor problem_sizes_host, Tensor addresses, "
                   "Tensor leading, bool b_column_major) -> ()")
    library.impl("grouped_gemm", _op_on_raw_memory, "CPU")
    monkeypatch.setattr(torch.ops, "kvprune_cutlass", torch.ops.kvprune_cutlass_contract, raising=False)
    monkeypatch.setattr(grouped_gemm, "load_cutlass_ops", lambda: True)
    fdc = _fdc()
    on_torch, through_table = (GroupedProjections(fdc.layers, runner=runner) for runner in ("torch", "cutlass"))
    key = _tokens(6, fdc.num_kv_heads, torch.bfloat16, 1, strided=True)
    query = _tokens(6, fdc.num_kv_heads * GROUP, torch.float32, 3, strided=True)
    for index in range(len(K_RANKS)):
        for actual, expected in zip(through_table.keys_values(index, key, key), on_torch.keys_values(index, key, key)):
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        reduced = through_table.queries(index, query)
        torch.testing.assert_close(reduced, on_torch.queries(index, query), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(through_table.outputs(index, reduced), on_torch.outputs(index, reduced),
                                   atol=1e-5, rtol=1e-5)
