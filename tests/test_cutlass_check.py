"""The CUTLASS kernel of FDC's projections compiles for a real GPU here (no GPU: nvcc and
CUTLASS's headers come from the package index, `tools/cutlass_check.py`), without spills; a
target nvcc refuses fails the check."""

from __future__ import annotations

import json
import subprocess

import pytest

from tools import cutlass_check

PTXAS_LOG = """\
ptxas info    : Compiling entry function '_ZN7cutlass6KernelIA' for 'sm_90'
ptxas info    : Function properties for _ZN7cutlass6KernelIA
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 165 registers, used 0 barriers, 1024 bytes smem, 424 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN7cutlass6KernelIB' for 'sm_90'
ptxas info    : Used 96 registers, 424 bytes cmem[0]
"""


def test_ptxas_report_is_read() -> None:
    assert cutlass_check.parse_ptxas(PTXAS_LOG) == [
        {"kernel": "_ZN7cutlass6KernelIA", "spill_store_bytes": 8, "spill_load_bytes": 4, "registers": 165,
         "static_shared_bytes": 1024},
        {"kernel": "_ZN7cutlass6KernelIB", "registers": 96, "static_shared_bytes": 0}]


@pytest.mark.slow
def test_cutlass_kernel_compiles_for_hopper_and_a_refused_target_fails(tmp_path) -> None:
    try:
        if cutlass_check.find_nvcc() is None or cutlass_check.find_headers() is None:
            cutlass_check.fetch()
    except subprocess.CalledProcessError as error:  # no package index reachable
        pytest.skip(f"could not download nvcc and CUTLASS: {error}")
    # sm_70 (Volta): CUDA 13's nvcc no longer compiles for it, and the kernel needs sm_80's cp.async.
    rc = cutlass_check.main(["--targets", "sm_90", "sm_70", "--out", str(tmp_path / "targets")])
    report = json.loads((tmp_path / "targets.json").read_text())
    by_target = {result["target"]: result for result in report["targets"]}
    assert rc == 1
    assert not by_target["sm_70"]["ok"] and by_target["sm_70"]["error"]
    hopper = by_target["sm_90"]
    assert hopper["ok"], hopper.get("error")
    assert len(hopper["kernels"]) == 2  # B row-major (keys, values, queries) and column-major (outputs)
    assert all(kernel["spill_store_bytes"] == 0 and kernel["registers"] <= 255 for kernel in hopper["kernels"])
    # Measured by running the kernel's host code here: 3 stages of fp32 64x16 and 16x64 tiles.
    assert all(24 * 1024 <= size <= 48 * 1024 for size in report["shared_bytes"].values())
