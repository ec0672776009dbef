"""Results-page sections of the GPU runs (`results/gpu/`): the kernels against torch on each GPU
they ran on, the GPU wrapper's work per decode step, the host's planning of a step, and fdc's
decode tile sweep."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.results_sections import MISSING, load, markdown_table, plot_link, shown_command

# ---- GPU kernels -----------------------------------------------------------------------------
GPU_COMMAND = "PYTHONPATH=. python3 -m benchmarks.gpu_kernels"


def gpu_section(path: Path, doc_dir: Path) -> str:
    """The Triton kernels against plain torch on the GPU they ran on, and the kernel tests there."""
    document = load(path)
    machine = document.get("machine", {})
    if machine.get("interpreter"):
        return ""  # an interpreter run checks the script, it times nothing
    shapes = document.get("shapes", {})
    setup = (f"{machine.get('gpu', MISSING)} ({machine.get('multiprocessors', MISSING)} SMs), torch "
             f"{machine.get('torch', MISSING)}, Triton {machine.get('triton', MISSING)}, {document.get('dtype')}; "
             f"batch {shapes.get('batch')}, {shapes.get('kv_heads')} KV heads x {shapes.get('group')} query heads each, "
             f"head size {shapes.get('head_dim')}, {shapes.get('seq_len')} tokens per request, block size "
             f"{shapes.get('block_size')}. Median of Triton's `do_bench` (CUDA events), host overhead included; "
             "each candidate checked against the torch computation of its case first (max |error|).")
    rows = [[row["case"], row["candidate"], f"{row['ms']:.4f}",
             MISSING if row.get("speedup_vs_torch") is None else f"{row['speedup_vs_torch']:.2f}x",
             "" if row.get("max_abs_error") is None else f"{row['max_abs_error']:.1e}"]
            for row in document["results"]]
    table = markdown_table(["case", "candidate", "ms", "vs torch", "max abs error"], rows)
    notes = []
    # kernels_h200.json's tests are pytest_h200.txt (kernels.json's: pytest.txt).
    tests = Path(path).with_name("pytest" + Path(path).stem[len("kernels"):] + ".txt")
    if tests.is_file():
        passed = re.search(r"(\d+) passed", tests.read_text())
        if passed:
            notes.append(f"Kernel tests on that GPU (`pytest -m triton --noconftest`, every kernel against its "
                         f"torch reference on CUDA tensors): {passed.group(1)} passed (`{tests.name}`).")
    command = shown_command(machine.get("command")) if machine.get("command") else GPU_COMMAND
    parts = [f"### Triton kernels on {machine.get('gpu', 'a GPU')} (`{Path(path).name}`)",
             f"Command (on the GPU machine, which has PyTorch and Triton but not vLLM): `{command}`",
             setup, table, "\n".join(f"- {note}" for note in notes)]
    image = plot_link(path, doc_dir)
    if image:
        parts.append(image)
    return "\n\n".join(part for part in parts if part)


def fdc_tiles_section(path: Path, doc_dir: Path) -> str:
    """The fdc decode kernel's tile sweep (``--cases fdc fdc-tiles``): per shape and width, SDPA
    at full width, the fastest and slowest tile, and how many were tried; the fdc case's
    key-split rows from the same run beside them."""
    document = load(path)
    machine = document.get("machine", {})
    if machine.get("interpreter"):
        return ""
    results = document["results"]
    rows = []
    for case in dict.fromkeys(row["case"] for row in results):
        in_case = [row for row in results if row["case"] == case]
        baseline = next((row for row in in_case if row["candidate"].startswith("torch SDPA")), None)
        if not case.startswith("fdc tiles"):
            rows += [[case, row["candidate"], f"{row['ms']:.4f}",
                      MISSING if row.get("speedup_vs_torch") is None else f"{row['speedup_vs_torch']:.2f}x"]
                     for row in in_case]
            continue
        if baseline:
            rows.append([case, baseline["candidate"], f"{baseline['ms']:.4f}", "1.00x"])
        for width in dict.fromkeys(row["candidate"].split(",")[0] for row in in_case if row is not baseline):
            tried = sorted((row for row in in_case if row["candidate"].split(",")[0] == width), key=lambda r: r["ms"])
            for which, row in (("fastest", tried[0]), ("slowest", tried[-1])):
                rows.append([case, f"{which} of {len(tried)}: {row['candidate']}", f"{row['ms']:.4f}",
                             MISSING if row.get("speedup_vs_torch") is None else f"{row['speedup_vs_torch']:.2f}x"])
    command = shown_command(machine.get("command")) if machine.get("command") else GPU_COMMAND
    parts = [f"### fdc decode: key splits, key layouts and tiles on {machine.get('gpu', 'a GPU')} "
             f"(`{Path(path).name}`)",
             f"Command (on the GPU machine): `{command}`. {document.get('dtype')}; \"vs torch\" is torch SDPA at "
             "full width on the same inputs (it reads every dim of every key).",
             markdown_table(["case", "candidate", "ms", "vs torch"], rows)]
    return "\n\n".join(parts)


def steps_section(path: Path, doc_dir: Path) -> str:
    """The GPU wrapper's own work per decode step (`bench gpu-steps`), each policy beside `none`."""
    document = load(path)
    machine = document.get("machine", {})
    if machine.get("interpreter"):
        return ""
    shapes = document.get("shapes", {})
    setup = (f"{machine.get('gpu', MISSING)}, torch {machine.get('torch', MISSING)}, Triton "
             f"{machine.get('triton', MISSING)}, {document.get('dtype')}; batch {shapes.get('batch')}, "
             f"{shapes.get('layers')} layers of {shapes.get('kv_heads')} KV heads x {shapes.get('group')} query heads, "
             f"head size {shapes.get('head_dim')}, prompts of {shapes.get('prompt')} tokens, budget "
             f"{shapes.get('budget')}; the median of {shapes.get('decode_steps', 0) - 2} decode steps, each ended by a "
             "GPU sync. A step is every layer's KV work only (moves, cache write, attention, scores, the host's "
             "plan); no model, and vLLM's own write and attention stood in for by our Triton kernels (the GPU "
             "machine has no vLLM).")
    rows = [[row["policy"], f"{row['step_ms']:.3f}", f"{row['plan_ms']:.3f}", str(row["kept_tokens"]),
             MISSING if row.get("vs_none") is None else f"{row['vs_none']:.2f}x"] for row in document["results"]]
    command = shown_command(machine.get("command")) if machine.get("command") else MISSING
    parts = [f"### The GPU wrapper's work per decode step on {machine.get('gpu', 'a GPU')} (`{Path(path).name}`)",
             f"Command (on the GPU machine, after `python3 setup.py build_ext --inplace`): `{command}`", setup,
             markdown_table(["policy", "ms per step", "of which host planning", "tokens kept", "speed vs none"],
                            rows)]
    image = plot_link(path, doc_dir)
    if image:
        parts.append(image)
    return "\n\n".join(parts)


def plan_steps_section(path: Path, doc_dir: Path) -> str:
    """The host's planning of a decode step alone (`bench plan-steps`), beside a revision's."""
    document = load(path)
    machine, shapes = document.get("machine", {}), document.get("shapes", {})
    against = document.get("against")
    setup = (f"`WorkerKVState.plan` alone (no model, no kernels) for batch {shapes.get('batch')}, "
             f"{shapes.get('layers')} layers x {shapes.get('kv_heads')} KV heads, prompts of {shapes.get('prompt')} "
             f"tokens, budget {shapes.get('budget')}; each row the median over {document.get('rounds')} child "
             f"processes' decode steps{f', alternating with revision `{against}`' if against else ''} (head "
             f"`{machine.get('head', MISSING)}`, {machine.get('cpu_count', MISSING)} CPUs, "
             f"{machine.get('time_utc', MISSING)}).")
    rows = [[row["tree"], row["policy"], f"{row['median_ms']:.3f}", f"{row['p10_ms']:.3f}",
             *[f"{row[key]:.2f}x" if row.get(key) else MISSING for key in ("vs_against", "vs_against_p10")]]
            for row in document["results"]]
    parts = [f"### The host's planning of a decode step (`{Path(path).name}`)",
             f"Command: `{shown_command(machine.get('command'))}`", setup,
             markdown_table(["tree", "policy", "median ms", "p10 ms", "speed-up (median)", "speed-up (p10)"], rows)]
    image = plot_link(path, doc_dir)
    if image:
        parts.append(image)
    return "\n\n".join(parts)


# ---- Triton kernels compiled for GPUs, on a machine without one ----------------------------------
def targets_section(path: Path, doc_dir: Path) -> str:
    """Per kernel and GPU target: the launches of the kernel tests compiled there, and the most
    shared memory, registers and spills any of them took (`tools/triton_targets.py`)."""
    document = load(path)
    machine = document.get("machine", {})
    targets = document.get("targets", [])
    names = [target["name"] for target in targets]
    described = "; ".join(f"{target['name']} ({target['gpus']}, {target['max_shared_bytes'] // 1024} KiB a block, "
                          f"{target.get('distinct_launches', MISSING)} launches)" for target in targets)
    failed = sum(line["failed"] for line in document.get("summary", []))
    setup = (f"Every distinct launch of the Triton kernel tests, run in the interpreter with the tiles and "
             f"precisions the wrappers choose for each target, then compiled for it by Triton "
             f"{document.get('triton', MISSING)} on a CPU-only machine (head `{machine.get('head', MISSING)}`, "
             f"{machine.get('time_utc', MISSING)}): {described}. Each cell: the most shared memory (KiB), "
             f"registers and spilled registers (NVIDIA: bytes of local memory) of the kernel's launches. "
             f"{failed} launches failed (refused by the compiler, or over a block's shared memory). Compiled, "
             "not run: what the kernels compute on a GPU and how fast is in the sections above.")
    by_kernel: dict[str, dict[str, dict]] = {}
    for line in document.get("summary", []):
        by_kernel.setdefault(line["kernel"], {})[line["target"]] = line
    rows = [[kernel.strip("_").removesuffix("_kernel"),
             *[_target_cell(cells.get(name)) for name in names]] for kernel, cells in by_kernel.items()]
    return "\n\n".join([f"### Triton kernels compiled for GPUs, without one (`{Path(path).name}`)",
                         f"Command: `{shown_command(machine.get('command'))}`", setup,
                         markdown_table(["kernel", *names], rows)])


def cutlass_targets_section(path: Path, doc_dir: Path) -> str:
    """Per GPU target: whether FDC's CUTLASS grouped projections compiled, and each of its two
    kernels' registers and spills (`tools/cutlass_check.py`)."""
    document = load(path)
    machine = document.get("machine", {})
    shared = " and ".join(f"{value} B" for value in document.get("shared_bytes", {}).values()) or MISSING
    setup = (f"FDC's grouped projections (`{document.get('source', MISSING)}`: CUTLASS "
             f"{document.get('cutlass', MISSING)}'s grouped GEMM from the package index, SM80 tensor-op tiles, "
             f"3xTF32) compiled by nvcc ({document.get('nvcc', MISSING)}) on a CPU-only machine (head "
             f"`{machine.get('head', MISSING)}`, {machine.get('time_utc', MISSING)}). Two kernels: B row-major "
             "(the key, value and query projections) and column-major (the output's); a block's shared memory "
             f"{shared} (measured by a host program linked with the kernel's host code; under 48 KiB, so no opt-in "
             "is needed on any target, which the source asserts at compile time). Compiled, not run.")
    rows = []
    for target in document.get("targets", []):
        kernels = target.get("kernels", [])
        rows.append([target["target"], "yes" if target["ok"] else f"NO: {target.get('error', '')[:80]}",
                     ", ".join(str(kernel.get("registers", MISSING)) for kernel in kernels) or MISSING,
                     str(sum(kernel.get("spill_store_bytes", 0) for kernel in kernels)), f"{target['seconds']:.0f}"])
    return "\n\n".join([f"### CUTLASS kernel compiled for GPUs, without one (`{Path(path).name}`)",
                         f"Command: `{shown_command(machine.get('command'))}`", setup,
                         markdown_table(["target", "compiled", "registers (2 kernels)", "spilled bytes",
                                         "nvcc s"], rows)])


def _target_cell(line: dict | None) -> str:
    if line is None:
        return MISSING
    cell = f"{line['max_shared_bytes'] / 1024:.0f} KiB, {line['max_registers']} regs, {line['max_spilled']} spilled"
    return cell if not line["failed"] else f"{line['failed']} of {line['launches']} FAILED; {cell}"
