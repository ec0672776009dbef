"""The GPU kernel benchmark's script, run on tiny shapes in Triton's interpreter (its timings
mean nothing there; on a GPU it times): every case runs, and every kernel agrees with the torch
computation it is timed against."""

from triton_setup import DEVICE  # noqa: F401  (first: the interpreter without a GPU)

import argparse
import json

import pytest

from vllm_kvprune.bench import gpu_kernels

pytestmark = pytest.mark.triton


def test_every_case_runs_and_agrees_with_torch(tmp_path):
    parser = argparse.ArgumentParser()
    gpu_kernels.add_arguments(parser)
    args = parser.parse_args(["--tiny", "--out", str(tmp_path / "kernels")])
    assert gpu_kernels.run(args) == 0
    document = json.loads((tmp_path / "kernels.json").read_text())
    assert (tmp_path / "kernels.png").stat().st_size > 0
    cases = {row["case"].split(" ")[0] for row in document["results"]}
    assert cases == {"kv-update", "h2o", "head-pages", "fdc", "paged-eviction", "gvote"}
    checked = [row for row in document["results"] if row["max_abs_error"] is not None]
    assert len(checked) >= 8
    for row in checked:
        # bf16 outputs: one rounding of values of size ~1; the vote and the copies: exact.
        limit = 0.0 if row["case"] in ("gvote vote",) or row["case"].startswith("kv-update") else 2e-2
        assert row["max_abs_error"] <= limit, row
    assert document["machine"]["interpreter"] == (DEVICE == "cpu")
