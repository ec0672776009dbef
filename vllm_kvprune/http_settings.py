"""HTTP 400 for a KV setting put at the top level of a request body instead of in `vllm_xargs`.

vLLM's OpenAI models accept unknown top-level fields and drop them (logged at debug level
only), so `extra_body={"kv_budget": 256}` (the OpenAI client's way to add fields) would be
served with the server's budget and no word of it. Per-request KV settings live in
`vllm_xargs`, where the plugin checks them; this ASGI middleware answers 400 for the same
keys at the top level, naming the key and where it goes, and passes every other request
through untouched (its body replayed as it came). As for `vllm_xargs`, the keys are checked
only where a policy runs.

vLLM adds it with its own `--middleware` option (`vllm_hooks.install_cli`).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from vllm_kvprune.config import REPORT_KEY, REQUEST_KEYS
from vllm_kvprune.frontend import FRONT_END

PATH = "vllm_kvprune.http_settings.MisplacedKVSettings"
KV_KEYS = frozenset((*REQUEST_KEYS, REPORT_KEY, "kv_policy"))

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def misplaced_key(body: bytes) -> str | None:
    """The first KV key (sorted) at the top level of a JSON object body, or None."""
    if b'"kv_' not in body:  # most bodies: no parse
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None  # not ours to judge: vLLM answers a malformed body
    if not isinstance(document, dict):
        return None
    found = sorted(KV_KEYS.intersection(document))
    return found[0] if found else None


def error_body(key: str) -> bytes:
    """vLLM's error shape (`ErrorResponse`), naming the key and where it belongs."""
    message = (f"{key}: per-request KV settings go in vllm_xargs, e.g. "
               f'{{"vllm_xargs": {{"{key}": ...}}}}; at the top level of the request it would be ignored')
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": key,
                                 "code": 400}}).encode()


class MisplacedKVSettings:
    """ASGI middleware: a POST whose JSON body has a KV key at its top level gets a 400."""

    def __init__(self, app: Callable[[Message, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        received = await _whole_body(receive)
        body = b"".join(message.get("body", b"") for message in received if message["type"] == "http.request")
        key = misplaced_key(body)
        if key is not None and _policy_runs():
            _count_rejection(key)
            await _answer_400(send, error_body(key))
            return
        pending = list(received)

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)


def _is_json(scope: Message) -> bool:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-type":
            return b"json" in value.lower()
    return False


async def _whole_body(receive: Receive) -> list[Message]:
    """Every message up to the body's last chunk (or a disconnect), as received."""
    received = []
    while True:
        message = await receive()
        received.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return received


async def _answer_400(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _policy_runs() -> bool:
    # As for vllm_xargs: without a policy in this front end, KV settings are not checked.
    return FRONT_END.policy is not None


def _count_rejection(key: str) -> None:
    # The front end's refusal counter, as for a bad vllm_xargs value.
    FRONT_END.count_rejection(key)
