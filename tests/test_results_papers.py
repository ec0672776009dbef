"""The results page's "papers vs us" tables: the papers' numbers next to ours, ours read from
the result files (a missing file says "not measured yet", never a number)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import results_papers

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_every_figure_is_listed_and_nothing_is_measured_without_files(tmp_path) -> None:
    page = results_papers.papers_section(tmp_path)
    for figure in results_papers.PAPER_FIGURES:
        assert f"| {figure.figure} | {figure.theirs} | {figure.their_setting} | {results_papers.NOT_MEASURED} |" in page
    assert {f"### {figure.paper}" for figure in results_papers.PAPER_FIGURES} <= set(page.splitlines())


def test_ours_is_read_from_the_result_files(tmp_path) -> None:
    h2o = json.loads((RESULTS / "kv_update_h2o_full.json").read_text())
    row = next(r for r in h2o["results"] if (r["batch"], r["kv_heads"], r["head_dim"], r["dtype"]) ==
               (32, 64, 128, "bfloat16"))
    (tmp_path / "kv_update_h2o_full.json").write_text(json.dumps(h2o))
    paged = json.loads((RESULTS / "throughput_paged.json").read_text())
    (tmp_path / "throughput_paged.json").write_text(json.dumps(paged))
    page = results_papers.papers_section(tmp_path)
    assert "| Table 6: KV update over H2O's, B32 H64 D128 | 31.43x |" in page
    assert f"| {row['speedup_cpp']:.1f}x |" in page.split("B32 H64 D128 | 31.43x")[1].splitlines()[0]
    rates = {(r["policy"], r["budget"]): r["tokens_per_s"] for r in paged["results"] if r["setting"] == "memory-bound"}
    line = next(l for l in page.splitlines() if "tokens/s over StreamingLLM, budget 1024" in l)
    assert f"| {rates[('paged_eviction', 1024)] / rates[('streaming', 1024)]:.2f}x |" in line
    # Files this test did not copy stay unmeasured.
    assert results_papers.NOT_MEASURED in next(l for l in page.splitlines() if "Fig. 10" in l)


def test_fig_10_row_says_none_ran_one_wave(tmp_path) -> None:
    """Fig. 10 reads `throughput_fig10.json`; where `none` was timed on fewer of the requests
    (`--none-requests`), the setting says how many and why that is its rate."""
    fig10 = json.loads((RESULTS / "throughput_fig10.json").read_text())
    (tmp_path / "throughput_fig10.json").write_text(json.dumps(fig10))
    rows = {r["policy"]: r for r in fig10["results"] if r["setting"] == "memory-bound"}
    line = next(l for l in results_papers.papers_section(tmp_path).splitlines() if "Fig. 10" in l)
    assert f"| {rows['streaming']['tokens_per_s'] / rows['none']['tokens_per_s']:.2f}x |" in line
    none = rows["none"]
    if none["requests"] < rows["streaming"]["requests"]:
        assert f"timed on {none['requests']} of them" in line, line
    fig10["results"] = [dict(r, requests=rows["streaming"]["requests"]) for r in fig10["results"]]
    (tmp_path / "throughput_fig10.json").write_text(json.dumps(fig10))
    line = next(l for l in results_papers.papers_section(tmp_path).splitlines() if "Fig. 10" in l)
    assert "timed on" not in line, line


def test_lazy_pruning_rows_come_from_r1_and_r64(tmp_path) -> None:
    """Its two halves run apart (TPOT, perplexity), each in its own file: the rows meet by setting."""
    from benchmarks import common, lazy_pruning

    def tpot(method, r, ms):
        return {"method": method, "R": r, "positions": None if r is None else "cache",
                "tpot": {"1": {"ms": ms, "steps": 10, "prune_events": None, "move_ms_per_step": None}}}

    def stream(r, perplexity):
        return {"method": "streaming", "R": r, "positions": "cache", "perplexity": perplexity, "scored_tokens": 20480}

    halves = {"lazy_pruning_tpot.json": [tpot("streaming", 1, 20.0), tpot("streaming", 64, 15.0),
                                         tpot(lazy_pruning.RECOMPUTE, None, 100.0)],
              "lazy_pruning_ppl.json": [stream(1, 20.0), stream(64, 20.2)]}
    for name, rows in halves.items():  # as the bench writes them: with the ratios its rows allow
        lazy_pruning.add_ratios(rows)
        common.write_json(tmp_path / name, "lazy_pruning", {"model": "m", "dtype": "float32", "budget": 2048}, rows)
    page = results_papers.papers_section(tmp_path)
    line = {figure: next(l for l in page.splitlines() if figure in l)
            for figure in ("strict (R = 1) -> lazy", "sliding-window recompute", "perplexity, R = 64")}
    assert "| 20.00 -> 15.00 ms |" in line["strict (R = 1) -> lazy"] and "lazy_pruning_tpot.json" in line[
        "strict (R = 1) -> lazy"]
    assert "| 6.67x |" in line["sliding-window recompute"]
    assert "| +1.00% (20.200 vs 20.000) |" in line["perplexity, R = 64"] and "20480 tokens" in line[
        "perplexity, R = 64"] and "lazy_pruning_ppl.json" in line["perplexity, R = 64"]
    rows = halves["lazy_pruning_tpot.json"]
    section = results_papers.lazy_pruning_section(tmp_path / "lazy_pruning_tpot.json", tmp_path)
    for body in lazy_pruning.table(rows)[1]:
        assert "| " + " | ".join(body) + " |" in section


def test_fig_3d_and_7a_rows_come_from_the_tpot_file(tmp_path) -> None:
    from benchmarks import common, tpot

    rows = [{"policy": policy, "ms": ms, "rounds_ms": [ms, ms + 1], "steps": 128}
            for policy, ms in (("none", 100.0), ("streaming", 80.0), ("paged_eviction", 78.0),
                               ("streaming-shift", 100.0), ("h2o", 90.0), ("h2o-gather", 180.0))]
    rows[2]["rounds_ms"] = [78.0, 85.0]  # paged_eviction's rounds overlap streaming's (80 / 81)
    tpot.add_ratios(rows)
    settings = {"model": "m", "dtype": "float32", "batch": 8, "prompt_tokens": 4096, "budget": 1024}
    common.write_json(tmp_path / "tpot.json", "tpot", settings, rows[:3])
    common.write_json(tmp_path / "tpot_equip.json", "tpot", settings, rows[1:])
    page = results_papers.papers_section(tmp_path)
    line = {over: next(l for l in page.splitlines() if f"Fig. 3d: time per output token vs {over}" in l)
            for over in ("the full cache", "StreamingLLM")}
    assert "| -22.0% (78.0 vs 100.0 ms) |" in line["the full cache"] and "4096-token prompts" in line["the full cache"]
    assert "| -2.5%, within the rounds' spread (78.0 vs 80.0 ms) |" in line["StreamingLLM"]
    assert "| -22.0% (78.0 vs 100.0 ms) |" in line["the full cache"]
    shift = next(l for l in page.splitlines() if "in place over StreamingLLM's shift-and-append" in l)
    assert "| 1.25x (80.0 vs 100.0 ms) |" in shift and "tpot_equip.json" in shift
    gather = next(l for l in page.splitlines() if "in place over H2O's gather" in l)
    assert "| 2.00x (90.0 vs 180.0 ms) |" in gather
    section = results_papers.tpot_section(tmp_path / "tpot.json", tmp_path)
    for body in tpot.table(rows[:3])[1]:
        assert "| " + " | ".join(body) + " |" in section
    assert "| paged_eviction | 78.0 | 78.0 / 85.0 | -22.0% | -2.5% | - |" in section


def test_a_shorter_original_stream_meets_r1_on_its_own_tokens() -> None:
    """`--original-tokens`: the `positions: original` stream is compared with R = 1's first
    chunks (the same tokens), never with R = 1's whole, longer stream."""
    import math

    from benchmarks import lazy_pruning

    chunks = [2.0, 2.0, 3.0, 5.0]  # R = 1's mean NLL per 1024 tokens
    strict = {"method": "streaming", "R": 1, "positions": "cache", "scored_tokens": 4096,
              "perplexity": math.exp(sum(chunks) / 4), "nll_by_1024": chunks}
    original = {"method": "streaming", "R": 1, "positions": "original", "scored_tokens": 2048,
                "perplexity": math.exp(4.0), "nll_by_1024": [4.0, 4.0]}
    odd = {"method": "streaming", "R": 8, "positions": "cache", "scored_tokens": 1000, "perplexity": 9.0}
    rows = [strict, original, odd]
    lazy_pruning.add_ratios(rows)
    assert original["ppl_vs_r1"] == pytest.approx(math.exp(4.0) / math.exp(2.0))
    assert strict["ppl_vs_r1"] == 1.0 and "ppl_vs_r1" not in odd  # 1000 tokens: not whole chunks
    (_, original_cells, _) = lazy_pruning.table(rows)[1]
    assert "2048" in original_cells and f"{100 * (math.exp(2.0) - 1):+.2f}%" in original_cells


@pytest.mark.parametrize("path", sorted(RESULTS.glob("attention_mass*.json")), ids=lambda path: path.name)
def test_attention_mass_section_shows_every_case_and_the_build(path: Path, tmp_path) -> None:
    document = json.loads(path.read_text())
    text = results_papers.attention_mass_section(path, tmp_path)
    assert f"extension built for **{document['settings']['extension_isa']}**" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == len(document["results"]) > 0
    for line, result in zip(rows, document["results"]):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[:2] == [result["case"], result["dtype"]] and cells[4] == f"{result['median_ms']:.2f}"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("ttft*.json")), ids=lambda path: path.name)
def test_ttft_section_names_the_machines_vector_unit(path: Path, tmp_path) -> None:
    """A TTFT ratio depends on the CPU's vector unit (vLLM's kernels and torch's bf16 linears
    differ between AVX-512 and AVX2-only machines): each run's section says which it had."""
    document = json.loads(path.read_text())
    flags = document["machine"]["cpu_key_flags"]
    text = results_papers.ttft_section(path, tmp_path)
    expected = "(AVX-512" if "avx512f" in flags else "(AVX2 only"
    assert f"Machine: {document['machine']['cpu_model']} {expected}" in text


def test_vector_isa_from_the_recorded_flags() -> None:
    assert results_papers._vector_isa({"cpu_key_flags": ["avx2", "fma", "avx512f", "amx_tile"]}) == " (AVX-512, AMX)"
    assert results_papers._vector_isa({"cpu_key_flags": ["avx2", "fma"]}) == " (AVX2 only)"
    assert results_papers._vector_isa({"cpu_flags": ["sse4_2"]}) == " (no AVX2)"
    assert results_papers._vector_isa({}) == ""  # files from before the flags were recorded
