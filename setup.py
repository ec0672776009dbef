"""Builds what serving uses: the optional C++ extension `vllm_kvprune._C` and, with a CUDA torch,
nvcc and CUTLASS's headers (the `[gpu]` extra), FDC's grouped projections `vllm_kvprune._cutlass_C`.
All metadata lives in pyproject.toml.

Install with `pip install --no-build-isolation -e .`: an isolated build environment would
download the registry's newest (CUDA) torch instead of compiling against the installed one.
Environment knobs:
  KVPRUNE_NO_EXT=1        skip the extensions (the package falls back to torch ops)
  KVPRUNE_CPU_ISA=X       force X in {avx512, avx2, generic} instead of reading
                               /proc/cpuinfo (e.g. to build on one machine for another)
  KVPRUNE_CUDA_SLOT_OPS=1 also build the CUDA slot ops `vllm_kvprune._cuda_C` (csrc/cuda,
                               with a CUDA or ROCm torch and its compiler): a benchmark's
                               (`bench gpu-kernels`, benchmarks/cuda_ops.py), which serving never
                               runs; without it the benchmark JIT-builds them on a CUDA machine
"""

from __future__ import annotations

import glob
import os
import platform
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CPU_SOURCE_DIR = os.path.join("csrc", "cpu")
CUDA_SOURCE_DIR = os.path.join("csrc", "cuda")
CUTLASS_SOURCE_DIR = os.path.join("csrc", "cutlass")

ISA_COMPILE_ARGS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}


def _env(name: str) -> str | None:
    """`KVPRUNE_<name>`, else its name of the last release, `VLLM_KVPRUNE_<name>`."""
    return os.environ.get(f"KVPRUNE_{name}", os.environ.get(f"VLLM_KVPRUNE_{name}"))


def _log(message: str) -> None:
    print(f"[vllm-kvprune setup] {message}", file=sys.stderr)


def cpu_flags() -> set[str]:
    """Flags of the build machine's CPU; empty where /proc/cpuinfo does not exist."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_isa(flags: set[str]) -> str:
    """Widest ISA the build machine runs: the .so is built where it is used (editable/CI)."""
    forced = _env("CPU_ISA")
    if forced:
        if forced not in ISA_COMPILE_ARGS:
            raise SystemExit(f"KVPRUNE_CPU_ISA={forced!r}; expected one of {sorted(ISA_COMPILE_ARGS)}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def compile_args(isa: str, flags: set[str]) -> list[str]:
    # No -std flag: BuildExtension adds the standard torch itself was built with. -g0 undoes the
    # -g in Python's own flags: debug info for torch's headers made every setup's build a fifth
    # slower, and nobody steps through this .so in a debugger.
    args = ["-O3", "-g0", "-fopenmp", *ISA_COMPILE_ARGS[isa]]
    if isa == "avx512" and "avx512_bf16" in flags:
        args.append("-mavx512bf16")
    return args


def extension_build() -> dict:
    """setup() keywords for the extension, or none when it is disabled or torch is missing."""
    if _env("NO_EXT") == "1":
        _log("KVPRUNE_NO_EXT=1: building without the C++ extension")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _log("torch is not importable: building without the C++ extension")
        return {}
    flags = cpu_flags()
    isa = pick_isa(flags)
    sources = sorted(
        os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, CPU_SOURCE_DIR, "*.cpp"))
    )
    _log(f"building vllm_kvprune._C for {isa} from {len(sources)} sources")
    extension = CppExtension(
        name="vllm_kvprune._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, CPU_SOURCE_DIR)],
        extra_compile_args=compile_args(isa, flags),
        extra_link_args=["-fopenmp"],
    )
    return {"ext_modules": [extension, *gpu_extensions()], "cmdclass": {"build_ext": BuildExtension}}


def gpu_extensions() -> list:
    """The GPU extensions when torch is a CUDA (or ROCm) build and its compiler is found (nvcc
    under CUDA_HOME, or ROCM_HOME; hipify turns a .cu into HIP), else none and one line saying
    why."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is not None:
        toolkit, home, compiler, home_variable = "CUDA", cpp_extension.CUDA_HOME, "nvcc", "CUDA_HOME"
    elif torch.version.hip is not None:
        toolkit, home, compiler, home_variable = "ROCm", cpp_extension.ROCM_HOME, "hipcc", "ROCM_HOME"
    else:
        _log(f"skipping the GPU extensions: torch {torch.__version__} is built for neither CUDA nor ROCm")
        return []
    if home is None or not os.path.isfile(os.path.join(home, "bin", compiler)):
        _log(f"skipping the GPU extensions: torch is a {toolkit} build but {compiler} was not found "
             f"(set {home_variable}; {home_variable}={home})")
        return []
    return [*slot_op_extensions(toolkit, home, cpp_extension), *cutlass_extensions(toolkit, cpp_extension)]


def slot_op_extensions(toolkit: str, home: str, cpp_extension) -> list:
    """`vllm_kvprune._cuda_C` (the CUDA slot ops, csrc/cuda) when KVPRUNE_CUDA_SLOT_OPS=1 asks
    for it, else none and one line saying so: only a benchmark runs them."""
    if _env("CUDA_SLOT_OPS") != "1":
        _log("skipping vllm_kvprune._cuda_C (the CUDA slot ops, which only `bench gpu-kernels` runs): "
             "KVPRUNE_CUDA_SLOT_OPS=1 builds it")
        return []
    sources = sorted(
        os.path.relpath(path, ROOT)
        for pattern in ("*.cu", "*.cpp")
        for path in glob.glob(os.path.join(ROOT, CUDA_SOURCE_DIR, pattern))
    )
    _log(f"building vllm_kvprune._cuda_C for {toolkit} ({home}) from {len(sources)} sources")
    return [cpp_extension.CUDAExtension(
        name="vllm_kvprune._cuda_C",
        sources=sources,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )]


def cutlass_extensions(toolkit: str, cpp_extension) -> list:
    """`vllm_kvprune._cutlass_C` (FDC's grouped projections, csrc/cutlass) when the toolkit is
    CUDA and CUTLASS's headers are found, else none and one line saying why."""
    if toolkit != "CUDA":
        _log(f"skipping vllm_kvprune._cutlass_C: CUTLASS is NVIDIA-only (this torch is {toolkit})")
        return []
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cutlass_headers", os.path.join(ROOT, "vllm_kvprune", "kernels", "cutlass_headers.py"))
    headers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(headers)
    include, where = headers.cutlass_include_dir()
    if include is None:
        _log(f"skipping vllm_kvprune._cutlass_C (FDC's grouped projections): {where}")
        return []
    sources = sorted(os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, CUTLASS_SOURCE_DIR, "*.cu")))
    _log(f"building vllm_kvprune._cutlass_C with CUTLASS from {where}")
    return [cpp_extension.CUDAExtension(
        name="vllm_kvprune._cutlass_C",
        sources=sources,
        include_dirs=[str(include), os.path.join(ROOT, CUTLASS_SOURCE_DIR)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
    )]


setup(**extension_build())
