"""A real `vllm-kvprune serve` with a policy: a bad per-request override is a 400 naming
the field, and the server keeps serving the next (good) request."""

import pytest
import requests

from conftest import page_bytes, served


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    pool_bytes = 256 * page_bytes(tiny_model, {"dtype": "float32", "block_size": 32})
    with served(tiny_model, "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "4096",
                "--kv-cache-memory-bytes", str(pool_bytes), "--kv-policy", "streaming", "--kv-budget", "64",
                "--kv-sinks", "4", log_dir=tmp_path_factory.mktemp("server"), timeout=240) as base:
        yield base, tiny_model


def _complete(base: str, model: str, xargs: dict | None, endpoint: str = "completions") -> requests.Response:
    body = {"model": model, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = "The quick brown fox"
    else:
        body["messages"] = [{"role": "user", "content": "Say something."}]
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return requests.post(f"{base}/v1/{endpoint}", json=body, timeout=120)


@pytest.mark.parametrize("xargs, field", [
    ({"kv_budget": 0}, "kv_budget"),
    ({"kv_budget": 16}, "kv_budget"),
    ({"kv_budget": "many"}, "kv_budget"),
    ({"kv_sinks": 64}, "kv_sinks"),
    ({"kv_window": -1}, "kv_window"),
    ({"kv_recent": -1}, "kv_recent"),
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


def test_per_request_budget_changes_the_output(server):
    base, model = server
    long = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    small = requests.post(f"{base}/v1/completions", json={**long, "vllm_xargs": {"kv_budget": 32}}, timeout=120)
    large = requests.post(f"{base}/v1/completions", json={**long, "vllm_xargs": {"kv_budget": 1024}}, timeout=120)
    assert small.status_code == large.status_code == 200
    assert small.json()["choices"][0]["text"] != large.json()["choices"][0]["text"]
