"""`python -m benchmarks load`: a real `vllm-kvprune serve` per policy, under load and
bad input, then checked for leaks.

Per policy: a server whose KV pool is small enough that the load forces preemption; one fixed
greedy request; then `--requests` streaming completions from `--concurrency` clients at once,
with random prompts (token ids; lengths log-uniform, so many short ones grow while long ones
hold the pool), lengths and per-request settings, a third of them cut off
mid-stream by the client, and bad requests (settings a policy refuses, unknown keys, wrong
types) interleaved; then the fixed greedy request again. Afterwards, from the server's own
`/metrics`: no request running or waiting, the pool empty (vLLM's `kv_cache_usage_perc` and our
`blocks_held`), and the preemptions that happened. A run passes with zero 5xx answers, zero lost
or short completions, every bad input a 4xx naming its field, an empty pool and the greedy text
unchanged. Prints a table, writes JSON and a plot.

`fdc` and `streaming+fdc` (FDC composed with streaming) run on a calibration the bench makes
first, on the same model (random tokens, `--fdc-tokens`, removal rate 0.1).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from benchmarks import common

NAME = "load"
# Every registered policy (`benchmarks.common.policies`), and streaming over FDC's narrow heads.
POLICIES = (*common.policies(none=False), "streaming+fdc")
FDC_FILE = "{fdc}"  # in SERVER_FLAGS: the calibration the bench makes
BLOCK_SIZE = 32
# Per policy: (settings the server starts with, good per-request settings to draw from).
SERVER_FLAGS: dict[str, list[str]] = {
    "streaming": ["--kv-budget", "64", "--kv-sinks", "4"],
    "h2o": ["--kv-budget", "64", "--kv-sinks", "4", "--kv-recent", "16"],
    "paged_eviction": ["--kv-budget", "128", "--kv-sinks", "4"],  # sink blocks + one evictable + the tail
    "gvote": [],
    "fdc": ["--kv-fdc", FDC_FILE],
    "snapkv": ["--kv-budget", "96", "--kv-snapkv-window", "16"],
    "streaming+fdc": ["--kv-budget", "64", "--kv-sinks", "4", "--kv-fdc", FDC_FILE],
}
GOOD_SETTINGS: dict[str, list[dict]] = {
    "streaming": [{}, {"kv_budget": 32}, {"kv_budget": 96, "kv_sinks": 8}],
    "h2o": [{}, {"kv_budget": 48}, {"kv_budget": 96, "kv_recent": 32}],
    "paged_eviction": [{}, {"kv_budget": 96}, {"kv_budget": 128}],
    "gvote": [{}, {"kv_gvote_p": 0.8}, {"kv_gvote_p": 0.6, "kv_gvote_samples": 4}],
    "fdc": [{}],  # budget-free, no per-request settings
    "snapkv": [{}, {"kv_budget": 64}, {"kv_budget": 128, "kv_snapkv_kernel": 3}],
    "streaming+fdc": [{}, {"kv_budget": 32}, {"kv_budget": 96, "kv_sinks": 8}],
}
assert set(SERVER_FLAGS) == set(GOOD_SETTINGS) == set(POLICIES), "every registered policy needs its load settings"
# (per-request settings, the field the 400 must name); every policy refuses each (a setting of
# another policy, an unknown key, a wrong type, a value out of range).
BAD_SETTINGS: list[tuple[dict, str]] = [
    ({"kv_bugdet": 64}, "kv_bugdet"),
    ({"kv_budget": "many"}, "kv_budget"),
    ({"kv_gvote_p": 1.5}, "kv_gvote_p"),
    ({"kv_prune_interval": -3}, "kv_prune_interval"),
]


@dataclass
class Tally:
    """What the clients saw."""

    completed: int = 0
    short: int = 0  # finished with fewer tokens than asked (none asked to stop early)
    cut_off: int = 0  # closed by the client mid-stream, as planned
    bad_refused: int = 0  # a 4xx naming the field
    bad_unnamed: int = 0  # a 4xx that does not name the field, or a bad request served
    server_errors: int = 0  # 5xx
    lost: int = 0  # no answer at all (connection error, timeout)
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="a real server per policy under load and bad input; no leaks",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--requests", type=int, default=300, help="good requests per policy")
    parser.add_argument("--bad-every", type=int, default=8, help="one bad request after every N good ones")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--max-prompt", type=int, default=600, help="prompt tokens, drawn from 4 up to this")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--pool-blocks", type=int, default=24,
                        help="KV pool size (blocks of 32 tokens), also the longest request: small, so that "
                             "the load preempts")
    parser.add_argument("--tiny", action="store_true", help="the tiny random Llama (default: the real model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fdc-tokens", type=int, default=2048, help="random tokens of the fdc calibration")
    parser.add_argument("--out", default="results/load")
    parser.set_defaults(run=run)


# ---- a real server ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served(model: str, args: list[str], log: Path, env: dict | None = None, timeout: float = 300) -> Iterator[str]:
    """`vllm-kvprune serve MODEL ARGS...` on a free loopback port until the block ends;
    yields its base URL (a start-up failure raises with the log's tail)."""
    import requests

    port = free_port()
    command = [str(Path(sys.executable).parent / "vllm-kvprune"), "serve", model, "--host", "127.0.0.1",
               "--port", str(port), *args]
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + timeout
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
                try:
                    if requests.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    """Every `vllm:` sample of the server's /metrics."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base}/metrics", timeout=30).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("vllm:")}


def total(samples: dict, name: str) -> float:
    return sum(value for (found, _), value in samples.items() if found == name)


# ---- the clients ------------------------------------------------------------------------------
def _stream(base: str, body: dict, cut_after: int | None, timeout: float = 600) -> tuple[int, int, str | None, str]:
    """One streaming completion: (HTTP status, tokens generated, finish reason, error text);
    with `cut_after`, the client closes the connection after that many chunks (finish "cut")."""
    import json

    import requests

    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=timeout) as answer:
        if answer.status_code != 200:
            return answer.status_code, 0, None, answer.text[:300]
        chunks, tokens, finish = 0, 0, None
        for line in answer.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return int(event["error"].get("code") or 500), tokens, None, str(event["error"])[:300]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or ():
                chunks += 1
                finish = choice.get("finish_reason") or finish
            if cut_after is not None and chunks >= cut_after:
                return 200, chunks, "cut", ""
        return 200, tokens, finish, ""


def _greedy(base: str, model: str) -> str:
    import requests

    body = {"model": model, "prompt": "The history of the printing press", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    answer = requests.post(f"{base}/v1/completions", json=body, timeout=300)
    answer.raise_for_status()
    return answer.json()["choices"][0]["text"]


def load_policy(base: str, model: str, policy: str, args: argparse.Namespace) -> tuple[Tally, float]:
    """The load of one policy's server; returns the tally and its wall seconds."""
    rng = random.Random(args.seed)
    lock = threading.Lock()
    tally = Tally()
    jobs: list[tuple[dict, int | None, str | None]] = []  # (body, cut after, bad field)
    for index in range(args.requests):
        max_tokens = rng.randint(8, args.max_tokens)
        # Log-uniform lengths: many short prompts, which grow to their cap (or, budget-free, on)
        # during decode while long ones hold the pool: what makes a capped policy preempt.
        length = int(math.exp(rng.uniform(math.log(4), math.log(args.max_prompt))))
        body = {"model": model, "prompt": [rng.randint(100, 30000) for _ in range(length)],
                "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}
        settings = rng.choice(GOOD_SETTINGS[policy])
        if settings:
            body["vllm_xargs"] = dict(settings)
        cut = rng.randint(1, max(1, max_tokens - 1)) if index % 3 == 2 else None
        jobs.append((body, cut, None))
        if index % args.bad_every == args.bad_every - 1:
            bad, named = rng.choice(BAD_SETTINGS)
            jobs.append(({**body, "vllm_xargs": bad, "max_tokens": 4}, None, named))

    def one(job: tuple[dict, int | None, str | None]) -> None:
        body, cut, bad_field = job
        try:
            status, tokens, finish, error = _stream(base, body, cut)
        except Exception as exc:  # noqa: BLE001 - counted as lost
            with lock:
                tally.lost += 1
                tally.note(f"lost: {type(exc).__name__}: {exc}"[:200])
            return
        with lock:
            if status >= 500:
                tally.server_errors += 1
                tally.note(f"{status}: {error}")
            elif bad_field is not None:
                if 400 <= status < 500 and bad_field in error:
                    tally.bad_refused += 1
                else:
                    tally.bad_unnamed += 1
                    tally.note(f"bad {bad_field} -> {status}: {error}")
            elif status != 200:
                tally.lost += 1
                tally.note(f"good request -> {status}: {error}")
            elif finish == "cut":
                tally.cut_off += 1
            elif finish == "length" and tokens == body["max_tokens"]:
                tally.completed += 1
            else:
                tally.short += 1
                tally.note(f"short: {tokens}/{body['max_tokens']} tokens, finish {finish}")

    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, jobs))
    return tally, time.perf_counter() - started


def wait_idle(base: str, timeout: float = 120) -> dict:
    """The server's metrics once nothing runs or waits (and our snapshot has caught up)."""
    deadline = time.time() + timeout
    while True:
        samples = scrape(base)
        idle = total(samples, "vllm:num_requests_running") == 0 and total(samples, "vllm:num_requests_waiting") == 0
        if idle and total(samples, "vllm:kvprune_blocks_held") == 0 or time.time() > deadline:
            return samples
        time.sleep(1)


def fdc_calibration(model: str, args: argparse.Namespace, work: Path) -> Path:
    """The calibration `fdc` and `streaming+fdc` serve with, made once per run."""
    from vllm_kvprune.fdc import calibration as fdc

    path = work / "load.fdc.safetensors"
    if not path.is_file():
        fdc.calibrate(model, tokens=args.fdc_tokens, seed=args.seed, rate=0.1).save(path)
    return path


def run_policy(model: str, policy: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from benchmarks.throughput import EngineSettings

    # The pool holds one request of the longest length (a budget-free policy may keep it all),
    # and little more: concurrent requests then preempt each other.
    max_model_len = args.pool_blocks * BLOCK_SIZE
    if args.max_prompt + args.max_tokens > max_model_len:
        raise SystemExit(f"load: --max-prompt + --max-tokens must fit --pool-blocks ({max_model_len} tokens)")
    block_bytes = EngineSettings(model, "float32", BLOCK_SIZE, max_model_len, 32, 4).block_bytes()
    flags = ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE), "--max-model-len",
             str(max_model_len),
             "--max-num-seqs", "32", "--kv-cache-memory-bytes", str((args.pool_blocks + 1) * block_bytes),  # + vLLM's null block
             "--kv-policy", policy.split("+")[0], *SERVER_FLAGS[policy]]
    if FDC_FILE in flags:
        flags[flags.index(FDC_FILE)] = str(fdc_calibration(model, args, work))
    with served(model, flags, work / f"server-{policy}.log") as base:
        before_text = _greedy(base, model)
        before = scrape(base)
        tally, seconds = load_policy(base, model, policy, args)
        after_text = _greedy(base, model)
        after = wait_idle(base)
    preemptions = total(after, "vllm:num_preemptions_total") - total(before, "vllm:num_preemptions_total")
    usage = total(after, "vllm:kv_cache_usage_perc")
    held = total(after, "vllm:kvprune_blocks_held")
    record = {"policy": policy, **{k: v for k, v in asdict(tally).items() if k != "examples"},
              "preemptions": preemptions, "pool_usage_after": usage, "blocks_held_after": held,
              "greedy_identical": before_text == after_text, "seconds": seconds, "examples": tally.examples}
    record["passed"] = (tally.server_errors == tally.lost == tally.short == tally.bad_unnamed == 0
                        and usage == 0 and held == 0 and record["greedy_identical"])
    return record


def run(args: argparse.Namespace) -> int:
    from benchmarks import common
    from tools import assets

    model = str(assets.tiny_model_dir() if args.tiny else assets.real_model_dir())
    records = []
    with tempfile.TemporaryDirectory(prefix="kvprune-load-") as folder:
        for policy in args.policies:
            records.append(run_policy(model, policy, args, Path(folder)))
            print(f"{policy}: done in {records[-1]['seconds']:.0f} s", flush=True)
    headers = ["policy", "good", "completed", "cut off", "bad (4xx named)", "5xx", "lost", "short", "preemptions",
               "pool after", "greedy same", "s", "pass"]
    rows = [[r["policy"], str(args.requests), str(r["completed"]), str(r["cut_off"]),
             f"{r['bad_refused']}/{r['bad_refused'] + r['bad_unnamed']}", str(r["server_errors"]), str(r["lost"]),
             str(r["short"]), f"{r['preemptions']:.0f}", f"{r['pool_usage_after']:.0%}",
             "yes" if r["greedy_identical"] else "NO", f"{r['seconds']:.0f}", "yes" if r["passed"] else "NO"]
            for r in records]
    common.print_table(headers, rows)
    for record in records:
        for example in record["examples"]:
            print(f"  {record['policy']}: {example}")
    out = Path(args.out)
    settings = {key: getattr(args, key) for key in ("requests", "bad_every", "concurrency", "max_prompt", "max_tokens",
                                                    "pool_blocks", "tiny", "seed")}
    settings["prompt_lengths"] = "log-uniform from 4"
    common.write_json(out.with_suffix(".json"), NAME, settings, records, passed=all(r["passed"] for r in records))
    figure, axes = common.new_figure(6.0, 3.2)
    names = [r["policy"] for r in records]
    bottom = [0.0] * len(records)
    for key, colour in (("completed", "tab:green"), ("cut_off", "tab:blue"), ("bad_refused", "tab:orange"),
                        ("server_errors", "tab:red"), ("short", "tab:purple"), ("lost", "black")):
        values = [float(r[key]) for r in records]
        axes.bar(names, values, bottom=bottom, color=colour, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    axes.set_ylabel("requests")
    axes.legend(fontsize=7)
    axes.set_title("load: what every request got")
    common.save_figure(figure, out.with_suffix(".png"))
    return 0 if all(r["passed"] for r in records) else 1
