"""The results page's "papers vs us" tables: the papers' numbers next to ours, ours read from
the result files (a missing file says "not measured yet", never a number)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_kvprune.bench import results_papers

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_every_figure_is_listed_and_nothing_is_measured_without_files(tmp_path) -> None:
    page = results_papers.papers_section(tmp_path)
    for figure in results_papers.PAPER_FIGURES:
        assert f"| {figure.figure} | {figure.theirs} | {figure.their_setting} | {results_papers.NOT_MEASURED} |" in page
    assert {f"### {figure.paper}" for figure in results_papers.PAPER_FIGURES} <= set(page.splitlines())


def test_ours_is_read_from_the_result_files(tmp_path) -> None:
    h2o = json.loads((RESULTS / "kv_update_h2o.json").read_text())
    row = next(r for r in h2o["results"] if (r["batch"], r["kv_heads"], r["head_dim"], r["dtype"]) ==
               (32, 64, 128, "bfloat16"))
    (tmp_path / "kv_update_h2o.json").write_text(json.dumps(h2o))
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
