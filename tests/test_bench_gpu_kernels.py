"""The GPU kernel benchmark's script, run on tiny shapes in Triton's interpreter (its timings
mean nothing there; on a GPU it times): every case runs, and every kernel agrees with the torch
computation it is timed against."""

from triton_setup import DEVICE  # noqa: F401  (first: the interpreter without a GPU)

import argparse
import json

import pytest

from benchmarks import gpu_kernels

pytestmark = pytest.mark.triton


def test_every_case_runs_and_agrees_with_torch(tmp_path):
    parser = argparse.ArgumentParser()
    gpu_kernels.add_arguments(parser)
    args = parser.parse_args(["--tiny", "--out", str(tmp_path / "kernels")])
    assert gpu_kernels.run(args) == 0
    document = json.loads((tmp_path / "kernels.json").read_text())
    assert (tmp_path / "kernels.png").stat().st_size > 0
    cases = {row["case"].split(" ")[0] for row in document["results"]}
    assert cases == {"kv-update", "h2o", "head-pages", "fdc", "fdc-layer", "fdc-prefill",
                     "paged-eviction", "gvote"}
    checked = [row for row in document["results"] if row["max_abs_error"] is not None]
    assert len(checked) >= 8
    for row in checked:
        # bf16 outputs: one rounding of values of size ~1; the vote, the copies and the writes: exact.
        # FDC's projections on the GPU runners (Triton here) against the fp32 einsums: fp32 sums
        # in another order.
        projection = "projections (" in row["candidate"]
        exact = not projection and (row["case"] in ("gvote vote",) or row["case"].startswith(("kv-update", "fdc-layer")))
        limit = 0.0 if exact else 1e-4 if projection else 2e-2
        assert row["max_abs_error"] <= limit, row
    layer = [row["candidate"] for row in document["results"] if row["case"].startswith("fdc-layer")]
    assert "whole layer step, Triton projections" in layer
    prefill = [row for row in document["results"] if row["case"].startswith("fdc-prefill")]
    assert len(prefill) == 3 and 0 < prefill[1]["relative_error"] < 2e-2, prefill  # bf16 rounding, no more
    assert prefill[2]["candidate"].startswith("Triton") and prefill[2]["relative_error"] < 1e-5, prefill
    assert document["machine"]["interpreter"] == (DEVICE == "cpu")


def test_gpu_steps_runs_every_policy(tmp_path):
    """The wrapper's per-step work, timed (`bench gpu-steps`): every policy's decode runs through
    the shared impl with the GPU kernel set and evicts down to its budget; `none` keeps all."""
    from benchmarks import gpu_steps

    parser = argparse.ArgumentParser()
    gpu_steps.add_arguments(parser)
    assert gpu_steps.run(parser.parse_args(["--tiny", "--out", str(tmp_path / "steps")])) == 0
    document = json.loads((tmp_path / "steps.json").read_text())
    assert (tmp_path / "steps.png").stat().st_size > 0
    shapes = gpu_steps.TINY if DEVICE == "cpu" else gpu_steps.FULL
    rows = {row["policy"]: row for row in document["results"]}
    assert list(rows) == list(gpu_steps.POLICIES)
    assert rows["none"]["kept_tokens"] == shapes.prompt + shapes.decode_steps
    for name in ("streaming", "h2o", "paged_eviction"):
        cap = -(-(shapes.budget + 1) // shapes.block_size) * shapes.block_size  # whole blocks (paged_eviction)
        assert 0 < rows[name]["kept_tokens"] <= cap < shapes.prompt + shapes.decode_steps
        assert rows[name]["step_ms"] > 0 and rows[name]["vs_none"] > 0
