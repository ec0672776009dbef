"""A real `vllm-kvprune serve` with a policy: a bad per-request override is a 400 naming
the field, and the server keeps serving the next (good) request; a request the policy fails
for is a 500 while the others are served as if it had not been there."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from conftest import page_bytes, served
from vllm_kvprune import metrics


FAULTY_ID = "kvprune-injected-fault"


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    """The module's server's output (stdout and stderr)."""
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, server_log):
    pool_bytes = 256 * page_bytes(tiny_model, {"dtype": "float32", "block_size": 32})
    with served(tiny_model, "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "4096",
                "--kv-cache-memory-bytes", str(pool_bytes), "--kv-policy", "streaming", "--kv-budget", "64",
                "--kv-sinks", "4", log_dir=server_log.parent, timeout=240,
                # Fault containment: the policy fails for requests sent with this id (and no other).
                env={"KVPRUNE_FAULT": f"plan:{FAULTY_ID}",
                     # Started from a process whose metrics folder holds another live engine's numbers.
                     metrics.DIR_ENV: str(_someone_elses_metrics(tmp_path_factory.mktemp("elsewhere")))}) as base:
        yield base, tiny_model


def _someone_elses_metrics(folder: Path) -> Path:
    """A snapshot of a live engine (this test process) that is not the server's."""
    snapshot = {"labels": {"model_name": "someone-else", "engine": "0"}, "pid": os.getpid(),
                "counters": [{"name": "tokens_evicted", "labels": {"policy": "h2o"}, "value": 1000.0}],
                "gauges": [{"name": "blocks_held", "labels": {}, "value": 50.0}], "histograms": []}
    (folder / "engine-1-x-0.json").write_text(json.dumps(snapshot))
    return folder


def _complete(base: str, model: str, xargs: dict | None, endpoint: str = "completions") -> requests.Response:
    body = {"model": model, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = "The quick brown fox"
    else:
        body["messages"] = [{"role": "user", "content": "Say something."}]
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return requests.post(f"{base}/v1/{endpoint}", json=body, timeout=120)


def test_start_up_logs_no_unknown_environment_variable(server, server_log):
    """Our variables are `KVPRUNE_*`: vLLM warns about every unknown `VLLM_*` one it finds in a
    server's environment, and the server exports its metrics folder to its engine processes.
    (vLLM's CPU worker leaves its own VLLM_DIST_IDENT in this test process's environment, which
    a server started from here inherits and vLLM then warns about: not ours.)"""
    base, _ = server
    assert requests.get(f"{base}/health", timeout=30).status_code == 200  # started: its start-up is logged
    log = server_log.read_text()
    assert "Application startup complete" in log
    ours = [line for line in log.splitlines() if "Unknown vLLM environment variable" in line and "KVPRUNE" in line]
    assert not ours, ours


@pytest.mark.parametrize("xargs, field", [
    ({"kv_budget": 0}, "kv_budget"),
    ({"kv_budget": 16}, "kv_budget"),
    ({"kv_budget": "many"}, "kv_budget"),
    ({"kv_sinks": 64}, "kv_sinks"),
    ({"kv_window": -1}, "kv_window"),
    ({"kv_recent": -1}, "kv_recent"),
    ({"kv_allocation": "pyramid"}, "kv_allocation"),  # streaming has one allocation
    ({"kv_bugdet": 64}, "kv_bugdet"),
])
def test_bad_override_is_400_then_good_request_is_200(server, xargs, field):
    base, model = server
    bad = _complete(base, model, xargs)
    assert bad.status_code == 400, bad.text
    assert field in bad.json()["error"]["message"]
    good = _complete(base, model, {"kv_budget": 96})
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 80


def test_chat_endpoint_validates_too(server):
    base, model = server
    assert _complete(base, model, {"kv_budget": 0}, "chat/completions").status_code == 400
    assert _complete(base, model, {"kv_budget": 64}, "chat/completions").status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_kv_setting_at_the_top_level_is_400_naming_vllm_xargs(server, endpoint):
    # The OpenAI client's extra_body={"kv_budget": ...} lands here; vLLM alone would drop it.
    base, model = server
    body = {"model": model, "max_tokens": 8, "kv_budget": 96,
            **({"prompt": "The quick brown fox"} if endpoint == "completions" else
               {"messages": [{"role": "user", "content": "Say something."}]})}
    bad = requests.post(f"{base}/v1/{endpoint}", json=body, timeout=120)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "kv_budget" and "vllm_xargs" in bad.json()["error"]["message"]
    assert _complete(base, model, {"kv_budget": 96}, endpoint).status_code == 200


def test_per_request_budget_changes_the_output(server):
    base, model = server
    long = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    small = requests.post(f"{base}/v1/completions", json={**long, "vllm_xargs": {"kv_budget": 32}}, timeout=120)
    large = requests.post(f"{base}/v1/completions", json={**long, "vllm_xargs": {"kv_budget": 1024}}, timeout=120)
    assert small.status_code == large.status_code == 200
    assert small.json()["choices"][0]["text"] != large.json()["choices"][0]["text"]


def test_kv_report_comes_back_with_the_answer(server):
    """`kv_report` asks for the request's KV statistics in its response; a wrong value is a 400."""
    base, model = server
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    answer = requests.post(f"{base}/v1/completions", json={**body, "vllm_xargs": {"kv_report": True}}, timeout=120)
    assert answer.status_code == 200, answer.text
    report = answer.json()["kv_transfer_params"]["kvprune"]
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    assert report["policy"] == "streaming"
    assert report["blocks_without_policy"] == -(-(prompt_tokens + 199) // 32)
    assert report["blocks_held"] <= 3 < report["blocks_without_policy"]  # budget 64: a cap of 3 blocks
    assert report["kept_tokens_max"] <= 65
    plain = requests.post(f"{base}/v1/completions", json=body, timeout=120)
    assert not (plain.json().get("kv_transfer_params") or {}).get("kvprune")
    bad = requests.post(f"{base}/v1/completions", json={**body, "vllm_xargs": {"kv_report": "yes"}}, timeout=120)
    assert bad.status_code == 400 and "kv_report" in bad.json()["error"]["message"]


# ---- metrics on vLLM's own /metrics (vllm_kvprune.metrics) -----------------------------------
def _scrape(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base}/metrics", timeout=30).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("vllm:kvprune_")}


def _scrape_until(base: str, ready, seconds: float = 10.0) -> dict:
    """/metrics once `ready(values)` holds (an engine writes what it counted within a step or
    two), or as it is after `seconds`."""
    deadline = time.monotonic() + seconds
    values = _scrape(base)
    while not ready(values) and time.monotonic() < deadline:
        time.sleep(0.2)
        values = _scrape(base)
    return values


def _total(values: dict, name: str, **labels) -> float:
    return sum(value for (found, their), value in values.items()
               if found == name and all((key, str(wanted)) in their for key, wanted in labels.items()))


def test_metrics_count_what_the_policy_did(server):
    """One request alone: every token it ran is either kept or evicted (the worker's count),
    its saving is the blocks it did not hold, each of its steps was planned, and nothing is
    held once it is done."""
    base, model = server
    before = _scrape(base)
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 80, "temperature": 0, "ignore_eos": True,
            "vllm_xargs": {"kv_budget": 32}}
    answer = requests.post(f"{base}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    after = _scrape(base)

    def grew(name: str, **labels) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    cached = answer.json()["usage"]["prompt_tokens"] + 80 - 1  # the last token sampled is never cached
    evicted = grew("vllm:kvprune_tokens_evicted_total", policy="streaming", model_name=model)
    kept = grew("vllm:kvprune_request_kept_tokens_sum", policy="streaming", heads="mean")
    assert grew("vllm:kvprune_request_kept_tokens_count", heads="mean") == 1
    assert 32 <= kept < cached and evicted + kept == cached
    assert grew("vllm:kvprune_request_kept_tokens_sum", heads="max") == kept  # streaming: every head alike
    saved = grew("vllm:kvprune_request_blocks_saved_sum", policy="streaming")
    assert 0 < saved < -(-cached // 32)  # it held at least one block, fewer than all of them
    assert grew("vllm:kvprune_step_seconds_count", phase="plan") >= 80
    assert grew("vllm:kvprune_blocks_returned_total") >= 0
    assert _total(after, "vllm:kvprune_blocks_held") == 0 and _total(after, "vllm:kvprune_blocks_without_pruning") == 0


def test_metrics_count_refused_requests_by_setting(server):
    base, model = server
    before = _scrape(base)
    assert _complete(base, model, {"kv_budget": 0}).status_code == 400
    assert _complete(base, model, {"kv_sinks": 64}).status_code == 400
    after = _scrape(base)
    for setting in ("kv_budget", "kv_sinks"):
        grown = (_total(after, "vllm:kvprune_requests_rejected_total", setting=setting)
                 - _total(before, "vllm:kvprune_requests_rejected_total", setting=setting))
        assert grown == 1, setting


def test_metrics_show_this_servers_engines_only(server):
    """The process that started the server had a metrics folder with another live engine's
    numbers in it; the server made its own, so /metrics names its own model alone."""
    base, model = server
    assert {dict(labels)["model_name"] for name, labels in _scrape(base)} == {model}


# ---- fault containment (vllm_kvprune/worker/faults.py) ------------------------------------------
def test_a_request_the_policy_fails_for_fails_alone(server):
    """Mid-batch, the policy fails for one request: that request is a 500, the others finish
    with the very tokens they get when nothing fails, and its blocks go back to the pool."""
    base, model = server

    def complete(prompt: str, request_id: str | None = None) -> requests.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        headers = {"X-Request-Id": request_id} if request_id else {}
        return requests.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)

    prompts = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "It was a dark night"]
    alone = [complete(prompt).json()["choices"][0]["text"] for prompt in prompts]
    before = _scrape(base)
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        faulty = pool.submit(complete, "Tell me a story about a dragon", FAULTY_ID)
        others = list(pool.map(complete, prompts))
        failed = faulty.result()
    assert failed.status_code == 500, failed.text
    assert [answer.status_code for answer in others] == [200] * len(prompts)
    assert [answer.json()["choices"][0]["text"] for answer in others] == alone
    after = _scrape(base)
    assert _total(after, "vllm:kvprune_requests_failed_total") - _total(before, "vllm:kvprune_requests_failed_total") \
        == 1
    assert _total(after, "vllm:kvprune_blocks_held") == 0
    assert complete(prompts[0]).json()["choices"][0]["text"] == alone[0]  # and it goes on serving


@pytest.mark.slow
# vLLM's default (an API server per engine) in the suite; one API server reading both engines
# (our snapshot collector) with --heavy.
@pytest.mark.parametrize("api_servers", [pytest.param([], id="api-server-per-engine"),
                                         pytest.param(["--api-server-count", "1"], id="one-api-server",
                                                      marks=pytest.mark.heavy)])
def test_data_parallel_engines_each_run_the_policy(tiny_model, tmp_path, monkeypatch, api_servers):
    """`--data-parallel-size 2`: two engine cores (one core each here), each with its own
    scheduler and worker maps, and two API servers (vLLM's default for it; their metrics go
    through Prometheus' multiprocess files) or one (`--api-server-count 1`: one process reads
    both engines' stats, our snapshot collector). The same prompt sent six times at once, three
    to each engine, answers the same tokens on both, every answer kept its budget, and
    /metrics counts each engine's three under its `engine` label."""
    pool_bytes = 128 * page_bytes(tiny_model, {"dtype": "float32", "block_size": 32})
    body = {"model": tiny_model, "prompt": "The quick brown fox", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "vllm_xargs": {"kv_report": True}}
    with served(tiny_model, "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "1024",
                "--kv-cache-memory-bytes", str(pool_bytes), "--kv-policy", "streaming", "--kv-budget", "64",
                "--data-parallel-size", "2", *api_servers, log_dir=tmp_path, timeout=300,
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as base:
        with ThreadPoolExecutor(6) as pool:  # three to each engine (vLLM's routing header)
            answers = list(pool.map(lambda rank: requests.post(f"{base}/v1/completions", json=body, timeout=300,
                                                               headers={"X-data-parallel-rank": str(rank % 2)}),
                                    range(6)))
        bad = requests.post(f"{base}/v1/completions", json={**body, "vllm_xargs": {"kv_budget": 0}}, timeout=60)
        values = _scrape_until(base, lambda found: _total(found, "vllm:kvprune_request_kept_tokens_count",
                                                          heads="mean") >= 6)
    assert all(answer.status_code == 200 for answer in answers), [answer.text for answer in answers]
    assert len({answer.json()["choices"][0]["text"] for answer in answers}) == 1
    for answer in answers:
        report = answer.json()["kv_transfer_params"]["kvprune"]
        assert report["kept_tokens_max"] <= 65 and report["blocks_held"] < report["blocks_without_policy"], report
    assert bad.status_code == 400 and "kv_budget" in bad.json()["error"]["message"]
    assert _total(values, "vllm:kvprune_request_kept_tokens_count", heads="mean") == 6
    engines = {dict(labels)["engine"] for name, labels in values if name == "vllm:kvprune_request_kept_tokens_count"}
    assert engines == {"0", "1"}, engines
    for engine in engines:
        assert _total(values, "vllm:kvprune_request_kept_tokens_count", heads="mean", engine=engine) == 3
    assert _total(values, "vllm:kvprune_requests_rejected_total", engine="frontend", setting="kv_budget") == 1
