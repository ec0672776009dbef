"""Results-page sections of the papers' own measurements (issue 16): what each paper reports,
next to what our engine measured, with the setting each ran in.

`PAPER_FIGURES` holds the papers' numbers as printed (their text is in `../shared/papers/`);
ours are read from the result files when they exist, so regenerating a file updates its row,
and a figure nobody has measured here says so."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from benchmarks import results_sections as sections
from benchmarks import throughput_report

NOT_MEASURED = "not measured yet"
Ours = Callable[[Path], "tuple[str, str] | None"]  # results dir -> (our value, our setting)


@dataclass(frozen=True)
class PaperFigure:
    paper: str
    figure: str
    theirs: str
    their_setting: str
    ours: Ours | None = None


def _document(results_dir: Path, name: str) -> Mapping[str, Any] | None:
    path = results_dir / name
    return sections.load(path) if path.is_file() else None


def _machine(document: Mapping[str, Any]) -> str:
    machine = document.get("machine", {})
    return f"{machine.get('cpu_model', '?')}{_vector_isa(machine)}, {machine.get('usable_cores', '?')} cores"


def _vector_isa(machine: Mapping[str, Any]) -> str:
    """The widest vector unit the CPU has (what decides how fast vLLM's CPU kernels and torch's
    bf16 linears run), or nothing for files that did not record the flags."""
    flags = set(machine.get("cpu_key_flags") or machine.get("cpu_flags") or ())
    if not flags:
        return ""
    isa = "AVX-512" if "avx512f" in flags else "AVX2 only" if "avx2" in flags else "no AVX2"
    return f" ({isa}{', AMX' if any(f.startswith('amx') for f in flags) else ''})"


def kv_update_speedup(name: str, batch: int, heads: int, head_dim: int) -> Ours:
    """EQUIP Table 6: our in-place C++ update over shift-and-append (or gather-and-append)."""
    def read(results_dir: Path) -> tuple[str, str] | None:
        document = _document(results_dir, name)
        for row in (document or {}).get("results", []):
            if (row["batch"], row["kv_heads"], row["head_dim"], row["evict"], row["dtype"]) == \
                    (batch, heads, head_dim, 64, "bfloat16") and row.get("speedup_cpp"):
                threads = document["settings"].get("threads")
                baseline = "gather" if row.get("baseline") == "gather" else "shift"
                return (f"{row['speedup_cpp']:.1f}x", f"{_machine(document)}, {threads} thread(s), bf16, cache "
                        f"{row['cache_tokens']}, our C++ op vs a torch {baseline}-and-append (`{name}`)")
        return None
    return read


def throughput_ratio(name: str, policy: str, budget: int, over: str) -> Ours:
    """Memory-bound tokens/s of `policy` at `budget` over `over` (`none`, or a policy at the same budget)."""
    def read(results_dir: Path) -> tuple[str, str] | None:
        document = _document(results_dir, name)
        if document is None:
            return None
        rows = {(row["policy"], row["budget"]): row for row in document["results"] if row["setting"] == "memory-bound"}
        mine, base = rows.get((policy, budget)), rows.get((over, None if over == "none" else budget))
        if mine is None or base is None:
            return None
        engine, bound = document["settings"]["engine"], document["settings"]["memory_bound"]
        fewer = throughput_report.none_fewer_text(document["results"])  # --none-requests
        return (f"{mine['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                f"SmolLM2-135M {engine['dtype']}, {bound['num_requests']} requests of {bound['prompt_tokens']} + "
                f"{bound['gen_tokens']} tokens{fewer if over == 'none' else ''}, a {bound['pool_blocks']}-block pool, "
                f"{_machine(document)} (`{name}`)")
    return read


def lazy_pruning(what: str) -> Ours:
    """Lazy Pruning Table 1 from `bench lazy-pruning`'s files (`lazy_pruning*.json`: one run, or
    its TPOT and perplexity halves run apart): `tpot` (R = 1 -> R = 64 at batch 1), `speedup`
    (R = 64 over the recompute baseline), `ppl` (R = 64 against R = 1)."""
    def read(results_dir: Path) -> tuple[str, str] | None:
        from benchmarks import lazy_pruning as bench

        documents = [(path.name, sections.load(path)) for path in sorted(results_dir.glob("lazy_pruning*.json"))]
        rows = bench.merge([row for _, document in documents for row in document["results"]])
        bench.add_ratios(rows)
        found = {row["R"]: row for row in rows if row["method"] == "streaming" and row["positions"] == "cache"}
        strict, lazy = found.get(1), found.get(64)
        if strict is None or lazy is None:
            return None

        def setting(measure: str, has: str) -> str:
            name, document = next((name, document) for name, document in documents
                                  if any(has in row and row[has] for row in document["results"]))
            settings = document["settings"]
            return (f"{settings.get('model')} {settings.get('dtype')}, cap {settings.get('budget')}, {measure}, "
                    f"{_machine(document)} (`{name}`)")

        if what == "ppl":
            if not (strict.get("perplexity") and lazy.get("perplexity")):
                return None
            return (f"{100 * (lazy['ppl_vs_r1'] - 1):+.2f}% ({lazy['perplexity']:.3f} vs {strict['perplexity']:.3f})",
                    setting(f"essays, {strict['scored_tokens']} tokens", "perplexity"))
        strict_ms, lazy_entry = strict["tpot"].get("1", {}).get("ms"), lazy["tpot"].get("1", {})
        if what == "tpot" and strict_ms and lazy_entry.get("ms"):
            return f"{strict_ms:.2f} -> {lazy_entry['ms']:.2f} ms", setting("batch 1", "tpot")
        if what == "speedup" and lazy_entry.get("speedup_vs_recompute"):
            return f"{lazy_entry['speedup_vs_recompute']:.2f}x", setting("batch 1", "tpot")
        return None
    return read


def tpot_change(name: str, policy: str, over: str, speedup: bool = False) -> Ours:
    """A policy's time per output token against another's (`bench tpot`'s file `name`): the
    change in percent (PagedEviction Fig. 3d), or with `speedup` the other's over ours (EQUIP
    Fig. 7a)."""

    def read(results_dir: Path) -> tuple[str, str] | None:
        document = _document(results_dir, name)
        if document is None:
            return None
        rows = {row["policy"]: row for row in document.get("results", [])}
        if policy not in rows or over not in rows:
            return None
        settings = document.get("settings", {})
        ours, theirs = rows[policy]["ms"], rows[over]["ms"]
        shown = f"{theirs / ours:.2f}x" if speedup else f"{100 * (ours / theirs - 1):+.1f}%"
        mine, other = rows[policy].get("rounds_ms") or [ours], rows[over].get("rounds_ms") or [theirs]
        if max(min(mine), min(other)) <= min(max(mine), max(other)):
            shown += ", within the rounds' spread"  # their rounds overlap: not resolved by this run
        return (f"{shown} ({ours:.1f} vs {theirs:.1f} ms)",
                f"{settings.get('model')} {settings.get('dtype')}, batch {settings.get('batch')}, "
                f"{settings.get('prompt_tokens')}-token prompts, budget {settings.get('budget')}, {_machine(document)} "
                f"(`{name}`)")
    return read


_TABLE6 = "Xeon SPR, a cache of 1024 tokens, evict 64, batch {b}, {h} heads of {d}"
_TABLE6_ROWS = ((1, 64, 64, "11.62", "26.54"), (1, 64, 128, "27.32", "36.04"), (1, 128, 64, "19.36", "27.65"),
                (8, 64, 64, "35.73", "47.94"), (8, 64, 128, "38.12", "46.67"), (8, 128, 64, "39.90", "45.04"),
                (32, 64, 64, "39.75", "50.58"), (32, 64, 128, "31.43", "47.34"))

PAPER_FIGURES: tuple[PaperFigure, ...] = (
    *(PaperFigure("EQUIP", f"Table 6: KV update over StreamingLLM's, B{b} H{h} D{d}", f"{streaming}x",
                  _TABLE6.format(b=b, h=h, d=d), kv_update_speedup("kv_update_streaming_paper.json", b, h, d))
      for b, h, d, _, streaming in _TABLE6_ROWS),
    *(PaperFigure("EQUIP", f"Table 6: KV update over H2O's, B{b} H{h} D{d}", f"{h2o}x",
                  _TABLE6.format(b=b, h=h, d=d), kv_update_speedup("kv_update_h2o_full.json", b, h, d))
      for b, h, d, h2o, _ in _TABLE6_ROWS),
    PaperFigure("EQUIP", "Fig. 10: StreamingLLM in vLLM over vLLM's full cache, batch 32, 4K", "7.44x",
                "Llama-2-7B, Xeon SPR", throughput_ratio("throughput_fig10.json", "streaming", 512, "none")),
    PaperFigure("EQUIP", "Fig. 7a: end to end, in place over StreamingLLM's shift-and-append (geomean)", "1.62x",
                "Llama models on Hugging Face, Xeon SPR", tpot_change("tpot_equip.json", "streaming", "streaming-shift",
                                                                           speedup=True)),
    PaperFigure("EQUIP", "Fig. 7a: end to end, in place over H2O's gather (geomean)", "4.48x",
                "Llama models on Hugging Face, Xeon SPR", tpot_change("tpot_equip.json", "h2o", "h2o-gather", speedup=True)),
    PaperFigure("Lazy Pruning", "Table 1: TPOT, strict (R = 1) -> lazy (R = 64)", "19.57 -> 14.37 ms",
                "Pythia-2.8B, PG19 20K tokens, cap 2048, batch 1, GPU", lazy_pruning("tpot")),
    PaperFigure("Lazy Pruning", "Table 1: speedup over sliding-window recompute (R = 64)", "6.81x",
                "Pythia-2.8B, PG19 20K tokens, cap 2048, batch 1, GPU", lazy_pruning("speedup")),
    PaperFigure("Lazy Pruning", "Table 1: perplexity, R = 64 vs R = 1", "+0.68% (20.318 vs 20.181)",
                "Pythia-2.8B, PG19 20K tokens, cap 2048", lazy_pruning("ppl")),
    PaperFigure("PagedEviction", "Fig. 3a: tokens/s over the full cache, budget 1024", "1.37x (3020 vs 2200)",
                "Llama-3.2-1B, vLLM, GPU", throughput_ratio("throughput_paged.json", "paged_eviction", 1024, "none")),
    PaperFigure("PagedEviction", "Fig. 3a: tokens/s over StreamingLLM, budget 1024", "1.03x (3020 vs 2920)",
                "Llama-3.2-1B, vLLM, GPU",
                throughput_ratio("throughput_paged.json", "paged_eviction", 1024, "streaming")),
    PaperFigure("PagedEviction", "Fig. 3d: time per output token vs the full cache, budget 1024", "-10 to -12%",
                "Llama 1B/3B/8B, vLLM, GPU", tpot_change("tpot.json", "paged_eviction", "none")),
    PaperFigure("PagedEviction", "Fig. 3d: time per output token vs StreamingLLM, budget 1024",
                "similar or slightly lower", "Llama 1B/3B/8B, vLLM, GPU", tpot_change("tpot.json", "paged_eviction", "streaming")),
)


def papers_section(results_dir: Path) -> str:
    """One table per paper: each headline figure, theirs and ours, and where each ran."""
    parts = []
    for paper in dict.fromkeys(figure.paper for figure in PAPER_FIGURES):
        rows = []
        for figure in (f for f in PAPER_FIGURES if f.paper == paper):
            found = figure.ours(results_dir) if figure.ours is not None else None
            ours, setting = found if found is not None else (NOT_MEASURED, "-")
            rows.append([figure.figure, figure.theirs, figure.their_setting, ours, setting])
        parts += [f"### {paper}",
                  sections.markdown_table(["figure", "theirs", "their setting", "ours", "our setting"], rows)]
    return "\n\n".join(parts)


def ttft_section(path: Path, doc_dir: Path) -> str:
    """`bench ttft`: prefill time of every policy against `none` at each prompt length."""
    from benchmarks import ttft

    document = sections.load(path)
    settings = document.get("settings", {})
    setup = (f"{settings.get('model')} {settings.get('dtype')}, batch 1, one generated token per request; "
             f"median of {settings.get('repeats')} request(s) per length after one warm-up request, each on its "
             f"own essay window; budget {settings.get('budget')} for the budgeted policies (`prefill: full`: the "
             "prompt is attended in full, then pruned).")
    if settings.get("fused_mass") is False:
        setup += " `KVPRUNE_FUSED_MASS=0`: h2o's prompt mass in a pass of its own after vLLM's attention."
    if settings.get("note"):
        setup += f" {settings['note']}"
    setup += f" Machine: {_machine(document)}."
    return sections.file_section(f"Time to first token (`{path.name}`)", document, setup,
                                 sections.markdown_table(*ttft.table(document.get("results", []))), [], path, doc_dir)


def attention_mass_section(path: Path, doc_dir: Path) -> str:
    """`bench attention-mass`: H2O's mass kernel alone, for the extension build that ran it."""
    from benchmarks import attention_mass

    document = sections.load(path)
    settings = document.get("settings", {})
    setup = (f"H2O's attention-mass kernel alone, extension built for **{settings.get('extension_isa')}**, "
             f"{settings.get('threads')} threads, {_machine(document)}: a prompt's mass ({settings.get('prompt_tokens')} "
             f"causal queries, mass only) and a decode step's ({settings.get('batch')} requests of "
             f"{settings.get('keys')} keys, attention and mass in one pass); {settings.get('kv_heads')} KV heads of "
             f"{settings.get('group')} query heads, head {settings.get('head_size')}, block "
             f"{settings.get('block_size')}; median of {settings.get('repeats')} calls.")
    if "layers" in settings:  # runs since 2026-11-27 also time the victim search
        setup += (f" Then h2o's victim search of that decode step: {settings.get('batch')} requests of "
                  f"{settings.get('layers')} layers x {settings.get('kv_heads')} KV heads x {settings.get('held')} "
                  "slots, the C++ op request by request on one thread and on all, and the ranking a GPU does "
                  "(all requests at once, torch) on CPU tensors.")
    return sections.file_section(f"attention_mass (`{path.name}`)", document, setup,
                                 sections.markdown_table(*attention_mass.table(document.get("results", []))), [],
                                 path, doc_dir)


def lazy_pruning_section(path: Path, doc_dir: Path) -> str:
    """`bench lazy-pruning`: every R (and the baselines) with TPOT, perplexity, prune events, moves."""
    from benchmarks import lazy_pruning as bench

    document = sections.load(path)
    settings = document.get("settings", {})
    setup = (f"{settings.get('model')} {settings.get('dtype')}, `streaming` with `positions: cache`, cap "
             f"{settings.get('budget')} (sinks {settings.get('sinks')}); perplexity over a teacher-forced essay stream "
             f"of {settings.get('stream_tokens')} tokens (one request per R, in one batch; `-`: not in this run; the "
             f"`positions: original` stream may be shorter, and is compared with R = 1 on its own tokens); "
             f"TPOT: one engine, R set per request, the R values taking turns {settings.get('repeats')} times "
             f"(the median run shown); a run's TPOT is its mean decode step over {settings.get('tpot_tokens')} "
             f"steps, prune steps included, prompts of {settings.get('budget')} tokens. "
             f"Recompute: every output token a fresh request on the last {settings.get('budget')} tokens, its "
             f"perplexity from windows of {settings.get('budget')} tokens scoring their last "
             f"{settings.get('recompute_stride')}. Prune events and move time: the worker's own counters."
             + (f" Engines run: {settings['cases_done']}." if "cases_done" in settings else ""))
    rows = copy.deepcopy(document.get("results", []))
    bench.add_ratios(rows)  # by this version's rules, whichever version wrote the file
    return sections.file_section(f"Lazy Pruning (`{path.name}`)", document, setup,
                                 sections.markdown_table(*bench.table(rows)), [], path, doc_dir)


def tpot_section(path: Path, doc_dir: Path) -> str:
    """`bench tpot`: each policy's decode step at a long context, against `none`'s."""
    from benchmarks import tpot

    document = sections.load(path)
    settings = document.get("settings", {})
    setup = (f"{settings.get('model')} {settings.get('dtype')}, eager; {settings.get('batch')} requests of "
             f"{settings.get('prompt_tokens')} essay tokens decoding together in a pool that holds all of them (no "
             f"policy is memory-bound); budget {settings.get('budget')} (sinks {settings.get('sinks')}) for the "
             f"budgeted policies, which prune each prompt after its prefill. TPOT: the mean decode step over "
             f"{settings.get('tokens')} steps; each policy in an engine of its own, the policies taking turns "
             f"{settings.get('repeats')} times (the median round shown, every round listed).")
    return sections.file_section(f"Time per output token (`{path.name}`)", document, setup,
                                 sections.markdown_table(*tpot.table(document.get("results", []))), [], path, doc_dir)
