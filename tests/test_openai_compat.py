"""OpenAI compatibility on the real ASGI app in process (the real runtime, scheduler
and engine on demo-tiny, no mesh): what only an in-process head can show.

- Responses name the model by its canonical served name, streamed or not, whichever
  alias the request used (vLLM's rule).
- An engine failure after a stream began ends it with an OpenAI-style error event
  and ``[DONE]``; the same failure unstreamed is a 500 in OpenAI's shape; the head
  serves the next request.
- A request without ``max_tokens`` gets the operator's cap, never past the context.
- Temperatures the engine could not divide by are made safe (vLLM's rule).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvmesh.api.app import create_app
from kvmesh.engine.sampling import GREEDY_BELOW, MIN_TEMPERATURE, safe_temperature
from kvmesh.runtime.head import HeadRuntime

PROMPT = "Explain prefill caching"
CONTEXT = 80  # a small window: the cap's clamp is visible in a few dozen tokens


@pytest.fixture(scope="module")
def runtime(tiny_engine) -> Iterator[HeadRuntime]:
    rt = HeadRuntime(tiny_engine, None, publish=False)
    yield rt
    rt.close()


def app_client(runtime: HeadRuntime, **kw: Any) -> TestClient:
    app = create_app(runtime, "house-model", CONTEXT, aliases=("demo-tiny",), **kw)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(runtime) -> Iterator[TestClient]:
    with app_client(runtime) as c:
        yield c


def events(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    """The SSE data events of a streamed request, JSON-decoded (NaN refused), and
    the final ``"[DONE]"`` as a string."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert all(x.startswith("data: ") for x in lines), lines
    out: list[Any] = []
    for x in lines:
        data = x[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data, parse_constant=_no_nan))
    return out


def _no_nan(name: str) -> Any:
    raise AssertionError(f"{name} in a response")


CHAT = {
    "model": "demo-tiny",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": 4,
    "temperature": 0,
}
COMPLETION = {"model": "demo-tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_streamed_and_whole_answers_name_the_canonical_model(client, path, body):
    assert client.get("/v1/models").json()["data"][0]["id"] == "house-model"
    for name in ("demo-tiny", "house-model"):  # an alias or the canonical name
        whole = client.post(path, json={**body, "model": name})
        assert whole.status_code == 200 and whole.json()["model"] == "house-model", whole.text
        chunks = events(
            client, path, {**body, "model": name, "stream_options": {"include_usage": True}}
        )
        assert chunks[-1] == "[DONE]"
        assert {c["model"] for c in chunks[:-1]} == {"house-model"}


class FailingForward:
    """The engine's batched forward, raising from its ``after``-th call on: an
    engine failure in the middle of a generation."""

    def __init__(self, engine: Any, after: int) -> None:
        self.real, self.after, self.calls = engine.decode_batch, after, 0

    def __call__(self, states: Any) -> None:
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError("injected: the device fell over")
        self.real(states)


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_an_engine_failure_mid_stream_ends_with_an_error_event_then_done(
    client, runtime, monkeypatch, path, body
):
    body = {**body, "max_tokens": 12, "ignore_eos": True}
    monkeypatch.setattr(runtime.engine, "decode_batch", FailingForward(runtime.engine, after=3))
    chunks = events(client, path, body)
    assert chunks[-1] == "[DONE]"
    err = chunks[-2]["error"]
    assert err["type"] == "server_error" and err["code"] == "generation_failed"
    assert err["message"] and "injected" not in err["message"]  # internals stay in the log
    text = [c for c in chunks[:-2] if "choices" in c]
    assert text and all("error" not in c for c in text)  # the tokens before it were sent
    whole = client.post(path, json=body)  # unstreamed, the same failure is a 500
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    ok = client.post(path, json=body)  # the head still serves
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12


def test_no_max_tokens_gets_the_operator_cap_within_the_context(runtime, client):
    body = {"model": "demo-tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    n_prompt = len(runtime.engine.encode(PROMPT))
    out = client.post("/v1/completions", json=body).json()  # no cap: the rest of the window
    assert out["usage"]["completion_tokens"] == CONTEXT - n_prompt
    with app_client(runtime, max_tokens_default=5) as capped:
        assert capped.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 5
        explicit = capped.post("/v1/completions", json={**body, "max_tokens": 9}).json()
        assert explicit["usage"]["completion_tokens"] == 9  # a request's own limit wins
    with app_client(runtime, max_tokens_default=10_000) as wide:  # clamped to the context
        out = wide.post("/v1/completions", json=body).json()
        assert out["usage"]["completion_tokens"] == CONTEXT - n_prompt


def test_temperatures_the_engine_cannot_divide_by_are_made_safe():
    assert safe_temperature(0.0) == 0.0
    for greedy in (5e-324, 1e-40, GREEDY_BELOW / 2):
        assert safe_temperature(greedy) == 0.0
    for tiny in (GREEDY_BELOW, 1e-3, MIN_TEMPERATURE / 2):
        assert safe_temperature(tiny) == MIN_TEMPERATURE
    for usual in (MIN_TEMPERATURE, 0.7, 2.0):
        assert safe_temperature(usual) == usual


def test_a_tiny_temperature_samples_as_greedy_does(client):
    """``1e-40`` divided into float32 logits is inf, then NaN; here it is greedy,
    and the answer (and its logprobs) is greedy's, streamed or not."""
    body = {**COMPLETION, "max_tokens": 8, "ignore_eos": True, "logprobs": 2}
    greedy = client.post("/v1/completions", json=body).json()["choices"][0]
    for t in (1e-40, 5e-324, 1e-6):
        tiny = client.post("/v1/completions", json={**body, "temperature": t, "seed": 1})
        assert tiny.status_code == 200 and tiny.json()["choices"][0] == greedy
        chunks = events(client, "/v1/completions", {**body, "temperature": t})
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == greedy["text"]
    warm = client.post("/v1/completions", json={**body, "temperature": 1e-3, "seed": 1})
    assert warm.status_code == 200  # raised to MIN_TEMPERATURE: sampled, finite
    assert all(lp <= 0 for lp in warm.json()["choices"][0]["logprobs"]["token_logprobs"])


def test_a_request_beyond_the_kv_budget_is_a_400_before_its_stream_begins(tiny_engine):
    per_token = tiny_engine.card.kv_bytes_per_token
    rt = HeadRuntime(tiny_engine, None, publish=False, kv_budget_bytes=per_token * 1000)
    try:
        app = create_app(rt, "house-model", 4096, aliases=("demo-tiny",))
        with TestClient(app, raise_server_exceptions=False) as c:
            for stream in (False, True):
                body = {**COMPLETION, "max_tokens": 2000, "stream": stream}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "kv_budget_exceeded" and "--kv-budget" in err["message"]
            ok = c.post("/v1/completions", json={**COMPLETION, "max_tokens": 8})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 8, ok.text
    finally:
        rt.close()
