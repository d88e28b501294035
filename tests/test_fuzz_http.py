"""Every HTTP route of a LIVE head, fuzzed: garbage bodies, wrong types, huge
numbers, unicode, wrong methods, random paths and keys.

Every answer is a 2xx or a 4xx (never a 5xx); a 4xx carries an OpenAI-style JSON
error; and the head is healthy afterwards, with nothing left queued or running.
Valid-looking completions are kept to a few tokens (``--max-tokens-default``, and
``max_tokens`` drawn small or absurd) so the run stays under a minute.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_api import Head

KEY = "fuzz-api-key"
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/",
          "/docs", "/openapi.json", "/static/app.js", "/static/nope.js", "/v1/network/summary",
          "/v1/network/nodes", "/v1/network/tokens", "/v1/network/prefill", "/v1/network/groups",
          "/v1/network/groups/x", "/v1/network/nodes/register", "/v1/network/pair")  # fmt: skip

# any code point, lone surrogates included ("\\ud800" is valid JSON, not valid text)
TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80), st.floats(), TEXT,
)  # fmt: skip
JSONS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)  # fmt: skip
# a decode stays short: a small count, an absurd one (refused), or the wrong type
TOKEN_COUNTS = st.one_of(
    st.integers(max_value=6), st.integers(min_value=40_000), st.floats(), st.text(max_size=5)
)
FIELDS = {
    "model": st.one_of(st.just("demo-tiny"), st.text(max_size=20), JSONS),
    "max_tokens": TOKEN_COUNTS,
    "max_completion_tokens": TOKEN_COUNTS,
    "temperature": st.one_of(st.floats(), st.integers(), st.text(max_size=3)),
    "top_p": st.one_of(st.floats(), st.integers()),
    "n": st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=3)),
    "stream": st.one_of(st.booleans(), JSONS),
    "stream_options": JSONS,
    "seed": st.one_of(st.integers(min_value=-(2**80), max_value=2**80), st.floats()),
    "ignore_eos": JSONS,
    "stop": JSONS,
    "logprobs": JSONS,
    "user": JSONS,
}
PROMPTS = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=200),
    st.lists(st.integers(min_value=-5, max_value=300), max_size=40),
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=3),
    st.lists(st.text(max_size=20), max_size=3),
    JSONS,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "wizard"]), JSONS),
     "content": st.one_of(TEXT, st.none(), JSONS,
                          st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                          "text": st.one_of(st.text(), JSONS)}), max_size=3))},
)  # fmt: skip


# deep nesting, alone or as a field: a parser's or a validator's stack is not a 500
NESTED = st.builds(
    lambda n, wrap: (b'{"model": "demo-tiny", "prompt": ' if wrap else b"") + b"[" * n + b"]" * n
    + (b"}" if wrap else b""),
    st.integers(min_value=1, max_value=100_000), st.booleans(),
)  # fmt: skip


@st.composite
def openai_bodies(draw: Any, chat: bool) -> dict[str, Any]:
    """A valid small request with a few fields replaced, added or removed."""
    body: dict[str, Any] = {"model": "demo-tiny", "max_tokens": 3, "temperature": 0}
    if chat:
        body["messages"] = draw(st.one_of(st.lists(MESSAGE, max_size=3), JSONS))
    else:
        body["prompt"] = draw(PROMPTS)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        body[name] = draw(FIELDS[name])
    if draw(st.booleans()):
        body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    keys = tmp_path_factory.mktemp("fuzz") / "keys"
    keys.write_text(KEY + "\n")
    h = Head("--api-key-file", str(keys), "--max-tokens-default", "4", "--max-queue", "4",
             "--max-body-bytes", "256KiB")  # fmt: skip
    yield h
    idle = h.wait(lambda s: s["queue"]["waiting"] == 0 and s["queue"]["running"] == 0, 60)
    assert idle["status"] == "ok"
    ok = h.http.post(
        "/v1/completions", json={"model": "demo-tiny", "prompt": "still", "max_tokens": 2}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert h.proc.poll() is None
    h.stop()


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.request.method, r.request.url, r.text[:500])
    if r.status_code >= 400 and r.request.method != "HEAD":
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], r.text


def send(h: Head, method: str, path: str, content: bytes, headers: dict[str, Any]) -> None:
    check(h.http.request(method, path, content=content, headers=headers))


def encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@SETTINGS
@given(body=st.one_of(openai_bodies(chat=False).map(encode), NESTED))
def test_fuzz_completions(head, body):
    send(head, "POST", "/v1/completions", body, {"Content-Type": "application/json"})


@SETTINGS
@given(body=openai_bodies(chat=True))
def test_fuzz_chat_completions(head, body):
    send(head, "POST", "/v1/chat/completions", encode(body), {"Content-Type": "application/json"})


@SETTINGS
@given(
    method=st.sampled_from(METHODS),
    path=st.one_of(st.sampled_from(ROUTES), st.text(max_size=30).map(lambda t: "/" + quote(t))),
    body=st.one_of(st.binary(max_size=300), JSONS.map(encode), NESTED),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "", "application/x-www-form-urlencoded"]
    ),
    key=st.sampled_from([None, KEY, "wrong", "\u00e9\u00e9"]),
)
def test_fuzz_every_route_and_method(head, method, path, body, content_type, key):
    headers: dict[str, Any] = {"Content-Type": content_type} if content_type else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}".encode()  # raw UTF-8 bytes too
    send(head, method, path, body, headers)


@SETTINGS
@given(
    path=st.sampled_from(["/v1/network/groups", "/v1/network/pair"]),
    body=st.one_of(
        st.fixed_dictionaries({"name": SCALARS, "members": JSONS, "description": JSONS}),
        st.fixed_dictionaries({"token": SCALARS, "alias": JSONS}),
        JSONS,
    ),
)
def test_fuzz_network_writes(head, path, body):
    headers = {"Content-Type": "application/json", "X-API-Key": KEY}
    send(head, "POST", path, encode(body), headers)
