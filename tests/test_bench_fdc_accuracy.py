"""`bench fdc-accuracy`'s pieces that need no engine: where its calibration text comes from (never
text a task reads), how each setting ranks the heads, and how the 99% point is picked.
The engines' side is `bench accuracy`'s runner, tested in test_bench_accuracy.py."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks import fdc_accuracy
from benchmarks.accuracy.task import Case, Task
from vllm_kvprune.fdc import calibration as fdc


def test_free_window_avoids_every_used_range() -> None:
    used = [(0, 100), (150, 300), (290, 400)]
    assert fdc_accuracy.free_window(50, used, 1000) == 100
    assert fdc_accuracy.free_window(51, used, 1000) == 400
    assert fdc_accuracy.free_window(600, used, 1000) == 400
    with pytest.raises(ValueError):
        fdc_accuracy.free_window(601, used, 1000)


def test_calibration_text_is_none_of_the_tasks_text() -> None:
    needle = types.SimpleNamespace(name="needle")
    perplexity = types.SimpleNamespace(name="perplexity")
    work = [(needle, [Case("needle", "a", [1], 4, {"context": 300}), Case("needle", "b", [1], 4, {"context": 100})]),
            (perplexity, [Case("perplexity", "s0", [1], 4, {"start": 350, "tokens": 200})])]
    essay = list(range(2000))
    sequences, start = fdc_accuracy.calibration_sequences(essay, work, 500, 200)
    flat = [token for sequence in sequences for token in sequence]
    assert start == 550 and flat == list(range(550, 1050)) and [len(s) for s in sequences] == [200, 200, 100]


def _calibration(layers: int = 2, heads: int = 2, dim: int = 8) -> fdc.FdcCalibration:
    torch.manual_seed(0)
    rotation = torch.linalg.qr(torch.randn(layers, heads, dim, dim))[0]
    spectrum = torch.sort(torch.rand(layers, heads, dim) + torch.arange(dim).flip(0), descending=True).values
    ranks = torch.full((layers, heads), dim, dtype=torch.int32)
    return fdc.FdcCalibration(qk_rotation=rotation, v_rotation=rotation, qk_singular=spectrum,
                              v_singular=spectrum * torch.linspace(1, 2, heads)[:, None], qk_rank=ranks,
                              v_rank=ranks.clone(), settings={})


def test_settings_rank_the_heads_as_named() -> None:
    calibration = _calibration()
    adaptive, uniform, qk_only = fdc_accuracy.settings_of([0.2], [0.2], [0.2])
    ranked = adaptive.ranks(calibration)
    assert torch.equal(ranked.qk_rank, fdc.ranks_for_rate(calibration.qk_singular, 0.2))
    assert torch.equal(ranked.v_rank, fdc.ranks_for_rate(calibration.v_singular, 0.2))
    assert ranked.kv_fraction() < 1.0
    flat = uniform.ranks(calibration)
    assert flat.qk_rank.unique().numel() == 1 and flat.v_rank.unique().numel() == 1
    assert abs(flat.kv_fraction() - ranked.kv_fraction()) <= 1 / calibration.head_dim
    cut_qk = qk_only.ranks(calibration)
    assert torch.equal(cut_qk.qk_rank, ranked.qk_rank) and bool((cut_qk.v_rank == calibration.head_dim).all())


class _Hits(Task):
    name = "needle"


def test_the_99_percent_point_is_the_most_tokens_that_keep_the_hit_rate() -> None:
    task = _Hits()

    def records(label, hits, total=100):
        return [{"task": "needle", "setting": label, "hit": i < hits} for i in range(total)]

    found = records(None, 50) + records("a", 50) + records("b", 49) + records("c", 60)
    timings = [{"system": "vllm-kvprune", "pool_blocks": blocks, **({} if label is None else {"setting": label})}
               for label, blocks in ((None, 100), ("a", 120), ("b", 200), ("c", 110))]
    points = [{"setting": label} for label in ("a", "b", "c")]
    summary = fdc_accuracy.summarize([task], found, timings, points)
    assert [p["pool_tokens_vs_none"] for p in summary["points"]] == [1.2, 2.0, 1.1]
    assert [p["hit_ratio"] for p in summary["points"]] == [1.0, 0.98, 1.2]
    assert summary["at_99_percent"] == "a"  # b holds more tokens but keeps 98% of none's hits
