"""Every Triton kernel launch the tests make, compiled for real GPUs on a machine without one.

Triton's interpreter (`TRITON_INTERPRET=1`) runs a kernel's Python on the CPU: it checks what
the kernel computes, not that Triton's compilers accept it for a GPU (the interpreter takes
precisions, tiles and layouts a backend refuses), nor what it costs there (shared memory,
registers, spills). Compiling needs no GPU: Triton ships ptxas and the AMD code generator, and
only a launch asks the driver. So, per target:

1. the kernel tests run in the interpreter with `KVPRUNE_TRITON_TARGET` naming the target and
   `KVPRUNE_RECORD_TRITON` a file; tests/triton_setup.py hands both to `install_from_environment`,
   which has the wrappers choose tiles and precisions as they would on that GPU
   (`vllm_kvprune.kernels.triton.set_target_gpu`, read by `device_limits`) and turns on a
   recorder that writes each distinct launch's arguments as types: a tensor is its dtype and
   16-byte alignment (all Triton specialises a pointer on), an integer its value;
2. a child process without the interpreter rebuilds each launch and compiles it with
   `JITFunction.warmup` under a stand-in driver that knows the target and nothing else.

A launch fails a target when the compiler refuses it or its shared memory exceeds what that GPU
gives one block (a real launch would raise OutOfResources). Registers and spills are read from
the binaries (Triton's cuobjdump; the AMD assembly's metadata). Nothing runs on a GPU here:
this proves the kernels build for a GPU, not what they compute there or how fast.

    python -m tools.triton_targets [--targets sm_90 gfx942 ...] [--out STEM]
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository: its kernel tests, and `tools` to import
RECORD_VARIABLE = "KVPRUNE_RECORD_TRITON"
# Names the target (`TARGETS`) whose limits the recording process's kernels choose as on.
TARGET_VARIABLE = "KVPRUNE_TRITON_TARGET"


@dataclass(frozen=True)
class Target:
    name: str  # what users call it: sm_90, gfx942
    backend: str  # Triton's: cuda, hip
    arch: int | str
    warp_size: int
    max_shared_bytes: int  # one block's most shared memory (LDS on AMD), opt-in included
    gpus: str


TARGETS = {target.name: target for target in (
    Target("sm_80", "cuda", 80, 32, 166912, "A100"),
    Target("sm_90", "cuda", 90, 32, 232448, "H100, H200"),
    Target("sm_100", "cuda", 100, 32, 232448, "B200"),
    Target("gfx90a", "hip", "gfx90a", 64, 65536, "MI210, MI250"),
    Target("gfx942", "hip", "gfx942", 64, 65536, "MI300X"),
)}
DEFAULT_TARGETS = tuple(TARGETS)
KERNEL_TESTS = ("tests/test_triton_attention.py", "tests/test_triton_fdc_vote.py", "tests/test_triton_fdc_write.py",
                "tests/test_triton_fdc_projections.py", "tests/test_triton_slot_ops.py",
                "tests/test_triton_policy_steps.py", "tests/test_bench_gpu_kernels.py")


# ---- recording (in the interpreter) -------------------------------------------------------------
def install_from_environment() -> None:
    """What `record` asks of the kernel tests' process (tests/triton_setup.py calls this before
    any kernel runs): tiles and precisions chosen as on `KVPRUNE_TRITON_TARGET`'s GPU, and the
    recorder writing to `KVPRUNE_RECORD_TRITON`'s file."""
    name = os.environ.get(TARGET_VARIABLE)
    if name:
        from vllm_kvprune.kernels import triton as kernels

        if name not in TARGETS:
            raise ValueError(f"{TARGET_VARIABLE}={name!r} is not one of {sorted(TARGETS)}")
        target = TARGETS[name]
        kernels.set_target_gpu(target.backend, target.arch, target.warp_size, target.max_shared_bytes)
    if os.environ.get(RECORD_VARIABLE):
        install_recorder(os.environ[RECORD_VARIABLE])


def install_recorder(path: str) -> None:
    """Record every interpreted launch's kernel and argument types; the distinct ones are
    written to `path` (JSON lines, appended) when the process exits."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict[str, Any]] = {}
    launch = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        entry = {"module": self.fn.__module__, "kernel": self.fn.__name__,
                 "args": [_describe(value) for value in args],
                 "kwargs": {name: _describe(value) for name, value in sorted(kwargs.items())}}
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    def write() -> None:
        with open(path, "a") as out:
            for entry in seen.values():
                out.write(json.dumps(entry, sort_keys=True) + "\n")

    InterpretedFunction.run = recording_run
    atexit.register(write)


def _describe(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a Triton launch took a {type(value).__name__}, which the recorder cannot describe")


def record(out: Path, target: str, tests: tuple[str, ...] = KERNEL_TESTS,
           select: str | None = None) -> list[dict[str, Any]]:
    """Run the kernel tests in the interpreter, choosing as on `target`, with the recorder on;
    returns the distinct launches."""
    out.unlink(missing_ok=True)
    if not (ROOT / tests[0]).exists():
        raise FileNotFoundError(f"the kernel tests are not beside this tool ({ROOT / tests[0]}): "
                                "run the check from a clone of the repository")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton", *tests]
    if select:
        command += ["-k", select]
    env = {**os.environ, RECORD_VARIABLE: str(out), "TRITON_INTERPRET": "1", TARGET_VARIABLE: target}
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"the kernel tests failed in the interpreter as on {target}:\n"
                           f"{result.stdout[-3000:]}{result.stderr[-2000:]}")
    return distinct(out)


def distinct(path: Path) -> list[dict[str, Any]]:
    lines = dict.fromkeys(path.read_text().splitlines()) if path.exists() else {}
    return [json.loads(line) for line in lines]


# ---- compiling (in a child without the interpreter) ----------------------------------------------
class TargetOnlyDriver:
    """What compiling asks of a driver (`JITFunction.warmup`, and `device_limits`' questions:
    the target, a device's shared memory), for a GPU that is not here; it launches nothing."""

    def __init__(self, target: Target) -> None:
        from triton.backends.compiler import GPUTarget

        self.gpu_target = GPUTarget(target.backend, target.arch, target.warp_size)
        self.utils = SimpleNamespace(get_device_properties=lambda device: {"max_shared_mem": target.max_shared_bytes})

    def get_current_target(self):
        return self.gpu_target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _rebuild(description: Any) -> Any:
    import torch

    if isinstance(description, dict):
        dtype = getattr(torch, description["tensor"])
        storage = torch.empty(64, dtype=dtype)  # CPU allocations are 64-byte aligned
        return storage if description["aligned"] else storage[1:]
    return description


def compile_launch(entry: dict[str, Any], target: Target) -> dict[str, Any]:
    """Compile one recorded launch for `target`; its resources, or why it failed."""
    import importlib

    from triton.runtime.driver import driver

    driver.set_active(TargetOnlyDriver(target))
    kernel = getattr(importlib.import_module(entry["module"]), entry["kernel"])
    args = [_rebuild(value) for value in entry["args"]]
    kwargs = {name: _rebuild(value) for name, value in entry["kwargs"].items()}
    row = {"kernel": entry["kernel"], "target": target.name, "constants": _constants(kernel, args, kwargs)}
    try:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
    except Exception as failure:  # noqa: BLE001 - the compiler's refusal is the finding
        return {**row, "ok": False, "error": _reason(failure)}
    shared = int(compiled.metadata.shared)
    row.update(ok=shared <= target.max_shared_bytes, shared_bytes=shared, **_resources(compiled, target))
    if not row["ok"]:
        row["error"] = f"needs {shared} bytes of shared memory; {target.name} gives a block {target.max_shared_bytes}"
    return row


def _reason(failure: BaseException) -> str:
    """The innermost cause of a compile failure (Triton chains one per nested `@triton.jit`
    call), its message's end: where the source excerpt stops and the reason is given."""
    while failure.__cause__ is not None:
        failure = failure.__cause__
    return f"{type(failure).__name__}: {str(failure).strip()[-600:]}"


def _constants(kernel, args: list, kwargs: dict) -> dict[str, Any]:
    """The launch's compile-time values (constexpr parameters and launch options), to tell rows apart."""
    names = [param.name for param in kernel.params]
    constexpr = {param.name for param in kernel.params if param.is_constexpr}
    bound = {**dict(zip(names, args)), **kwargs}
    return {name: value for name, value in bound.items() if name in constexpr or name not in names}


def _resources(compiled, target: Target) -> dict[str, Any]:
    if target.backend == "cuda":
        return _cubin_resources(compiled.asm["cubin"])
    text = compiled.asm["amdgcn"]

    def field(name: str) -> int | None:
        found = re.search(rf"\.{name}:\s+(\d+)", text)
        return int(found.group(1)) if found else None

    return {"registers": field("vgpr_count"), "spilled": (field("vgpr_spill_count") or 0) + (field("sgpr_spill_count") or 0)}


def _cubin_resources(cubin: bytes) -> dict[str, Any]:
    """Registers and local memory (spills land there) from Triton's own cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True).stdout
    registers, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    return {"registers": int(registers.group(1)) if registers else None,
            "spilled": int(local.group(1)) if local else None}


def compile_all(targets: list[str], select: str | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each target's launches recorded and compiled, targets side by side (each is two child
    processes, one after the other, on a core of its own); the rows, and each target's number of
    distinct launches."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> tuple[list[dict[str, Any]], int]:
        with tempfile.TemporaryDirectory() as folder:
            entries = record(Path(folder) / "launches.jsonl", name, select=select)
        return compile_entries(entries, name), len(entries)

    with ThreadPoolExecutor(max(1, min(len(targets), os.cpu_count() or 1))) as pool:
        done = list(pool.map(one, targets))
    rows = [row for target_rows, _ in done for row in target_rows]
    return rows, {name: count for name, (_, count) in zip(targets, done)}


def compile_entries(entries: list[dict[str, Any]], target: str) -> list[dict[str, Any]]:
    """Recorded launches compiled for `target` in a child process: a fresh Triton, its kernels
    not interpreted (a process that imported them under the interpreter cannot compile them)."""
    with tempfile.TemporaryDirectory() as folder:
        inputs, outputs = Path(folder) / "launches.json", Path(folder) / "rows.json"
        inputs.write_text(json.dumps(entries))
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(Path(folder) / "cache")  # a fresh compile, not a cached binary
        subprocess.run([sys.executable, "-m", "tools.triton_targets", "--compile-child", target,
                        str(inputs), str(outputs)], env=env, check=True, cwd=ROOT)
        return json.loads(outputs.read_text())


def _compile_child(target: str, inputs: str, outputs: str) -> None:
    entries = json.loads(Path(inputs).read_text())
    rows = [compile_launch(entry, TARGETS[target]) for entry in entries]
    Path(outputs).write_text(json.dumps(rows))


def git_head() -> str | None:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=ROOT)
    return found.stdout.strip() or None


# ---- the command ---------------------------------------------------------------------------------
def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kernel and target: launches compiled, failed, and the most shared memory, registers, spills."""
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        line = table.setdefault((row["kernel"], row["target"]), {
            "kernel": row["kernel"], "target": row["target"], "launches": 0, "failed": 0,
            "max_shared_bytes": 0, "max_registers": 0, "max_spilled": 0})
        line["launches"] += 1
        line["failed"] += not row["ok"]
        for field, key in (("shared_bytes", "max_shared_bytes"), ("registers", "max_registers"),
                           ("spilled", "max_spilled")):
            line[key] = max(line[key], row.get(field) or 0)
    return list(table.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.triton_targets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), choices=list(TARGETS))
    parser.add_argument("--select", default=None, help="pytest -k expression: record only these kernel tests")
    parser.add_argument("--out", default="results/gpu/triton_targets", help="writes STEM.json")
    parser.add_argument("--compile-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_child:
        _compile_child(*args.compile_child)
        return 0
    import triton

    print(f"recording the kernel tests' launches and compiling them for {', '.join(args.targets)} "
          f"(Triton {triton.__version__})", flush=True)
    rows, launches = compile_all(args.targets, args.select)
    lines = summary(rows)
    print(f"{'kernel':<30}{'target':<8}{'launches':>9}{'failed':>7}{'shared B':>10}{'regs':>6}{'spilled':>8}")
    for line in lines:
        print(f"{line['kernel']:<30}{line['target']:<8}{line['launches']:>9}{line['failed']:>7}"
              f"{line['max_shared_bytes']:>10}{line['max_registers']:>6}{line['max_spilled']:>8}")
    for row in rows:
        if not row["ok"]:
            print(f"FAILED {row['kernel']} on {row['target']} {row['constants']}: {row['error']}")
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    machine = {"command": [sys.executable, *sys.argv], "head": git_head(),
               "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    document = {"check": "triton-targets", "triton": triton.__version__, "machine": machine,
                "targets": [{**asdict(TARGETS[name]), "distinct_launches": launches[name]} for name in args.targets],
                "summary": lines, "launches": rows}
    stem.with_suffix(".json").write_text(json.dumps(document, indent=1))
    print(f"wrote {stem.with_suffix('.json')}")
    return 1 if any(not row["ok"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
