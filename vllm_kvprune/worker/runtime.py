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


def ended_choices() -> dict:
    """Debug mode (`VLLM_KVPRUNE_CHECK=1`), through `LLM.collective_rpc("kvprune_ended_choices")`:
    this process's tensor-parallel rank and what each ended request kept
    (`RequestKVState.kept_choices`)."""
    from vllm_kvprune import vllm_hooks

    state = worker_state()
    rank, world_size = vllm_hooks.tp_rank_and_size()
    return {"rank": rank, "world_size": world_size,
            "choices": dict(state.ended_choices) if state is not None else {}}
