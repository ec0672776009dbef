"""Our families in Prometheus' multiprocess files, for servers with several API server processes.

With `--api-server-count N` (and `--data-parallel-size N`, which defaults to N API servers)
vLLM sets `PROMETHEUS_MULTIPROC_DIR` before it starts any other process and answers `/metrics`
from the files there alone: the collector in a process's registry (`exporter.py`) is never
asked. So wherever that folder is set, every count is also made on a `prometheus_client`
metric, whose value lives in a file of that folder and is added up over the processes when
`/metrics` is scraped: the engine cores' totals (`EngineStats`) and each API server's
refusals. Gauges keep the most recent value per label set (each engine has its own `engine`
label).
"""

from __future__ import annotations

import os
from typing import Any

from vllm_kvprune import metrics

ENV = "PROMETHEUS_MULTIPROC_DIR"


def active() -> bool:
    return ENV in os.environ


class PrometheusMirror:
    """One process's metrics in the multiprocess files, labelled `base` (model_name, engine)
    and then by the labels of each call; a name keeps the label names of its first call.
    Not locked: its callers are serialized already (the engine core's scheduler; the front
    end's refusals under `exporter._lock`)."""

    def __init__(self, base: dict[str, str]) -> None:
        _use_multiprocess_values()
        self.base = base
        self._metrics: dict[str, Any] = {}
        self._children: dict[tuple, Any] = {}  # (name, labels) -> the labelled metric (a lookup per call saved)

    def count(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._child(name, labels).inc(value)

    def observe(self, name: str, value: float, bounds: tuple[float, ...], labels: dict[str, str]) -> None:
        self._child(name, labels, bounds).observe(value)

    def set_gauge(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._child(name, labels).set(value)

    def _child(self, name: str, labels: dict[str, str], bounds: tuple[float, ...] | None = None) -> Any:
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metric(name, labels, bounds).labels(**self.base, **labels)
        return child

    def _metric(self, name: str, labels: dict[str, str], bounds: tuple[float, ...] | None = None) -> Any:
        made = self._metrics.get(name)
        if made is not None:
            return made
        from prometheus_client import Counter, Gauge, Histogram

        kind, documentation = metrics.METRICS[name]
        options: dict[str, Any] = {"labelnames": [*self.base, *sorted(labels)], "registry": None}
        if kind == "histogram":
            options["buckets"] = bounds
        elif kind == "gauge":
            options["multiprocess_mode"] = "mostrecent"
        made = self._metrics[name] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[kind](
            metrics.PREFIX + name, documentation, **options)
        return made


def _use_multiprocess_values() -> None:
    """prometheus_client picks where values live when it is first imported: a process forked
    from one that imported it before vLLM set the folder would keep them in memory."""
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.get_value_class()
