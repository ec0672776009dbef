"""Every Triton kernel launch of the kernel tests compiles for real GPUs, here, with no GPU
(`tools/triton_targets.py`): NVIDIA's H100 (sm_90) and AMD's MI250 (gfx90a: 64 KiB of shared
memory a block, no TF32), with the tiles and precisions the wrappers choose for them.
And the check can fail: the launches the wrappers chose before they read the GPU's limits (an
fp32 key tile of 128 x 64 dims, TF32 dots) are refused for AMD's GPUs."""

import copy
from pathlib import Path

import pytest
import torch

from tools import triton_targets as targets
from vllm_kvprune.kernels import triton as kernels

KERNELS = {"_attention_mass_kernel", "_head_page_attention_kernel", "_reduced_attention_kernel",
           "_combine_splits_kernel", "_vote_kernel", "_write_packed_kernel", "_write_slots_kernel",
           "_read_slots_kernel", "_token_scores_kernel", "_block_means_kernel", "_head_projection_kernel"}


@pytest.mark.slow
def test_every_kernel_launch_compiles_for_nvidia_and_amd():
    rows, launches = targets.compile_all(["sm_90", "gfx90a"])
    assert not [row for row in rows if not row["ok"]]
    for target in ("sm_90", "gfx90a"):
        assert launches[target] > 100
        compiled = [row for row in rows if row["target"] == target]
        assert {row["kernel"] for row in compiled} == KERNELS  # every kernel the package has
        assert all(row["registers"] and row["shared_bytes"] <= targets.TARGETS[target].max_shared_bytes
                   for row in compiled)


def test_the_check_refuses_what_an_amd_gpu_cannot_launch(tmp_path: Path):
    """One fp32 attention-mass launch, recorded as chosen for gfx90a, compiles there; the same
    launch with the tile chosen before (128 keys x 64 dims: 72 KiB staged) does not fit its
    shared memory, and with TF32 dots (which CDNA2 lacks) the compiler refuses it."""
    entries = targets.record(tmp_path / "launches.jsonl", "gfx90a", tests=("tests/test_triton_attention.py",),
                             select="test_attention_mass_at_model_head_sizes")
    fp32 = next(entry for entry in entries if entry["kernel"] == "_attention_mass_kernel"
                and entry["args"][1] == {"tensor": "float32", "aligned": True})
    assert fp32["kwargs"]["DOT_PRECISION"] == "ieee" and fp32["kwargs"]["KEY_TILE"] < 128
    too_wide = copy.deepcopy(fp32)
    too_wide["kwargs"].update(KEY_TILE=128, D_PAD=64)
    tf32 = copy.deepcopy(fp32)
    tf32["args"][1]["tensor"] = "bfloat16"
    tf32["kwargs"]["DOT_PRECISION"] = "tf32"
    chosen, wide, dots = targets.compile_entries([fp32, too_wide, tf32], "gfx90a")
    assert chosen["ok"], chosen
    assert not wide["ok"] and wide["shared_bytes"] > 65536 and "shared memory" in wide["error"]
    assert not dots["ok"] and "tf32" in dots["error"]


@pytest.mark.parametrize(("target", "tf32"), [("sm_80", True), ("sm_90", True), ("gfx90a", False), ("gfx942", True)])
def test_limits_are_what_the_driver_and_triton_say(target: str, tf32: bool):
    """On a GPU the limits come from Triton's driver (the device's shared memory) and backend
    (its dot precisions): asked here of a stand-in driver for each target, as a GPU's would be."""
    from triton.runtime.driver import driver

    before = driver._active
    driver.set_active(targets.TargetOnlyDriver(targets.TARGETS[target]))
    kernels._driver_limits.cache_clear()
    try:
        limits = kernels._driver_limits(0)
    finally:
        driver._active = before
        kernels._driver_limits.cache_clear()
    assert limits.max_shared_bytes == targets.TARGETS[target].max_shared_bytes
    assert ("tf32" in limits.dot_precisions) == tf32
    assert kernels.dot_precision(torch.bfloat16, limits) == ("tf32" if tf32 else "ieee")
    assert kernels.dot_precision(torch.float32, limits) == "ieee"
