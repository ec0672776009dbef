"""Markdown sections of the results page, rendered from the benchmark JSON files under `results/`.

Each function returns Markdown text without a `##` heading of its own (the page adds those);
per-file sections start with a `###` heading. Tables reuse the benchmark modules' own table
code (`kv_update.table_rows`, `throughput_report.table_cells`), so the page shows exactly the numbers
the benchmarks print. Files written by older versions of a benchmark lack some keys: those
show as "-" instead of failing the page.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

MISSING = "-"
# A cell that reads as a number, a ratio or a share is right-aligned, as `print_table` does.
NUMERIC_CELL = re.compile(r"^[-+]?\d[\d.,]*(x|%)?$")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; cells are `str(cell)` as in `common.print_table`, None is "-"."""
    def text(cell: object) -> str:
        return MISSING if cell is None else str(cell).replace("|", r"\|").replace("\n", " ")

    body = [[text(cell) for cell in row] for row in rows]
    for row in body:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, the header {len(headers)}: {row}")
    numeric = [all(cell == MISSING or NUMERIC_CELL.match(cell) for cell in column)
               and any(cell != MISSING for cell in column) for column in zip(*body)] or [False] * len(headers)
    lines = ["| " + " | ".join(text(header) for header in headers) + " |",
             "|" + "|".join("---:" if right else "---" for right in numeric) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def load(path: Path) -> dict[str, Any]:
    """One results file as written by `common.write_json` (benchmark, machine, settings, results, ...)."""
    return json.loads(Path(path).read_text())


def lookup(document: Mapping[str, Any], *keys: str, default: Any = MISSING) -> Any:
    """`document[k1][k2]...`, or `default` where a level is missing or None (older files)."""
    value: Any = document
    for key in keys:
        if not isinstance(value, Mapping) or value.get(key) is None:
            return default
        value = value[key]
    return value


# The top-level packages of this repository whose modules a recorded command may have run.
COMMAND_PACKAGES = ("vllm_kvprune", "benchmarks", "tools")
# Modules that have moved since older results were recorded: old name -> the one to type now.
MOVED_MODULES = {"vllm_kvprune.bench": "benchmarks",
                 "vllm_kvprune.kernels.triton.targets": "tools.triton_targets",
                 "vllm_kvprune.kernels.cutlass_check": "tools.cutlass_check"}


def shown_command(command: Sequence[str] | None) -> str:
    """The recorded argv as a reader would type it: `python -m benchmarks ...`.

    The interpreter's path is this machine's venv, and `sys.argv[0]` of `python -m pkg` is the
    path of `pkg/__main__.py`; both say nothing to a reader. A module recorded under a name it
    has since left (`MOVED_MODULES`) is shown under the name that runs it now."""
    if not command:
        return MISSING
    args = list(command[1:])
    script = args[0].replace("\\", "/") if args else ""
    parts = script.removesuffix(".py").split("/")
    roots = [index for index, part in enumerate(parts) if part in COMMAND_PACKAGES]
    if script.endswith(".py") and roots:
        module = ".".join(parts[roots[-1]:]).removesuffix(".__main__")
        args[0:1] = ["-m", _current_module(module)]
    elif len(args) > 1 and args[0] == "-m":
        args[1] = _current_module(args[1])
    return "python " + shlex.join(args)


def _current_module(module: str) -> str:
    for old, new in MOVED_MODULES.items():
        if module == old or module.startswith(old + "."):
            return new + module.removeprefix(old)
    return module


def plot_link(json_path: Path, doc_dir: Path) -> str | None:
    """The plot written next to a results file, as an image link relative to the page."""
    png = Path(json_path).with_suffix(".png")
    if not png.is_file():
        return None
    return f"![{png.stem}]({Path(os.path.relpath(png.resolve(), Path(doc_dir).resolve())).as_posix()})"


def loads(load_average: Any) -> str:
    return f"{load_average[0]:.1f}" if isinstance(load_average, list) and load_average else MISSING


def file_section(heading: str, document: Mapping[str, Any], setup: str, table: str, notes: Sequence[str],
                 path: Path, doc_dir: Path) -> str:
    parts = [f"### {heading}", f"Command: `{shown_command(lookup(document, 'machine', 'command', default=None))}`",
             setup, table]
    if notes:
        parts.append("\n".join(f"- {note}" for note in notes))
    image = plot_link(path, doc_dir)
    if image:
        parts.append(image)
    return "\n\n".join(parts)


# ---- kv-update ---------------------------------------------------------------------------
def kv_update_rows(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The result rows with what `kv_update.table_rows` indexes filled in for older files."""
    from benchmarks import kv_update

    # Files written before --policy existed timed StreamingLLM's update (Config's default).
    policy = lookup(document, "settings", "policy", default="streaming")
    rows = []
    for original in document.get("results") or []:
        row = copy.deepcopy(original)
        row.setdefault("policy", policy)
        row.setdefault("baseline", kv_update.BASELINE.get(row["policy"], "shift"))
        for key in ("dtype", "batch", "kv_heads", "head_dim", "evict"):
            row.setdefault(key, MISSING)
        for key in ("speedup_cpp", "speedup_torch", "speedup_cpp_vs_prealloc"):
            row.setdefault(key, None)
        timings = row.get("timings_us") or {}
        row["timings_us"] = {name: t for name, t in timings.items() if isinstance(t, Mapping) and "median" in t}
        rows.append(row)
    return rows


def kv_update_setup(document: Mapping[str, Any], rows: list[dict[str, Any]]) -> str:
    first = rows[0] if rows else {}
    layout = str(first.get("layout", MISSING)).split(":")[0].split("/")[0]  # as the plot's title
    sinks = "" if first.get("policy") == "h2o" else f"{first.get('sinks', MISSING)} sinks, "
    return (f"Cache {first.get('cache_tokens', MISSING)} tokens, {sinks}block {first.get('block_size', MISSING)}, "
            f"{layout} layout; median of at least {lookup(document, 'settings', 'min_repeats')} repetitions; "
            f"load average {loads(lookup(document, 'settings', 'load_average_before'))} before, "
            f"{loads(lookup(document, 'machine', 'load_average'))} after, "
            f"on {lookup(document, 'machine', 'usable_cores')} cores; {lookup(document, 'machine', 'time_utc')}.")


def kv_update_heading(document: Mapping[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    policy = rows[0]["policy"] if rows else lookup(document, "settings", "policy")
    threads = lookup(document, "settings", "threads", default=lookup(document, "machine", "torch_threads"))
    dtypes = "/".join(sorted({str(row["dtype"]) for row in rows})) or MISSING
    plural = "" if threads == 1 else "s"
    return f"kv-update: {policy}, {threads} thread{plural}, {dtypes} (`{Path(path).name}`)"


def kv_update_section(paths: Sequence[Path], doc_dir: Path) -> str:
    """One `###` subsection per kv_update*.json: heading (policy, threads, dtype), the command,
    the setup, the grid table exactly as `kv-update` prints it, its target check and its plot."""
    from benchmarks import kv_update

    sections = []
    for path in paths:
        document = load(path)
        rows = kv_update_rows(document)
        headers, body = kv_update.table_rows(rows)
        sections.append(file_section(kv_update_heading(document, rows, path), document,
                                     kv_update_setup(document, rows), markdown_table(headers, body),
                                     list(document.get("target_check") or []), path, doc_dir))
    return "\n\n".join(sections)


# ---- throughput --------------------------------------------------------------------------
# Columns only some runs record (older files predate them): left out when no row has them.
OPTIONAL_THROUGHPUT_COLUMNS = ("plan share", "score share", "mean blocks/req", "at the memory of")


def throughput_table(rows: list[dict[str, Any]]) -> str:
    """`throughput_report.table_cells`, without the optional columns no row of this file has."""
    from benchmarks import throughput_report as throughput

    headers, body = throughput.table_cells(rows)
    key_of = {header: key for header, key, _ in throughput.TABLE_COLUMNS}
    keep = [index for index, header in enumerate(headers) if header not in OPTIONAL_THROUGHPUT_COLUMNS
            or any(row.get(key_of[header]) is not None for row in rows)]
    return markdown_table([headers[i] for i in keep], [[cells[i] for i in keep] for cells in body])


def workload_text(workload: Any) -> str:
    if not isinstance(workload, Mapping):
        return MISSING
    count = lookup(workload, "num_requests")
    return (f"{count} request{'' if count == 1 else 's'} x {lookup(workload, 'prompt_tokens')}+"
            f"{lookup(workload, 'gen_tokens')} tokens on {lookup(workload, 'pool_blocks')} blocks")


def throughput_setup(document: Mapping[str, Any]) -> str:
    from benchmarks import throughput_report

    engine, settings = lookup(document, "settings", "engine", default={}), lookup(document, "settings", default={})
    model = Path(engine["model"]).name if engine.get("model") else MISSING
    return (f"{model} {lookup(engine, 'dtype')}, block {lookup(engine, 'block_size')}, max_model_len "
            f"{lookup(engine, 'max_model_len')}; memory-bound: {workload_text(settings.get('memory_bound'))}"
            f"{throughput_report.none_fewer_text(document.get('results') or [])}; "
            f"overhead: {workload_text(settings.get('overhead')) if settings.get('overhead', MISSING) is not None else 'not run'}; OMP_WAIT_POLICY "
            f"{lookup(settings, 'engine_env', 'OMP_WAIT_POLICY')}; load average "
            f"{loads(lookup(document, 'timing', 'load_before'))} before, "
            f"{loads(lookup(document, 'timing', 'load_after'))} after; {lookup(document, 'machine', 'time_utc')}.")


def throughput_targets(summary: Mapping[str, Any]) -> list[str]:
    """The two target ratios the run recorded, worded as `throughput` prints them."""
    from benchmarks import throughput_report as throughput

    def shown(ratio: Any, target: Any) -> str:
        if ratio is None or target is None:
            return "not measured"
        return f"{ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"

    lines = [f"memory-bound, streaming budget {throughput.TARGET_BUDGET} vs none: "
             + shown(summary.get("memory_bound_ratio_budget_512"), summary.get("memory_bound_target")),
             "nothing evicted, streaming vs none: "
             + shown(summary.get("overhead_ratio"), summary.get("overhead_target"))]
    # A run of other policies (gvote, fdc) measures neither streaming target: say what it measured.
    return ([line for line in lines if not line.endswith("not measured")]
            + throughput.budget_free_lines(summary.get("budget_free") or {}))


def throughput_section(paths: Sequence[Path], doc_dir: Path) -> str:
    """One `###` subsection per throughput*.json: heading (policies), the command, the setup,
    the table exactly as `throughput` prints it (tokens/s, ratio vs none, plan/score shares
    when recorded), the target ratios and the plot."""
    from benchmarks import throughput_report as throughput

    sections = []
    for path in paths:
        document = load(path)
        rows = [dict(row) for row in document.get("results") or []]
        # The policies under test are the memory-bound ones (the overhead case is always streaming).
        tested = [row for row in rows if row.get("setting") == throughput.MEMORY_BOUND] or rows
        policies = sorted({str(row.get("policy", MISSING)) for row in tested} - {"none"}) or [MISSING]
        heading = f"throughput: {', '.join(policies)} vs none (`{Path(path).name}`)"
        sections.append(file_section(heading, document, throughput_setup(document), throughput_table(rows),
                                     throughput_targets(document.get("summary") or {}), path, doc_dir))
    return "\n\n".join(sections)


# ---- worker memory -------------------------------------------------------------------------
def worker_memory_section(path: Path, doc_dir: Path) -> str:
    """Per-request worker state and RSS per policy, each run (before / after) side by side."""
    from benchmarks import worker_memory

    document = load(path)
    settings = document.get("settings", {})
    shape = document.get("model_shape", {})
    setup = (f"{settings.get('requests', MISSING)} requests at once (prompt and generated tokens per run: see "
             f"the commands), bf16, a model of {shape.get('num_hidden_layers', MISSING)} layers with "
             f"{shape.get('num_attention_heads', MISSING)} query / {shape.get('num_key_value_heads', MISSING)} KV "
             f"heads of {shape.get('head_dim', MISSING)} dims; `plan share`: planning's share of the decode "
             "steps with every request decoding (`h2o` with lazy pruning, R = 8).")
    commands: dict[str, list[str]] = {}
    for row in document["results"]:
        command = shown_command(row.get("command"))
        if command not in commands.setdefault(row["label"], []):
            commands[row["label"]].append(command)
    notes = [f"{label}: " + "; ".join(f"`{command}`" for command in shown) for label, shown in commands.items()]
    return file_section(f"worker memory (`{Path(path).name}`)", document, setup,
                        markdown_table(*worker_memory.table(document["results"])), notes, path, doc_dir)


# ---- gvote ---------------------------------------------------------------------------------
def gvote_section(path: Path, doc_dir: Path) -> str:
    """What `gvote` keeps and holds per prompt length, the vote's prefill share, and decode
    over head-pages vs vLLM's uniform layout."""
    from benchmarks import gvote

    document = load(path)
    settings = document.get("settings", {})
    dtype, per_length = settings.get("dtype", "bfloat16"), settings.get("prompts_per_length", MISSING)
    setup = (f"SmolLM2-135M-Instruct, {dtype}, essay prompts ({per_length} per "
             "length, one at a time), the paper's defaults (p 0.95, 8 samples, 16 future positions); blocks "
             "read from vLLM's block pool right after the vote.")
    notes = [gvote.decode_line(document["decode"])] if "decode" in document else []
    return file_section(f"gvote (`{Path(path).name}`)", document, setup,
                        markdown_table(*gvote.table(document["results"])), notes, path, doc_dir)


# ---- fdc -------------------------------------------------------------------------------------
FDC_CALIBRATIONS = (("fdc_calibration_random.json", "random tokens"), ("fdc_calibration_essays.json", "essays"),
                    ("fdc_calibration_v_weights.json", "random tokens, V from the weights"),
                    ("fdc_heldout_random.json", "random tokens (held-out text)"),
                    ("fdc_heldout_essays.json", "essays (held-out text)"),
                    ("fdc_pre_rope.json", "random tokens, with keys cut before RoPE"))


# Served throughput with FDC: alone (8 requests), under streaming and paged_eviction (24 requests).
FDC_THROUGHPUT = ("throughput_fdc", "throughput_streaming_fdc_24", "throughput_paged_fdc_24")


def _percent(value: Any) -> str:
    return MISSING if value is None else f"{value:.1%}"


def fdc_calibration_table(found: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """One row per calibration report: what it kept at its rate and how its spectra spread."""
    rows = []
    for label, report in found:
        compared = report.get("compared_with") or {}
        rows.append([label, str(lookup(report, "settings", "tokens")), str(report.get("rate", MISSING)),
                     _percent(report.get("kv_fraction")), f"{report.get('qk_rank_mean', 0):.1f}",
                     f"{report.get('v_rank_mean', 0):.1f}", _percent(report.get("qk_max_singular_cv")),
                     _percent(report.get("v_max_singular_cv")), _percent(compared.get("qk_subspace_overlap"))])
    headers = ["calibration", "tokens", "rate", "KV kept", "mean rank Q/K", "mean rank V", "CV of largest σ Q/K",
               "CV V", "Q/K subspace shared with random"]
    return markdown_table(headers, rows)


def fdc_perplexity_table(found: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Perplexity through the compressed cache (the reference) at each rate, adaptive and
    uniform ranks, and keys cut before RoPE where a report has them, against `none` on the
    same text."""
    def ratio(value: float | None, none: float) -> str:
        return MISSING if value is None else f"{value:.2f} ({value / none:.2f}x)"

    rows = []
    for label, report in found:
        sweep = report.get("perplexity")
        if not sweep:
            continue
        text = f"{sweep.get('tokens')} tokens from {sweep.get('offset', 0)}"
        for point in sweep.get("points", []):
            rows.append([label, text, f"{point['rate']:g}", f"{sweep['none']:.2f}", _percent(point["kv_fraction"]),
                         ratio(point["perplexity"], sweep["none"]), _percent(point["uniform_kv_fraction"]),
                         ratio(point["uniform_perplexity"], sweep["none"]),
                         ratio(point.get("pre_rope_perplexity"), sweep["none"])])
    headers = ["calibration", "essay text", "rate", "none", "KV kept", "perplexity", "uniform ranks: KV kept",
               "perplexity", "keys cut before RoPE (same KV kept)"]
    return markdown_table(headers, rows)


def fdc_section(folder: Path, doc_dir: Path) -> str:
    """FDC's calibrations (spectra, ranks, stability), perplexity through the cache, and the
    reduced-space attention kernel against vLLM's."""
    found = [(label, load(folder / name)) for name, label in FDC_CALIBRATIONS if (folder / name).is_file()]
    parts = []
    if found:
        commands = "\n".join(f"- {label}: `{shown_command(lookup(report, 'machine', 'command', default=None))}`"
                              for label, report in found)
        model = lookup(found[0][1], "settings", "model", default="smollm2-135m-instruct")
        layers = lookup(found[0][1], "settings", "layers", default=None)
        narrowed = f"; only its full-attention layers {layers} are narrowed" if layers else ""
        parts += [f"### FDC calibration (`{_results_path(folder)}/`)", "Commands:", commands,
                  f"{model}, fp32 Hugging Face reference{narrowed}; ranks from one removal rate (FDC Eq. 1); "
                  "the CV is FDC's Tables 3/4 (spread of each head's largest singular value).",
                  fdc_calibration_table(found),
                  "Perplexity of essay text through the compressed cache (reference), adaptive ranks, every "
                  "head at the mean ranks (the paper's ablation) and, where measured, the adaptive ranks "
                  "with each key cut before RoPE instead of after (Palu-style, `fdc/pre_rope.py`):",
                  fdc_perplexity_table(found)]
    accuracy = folder / "accuracy.json"
    if accuracy.is_file():
        parts.append(fdc_accuracy_section(accuracy, doc_dir))
    served = [folder / f"{stem}.json" for stem in FDC_THROUGHPUT if (folder / f"{stem}.json").is_file()]
    if served:
        parts.append(throughput_section(served, doc_dir))
    attention = folder / "attention.json"
    if attention.is_file():
        document = load(attention)
        settings = document.get("settings", {})
        from benchmarks import fdc_attention

        headers, rows = fdc_attention.table(document.get("results", []))
        summary = document.get("summary", {})
        notes = [f"50% of the dims vs vLLM's kernel at full width: {summary.get('half_dims_vs_vllm_full', 0):.2f}x "
                 f"(goal >= {summary.get('target', MISSING)}x)",
                 f"LPT vs static schedule: {summary.get('lpt_vs_static_mixed', 0):.2f}x on mixed lengths, "
                 f"{summary.get('lpt_vs_static_equal', 0):.2f}x on equal lengths"]
        setup = (f"One decode step of all 30 layers of SmolLM2's shape, each over its own cache: "
                 f"{settings.get('batch', MISSING)} sequences x {settings.get('seq_len', MISSING)} tokens, "
                 f"{settings.get('dtype', MISSING)}, median of {settings.get('repeats', MISSING)} rounds.")
        parts.append(file_section("FDC decode attention (`fdc/attention.json`)", document, setup,
                                  markdown_table(headers, rows),
                                  notes, attention, doc_dir))
    return "\n\n".join(parts)


def _results_path(folder: Path) -> str:
    """`folder` from `results/` on (`results/fdc`, `results/fdc/gemma`), however it was reached."""
    parts = folder.resolve().parts
    return "/".join(parts[parts.index("results"):]) if "results" in parts else folder.name


def fdc_accuracy_section(path: Path, doc_dir: Path) -> str:
    """`bench fdc-accuracy`: the accuracy suite served with fdc at each setting, and the 99% point."""
    document = load(path)
    settings, summary = document.get("settings", {}), document.get("summary", {})
    calibration = settings.get("calibration", {})
    model = settings.get("model", "SmolLM2-135M-Instruct")
    layers = calibration.get("layers")
    setup = (f"Served engines (`--kv-policy fdc`), {model} in {settings.get('dtype', MISSING)}, block size "
             f"{settings.get('block_size', 32)}, the accuracy suite's cases (seed {settings.get('seed', MISSING)}). "
             f"One calibration: {calibration.get('tokens', MISSING)} essay tokens from token "
             f"{calibration.get('essay_offset', MISSING)} (text no task reads). KV kept: the packed cache per token "
             "over the full one; pool tokens: the pool's blocks for the same bytes over `none`'s (each layer's row "
             "rounded up to a head size of its own)."
             + (f" A hybrid model: FDC narrows its full-attention layers {layers} only (the sliding-window layers "
                "stay whole, bounded by their window), so both columns count those layers; the narrowed layers "
                "share the widest one's row and a block holds a multiple of 32 of their tokens in the sliding "
                "layers' page (docs/FDC.md, \"Hybrid models\")." if layers else ""))
    table = document.get("table", {})
    chosen = summary.get("at_99_percent")
    tasks = ", ".join(settings.get("tasks", ["needle", "kv_retrieval", "arithmetic"]))
    notes = [f"Largest compression at >= 99% of `none`'s mean hit rate ({tasks}): "
             f"{chosen if chosen is not None else 'none of the settings'}"]
    return file_section(f"FDC accuracy vs compression (`{_results_path(path.parent)}/accuracy.json`)", document, setup,
                        markdown_table(table.get("headers", []), table.get("rows", [])), notes, path, doc_dir)


def metrics_overhead_section(path: Path, doc_dir: Path) -> str:
    """`bench metrics-overhead`: our metrics (or, `switch: checks`, the debug checks) on vs off."""
    document = load(path)
    settings = document.get("settings", {})
    switched = "our metrics" if settings.get("switch", "metrics") == "metrics" else "the debug invariant checks"
    model = "the tiny random Llama" if settings.get("tiny") else "SmolLM2-135M-Instruct"
    budget = f" at budget {settings.get('budget', MISSING)}" if settings.get("policy") != "gvote" else ""
    setup = (f"One engine, {model} in {settings.get('dtype', MISSING)}, `{settings.get('policy', MISSING)}`{budget}, "
             f"{settings.get('requests', MISSING)} requests of {settings.get('prompt_tokens', MISSING)} + "
             f"{settings.get('gen_tokens', MISSING)} tokens, {switched} on and off in turn over "
             f"{settings.get('rounds', MISSING)} rounds; vLLM's own stats on in both.")
    if settings.get("prometheus_multiprocess"):
        setup += (" Counted into Prometheus' multiprocess files too, as under several API servers "
                  "(`--prometheus-multiprocess`).")
    rows = [[r["metrics"], f"{statistics.median(r['tokens_per_s']):.1f}",
             " ".join(f"{v:.1f}" for v in r["tokens_per_s"])] for r in document.get("results", [])]
    goal = " (goal <= 1%)" if switched == "our metrics" else ""
    notes = [f"Overhead of {switched}: {document.get('overhead', 0):+.2%} of output tokens/s{goal}"]
    shares = document.get("metrics_code_shares")
    if shares:
        notes.append(f"Time inside our metrics code (a stopwatch around it in the rounds with metrics on): "
                     f"{statistics.median(shares):.3%} of the wall time, median of {len(shares)} rounds "
                     f"(largest {max(shares):.3%})")
    heading = "Metrics overhead" if switched == "our metrics" else "Debug checks overhead"
    return file_section(f"{heading} (`{path.name}`)", document, setup,
                        markdown_table(["on/off", "tokens/s (median)", "runs"], rows), notes, path, doc_dir)


LOAD_HEADERS = ["policy", "good requests", "completed", "cut off by the client", "bad (4xx naming the field)",
                "5xx", "lost", "short", "preemptions", "pool after", "greedy request unchanged", "s"]


def load_section(path: Path, doc_dir: Path) -> str:
    """`bench load`: what every request of the load got, per policy, and what was left behind."""
    document = load(path)
    settings = document.get("settings", {})
    setup = (f"A real `vllm-kvprune serve` per policy ({'tiny random Llama' if settings.get('tiny') else 'SmolLM2'}, "
             f"float32), a pool of {settings.get('pool_blocks', MISSING)} blocks of 32 tokens; "
             f"{settings.get('requests', MISSING)} streaming requests from {settings.get('concurrency', MISSING)} "
             f"clients at once (prompts of up to {settings.get('max_prompt', MISSING)} random tokens, lengths "
             f"{settings.get('prompt_lengths', 'uniform from 4')}, up to "
             f"{settings.get('max_tokens', MISSING)} new tokens, random per-request settings, every third cut off "
             f"mid-stream), one bad request after every {settings.get('bad_every', MISSING)}.")
    rows = [[r["policy"], str(settings.get("requests", MISSING)), str(r["completed"]), str(r["cut_off"]),
             f"{r['bad_refused']} of {r['bad_refused'] + r['bad_unnamed']}", str(r["server_errors"]), str(r["lost"]),
             str(r["short"]), f"{r['preemptions']:.0f}", f"{r['pool_usage_after']:.0%}, {r['blocks_held_after']:.0f} held",
             "yes" if r["greedy_identical"] else "no", f"{r['seconds']:.0f}"] for r in document.get("results", [])]
    notes = ["Passed (no 5xx, nothing lost or short, every bad request named, the pool empty, the greedy "
             "request unchanged): " + ("yes" if document.get("passed") else "NO")]
    return file_section(f"Load and bad input (`{path.name}`)", document, setup, markdown_table(LOAD_HEADERS, rows),
                        notes, path, doc_dir)


# ---- Ray batch job --------------------------------------------------------------------------
def ray_batch_section(path: Path, doc_dir: Path) -> str:
    """`bench ray-batch`: the batch job with 1, then 2 actors: throughput and KV blocks held."""
    document = load(path)
    setup = (f"`python -m vllm_kvprune.batch` on a local Ray cluster, {document.get('rows')} rows of "
             f"{document.get('prompt_tokens')} prompt tokens, {document.get('max_tokens')} generated each, "
             f"policy `{' '.join(document.get('policy') or [])}`, float32, one engine per actor, each actor "
             "pinned to its own core(s). Busy: generated tokens over the busiest actor's time inside "
             "`generate`; wall: over the whole job, the engines' start-up included.")
    rows = [[str(run["actors"]), str(run["cpus_per_actor"]), f"{run['generated_tokens_per_busy_second']:.1f}",
             f"{run['speedup_busy']:.2f}x", f"{run['generated_tokens_per_second']:.1f}", f"{run['speedup_wall']:.2f}x",
             f"{run['kv_blocks_held_mean']:.1f}", f"{run['kv_blocks_without_policy_mean']:.1f}"]
            for run in document.get("runs", [])]
    headers = ["actors", "cores each", "tok/s (busy)", "vs 1 actor", "tok/s (wall)", "vs 1 actor",
               "KV blocks held per request", "without the policy"]
    return file_section("Ray batch job: 1 vs 2 actors (`ray_batch.json`)", document, setup,
                        markdown_table(headers, rows), [], path, doc_dir)


# ---- machine -----------------------------------------------------------------------------
MACHINE_FIELDS = (
    ("CPU", "cpu_model"), ("key CPU flags", "cpu_key_flags"), ("usable cores", "usable_cores"),
    ("memory GiB", "memory_gib"), ("Python", "python"), ("torch", "torch"), ("vLLM", "vllm"),
    ("vllm_kvprune", "vllm_kvprune"), ("platform", "platform"),
)


def machine_value(machine: Mapping[str, Any], key: str) -> str:
    value = machine.get(key)
    if value is None or value == []:
        return MISSING
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def machine_section(documents: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Hardware and versions of the runs, as a table.

    `documents` are (name, loaded JSON) pairs; the name (e.g. the file name) is what a value is
    attributed to when the runs disagree: then the cell lists each distinct value followed by
    the names it came from."""
    rows = []
    for label, key in MACHINE_FIELDS:
        sources: dict[str, list[str]] = {}
        for name, document in documents:
            sources.setdefault(machine_value(lookup(document, "machine", default={}), key), []).append(name)
        if len(sources) <= 1:
            rows.append([label, next(iter(sources), MISSING)])
        else:
            rows.append([label, "; ".join(f"{value} ({', '.join(names)})" for value, names in sources.items())])
    times = sorted(str(lookup(document, "machine", "time_utc")) for _, document in documents
                   if lookup(document, "machine", "time_utc") != MISSING)
    span = f"{times[0]} to {times[-1]}" if times else MISSING
    return f"{len(documents)} result files, measured {span} (UTC).\n\n" + markdown_table(["", "value"], rows)
