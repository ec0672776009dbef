"""Loading our CUDA op libraries (`kernels/op_library.py`, used by CUTLASS's grouped GEMM and by
the CUDA slot ops of `bench gpu-kernels`, `benchmarks/cuda_ops.py`): the built extension, an
already registered library, or one line saying what this machine lacks to JIT-build it. The JIT
build itself needs a CUDA device."""

from pathlib import Path

import pytest

from benchmarks.cuda_ops import LIBRARY as SLOT_OPS
from vllm_kvprune import kernels
from vllm_kvprune.kernels.grouped_gemm import LIBRARY as CUTLASS
from vllm_kvprune.kernels.op_library import OpLibrary


def _library(sources: list[Path], probe: str = "kvprune_nothing.op") -> OpLibrary:
    return OpLibrary("test ops", module="vllm_kvprune._nothing_C", probe=probe, jit_name="kvprune_nothing",
                     sources=sources)


def test_each_library_names_its_checkout_sources():
    assert [path.name for path in SLOT_OPS.sources] == ["slot_ops.cu"]
    assert [path.name for path in CUTLASS.sources] == ["fdc_projections.cu", "fdc_projections_op.cu"]
    assert all(path.is_file() for path in (*SLOT_OPS.sources, *CUTLASS.sources))


def test_a_library_it_cannot_load_says_why_once(tmp_path: Path):
    source = tmp_path / "ops.cu"
    missing = _library([source])
    assert not missing.load()
    assert missing.error.startswith("vllm_kvprune._nothing_C is not built (No module named")
    assert f"its sources are not beside the package ({source})" in missing.error
    source.write_text("// a source\n")
    present = _library([source])
    assert not present.load() and present.error.endswith("cannot JIT-build it: no CUDA device to JIT-build for")
    assert present.load() is False  # remembered: no second attempt


@pytest.mark.skipif(not kernels.HAS_EXTENSION, reason="the CPU extension is not built")
def test_an_already_registered_library_counts_as_loaded(tmp_path: Path):
    # The CPU extension registered torch.ops.kvprune.* when the package was imported.
    library = _library([tmp_path / "ops.cu"], probe="kvprune.write_slots")
    assert library.load() and library.error is None
