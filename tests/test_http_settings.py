"""The front end's middleware for KV settings at the top level of a request body
(`vllm_kvprune/http_settings.py`), driven as an ASGI app without a server; `test_server.py`
runs it in a real `vllm-kvprune serve`."""

import asyncio
import json

import pytest

from vllm_kvprune import http_settings, plugin
from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.frontend import FRONT_END
from vllm_kvprune.http_settings import MisplacedKVSettings, misplaced_key


class RecordingApp:
    """The app behind the middleware: records what reached it, answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.bodies.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _call(body: bytes, *, chunks: int = 1, method: str = "POST", content_type: bytes = b"application/json"):
    app = RecordingApp()
    size = -(-len(body) // chunks) or 1
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    incoming = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1} for i, part in enumerate(parts)]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": [(b"content-type", content_type)]}
    asyncio.run(MisplacedKVSettings(app)(scope, receive, send))
    status = sent[0]["status"]
    answer = b"".join(message.get("body", b"") for message in sent[1:])
    return status, answer, app.bodies


@pytest.fixture
def policy_runs(monkeypatch):
    monkeypatch.setattr(FRONT_END, "policy", KVPolicyConfig.from_dict({"name": "streaming", "budget": 64}))


@pytest.mark.parametrize("key", ["kv_budget", "kv_sinks", "kv_window", "kv_recent", "kv_prune_interval",
                                 "kv_gvote_p", "kv_gvote_samples", "kv_report", "kv_policy"])
def test_a_top_level_kv_key_is_a_400_naming_it_and_vllm_xargs(policy_runs, key):
    status, answer, reached = _call(json.dumps({"model": "m", "prompt": "hi", key: 3}).encode())
    assert status == 400 and reached == []
    error = json.loads(answer)["error"]
    assert error["param"] == key and error["code"] == 400
    assert key in error["message"] and "vllm_xargs" in error["message"]


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "hi", "vllm_xargs": {"kv_budget": 64}},  # where it belongs
    {"model": "m", "prompt": "hi", "kv_transfer_params": None},  # vLLM's own kv_ field
    {"model": "m", "prompt": "hi kv_budget", "stop": ['"kv_budget"']},  # in a value, not a key
    {"model": "m", "messages": [{"role": "user", "content": '{"kv_budget": 1}'}]},
])
def test_other_bodies_reach_the_app_unchanged(policy_runs, body):
    raw = json.dumps(body).encode()
    status, answer, reached = _call(raw, chunks=3)
    assert (status, answer, reached) == (200, b"ok", [raw])


def test_a_body_in_chunks_is_judged_whole(policy_runs):
    raw = json.dumps({"model": "m", "prompt": "x" * 5000, "kv_budget": 64}).encode()
    assert _call(raw, chunks=7)[0] == 400


@pytest.mark.parametrize("raw, method, content_type", [
    (b'{"kv_budget": 64', "POST", b"application/json"),  # malformed: vLLM answers it
    (b'["kv_budget"]', "POST", b"application/json"),
    (b'{"kv_budget": 64}', "POST", b"multipart/form-data; boundary=x"),
    (b'{"kv_budget": 64}', "PUT", b"application/json"),
])
def test_what_is_not_a_json_object_post_passes(policy_runs, raw, method, content_type):
    status, _, reached = _call(raw, method=method, content_type=content_type)
    assert status == 200 and reached == [raw]


def test_without_a_policy_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(FRONT_END, "policy", None)
    raw = json.dumps({"model": "m", "prompt": "hi", "kv_budget": 64}).encode()
    assert _call(raw)[0] == 200


def test_the_key_found_is_the_first_in_order():
    assert misplaced_key(b'{"kv_sinks": 1, "kv_budget": 2}') == "kv_budget"
    assert misplaced_key(b'{"prompt": "kv_budget"}') is None


def test_the_parsed_flags_carry_the_policy_into_additional_config():
    # What `--api-server-count N` front ends build their engine args from, without the plugin's
    # `from_cli_args` patch (they load the plugin only after): the namespace itself.
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plugin.register()
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--additional-config", '{"other": 1}', "--kv-policy", "streaming",
                              "--kv-budget", "256"])
    assert args.additional_config["other"] == 1
    assert args.additional_config["kv_policy"]["name"] == "streaming"
    assert args.additional_config["kv_policy"]["budget"] == 256
    assert "kv_policy" not in parser.parse_args(["--model", "m"]).additional_config


def test_the_serve_cli_adds_the_middleware_once():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plugin.register()
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--middleware", "a.b", "--kv-policy", "streaming", "--kv-budget", "256"])
    assert args.middleware == ["a.b", http_settings.PATH]
    assert parser.parse_args(["--model", "m", "--middleware", http_settings.PATH]).middleware == [http_settings.PATH]
