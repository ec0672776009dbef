"""Helpers shared by the benchmarks: timing, child processes, tables, JSON and plots.

Results are only comparable with the machine they ran on, so every JSON file carries the CPU
model and flags, the core count, the library versions, the command line and the load average
before and after (`vllm_kvprune.machine`; this box is often shared, and a busy neighbour shows
up as noise).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from vllm_kvprune.machine import machine_info

# The repository root: `benchmarks` and `tools` import from there (`python -m benchmarks`, run
# in it). A benchmark's child processes get it first on PYTHONPATH (`child_env`), so that they
# import what their parent did wherever they are started from.
REPO_ROOT = Path(__file__).resolve().parents[1]

# What every engine a benchmark starts runs with: offline, in its own process's engine core
# (so the scheduler can be read), on both cores, quiet logs.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}

def policies(*, none: bool = True, budgeted: bool | None = None, fdc: bool = True) -> tuple[str, ...]:
    """The registered policies a benchmark offers (`vllm_kvprune/policies/`): `none` first (with
    `none`), then those with a budget (`budgeted=True`), those without (`False`), or all; FDC's
    (`fdc` alone) only with `fdc`, as it needs a calibration file."""
    from vllm_kvprune.policies import REGISTRY

    return tuple(name for name, policy in REGISTRY.items()
                 if (none if name == "none" else (budgeted is None or policy.budgeted == budgeted)
                     and (fdc or policy.layout != "full")))


def budget_free() -> tuple[str, ...]:
    """The policies that choose each request's memory themselves (their worker reports it)."""
    from vllm_kvprune.policies import REGISTRY

    return tuple(name for name, policy in REGISTRY.items() if policy.reports_footprint)


def engine_policy(name: str, budget: int | None = None, sinks: int = 4, fdc: str | None = None) -> dict | None:
    """The `kv_policy` settings of a benchmark's engine: the budget (and `sinks`) where the
    policy reads them, FDC's calibration file where it is FDC; None for `none`."""
    from vllm_kvprune.policies import REGISTRY

    if name == "none":
        return None
    policy = REGISTRY[name]
    settings: dict[str, Any] = {"name": name}
    if policy.budgeted:
        settings["budget"] = budget
        if policy.reads("sinks"):
            settings["sinks"] = sinks
    if policy.layout == "full":
        settings["fdc"] = fdc
    return settings


# A benchmark that runs each engine in a child process of its own: the child prints its result
# as one line with this prefix, the parent reads the last such line.
RESULT_PREFIX = "RESULT "


def print_child_result(result: Any) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def child_env(env: Mapping[str, str], *first: str | Path) -> dict[str, str]:
    """`env` for a child process that imports `benchmarks` or `tools`: PYTHONPATH starts with
    `first` (e.g. another checkout of the package), then the repository root."""
    paths = [str(path) for path in (*first, REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def run_child(command: Sequence[str], env: dict[str, str], what: str) -> Any:
    """Run a child benchmark process and return what it printed with `print_child_result`;
    RuntimeError (with the end of its stderr) if it failed or printed no result."""
    import subprocess

    done = subprocess.run(list(command), env=env, capture_output=True, text=True)
    results = [line[len(RESULT_PREFIX):] for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(results[-1])


def child_rounds(command: str, names: Sequence[str], flags: Sequence[str], repeats: int,
                 switches: Callable[[str], dict[str, str]] | None = None) -> dict[str, list[Any]]:
    """Each name's child run (`python -m benchmarks COMMAND --child NAME FLAGS`, in-process
    engines: ENGINE_ENV, plus `switches(name)` in its environment) `repeats` times, the names
    taking turns in every round so that load that comes and goes hits them alike; their
    results by name, in round order. A failed child stops the bench, naming it."""
    env = child_env({**os.environ, **ENGINE_ENV})
    found: dict[str, list[Any]] = {name: [] for name in names}
    for round_index in range(repeats):
        for name in names:
            print(f"[{command}] round {round_index + 1}/{repeats}: {name} ...", flush=True)
            extra = switches(name) if switches is not None else {}
            try:
                found[name].append(run_child([sys.executable, "-m", "benchmarks", command, "--child", name, *flags],
                                             {**env, **extra}, f"{command} {name}"))
            except RuntimeError as error:
                raise SystemExit(f"{command}: {error}") from None
    return found


def median_round(found: Sequence[dict[str, Any]], key: str) -> tuple[dict[str, Any], list[float]]:
    """Of a measurement's rounds, the one whose `key` is the median (the lower middle of an even
    count), and every round's `key` in round order."""
    middle = sorted(found, key=lambda entry: entry[key])[(len(found) - 1) // 2]
    return middle, [entry[key] for entry in found]


def engine_scheduler(llm: Any) -> Any:
    """The scheduler of an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, ENGINE_ENV)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def model_runner(llm: Any) -> Any:
    """The worker's model runner of an in-process engine (ours when a policy is on)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def shutdown(llm: Any) -> None:
    """Stops the engine core now (in-process engines do not stop when `llm` is dropped)."""
    llm.llm_engine.engine_core.shutdown()


def time_round_robin(
    candidates: dict[str, Callable[[], object]], warmup: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Wall time of each candidate in microseconds: median, min, quartiles.

    The candidates take turns within every repetition, so load from other processes that
    comes and goes hits all of them alike instead of skewing whichever ran during it.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for round_index in range(warmup + repeats):
        for name, step in candidates.items():
            started = time.perf_counter()
            step()
            elapsed_us = (time.perf_counter() - started) * 1e6
            if round_index >= warmup:
                samples[name].append(elapsed_us)
    return {name: summarize_us(values) for name, values in samples.items()}


def summarize_us(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "p25": quartiles[0],
        "p75": quartiles[2],
        "repeats": len(ordered),
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    print("  ".join(str(cell).rjust(width) for cell, width in zip(headers, widths)))
    print("  ".join("-" * width for width in widths))
    for row in rows:
        print("  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)))


def write_json(path: Path, benchmark: str, settings: dict[str, Any], results: list[dict[str, Any]], **extra: Any) -> None:
    document = {"benchmark": benchmark, "machine": machine_info(), "settings": settings, "results": results, **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))


def new_figure(width: float, height: float, columns: int = 1):
    """A matplotlib figure on the Agg backend (no display on servers and CI), and its axes
    (a tuple of `columns` side by side when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(width, height))


def save_figure(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
