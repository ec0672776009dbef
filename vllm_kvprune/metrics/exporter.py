"""The front end's side of the metrics: a Prometheus collector in the registry vLLM's `/metrics`
(and `LLM.get_metrics()`) reads, over the engine cores' snapshots and this process's own
counts of requests refused with HTTP 400."""

from __future__ import annotations

import glob
import json
import os
import threading
from collections import defaultdict
from typing import Any, Iterator

from vllm_kvprune import metrics
from vllm_kvprune.metrics import multiprocess

_lock = threading.Lock()
# (model_name, setting) -> requests this front end refused (HTTP 400 / ValueError).
_frontend_rejections: dict[tuple[str, str], int] = defaultdict(int)
_registered = False
_mirrors: dict[str, multiprocess.PrometheusMirror] = {}  # model -> this front end's refusals, multiprocess


def record_rejection(vllm_config: Any, setting: str) -> None:
    """A request refused by the policy's checks in this front end, for the setting at fault."""
    names = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None) or ""
    model = names[0] if isinstance(names, (list, tuple)) else str(names)
    with _lock:
        _frontend_rejections[(model, setting)] += 1
        if multiprocess.active():  # several API servers: /metrics adds up every one's files
            if model not in _mirrors:
                _mirrors[model] = multiprocess.PrometheusMirror({"model_name": model, "engine": "frontend"})
            _mirrors[model].count("requests_rejected", 1.0, {"setting": setting})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(folder: str | None) -> list[dict]:
    """The snapshots of live engine processes in `folder` (a dead one's file is removed)."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder or "", "engine-*.json"))) if folder else ():
        try:
            with open(path) as file:
                snapshot = json.load(file)
        except (OSError, ValueError):
            continue  # removed meanwhile
        if not _alive(int(snapshot.get("pid", 0))):
            try:
                os.remove(path)
            except OSError:
                pass
            continue
        found.append(snapshot)
    return found


class KVPruneCollector:
    """Yields the `vllm:kvprune_*` families at scrape time (nothing is cached between scrapes)."""

    def describe(self) -> list:
        return []  # families are known only at collect time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snapshots = read_snapshots(metrics.metrics_dir())
        families: dict[str, Any] = {}

        def family(name: str, labelnames: list[str]) -> Any:
            kind, documentation = metrics.METRICS[name]
            full = metrics.PREFIX + name
            if full not in families:
                made = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                        "histogram": HistogramMetricFamily}[kind]
                families[full] = made(full, documentation, labels=labelnames)
            return families[full]

        for snapshot in snapshots:
            base = snapshot["labels"]
            for kind in ("counters", "gauges"):
                for item in snapshot[kind]:
                    labels = {**base, **item["labels"]}
                    family(item["name"], list(labels)).add_metric(list(labels.values()), item["value"])
            for item in snapshot["histograms"]:
                labels = {**base, **item["labels"]}
                cumulative, buckets = 0, []
                for bound, count in zip([*item["bounds"], float("inf")], item["counts"]):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
                family(item["name"], list(labels)).add_metric(list(labels.values()), buckets, item["sum"])
        with _lock:
            rejections = dict(_frontend_rejections)
        for (model, setting), count in rejections.items():
            family("requests_rejected", ["model_name", "engine", "setting"]).add_metric([model, "frontend", setting],
                                                                                        count)
        yield from families.values()


def register_collector() -> None:
    """Once per process: the collector joins the registry vLLM's `/metrics` serves with a
    single API server (several read Prometheus' multiprocess files: `multiprocess.py`)."""
    global _registered
    if _registered:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(KVPruneCollector())
    _registered = True
