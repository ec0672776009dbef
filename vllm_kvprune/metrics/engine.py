"""The engine core's side of the metrics: totals kept by the scheduler, written as a snapshot.

Invariants (per request, over its life in the engine):
- `tokens_evicted` adds, each step, the tokens the request held before the step plus those the
  step ran, minus those it holds after (the worker's report; mean over layers and KV heads), so
  the sum is what the policy dropped; a preempted request starts again from nothing held;
- `request_kept_tokens` / `request_blocks_saved` are observed once, when it finishes or is
  aborted: the last kept count the worker reported, and the blocks of its policy's KV-cache
  groups it would hold without the policy (`ceil(computed tokens / block size)` per group) minus
  those it holds;
- `blocks_returned` counts exactly the blocks the capped manager gave back (`KVPruneManager._trim`).
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import defaultdict
from typing import Any

from vllm_kvprune import metrics
from vllm_kvprune.metrics import multiprocess

Labels = tuple[tuple[str, str], ...]


class Histogram:
    """Counts per bucket (not cumulative), the sum of the values and their bounds."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


def engine_index(parallel_config: Any) -> int:
    """The engine's data-parallel rank, as vLLM's own metrics label it. A dense model's DP
    engines are independent: vLLM resets each one's `data_parallel_rank` to 0 and keeps the
    rank in `data_parallel_index` (an MoE's keep both)."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return int(index if index is not None else getattr(parallel_config, "data_parallel_rank", 0) or 0)


class EngineStats:
    """One engine core's totals, labelled by model and engine index, and their snapshot file."""

    def __init__(self, vllm_config: Any, folder: str) -> None:
        names = vllm_config.model_config.served_model_name
        self.labels = {"model_name": names[0] if isinstance(names, (list, tuple)) else str(names),
                       "engine": str(engine_index(vllm_config.parallel_config))}
        self.path = os.path.join(folder, f"engine-{os.getpid()}-{vllm_config.instance_id or 'x'}"
                                         f"-{self.labels['engine']}.json")
        self.counters: dict[tuple[str, Labels], float] = defaultdict(float)
        self.histograms: dict[tuple[str, Labels], Histogram] = {}
        self.gauges: dict[tuple[str, Labels], float] = {}
        self._kept: dict[str, tuple[float, int]] = {}  # request -> last reported (mean, max)
        self._last_write = 0.0
        self._dirty = True
        # Several API servers: /metrics reads Prometheus' multiprocess files, not our snapshot.
        self._mirror = multiprocess.PrometheusMirror(self.labels) if multiprocess.active() else None

    # ---- counting --------------------------------------------------------------------
    def count(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += value
        self._dirty = True
        if self._mirror is not None:
            self._mirror.count(name, value, labels)

    def observe(self, name: str, value: float, bounds: tuple[float, ...], **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.histograms.setdefault(key, Histogram(bounds)).observe(value)
        self._dirty = True
        if self._mirror is not None:
            self._mirror.observe(name, value, bounds, labels)

    def set_gauge(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        if self.gauges.get(key) != value:
            self.gauges[key] = value
            self._dirty = True
            if self._mirror is not None:
                self._mirror.set_gauge(name, value, labels)

    # ---- what the scheduler sees -------------------------------------------------------
    def step(self, report: dict, scheduled_tokens: dict[str, int], policy_of: Any, engine_policy: str) -> None:
        """One step's worker report (`WorkerKVState.step_report`) with the tokens each request
        ran in it (`SchedulerOutput.num_scheduled_tokens`)."""
        evicted_by_policy: dict[str, float] = defaultdict(float)  # one count per policy and step
        for request_id, (mean, largest) in report.get("kept", {}).items():
            held_before = self._kept.get(request_id, (0.0, 0))[0]
            evicted = held_before + scheduled_tokens.get(request_id, 0) - mean
            if evicted > 0:
                policy = policy_of(request_id)
                evicted_by_policy[policy.name if policy is not None else engine_policy] += evicted
            self._kept[request_id] = (mean, largest)
        for policy_name, evicted in evicted_by_policy.items():
            self.count("tokens_evicted", evicted, policy=policy_name)
        for phase, seconds in report.get("seconds", {}).items():
            if seconds > 0:
                self.observe("step_seconds", seconds, metrics.SECONDS_BUCKETS, policy=engine_policy, phase=phase)

    def returned(self, num_blocks: int, policy: str) -> None:
        self.count("blocks_returned", num_blocks, policy=policy)

    def preempted(self, request_id: str, policy: str) -> None:
        self.count("preemptions", policy=policy)
        self._kept.pop(request_id, None)  # it re-prefills from nothing

    def rejected(self, setting: str) -> None:
        self.count("requests_rejected", setting=setting)

    def failed(self, policy: str) -> None:
        self.count("requests_failed", policy=policy)

    def finished(self, request_id: str, policy: str, held_blocks: int, unpruned_blocks: int) -> None:
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            self.observe("request_kept_tokens", kept[0], metrics.TOKEN_BUCKETS, policy=policy, heads="mean")
            self.observe("request_kept_tokens", float(kept[1]), metrics.TOKEN_BUCKETS, policy=policy, heads="max")
        self.observe("request_blocks_saved", float(max(unpruned_blocks - held_blocks, 0)), metrics.BLOCK_BUCKETS,
                     policy=policy)

    # ---- the snapshot -------------------------------------------------------------------
    def snapshot(self) -> dict:
        def entry(key: tuple[str, Labels]) -> dict:
            return {"name": key[0], "labels": dict(key[1])}

        return {
            "labels": self.labels,
            "pid": os.getpid(),
            "counters": [{**entry(key), "value": value} for key, value in self.counters.items()],
            "gauges": [{**entry(key), "value": value} for key, value in self.gauges.items()],
            "histograms": [{**entry(key), "bounds": list(h.bounds), "counts": h.counts, "sum": h.sum}
                           for key, h in self.histograms.items()],
        }

    def due(self, force: bool = False) -> bool:
        """Whether a snapshot should be written now: something changed, and the last write is
        `WRITE_INTERVAL_S` old (or `force`: the engine went idle, or started)."""
        return self._dirty and (force or time.monotonic() - self._last_write >= metrics.WRITE_INTERVAL_S)

    def write(self) -> None:
        """Atomic: a reader sees whole files only."""
        partial = f"{self.path}.{os.getpid()}.tmp"
        with open(partial, "w") as file:
            json.dump(self.snapshot(), file)
        os.replace(partial, self.path)
        self._last_write, self._dirty = time.monotonic(), False

    def remove(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
