"""The metrics' two halves without an engine: the engine core's totals (`metrics/engine.py`)
and the front end's collector over their snapshot files (`metrics/exporter.py`), read back
through Prometheus' own text format. The engines' side is tested on real engines in
test_server.py (`/metrics` of a real server) and test_gvote_engine.py (`LLM.get_metrics()`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from vllm_kvprune import metrics
from vllm_kvprune.metrics.engine import EngineStats
from vllm_kvprune.metrics.exporter import KVPruneCollector, read_snapshots, record_rejection


def _config(name: str = "m", instance: str = "i1"):
    return types.SimpleNamespace(model_config=types.SimpleNamespace(served_model_name=[name]),
                                 parallel_config=types.SimpleNamespace(data_parallel_rank=0), instance_id=instance)


def _policy(name: str):
    return lambda request_id: types.SimpleNamespace(name=name)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(metrics.DIR_ENV, str(tmp_path))
    return tmp_path


def _exposed() -> dict:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    registry.register(KVPruneCollector())
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_evictions_telescope_to_tokens_run_minus_tokens_kept(folder) -> None:
    stats = EngineStats(_config(), str(folder))
    # prompt of 100 (kept 64 after it), then 3 decodes at the budget: 100 + 3 - 64 evicted
    stats.step({"kept": {"a": (64.0, 64)}}, {"a": 100}, _policy("streaming"), "streaming")
    for _ in range(3):
        stats.step({"kept": {"a": (64.0, 64)}}, {"a": 1}, _policy("streaming"), "streaming")
    assert stats.counters[("tokens_evicted", (("policy", "streaming"),))] == 39
    # preempted: it re-prefills from nothing, so the re-run prompt is not evicted again
    stats.preempted("a", "streaming")
    stats.step({"kept": {"a": (64.0, 64)}}, {"a": 64}, _policy("streaming"), "streaming")
    assert stats.counters[("tokens_evicted", (("policy", "streaming"),))] == 39
    stats.finished("a", "streaming", held_blocks=2, unpruned_blocks=5)
    kept_mean = stats.histograms[("request_kept_tokens", (("heads", "mean"), ("policy", "streaming")))]
    assert kept_mean.sum == 64 and sum(kept_mean.counts) == 1
    saved = stats.histograms[("request_blocks_saved", (("policy", "streaming"),))]
    assert saved.sum == 3 and saved.counts[saved.bounds.index(4.0)] == 1  # 3 falls in the bucket le=4


def test_collector_shows_live_engines_as_prometheus_families(folder) -> None:
    stats = EngineStats(_config("tiny"), str(folder))
    stats.returned(3, "h2o")
    stats.observe("step_seconds", 0.002, metrics.SECONDS_BUCKETS, policy="h2o", phase="plan")
    stats.observe("step_seconds", 0.02, metrics.SECONDS_BUCKETS, policy="h2o", phase="plan")
    stats.set_gauge("blocks_held", 7.0)
    assert stats.due(force=True)
    stats.write()
    record_rejection(_config("tiny"), "kv_budget")
    values = _exposed()
    base = {("model_name", "tiny"), ("engine", "0")}
    assert values[("vllm:kvprune_blocks_returned_total", frozenset(base | {("policy", "h2o")}))] == 3
    assert values[("vllm:kvprune_blocks_held", frozenset(base))] == 7
    plan = base | {("policy", "h2o"), ("phase", "plan")}
    assert values[("vllm:kvprune_step_seconds_bucket", frozenset(plan | {("le", "0.001")}))] == 0
    assert values[("vllm:kvprune_step_seconds_bucket", frozenset(plan | {("le", "0.003")}))] == 1
    assert values[("vllm:kvprune_step_seconds_bucket", frozenset(plan | {("le", "+Inf")}))] == 2
    assert values[("vllm:kvprune_step_seconds_count", frozenset(plan))] == 2
    frontend = {("model_name", "tiny"), ("engine", "frontend"), ("setting", "kv_budget")}
    assert values[("vllm:kvprune_requests_rejected_total", frozenset(frontend))] >= 1
    stats.remove()
    assert not any(name.startswith("vllm:kvprune_blocks_returned") for name, _ in _exposed())


def test_a_dead_engines_snapshot_is_dropped(folder) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = folder / f"engine-{dead.stdout.strip()}-x-0.json"
    path.write_text(json.dumps({"labels": {}, "pid": int(dead.stdout), "counters": [], "gauges": [],
                                "histograms": []}))
    assert read_snapshots(str(folder)) == [] and not path.exists()


def test_snapshots_are_written_only_when_due(folder) -> None:
    stats = EngineStats(_config(), str(folder))
    stats.write()
    assert not stats.due(force=True)  # nothing changed
    stats.rejected("prompt")
    assert stats.due(force=True) and not stats.due()  # changed, but written moments ago
    stats.write()
    assert os.path.exists(stats.path) and read_snapshots(str(folder))[0]["counters"][0]["value"] == 1


def test_the_overhead_stopwatch_times_outermost_calls_once() -> None:
    """bench metrics-overhead's direct measure: a wrapped function calling another wrapped one
    is timed once, for its whole duration, and the wrapped functions still return their values."""
    import time as clock
    import types

    from benchmarks.metrics_overhead import Stopwatch

    def inner() -> int:
        clock.sleep(0.02)
        return 1

    owner = types.SimpleNamespace(inner=inner)
    owner.outer = lambda: owner.inner() + 1
    watch = Stopwatch()
    watch.wrap(owner, "inner")
    watch.wrap(owner, "outer")
    assert owner.outer() == 2 and watch.calls == 1
    assert 0.02 <= watch.seconds < 0.2
    assert owner.inner() == 1 and watch.calls == 2 and watch.seconds >= 0.04


# One process of a server with several API servers: an engine core (its prometheus_client
# imported before the folder was set, as in a process forked from vLLM's front end) or a
# front end refusing requests.
_MULTIPROCESS_ROLE = """
import os, sys, types
import prometheus_client  # before the folder is known: values would stay in memory
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]
from vllm_kvprune import metrics
from vllm_kvprune.metrics.engine import EngineStats
from vllm_kvprune.metrics.exporter import record_rejection
config = types.SimpleNamespace(model_config=types.SimpleNamespace(served_model_name=["tiny"]),
                               parallel_config=types.SimpleNamespace(data_parallel_rank=int(sys.argv[3])),
                               instance_id="i")
if sys.argv[1] == "engine":
    stats = EngineStats(config, sys.argv[4])
    stats.returned(3, "h2o")
    stats.observe("step_seconds", 0.002, metrics.SECONDS_BUCKETS, policy="h2o", phase="plan")
    stats.observe("step_seconds", 0.02, metrics.SECONDS_BUCKETS, policy="h2o", phase="plan")
    stats.set_gauge("blocks_held", 5.0)
    stats.set_gauge("blocks_held", 7.0)
    stats.rejected("prompt")
else:
    for _ in range(int(sys.argv[3])):
        record_rejection(config, "kv_budget")
"""


def test_several_api_servers_add_up_every_process_in_prometheus_files(tmp_path) -> None:
    """With several API servers vLLM answers /metrics from Prometheus' multiprocess files only:
    two engines and two front ends write there, and the files add up to every one's counts."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.parser import text_string_to_metric_families

    folder = tmp_path / "prometheus"
    folder.mkdir()
    for role, number in (("engine", 0), ("engine", 1), ("frontend", 2), ("frontend", 3)):
        subprocess.run([sys.executable, "-c", _MULTIPROCESS_ROLE, role, str(folder), str(number), str(tmp_path)],
                       check=True, timeout=120)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    values = {(s.name, frozenset(s.labels.items())): s.value
              for family in text_string_to_metric_families(generate_latest(registry).decode())
              for s in family.samples}
    for engine in ("0", "1"):
        base = {("model_name", "tiny"), ("engine", engine)}
        assert values[("vllm:kvprune_blocks_returned_total", frozenset(base | {("policy", "h2o")}))] == 3
        assert values[("vllm:kvprune_blocks_held", frozenset(base))] == 7  # the last value set
        plan = base | {("policy", "h2o"), ("phase", "plan")}
        assert values[("vllm:kvprune_step_seconds_bucket", frozenset(plan | {("le", "0.001")}))] == 0
        assert values[("vllm:kvprune_step_seconds_bucket", frozenset(plan | {("le", "0.003")}))] == 1
        assert values[("vllm:kvprune_step_seconds_bucket", frozenset(plan | {("le", "+Inf")}))] == 2
        assert values[("vllm:kvprune_requests_rejected_total", frozenset(base | {("setting", "prompt")}))] == 1
    frontend = {("model_name", "tiny"), ("engine", "frontend"), ("setting", "kv_budget")}
    assert values[("vllm:kvprune_requests_rejected_total", frozenset(frontend))] == 2 + 3


# Where a process's snapshot folder comes from: printed by a process started either way.
_FOLDER_OF = """
import multiprocessing, sys
from vllm_kvprune import metrics

def show(queue):
    queue.put(metrics.metrics_dir(create=True))

if __name__ == "__main__":
    mine = metrics.metrics_dir(create=True)
    queue = multiprocessing.get_context(sys.argv[1]).Queue()
    child = multiprocessing.get_context(sys.argv[1]).Process(target=show, args=(queue,))
    child.start()
    print(mine, queue.get(timeout=60), metrics.metrics_dir(create=True), sep="\\n")
    child.join()
"""


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_a_new_server_makes_its_own_folder_and_its_engines_share_it(tmp_path, start) -> None:
    """A process that inherited a folder from whatever started it (a test run, a launcher of
    several servers) makes its own, so its /metrics shows its engines only; the processes it
    starts with multiprocessing, as vLLM starts engine cores, share that one; and asking again
    in the same process gives the same folder."""
    inherited = tmp_path / "someone-elses"
    inherited.mkdir()
    script = tmp_path / "folder_of.py"  # a file: a spawned child imports its target from it
    script.write_text(_FOLDER_OF)
    shown = subprocess.run([sys.executable, str(script), start], capture_output=True, text=True, timeout=120,
                           env={**os.environ, metrics.DIR_ENV: str(inherited)}, check=True).stdout.split()
    mine, child, again = shown
    assert mine != str(inherited) and os.path.basename(mine).startswith("vllm-kvprune-metrics-")
    assert child == mine and again == mine
    assert not os.path.exists(mine)  # removed when the process that made it exits
