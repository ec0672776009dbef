"""The issue's stall scenario, on a real server with the real model: SmolLM2 (float32: bf16 is
emulated, and several times slower, on CPUs without AVX-512; the scenario is the pool's), a pool of
2,048 tokens set by memory, max_model_len 4,096, `streaming` with budget 128. A 2,800-token
prompt used to wait forever and hold up every request behind it. The refusing server runs two API
server processes (`--api-server-count 2`), whose every check must hold as in one."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from conftest import page_bytes, served
from test_server import _scrape_until, _total

POOL_BLOCKS = 64
LONG_PROMPT = 2800


def serve_args(model: str, *policy: str) -> list[str]:
    pool = POOL_BLOCKS * page_bytes(model, {"dtype": "float32", "block_size": 32})
    return ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "4096",
            "--kv-cache-memory-bytes", str(pool), "--kv-policy", "streaming", "--kv-budget", "128", *policy]


def complete(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[requests.Response, float]:
    started = time.perf_counter()
    response = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    return response, time.perf_counter() - started


def long_and_short(base: str, model: str) -> tuple[tuple, tuple]:
    """The long prompt, and a short request sent right behind it."""
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, 30000, LONG_PROMPT).tolist()
    short_prompt = rng.integers(100, 30000, 20).tolist()
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(complete, base, model, long_prompt, 16)
        time.sleep(0.5)
        short = pool.submit(complete, base, model, short_prompt, 16)
        return long.result(), short.result()


@pytest.mark.slow
def test_full_prefill_refuses_the_long_prompt_at_once_and_serves_the_next(real_model, tmp_path):
    # Two API server processes: each checks requests as one does (the policy reaches them
    # through the parsed flags, not through a plugin patch they load too late).
    with served(real_model, *serve_args(real_model), "--api-server-count", "2", log_dir=tmp_path) as base:
        (long, long_seconds), (short, short_seconds) = long_and_short(base, real_model)
        bad = [requests.post(f"{base}/v1/completions", timeout=60, json={
            "model": real_model, "prompt": "Hello", "max_tokens": 4, **extra}) for extra in
            ({"vllm_xargs": {"kv_budget": 0}}, {"vllm_xargs": {"kv_budget": 0}}, {"kv_budget": 64})]
        after, _ = complete(base, real_model, [5, 6, 7], 4)
        # /metrics of several API servers reads Prometheus' multiprocess files: every front
        # end's refusals and the engine's totals, whichever process answers the scrape.
        scrapes = [_scrape_until(base, lambda values: _total(values, "vllm:kvprune_request_kept_tokens_count") >= 2)
                   for _ in range(4)]
    assert [response.status_code for response in bad] == [400, 400, 400], [response.text for response in bad]
    for values in scrapes:
        assert _total(values, "vllm:kvprune_requests_rejected_total", engine="frontend", setting="kv_budget") == 3
        assert _total(values, "vllm:kvprune_request_kept_tokens_count", engine="0", heads="mean") == 2  # short, after
        assert ("vllm:kvprune_blocks_held", frozenset({("model_name", real_model), ("engine", "0")})) in values
    assert after.status_code == 200, after.text
    assert long.status_code == 400, long.text
    message = long.json()["error"]["message"]
    assert "2800 tokens" in message and "--kv-prefill streaming" in message
    assert long_seconds < 10
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 16
    assert short_seconds < 60


@pytest.mark.slow
def test_streaming_prefill_serves_the_long_prompt_from_the_2048_token_pool(real_model, tmp_path):
    with served(real_model, *serve_args(real_model, "--kv-prefill", "streaming"), log_dir=tmp_path) as base:
        (long, _), (short, short_seconds) = long_and_short(base, real_model)
    assert long.status_code == 200, long.text
    assert long.json()["usage"] == {**long.json()["usage"], "prompt_tokens": LONG_PROMPT, "completion_tokens": 16}
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 16
    assert short_seconds < 120
