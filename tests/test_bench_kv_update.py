"""Smoke test of `python -m benchmarks kv-update --policy h2o` on a tiny grid.

Checks what the bench reports, never how fast anything ran: one row per configuration with
the gather-and-append baseline and the in-place paths timed, the per-head correctness checks
run and passed, the table and the plot written. Also that the per-head check catches an update
that does not write every head's own victims."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import __main__ as bench_main
from benchmarks import kv_update

TINY_GRID = {"batch": (1, 2), "kv_heads": (2,), "head_dim": (64,), "evict": (8,)}


@pytest.fixture
def restore_threads():
    """`run` sets torch's thread count for the whole process; put it back for later tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_h2o_quick_run_reports_every_row(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys, restore_threads) -> None:
    monkeypatch.setattr(kv_update, "H2O_QUICK_GRID", TINY_GRID)
    out = tmp_path / "kv_update_h2o.json"
    status = bench_main.main(["kv-update", "--policy", "h2o", "--quick", "--threads", "1", "--cache-tokens", "256",
                              "--block-size", "32", "--out", str(out)])
    assert status == 0
    document = json.loads(out.read_text())
    assert document["settings"]["policy"] == "h2o"
    assert document["settings"]["grid"] == {key: list(values) for key, values in TINY_GRID.items()}
    rows = document["results"]
    assert [(row["batch"], row["kv_heads"], row["head_dim"], row["evict"]) for row in rows] == [(1, 2, 64, 8),
                                                                                                 (2, 2, 64, 8)]
    from vllm_kvprune import kernels

    for row in rows:
        assert row["policy"] == "h2o" and row["baseline"] == "gather" and row["sinks"] == 0
        assert row["same_tokens"] is True and row["correct"] is True
        assert row["tokens_written"] == row["batch"] * row["evict"]
        expected = {"gather", "gather_prealloc", "inplace_torch"} | ({"inplace_cpp"} if kernels.HAS_EXTENSION else set())
        assert set(row["timings_us"]) == expected
        assert all(timing["median"] > 0 for timing in row["timings_us"].values())
        assert row["speedup_torch"] > 0
        assert (row["speedup_cpp"] is not None) == kernels.HAS_EXTENSION
    assert "gather us" in capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 0


def test_h2o_same_tokens_check_catches_shared_victims() -> None:
    """An update that writes one slot per token for all heads (ignoring the per-head victims)
    must fail the check, and one that writes nothing too."""
    from vllm_kvprune import kernels

    config = kv_update.Config("bfloat16", 2, 4, 64, 8, 256, 0, 32, "h2o")
    layout = kernels.probe_layout(config.torch_dtype, config.block_size, config.head_dim,
                                  kernels.default_isa(config.torch_dtype, config.block_size, config.head_dim))
    assert kv_update.check_same_tokens(config, layout, kernels.write_slots)

    def head_zero_slots_only(key, value, kv_cache, slots, layout):
        kernels.write_slots(key, value, kv_cache, slots[:, 0] if slots.dim() == 2 else slots, layout)

    assert not kv_update.check_same_tokens(config, layout, head_zero_slots_only)

    def fill_only(key, value, kv_cache, slots, layout):  # fills the cache, then skips the update
        if slots.dim() == 1:
            kernels.write_slots(key, value, kv_cache, slots, layout)

    assert not kv_update.check_same_tokens(config, layout, fill_only)


def test_h2o_victims_are_distinct_per_head_and_differ_across_heads() -> None:
    config = kv_update.Config("bfloat16", 3, 4, 64, 16, 256, 0, 32, "h2o")
    victims = kv_update.h2o_victim_positions(config, torch.Generator().manual_seed(0), steps=2)
    for step in victims:
        assert step.shape == (3, 4, 16)
        assert all(len(set(per_head.tolist())) == 16 for per_head in step.view(-1, 16))
        assert not torch.equal(step[:, 0], step[:, 1])
        keep = kv_update.keep_index(step, 256)
        assert keep.shape == (3, 4, 240)
        assert torch.equal(torch.cat([keep, step], dim=-1).sort(dim=-1).values, torch.arange(256).expand(3, 4, 256))
    block_table = torch.randperm(3 * 8).view(3, 8)
    slots = kv_update.victim_slot_schedule(config, block_table, victims)
    assert [tuple(s.shape) for s in slots] == [(3 * 16, 4)] * 2
    # token b * E + e of head h goes to request b's e-th victim of head h
    b, e, h = 2, 5, 3
    position = int(victims[0][b, h, e])
    assert int(slots[0][b * 16 + e, h]) == int(block_table[b, position // 32]) * 32 + position % 32


def test_streaming_takes_the_papers_grid(tmp_path, monkeypatch: pytest.MonkeyPatch, restore_threads) -> None:
    """`--paper-grid` times streaming's update on EQUIP's Table 6 grid (h2o's), not its own."""
    monkeypatch.setattr(kv_update, "H2O_QUICK_GRID", TINY_GRID)
    out = tmp_path / "kv_update_streaming_paper.json"
    status = bench_main.main(["kv-update", "--paper-grid", "--quick", "--threads", "1", "--cache-tokens", "256",
                              "--block-size", "32", "--out", str(out)])
    assert status == 0
    document = json.loads(out.read_text())
    assert document["settings"]["grid"] == {key: list(values) for key, values in TINY_GRID.items()}
    assert {row["policy"] for row in document["results"]} == {"streaming"}
    assert all(row["correct"] is True for row in document["results"])
