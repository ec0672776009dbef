"""Results-page sections of the papers' own measurements (issue 16): what each paper reports,
redone on our engine."""

from __future__ import annotations

from pathlib import Path

from vllm_kvprune.bench import results_sections as sections


def ttft_section(path: Path, doc_dir: Path) -> str:
    """`bench ttft`: prefill time of every policy against `none` at each prompt length."""
    from vllm_kvprune.bench import ttft

    document = sections.load(path)
    settings = document.get("settings", {})
    setup = (f"{settings.get('model')} {settings.get('dtype')}, batch 1, one generated token per request; "
             f"median of {settings.get('repeats')} request(s) per length after one warm-up request, each on its "
             f"own essay window; budget {settings.get('budget')} for the budgeted policies (`prefill: full`: the "
             "prompt is attended in full, then pruned).")
    return sections.file_section("Time to first token (`ttft.json`)", document, setup,
                                 sections.markdown_table(*ttft.table(document.get("results", []))), [], path, doc_dir)
