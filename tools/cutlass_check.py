"""Compile the CUTLASS kernel (``csrc/cutlass/fdc_projections.cu``) for real GPUs on a machine
without one: nvcc and CUTLASS's headers are packages on the index, and compiling asks no driver.

    python -m tools.cutlass_check [--targets sm_80 sm_90 sm_100] [--fetch] [--out STEM]
    python -m tools.cutlass_check --fetch --headers-for .cutlass-include

Per target: nvcc compiles the torch-free source (both B layouts' kernels are instantiated) with
``-Xptxas -v``; a target fails when nvcc refuses it. Registers, spills and static shared memory
come from ptxas; the kernels' dynamic shared memory is bounded at compile time by the source's
``static_assert`` and measured by a small host program (linked with the kernel's host code; it
runs on the CPU). ``--fetch`` downloads what is missing (``nvidia-cutlass``; nvcc's wheels where
no nvcc is found) into :data:`TOOLCHAIN` with pip. Running the kernel needs a GPU: ``tests/test_fdc_projections.py``
on one (``scripts/gpu_check.sh``). ``--headers-for DIR`` copies just the CUTLASS headers the
source includes (about 11 MB of the 27) into ``DIR``, for a GPU machine without the package
index: ``scripts/gpu_check.sh`` builds with ``.cutlass-include`` when it is there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.triton_targets import git_head
from vllm_kvprune.kernels.cutlass_headers import cutlass_include_dir

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cutlass" / "fdc_projections.cu"
TOOLCHAIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-kvprune" / "cuda-toolchain"
# nvcc's wheels (cicc lives in nvidia-nvvm); nvcc from CUDA_HOME or PATH is used first.
TOOLCHAIN_PACKAGES = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl")
DEFAULT_TARGETS = ("sm_80", "sm_90", "sm_100")


def find_nvcc() -> Path | None:
    """nvcc from CUDA_HOME, PATH, or the fetched toolchain (the PyPI wheels' ``nvidia/cu13``)."""
    home = os.environ.get("CUDA_HOME")
    candidates = [Path(home) / "bin" / "nvcc"] if home else []
    if (on_path := shutil.which("nvcc")) is not None:
        candidates.append(Path(on_path))
    candidates += sorted(TOOLCHAIN.glob("nvidia/cu*/bin/nvcc"))
    return next((path for path in candidates if path.is_file()), None)


def cutlass_version(include: Path) -> str | None:
    """CUTLASS's version from its ``cutlass/version.h``."""
    try:
        text = (include / "cutlass" / "version.h").read_text()
    except OSError:
        return None
    parts = [re.search(rf"#define CUTLASS_{part} (\d+)", text) for part in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(match.group(1) for match in parts) if all(parts) else None


def find_headers() -> Path | None:
    include, _ = cutlass_include_dir()
    if include is None and (fetched := TOOLCHAIN / "cutlass_library" / "source" / "include").is_dir():
        include = fetched
    return include


def fetch() -> None:
    """What is missing of nvcc and CUTLASS's headers, downloaded with pip and unpacked into
    :data:`TOOLCHAIN`."""
    packages = (TOOLCHAIN_PACKAGES if find_nvcc() is None else ()) + (("nvidia-cutlass",) if find_headers() is None else ())
    if not packages:
        return
    TOOLCHAIN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--dest", wheels, *packages], check=True)
        for wheel in Path(wheels).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(TOOLCHAIN)
    for tool in [*TOOLCHAIN.glob("nvidia/cu*/bin/*"), *TOOLCHAIN.glob("nvidia/cu*/nvvm/bin/*")]:
        tool.chmod(0o755)  # zip files keep no permissions


def _nvcc_command(nvcc: Path, include: Path, target: str, *arguments: str) -> list[str]:
    """nvcc with the flags every compile of the source needs (C++17, CUTLASS's constexpr use, its
    headers and ours), for `target`."""
    return [str(nvcc), "-std=c++17", "--expt-relaxed-constexpr", f"-arch={target}", f"-I{include}",
            f"-I{SOURCE.parent}", *arguments]


# Prints a block's shared memory for B row-major and column-major (host code, no GPU needed).
_SHARED_PROBE = """#include <cstdio>
#include "fdc_projections.h"
int main() { std::printf("%zu %zu\\n", kvprune_cutlass::shared_bytes(false), kvprune_cutlass::shared_bytes(true)); }
"""


def shared_bytes(nvcc: Path, include: Path) -> list[int]:
    """A block's shared memory of the two kernels, from the host program above."""
    with tempfile.TemporaryDirectory() as folder:
        probe, program = Path(folder) / "probe.cu", Path(folder) / "probe"
        probe.write_text(_SHARED_PROBE)
        subprocess.run(_nvcc_command(nvcc, include, "sm_90", str(probe), str(SOURCE), "-o", str(program)),
                       capture_output=True, text=True, check=True)
        return [int(word) for word in subprocess.run([str(program)], capture_output=True, text=True,
                                                      check=True).stdout.split()]


_PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\S+)' for '(\S+)'")
_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> list[dict]:
    """Each entry function ptxas compiled: registers, spill bytes, static shared memory."""
    kernels, current = [], None
    for line in log.splitlines():
        if match := _PTXAS_FUNCTION.search(line):
            current = {"kernel": match.group(1)}
            kernels.append(current)
        elif current is not None:
            if match := _PTXAS_SPILLS.search(line):
                current["spill_store_bytes"], current["spill_load_bytes"] = int(match.group(1)), int(match.group(2))
            if match := _PTXAS_USAGE.search(line):
                current["registers"] = int(match.group(1))
                smem = _PTXAS_SMEM.search(line)
                current["static_shared_bytes"] = int(smem.group(1)) if smem else 0
    return kernels


def compile_for(target: str, nvcc: Path, include: Path) -> dict:
    """One target's compile: {target, ok, seconds, kernels, error}."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        command = _nvcc_command(nvcc, include, target, "-O3", "-Xptxas", "-v", "-c", str(SOURCE),
                                "-o", str(Path(folder) / "kernel.o"))
        done = subprocess.run(command, capture_output=True, text=True)
    result = {"target": target, "ok": done.returncode == 0, "seconds": round(time.monotonic() - started, 1),
              "kernels": parse_ptxas(done.stderr + done.stdout)}
    if done.returncode != 0:
        lines = done.stderr.splitlines()
        result["error"] = "\n".join([line for line in lines if "error" in line or "fatal" in line] or lines[-5:])[-2000:]
    elif not result["kernels"]:
        result.update(ok=False, error="nvcc compiled no kernel (ptxas reported no entry function)")
    return result


def copy_used_headers(nvcc: Path, include: Path, destination: Path) -> int:
    """Copy the headers under ``include`` that the source includes (nvcc's dependency list) to
    ``destination``, keeping their paths; returns how many."""
    done = subprocess.run(_nvcc_command(nvcc, include, "sm_90", "-M", str(SOURCE)), capture_output=True, text=True,
                          check=True)
    used = {Path(word).resolve() for word in done.stdout.replace("\\\n", " ").split() if word.endswith((".h", ".hpp"))}
    root = include.resolve()
    headers = sorted(path for path in used if path.is_relative_to(root))
    for header in headers:
        target = destination / header.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(header, target)
    return len(headers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    parser.add_argument("--fetch", action="store_true", help=f"download nvcc and CUTLASS into {TOOLCHAIN} if missing")
    parser.add_argument("--out", default="results/gpu/cutlass_targets", help="writes STEM.json")
    parser.add_argument("--headers-for", type=Path, metavar="DIR",
                        help="only copy the CUTLASS headers the source includes into DIR (compile nothing)")
    args = parser.parse_args(argv)
    if args.fetch and (find_nvcc() is None or find_headers() is None):
        fetch()
    nvcc, include = find_nvcc(), find_headers()
    if nvcc is None or include is None:
        missing = "nvcc" if nvcc is None else "CUTLASS's headers"
        print(f"cutlass_check: {missing} not found (--fetch downloads them into {TOOLCHAIN})", file=sys.stderr)
        return 2
    if args.headers_for is not None:
        count = copy_used_headers(nvcc, include, args.headers_for)
        print(f"copied {count} CUTLASS headers into {args.headers_for}")
        return 0
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    # nvcc is single-threaded: one target a core.
    with ThreadPoolExecutor(max_workers=max(1, min(len(args.targets) + 1, os.cpu_count() or 1))) as pool:
        shared = pool.submit(shared_bytes, nvcc, include)
        results = list(pool.map(lambda target: compile_for(target, nvcc, include), args.targets))
        shared = shared.result()
    print(f"a block's shared memory: {shared[0]} B (B row-major), {shared[1]} B (column-major)")
    print(f"{'target':8} {'ok':3} {'seconds':>7}  kernels (registers / spill bytes / static smem)")
    for result in results:
        kernels = "; ".join(f"{k.get('registers')} regs / {k.get('spill_store_bytes', 0)} / "
                            f"{k.get('static_shared_bytes')} B" for k in result["kernels"])
        print(f"{result['target']:8} {'yes' if result['ok'] else 'NO':3} {result['seconds']:7}  {kernels}")
        if not result["ok"]:
            print(f"  {result['error']}")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"command": [sys.executable, "-m", "tools.cutlass_check", *(argv or sys.argv[1:])],
               "head": git_head(),
               "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out.write_text(json.dumps({"check": "cutlass-targets", "nvcc": version, "cutlass": cutlass_version(include),
                               "source": str(SOURCE.relative_to(SOURCE.parents[2])), "machine": machine,
                               "shared_bytes": {"b_row_major": shared[0], "b_column_major": shared[1]},
                               "targets": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
