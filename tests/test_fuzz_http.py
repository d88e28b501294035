"""Every HTTP route of a LIVE head, fuzzed: garbage bodies, wrong types, huge
numbers, unicode, wrong methods, random paths and keys.

Every answer is a 2xx or a 4xx (never a 5xx); a 4xx carries an OpenAI-style JSON
error; every JSON answer and every streamed event is strict JSON (no NaN or
infinities), and a stream ends with ``[DONE]`` and no error event; and the head is
healthy afterwards, with nothing left queued or running. The sampling parameters
(temperature down to ``1e-40`` and the smallest subnormal and up to ``1e308``,
top_p, penalties, logprobs, n, seed, max_tokens) are fuzzed on their own too: a
value in OpenAI's range always decodes (200), one outside is a 400. Valid-looking
completions are kept to a few tokens (``--default-max-tokens``, and ``max_tokens``
drawn small or absurd) so the run stays under a minute.
"""

from __future__ import annotations

import json
import math
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
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/render",
    "/tokenize",
    "/detokenize",
    "/v1/models",
    "/healthz",
    "/metrics",
    "/",
    "/docs",
    "/openapi.json",
    "/static/app.js",
    "/static/nope.js",
    "/v1/network/summary",
    "/v1/network/nodes",
    "/v1/network/tokens",
    "/v1/network/prefill",
    "/v1/network/groups",
    "/v1/network/groups/x",
    "/v1/network/nodes/register",
    "/v1/network/pair",
)

# any code point, lone surrogates included ("\\ud800" is valid JSON, not valid text)
TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),
    TEXT,
)
JSONS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
# a decode stays short: a small count, an absurd one (refused), or the wrong type
TOKEN_COUNTS = st.one_of(
    st.integers(max_value=6), st.integers(min_value=40_000), st.floats(), st.text(max_size=5)
)
MAX_BATCH = 8  # the head's default --max-batch: n above it is a 400
# values where sampling breaks if nothing guards it: logits / 1e-40 is inf, then NaN
EDGE_TEMPERATURES = [0.0, -0.0, 5e-324, 1e-300, 1e-40, 1e-6, 1e-5, 1e-3, 0.01, 2.0, 1e308]
# in OpenAI's range, at its edges, or just past them (each must be a 200 or a 400)
TEMPERATURE = st.one_of(
    st.sampled_from(EDGE_TEMPERATURES),
    st.floats(min_value=0, max_value=2),
    st.floats(min_value=0, max_value=1e-4),
    st.floats(),
    st.integers(-3, 3),
    st.none(),
)
TOP_P = st.one_of(
    st.sampled_from([5e-324, 1e-300, 1e-9, 1.0, 0.0, -0.0, 1.0000001]),
    st.floats(min_value=0, max_value=1),
    st.floats(),
    st.none(),
)
PENALTY = st.one_of(
    st.sampled_from([-2.0, 2.0, -2.0000001, 2.0000001, 5e-324]),
    st.floats(min_value=-2, max_value=2),
    st.floats(),
    st.none(),
)
SEED = st.one_of(
    st.integers(min_value=-2, max_value=2**64), st.sampled_from([0, 2**63 - 1, 2**63]), st.none()
)
COUNT = st.one_of(st.integers(min_value=-1, max_value=MAX_BATCH + 2), st.none())
LOGPROBS = st.one_of(st.integers(min_value=-1, max_value=22), st.none())
SAMPLING = {
    "temperature": TEMPERATURE,
    "top_p": TOP_P,
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "seed": SEED,
    "n": COUNT,
}
FIELDS = {
    "model": st.one_of(st.just("demo-tiny"), st.text(max_size=20), JSONS),
    "max_tokens": TOKEN_COUNTS,
    "max_completion_tokens": TOKEN_COUNTS,
    "temperature": st.one_of(TEMPERATURE, st.integers(), st.text(max_size=3)),
    "top_p": st.one_of(TOP_P, st.integers()),
    "presence_penalty": st.one_of(PENALTY, JSONS),
    "frequency_penalty": st.one_of(PENALTY, JSONS),
    "n": st.one_of(st.integers(min_value=-(2**70), max_value=2**70), COUNT, st.text(max_size=3)),
    "stream": st.one_of(st.booleans(), JSONS),
    "stream_options": JSONS,
    "seed": st.one_of(st.integers(min_value=-(2**80), max_value=2**80), SEED, st.floats()),
    "ignore_eos": JSONS,
    "stop": JSONS,
    "logprobs": st.one_of(LOGPROBS, st.booleans(), JSONS),
    "top_logprobs": st.one_of(LOGPROBS, JSONS),
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
    {
        "role": st.one_of(
            st.sampled_from(["system", "user", "assistant", "tool", "wizard"]), JSONS
        ),
        "content": st.one_of(
            TEXT,
            st.none(),
            JSONS,
            st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["text", "image"]),
                        "text": st.one_of(st.text(), JSONS),
                    }
                ),
                max_size=3,
            ),
        ),
    },
)


# deep nesting, alone or as a field: a parser's or a validator's stack is not a 500
NESTED = st.builds(
    lambda n, wrap: (
        (b'{"model": "demo-tiny", "prompt": ' if wrap else b"")
        + b"[" * n
        + b"]" * n
        + (b"}" if wrap else b"")
    ),
    st.integers(min_value=1, max_value=100_000),
    st.booleans(),
)


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
    h = Head(
        "--admin-key-file",
        str(keys),
        "--default-max-tokens",
        "4",
        "--max-queue",
        "4",
        "--max-body-bytes",
        "256KiB",
    )
    yield h
    idle = h.wait(lambda s: s["queue"]["waiting"] == 0 and s["queue"]["running"] == 0, 60)
    assert idle["status"] == "ok"
    # ignore_eos: a sampled end of text must not end the answer early (a flake seen in a full run)
    body = {"model": "demo-tiny", "prompt": "still", "max_tokens": 2, "ignore_eos": True}
    ok = h.http.post("/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert h.proc.poll() is None
    h.stop()


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.request.method, r.request.url, r.text[:500])
    if r.request.method == "HEAD":  # headers only
        return
    if r.status_code >= 400:
        err = strict_json(r.text)["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], r.text
    elif r.headers.get("content-type", "").startswith("application/json"):
        strict_json(r.text)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        stream_events(r.text)


def strict_json(text: str) -> Any:
    """JSON as a client's parser reads it: NaN and infinities are not JSON."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in an answer: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def stream_events(text: str) -> list[Any]:
    """A whole SSE answer: strict JSON events, no error event, then ``[DONE]``."""
    lines = [x for x in text.split("\n") if x]
    assert lines and lines[-1] == "data: [DONE]", text[-300:]
    events = [strict_json(x.removeprefix("data: ")) for x in lines[:-1]]
    assert all("error" not in e for e in events), text[-300:]
    return events


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


def in_openai_range(body: dict[str, Any]) -> bool:
    """Whether OpenAI (and so kvmesh) accepts the body's sampling parameters."""

    def within(name: str, lo: float, hi: float, low_open: bool = False) -> bool:
        v = body.get(name)
        return v is None or (math.isfinite(v) and (lo < v if low_open else lo <= v) and v <= hi)

    return (
        within("temperature", 0, 2)
        and within("top_p", 0, 1, low_open=True)
        and within("presence_penalty", -2, 2)
        and within("frequency_penalty", -2, 2)
        and within("seed", 0, 2**63 - 1)
        and within("n", 1, MAX_BATCH)
        and within("logprobs", 0, 20)
        and within("top_logprobs", 0, 20)
    )


@st.composite
def sampling_bodies(draw: Any, chat: bool) -> dict[str, Any]:
    """A request that is valid but for its sampling parameters, drawn over and past
    their ranges; it decodes a few tokens with them."""
    body: dict[str, Any] = {"model": "demo-tiny", "stream": draw(st.booleans())}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
        if draw(st.booleans()):
            body["logprobs"], body["top_logprobs"] = True, draw(LOGPROBS)
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=30))
        body["logprobs"] = draw(LOGPROBS)
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(min_value=1, max_value=4))  # else the cap: 4
    for name in draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=6, unique=True)):
        body[name] = draw(SAMPLING[name])
    body["ignore_eos"] = draw(st.booleans())
    return body


@SETTINGS
@given(body=sampling_bodies(chat=False))
def test_fuzz_completion_sampling_parameters(head, body):
    check_sampling(head, "/v1/completions", body)


@SETTINGS
@given(body=sampling_bodies(chat=True))
def test_fuzz_chat_sampling_parameters(head, body):
    check_sampling(head, "/v1/chat/completions", body)


def check_sampling(h: Head, path: str, body: dict[str, Any]) -> None:
    """In range: 200 with finite logprobs, streamed or not. Out: a 400."""
    r = h.http.post(path, content=encode(body), headers={"Content-Type": "application/json"})
    check(r)
    assert r.status_code == (200 if in_openai_range(body) else 400), (body, r.text[:300])
    if r.status_code != 200:
        return
    chunks = stream_events(r.text) if body["stream"] else [strict_json(r.text)]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert {c["index"] for c in choices} == set(range(body.get("n") or 1)), body
    for c in choices:
        for v in logprob_values(c.get("logprobs")):
            assert -1e4 <= v <= 0, (body, c)


def logprob_values(lp: dict[str, Any] | None) -> list[float]:
    if lp is None:
        return []
    if "content" in lp:  # chat
        return [
            x
            for t in lp["content"]
            for x in [t["logprob"]] + [a["logprob"] for a in t["top_logprobs"]]
        ]
    return [*lp["token_logprobs"], *(v for top in lp["top_logprobs"] for v in top.values())]


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
