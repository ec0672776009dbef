"""The worker process's KV state, shared by its model runner and attention builders.

One model runner per worker process publishes the rows of each step here; the
attention metadata builders (one per KV-cache group) plan against it.
"""

from __future__ import annotations

from vllm_kvprune.worker.state import WorkerKVState

_WORKER_STATE: WorkerKVState | None = None


def install(state: WorkerKVState) -> None:
    global _WORKER_STATE
    _WORKER_STATE = state


def worker_state() -> WorkerKVState | None:
    return _WORKER_STATE
