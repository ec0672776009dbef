"""What the policies do, on vLLM's own `/metrics` (and `LLM.get_metrics()`).

The numbers are made where the work happens, in the engine core (`engine.py`: the scheduler
counts, the worker's step report says what each request keeps and what planning cost), and
shown where vLLM serves its metrics, the front end (`exporter.py`: a Prometheus collector in
the registry vLLM's `/metrics` reads).

Why a snapshot file between the two: vLLM sends `SchedulerStats` from the engine core to the
front end as msgpack decoded into that dataclass, so any field of ours is dropped on the way
(checked on vLLM 0.32), and the stat-logger plugins (`vllm.stat_logger_plugins`) only see what
arrives. So the engine core writes its totals to a small JSON file (atomically, at most every
`WRITE_INTERVAL_S` and whenever the engine goes idle) in a folder the front end made and its
engine processes inherit (`KVPRUNE_METRICS_DIR`), and the front end's collector reads the
files of live engines when `/metrics` is scraped. Counting follows vLLM's `log_stats`: off with
`--disable-log-stats` (and in `LLM(...)` unless `disable_log_stats=False`); `KVPRUNE_METRICS=0`
turns off ours alone (the overhead benchmark compares the two).
"""

from __future__ import annotations

import os

from vllm_kvprune import envs

DIR_ENV = envs.name("METRICS_DIR")
SWITCH_ENV = envs.name("METRICS")
PREFIX = "vllm:kvprune_"
WRITE_INTERVAL_S = 0.5

# Histogram buckets (upper bounds; +Inf is implied).
TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 18))  # 16 .. 131072 tokens
BLOCK_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0)
SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)

# name (without PREFIX) -> (type, help). Labels: model_name, engine, and those listed in
# the engine snapshot's entries (policy; heads; phase; reason).
METRICS: dict[str, tuple[str, str]] = {
    "tokens_evicted": ("counter", "Tokens the KV policy dropped from the cache (mean over KV heads and layers)"),
    "blocks_returned": ("counter", "KV blocks pruning gave back to the pool"),
    "preemptions": ("counter", "Requests under a KV policy preempted (their cache is recomputed)"),
    "requests_rejected": ("counter", "Requests refused by the KV policy's checks, by the setting at fault"),
    "requests_failed": ("counter", "Requests the KV policy failed for, each finished with an error alone "
                                   "(fault containment)"),
    "request_kept_tokens": ("histogram", "Tokens a finished request kept in the cache, mean and max over KV heads"),
    "request_blocks_saved": ("histogram", "KV blocks a finished request held less than it would without the policy"),
    "step_seconds": ("histogram", "Time the KV policy took in one engine step (plan: slot maps and moves "
                                  "planned; score: attention mass, votes, prompt pruning's choice; "
                                  "move: K/V copied between slots)"),
    "blocks_held": ("gauge", "KV blocks the running requests hold"),
    "blocks_without_pruning": ("gauge", "KV blocks the running requests would hold without the policy"),
}


def enabled() -> bool:
    return envs.get("METRICS", "1") != "0"


_made_here: str | None = None  # the folder this process made, if it made one


def metrics_dir(create: bool = False) -> str | None:
    """This process's snapshot folder (None: metrics off); with `create`, made (and exported
    to the engine processes it starts) unless this process shares its parent's.

    Only a process `multiprocessing` started (vLLM's engine cores, API servers and workers)
    shares the folder it inherited. Any other process is the root of its own engines: a server
    started by a program that has a folder of its own (a test run, a launcher of several
    servers) would otherwise show that program's engines on its /metrics as if they were its own.
    """
    global _made_here
    if not enabled():
        return None
    import multiprocessing

    folder = envs.get("METRICS_DIR")
    if not create or (folder and (folder == _made_here or multiprocessing.parent_process() is not None)):
        return folder
    import atexit
    import shutil
    import tempfile

    folder = _made_here = tempfile.mkdtemp(prefix="vllm-kvprune-metrics-")
    os.environ[DIR_ENV] = folder
    atexit.register(shutil.rmtree, folder, True)
    return folder
