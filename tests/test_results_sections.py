"""The results page's sections, rendered from the committed `results/*.json`.

Every number checked here is read from the JSON in the test, never typed in: a section that
drops a row, shifts a column or mislabels a file fails. Also: tables are well formed, image
links resolve, and files with keys missing (older benchmark versions) still render."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import pytest

from benchmarks import results_gpu
from benchmarks import results_sections as sections

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
DOC_DIR = REPO / "docs"
KV_UPDATE_FILES = sorted(RESULTS.glob("kv_update*.json"))
THROUGHPUT_FILES = sorted(RESULTS.glob("throughput*.json"))
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def tables(markdown: str) -> list[list[list[str]]]:
    """Every table as its lines' cells (header, separator, body), split on unescaped pipes."""
    blocks = [block.splitlines() for block in markdown.split("\n\n")]
    return [[[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in block]
            for block in blocks if block and all(line.startswith("|") for line in block)]


def body_rows(markdown: str) -> list[list[str]]:
    return [row for table in tables(markdown) for row in table[2:]]


def test_results_are_committed() -> None:
    assert KV_UPDATE_FILES and THROUGHPUT_FILES


@pytest.mark.parametrize("path", KV_UPDATE_FILES, ids=lambda path: path.name)
def test_kv_update_rows_show_the_files_medians_and_speedups(path: Path) -> None:
    document = json.loads(path.read_text())
    rendered = sections.kv_update_section([path], DOC_DIR)
    rows = body_rows(rendered)
    assert len(rows) == len(document["results"])
    for cells, result in zip(rows, document["results"]):
        assert cells[1] == str(result["batch"]) and cells[4] == str(result["evict"])
        for timing in result["timings_us"].values():
            assert f"{timing['median']:.1f}" in cells
        assert f"{result['speedup_cpp']:.1f}x" in cells


@pytest.mark.parametrize("path", KV_UPDATE_FILES, ids=lambda path: path.name)
def test_kv_update_heading_and_command_come_from_the_file(path: Path) -> None:
    document = json.loads(path.read_text())
    rendered = sections.kv_update_section([path], DOC_DIR)
    heading = rendered.splitlines()[0]
    assert heading.startswith("### ") and path.name in heading
    assert f"{document['settings']['threads']} thread" in heading
    assert document["results"][0]["dtype"] in heading
    if "policy" in document["settings"]:
        assert document["settings"]["policy"] in heading
    arguments = shlex.join(document["machine"]["command"][2:])
    assert f"`python -m benchmarks {arguments}`" in rendered


@pytest.mark.parametrize("path", THROUGHPUT_FILES, ids=lambda path: path.name)
def test_throughput_rows_show_tokens_per_second_and_ratio(path: Path) -> None:
    document = json.loads(path.read_text())
    rendered = sections.throughput_section([path], DOC_DIR)
    header = tables(rendered)[0][0]
    rows = body_rows(rendered)
    assert len(rows) == len(document["results"])
    for cells, result in zip(rows, document["results"]):
        assert cells[header.index("policy")] == result["policy"]
        assert cells[header.index("tokens/s")] == f"{result['tokens_per_s']:.1f}"
        assert cells[header.index("vs none")] == f"{result['ratio_vs_none']:.2f}x"
    has_score = any("score_share" in result for result in document["results"])
    assert ("score share" in header) == has_score


def test_every_table_row_has_as_many_cells_as_its_header() -> None:
    rendered = "\n\n".join([
        sections.kv_update_section(KV_UPDATE_FILES, DOC_DIR),
        sections.throughput_section(THROUGHPUT_FILES, DOC_DIR),
        sections.machine_section([(path.name, json.loads(path.read_text())) for path in sorted(RESULTS.glob("*.json"))]),
    ])
    found = tables(rendered)
    assert len(found) == len(KV_UPDATE_FILES) + len(THROUGHPUT_FILES) + 1
    for table in found:
        assert all(len(row) == len(table[0]) for row in table), table[0]


def test_image_links_point_at_the_plots_next_to_the_json() -> None:
    rendered = sections.kv_update_section(KV_UPDATE_FILES, DOC_DIR) + sections.throughput_section(
        THROUGHPUT_FILES, DOC_DIR)
    links = IMAGE.findall(rendered)
    plots = [path.with_suffix(".png") for path in KV_UPDATE_FILES + THROUGHPUT_FILES
             if path.with_suffix(".png").is_file()]
    assert plots and len(links) == len(plots)
    assert sorted((DOC_DIR / link).resolve() for link in links) == sorted(plot.resolve() for plot in plots)


def test_machine_section_shows_the_recorded_machine() -> None:
    documents = [(path.name, json.loads(path.read_text())) for path in sorted(RESULTS.glob("*.json"))]
    rendered = sections.machine_section(documents)
    machine = documents[0][1]["machine"]
    for key in ("cpu_model", "python", "torch", "vllm", "platform"):
        assert str(machine[key]) in rendered
    assert " ".join(machine["cpu_key_flags"]) in rendered


def test_machine_section_attributes_disagreeing_values_to_their_files() -> None:
    first, second = KV_UPDATE_FILES[0], THROUGHPUT_FILES[0]
    original = json.loads(second.read_text())
    changed = copy.deepcopy(original)
    changed["machine"]["vllm"] = original["machine"]["vllm"] + ".post1"
    del changed["machine"]["memory_gib"]
    rendered = sections.machine_section([(first.name, json.loads(first.read_text())), (second.name, changed)])
    vllm_row = next(row for row in body_rows(rendered) if row[0] == "vLLM")
    assert f"{original['machine']['vllm']} ({first.name})" in vllm_row[1]
    assert f"{changed['machine']['vllm']} ({second.name})" in vllm_row[1]
    memory_row = next(row for row in body_rows(rendered) if row[0] == "memory GiB")
    assert f"- ({second.name})" in memory_row[1]


def test_files_missing_keys_still_render(tmp_path: Path) -> None:
    """Older benchmark versions wrote fewer keys: those cells show "-" and nothing raises."""
    kv_document = json.loads(KV_UPDATE_FILES[0].read_text())
    del kv_document["machine"], kv_document["settings"], kv_document["target_check"]
    for row in kv_document["results"]:
        row.pop("speedup_cpp"), row.pop("baseline", None), row.pop("policy", None), row.pop("batch")
        row["timings_us"].pop("inplace_cpp")
    throughput_document = json.loads(THROUGHPUT_FILES[0].read_text())
    del throughput_document["summary"], throughput_document["timing"], throughput_document["settings"]
    for row in throughput_document["results"]:
        row.pop("ratio_vs_none"), row.pop("policy")
    (tmp_path / "kv_update_old.json").write_text(json.dumps(kv_document))
    (tmp_path / "throughput_old.json").write_text(json.dumps(throughput_document))
    rendered = (sections.kv_update_section([tmp_path / "kv_update_old.json"], tmp_path)
                + "\n\n" + sections.throughput_section([tmp_path / "throughput_old.json"], tmp_path))
    assert "Command: `-`" in rendered and not IMAGE.search(rendered)
    kv_rows, throughput_rows = (body_rows(part) for part in rendered.split("### ")[1:])
    assert len(kv_rows) == len(kv_document["results"]) and all(row[1] == "-" for row in kv_rows)
    assert all(row[tables(rendered)[1][0].index("vs none")] == "-" for row in throughput_rows)
    kept = next(iter(kv_document["results"][0]["timings_us"].values()))["median"]
    assert f"{kept:.1f}" in kv_rows[0]


def test_markdown_table_escapes_pipes_and_rejects_ragged_rows() -> None:
    table = sections.markdown_table(["a", "b"], [["x|y", None]])
    assert tables(table)[0][2] == [r"x\|y", "-"]
    with pytest.raises(ValueError):
        sections.markdown_table(["a", "b"], [["only one"]])


def test_worker_memory_section_reads_every_row_from_its_json() -> None:
    path = RESULTS / "worker_memory.json"
    document = json.loads(path.read_text())
    rows = {(row[0], row[1]): row for row in body_rows(sections.worker_memory_section(path, DOC_DIR))}
    assert len(rows) == len(document["results"])
    for result in document["results"]:
        row = rows[(result["label"], result["policy"])]
        assert float(row[2]) == pytest.approx(result["peak_rss_mib"], abs=0.5)
        assert float(row[4]) == pytest.approx(result["peak_state_mib"], abs=0.05)


def test_gvote_section_reads_every_length_from_its_json() -> None:
    path = RESULTS / "gvote.json"
    document = json.loads(path.read_text())
    rows = {row[0]: row for row in body_rows(sections.gvote_section(path, DOC_DIR))}
    lengths = {result["prompt_tokens"] for result in document["results"]}
    assert set(rows) == {str(length) for length in lengths}
    for length in lengths:
        group = [r for r in document["results"] if r["prompt_tokens"] == length]
        assert float(rows[str(length)][2]) == pytest.approx(sum(r["blocks_held"] for r in group) / len(group), abs=0.05)
        assert float(rows[str(length)][4]) == pytest.approx(sum(r["blocks_none"] for r in group) / len(group), abs=0.05)


def test_fdc_section_shows_every_calibration_and_sweep_point() -> None:
    folder = RESULTS / "fdc"
    rendered = sections.fdc_section(folder, DOC_DIR)
    found = [(label, json.loads((folder / name).read_text())) for name, label in sections.FDC_CALIBRATIONS
             if (folder / name).is_file()]
    assert found
    found_tables = tables(rendered)
    calibration_table, sweep_table, attention_table = found_tables[0], found_tables[1], found_tables[-1]
    assert [row[0] for row in calibration_table[2:]] == [label for label, _ in found]
    for row, (_, report) in zip(calibration_table[2:], found):
        assert row[3] == f"{report['kv_fraction']:.1%}"
    points = [(label, point) for label, report in found for point in (report.get("perplexity") or {}).get("points", [])]
    assert len(sweep_table) - 2 == len(points) > 0
    none_of = {label: report["perplexity"]["none"] for label, report in found if report.get("perplexity")}
    for row, (label, point) in zip(sweep_table[2:], points):
        assert row[0] == label and row[5].startswith(f"{point['perplexity']:.2f} (")
        # The pre-RoPE column: the measured value where a report has it, "-" elsewhere.
        before_rope = point.get("pre_rope_perplexity")
        expected = "-" if before_rope is None else f"{before_rope:.2f} ({before_rope / none_of[label]:.2f}x)"
        assert row[8] == expected
    assert any(point.get("pre_rope_perplexity") for _, point in points)
    attention = json.loads((folder / "attention.json").read_text())
    assert [row[0] for row in attention_table[2:]] == [row["case"] for row in attention["results"]]
    for link in IMAGE.findall(rendered):
        assert (DOC_DIR / link).resolve().is_file(), link


@pytest.mark.parametrize("name", ["kernels_h100.json", "kernels_h200.json"])
def test_gpu_section_shows_every_timed_kernel_and_its_gpu(tmp_path: Path, name: str) -> None:
    path = RESULTS / "gpu" / name
    document = json.loads(path.read_text())
    text = results_gpu.gpu_section(path, DOC_DIR)
    assert document["machine"]["gpu"] in text
    body = tables(text)[0][2:]
    assert len(body) == len(document["results"])
    for cells, row in zip(body, document["results"]):
        assert cells[:3] == [row["case"], row["candidate"], f"{row['ms']:.4f}"]
    passed = re.search(r"(\d+) passed", (path.parent / name.replace("kernels", "pytest").replace(".json", ".txt")).read_text())
    assert f"{passed.group(1)} passed" in text
    # An interpreter run times nothing: no section from it.
    interpreted = copy.deepcopy(document)
    interpreted["machine"]["interpreter"] = True
    (tmp_path / "kernels.json").write_text(json.dumps(interpreted))
    assert results_gpu.gpu_section(tmp_path / "kernels.json", DOC_DIR) == ""


def test_fdc_tiles_section_shows_the_fastest_and_slowest_tile_of_each_width() -> None:
    path = RESULTS / "gpu" / "fdc_tiles_h200.json"
    document = json.loads(path.read_text())
    text = results_gpu.fdc_tiles_section(path, DOC_DIR)
    assert document["machine"]["gpu"] in text
    body = tables(text)[0][2:]
    for case in {row["case"] for row in document["results"] if row["case"].startswith("fdc tiles")}:
        for width in ("full width", "50% dims"):
            tried = [row for row in document["results"] if row["case"] == case and row["candidate"].startswith(width)]
            fastest = min(tried, key=lambda row: row["ms"])
            assert [case, f"fastest of {len(tried)}: {fastest['candidate']}", f"{fastest['ms']:.4f}"] in [
                cells[:3] for cells in body]
    split_rows = [row for row in document["results"] if "key splits" in row["candidate"]]
    assert split_rows and all(row["candidate"] in text for row in split_rows)


def test_targets_section_shows_every_kernel_on_every_target() -> None:
    path = RESULTS / "gpu" / "triton_targets.json"
    document = json.loads(path.read_text())
    text = results_gpu.targets_section(path, DOC_DIR)
    header, _, *body = tables(text)[0]
    names = [target["name"] for target in document["targets"]]
    assert header == ["kernel", *names]
    cells = {row[0]: dict(zip(names, row[1:])) for row in body}
    assert len(body) == len({line["kernel"] for line in document["summary"]})
    for line in document["summary"]:
        cell = cells[line["kernel"].strip("_").removesuffix("_kernel")][line["target"]]
        assert f"{line['max_registers']} regs, {line['max_spilled']} spilled" in cell
        assert ("FAILED" in cell) == bool(line["failed"])
    assert f"Triton {document['triton']}" in text and document["machine"]["head"] in text


@pytest.mark.parametrize("path", sorted(RESULTS.glob("load*.json")), ids=lambda path: path.name)
def test_load_section_reads_every_policy_from_its_json(path: Path) -> None:
    document = json.loads(path.read_text())
    section = sections.load_section(path, DOC_DIR)
    assert f"(`{path.name}`)" in section
    rows = {row[0]: row for row in body_rows(section)}
    assert set(rows) == {result["policy"] for result in document["results"]}
    for result in document["results"]:
        row = rows[result["policy"]]
        assert (int(row[2]), int(row[3]), int(row[5]), int(row[6]), int(row[7])) == (
            result["completed"], result["cut_off"], result["server_errors"], result["lost"], result["short"])
        assert row[4] == f"{result['bad_refused']} of {result['bad_refused'] + result['bad_unnamed']}"
    assert f"request unchanged): {'yes' if document['passed'] else 'NO'}" in section


def test_metrics_overhead_section_shows_both_measures_from_its_json() -> None:
    import statistics

    path = RESULTS / "metrics_overhead.json"
    document = json.loads(path.read_text())
    section = sections.metrics_overhead_section(path, DOC_DIR)
    rows = {row[0]: row for row in body_rows(section)}
    for result in document["results"]:
        assert rows[result["metrics"]][1] == f"{statistics.median(result['tokens_per_s']):.1f}"
    assert f"{document['overhead']:+.2%} of output tokens/s" in section
    shares = document["metrics_code_shares"]
    assert f"{statistics.median(shares):.3%} of the wall time, median of {len(shares)} rounds" in section


@pytest.mark.parametrize("folder", ["fdc", "fdc/gemma"])
def test_fdc_accuracy_section_shows_every_setting_and_the_99_percent_point(folder: str) -> None:
    path = RESULTS / folder / "accuracy.json"
    document = json.loads(path.read_text())
    section = sections.fdc_accuracy_section(path, DOC_DIR)
    assert body_rows(section) == [[str(cell) for cell in row] for row in document["table"]["rows"]]
    assert {row[0] for row in body_rows(section)} >= {"none"}
    tasks = ", ".join(document["settings"]["tasks"])
    assert f"mean hit rate ({tasks}): {document['summary']['at_99_percent']}" in section
    assert document["settings"].get("model", "SmolLM2-135M-Instruct") in section
    assert f"`results/{folder}/accuracy.json`" in section


def test_ray_batch_section_reads_every_run() -> None:
    path = RESULTS / "ray_batch.json"
    document = json.loads(path.read_text())
    body = tables(sections.ray_batch_section(path, DOC_DIR))[0][2:]
    assert [cells[0] for cells in body] == [str(run["actors"]) for run in document["runs"]]
    for cells, run in zip(body, document["runs"]):
        assert cells[2] == f"{run['generated_tokens_per_busy_second']:.1f}"
        assert cells[3] == f"{run['speedup_busy']:.2f}x"
        assert cells[6] == f"{run['kv_blocks_held_mean']:.1f}"


def test_accuracy_runs_apart_render_after_the_suites(tmp_path) -> None:
    """A run of a few tasks in a folder of results/ (ACCURACY_RUNS_APART) gets its own
    section, under its title, with its table computed from its records."""
    from benchmarks import results_page
    from benchmarks.accuracy import TASK_TYPES, report

    folder, title = next(iter(results_page.ACCURACY_RUNS_APART.items()))
    document = json.loads((RESULTS / "accuracy_needle.json").read_text())
    document["results"] = [r for r in document["results"] if r["method"] in ("none", "paged_eviction")]
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "accuracy_needle.json").write_text(json.dumps(document))
    page = results_page.render(tmp_path, tmp_path / "docs" / "RESULTS.md")
    after = page.split(f"### {title}", 1)[1]
    assert after.lstrip().startswith("#### needle (hit rate)")
    budgets = sorted({r["budget"] for r in document["results"] if r["budget"] is not None})
    for row in report.budget_table(TASK_TYPES["needle"](), document["results"], budgets)[1]:
        assert "| " + " | ".join(row) + " |" in after
