"""Fault containment: a policy that fails for one request fails that request, not the batch.

Where a failure can be contained (the worker's per-request work):
- planning a row (the policy's victims, the map's bookkeeping): the row is re-planned as a
  *quarantined* row, a fresh map's first prompt chunk written into the request's own first
  slots, so the batch runs and no other request's slots are touched;
- the per-request work after a layer's attention (a prompt's vote or per-layer pruning): that
  request's remaining work is skipped; its own blocks may be left half-written.

Either way the request's state is marked failed (`RequestKVState.failure`), every later step
quarantines it, and the step report tells the scheduler, which finishes it with an error
(HTTP 500; offline, `finish_reason == "error"` and `stop_reason` naming the policy) and takes
its blocks back. Its sampled token of the failing step is never sent.

Where it cannot: anything batch-wide (a kernel over the whole step, building the step's plan
from its rows, vLLM's own code). The exception then stops the engine as vLLM stops it for any
worker error (the engine core logs it and exits; a server answers 500 and exits), loudly,
before a corrupt cache could be read.

`KVPRUNE_FAULT=PHASE:REGEX` injects a failure, for tests: the requests whose id matches
REGEX (`re.search`) fail in PHASE (`plan`, or `score` for the work after attention).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vllm_kvprune import envs

if TYPE_CHECKING:
    from vllm_kvprune.worker.state import RequestKVState

logger = logging.getLogger("vllm_kvprune")

FAULT_ENV = envs.name("FAULT")
PHASES = ("plan", "score")


class InjectedFault(RuntimeError):
    """The failure `KVPRUNE_FAULT` asks for."""


def _injection() -> tuple[str, re.Pattern] | None:
    spec = envs.get("FAULT")
    if not spec:
        return None
    phase, _, pattern = spec.partition(":")
    if phase not in PHASES or not pattern:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected PHASE:REGEX with PHASE one of {PHASES}")
    return phase, re.compile(pattern)


def inject(phase: str, request_id: str) -> None:
    """Raise `InjectedFault` where `KVPRUNE_FAULT` names this phase and request."""
    injection = _injection()
    if injection is not None and injection[0] == phase and injection[1].search(request_id):
        raise InjectedFault(f"fault injected by {FAULT_ENV} in {phase}")


def fail(state: RequestKVState, phase: str, error: BaseException) -> None:
    """Mark a request failed (once): its later work is skipped, the scheduler finishes it."""
    if state.failure is not None:
        return
    state.failure = f"kvprune {state.config.name}: {phase} failed: {type(error).__name__}: {error}"
    logger.error("kvprune: request %s: %s; it fails alone, the batch goes on", state.request_id, state.failure,
                 exc_info=not isinstance(error, InjectedFault))


def live(items: list) -> list:
    """The items (anything with a `.state`) whose request has not failed."""
    return [item for item in items if item.state.failure is None]


@contextmanager
def contained(state: RequestKVState, phase: str) -> Iterator[None]:
    """Run one request's part of a step; a failure fails that request and is swallowed
    (only what the body finished is kept, so append to shared lists last). The body starts
    with `inject(phase, request_id)`."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any policy failure is that request's
        fail(state, phase, error)
