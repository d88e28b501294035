"""A stream sends a chunk as soon as a token is decoded, even while the token's text
is held back (here: text that could still become a stop string), as vLLM does: a
client's first chunk, its time to first token, is the first token's, not the first
printable text's; the text streamed is still exactly the whole answer. On the real
ASGI app in process (the real runtime, scheduler and engine on demo-tiny).

The stream reads each choice's live state when a token's event reaches it, so
without pacing a loaded machine can decode the next tokens first and one chunk
then carries several tokens' text (issue #36's flake). :class:`Paced` makes the
order deterministic: the engine forwards token ``k`` only once the chunk of token
``k`` has been sent. The stop string is the whole answer and a character it never
produces, so every token's text is held back until the last one, whatever the
tokenizer makes of the first tokens and whichever kernel batched steps use.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvmesh.api.app import create_app
from kvmesh.runtime.head import HeadRuntime

NEVER = "\u2603\u2603"  # appended to a stop string: the greedy answer never completes it
ROUTES = {
    "/v1/completions": {"prompt": "Explain prefill caching"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Explain prefill caching"}]},
}


class Paced:
    """Paces a real engine by the chunks a real app sends: while ``on``, the engine
    forwards its ``k``-th token (``decode_batch``, after sampling it) only once
    ``k + base`` SSE events went out (``base``: chunks before the first token's,
    chat's role chunk). A wait gives up after ``PATIENCE`` seconds (the test then
    fails on the chunks it got, instead of hanging)."""

    PATIENCE = 120.0

    def __init__(self, engine: Any, app: Any) -> None:
        self.inner = app
        self.cond = threading.Condition()
        self.on, self.base, self.sent, self.steps = False, 0, 0, 0
        self.late = 0  # waits that gave up: the order was not kept
        self._decode = engine.decode_batch

    def start(self, base: int) -> None:
        with self.cond:
            self.on, self.base, self.sent, self.steps, self.late = True, base, 0, 0, 0

    def stop(self) -> None:
        with self.cond:
            self.on = False
            self.cond.notify_all()

    def decode_batch(self, states: Any) -> None:
        with self.cond:
            if self.on:
                self.steps += 1
                if not self.cond.wait_for(
                    lambda: not self.on or self.sent >= self.steps + self.base, self.PATIENCE
                ):
                    self.late += 1
        self._decode(states)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def counting(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                with self.cond:
                    self.sent += message.get("body", b"").count(b"data: ")
                    self.cond.notify_all()

        await self.inner(scope, receive, counting if scope["type"] == "http" else send)


@pytest.fixture(scope="module")
def paced(tiny_engine) -> Iterator[tuple[TestClient, Paced]]:
    rt = HeadRuntime(tiny_engine, None, publish=False)
    pace = Paced(tiny_engine, create_app(rt, "demo-tiny", 256))
    tiny_engine.decode_batch = pace.decode_batch  # the runtime steps through it
    try:
        with TestClient(pace, raise_server_exceptions=False) as c:
            yield c, pace
    finally:
        pace.stop()
        del tiny_engine.decode_batch  # the class's method again
        rt.close()


def text_of(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or choice.get("message", {}).get("content") or "")


def chunks(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed chunks that carry a choice (not the usage chunk, not [DONE])."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        data = [x[len("data: ") :] for x in r.iter_lines() if x.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [c for c in map(json.loads, data[:-1]) if c.get("choices")]


@pytest.mark.parametrize("path", ROUTES)
def test_a_token_whose_text_is_held_back_is_still_a_chunk(paced, path):
    client, pace = paced
    # a frequency penalty: greedy text that moves (demo-tiny repeats one token otherwise)
    body = {
        "model": "demo-tiny",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "frequency_penalty": 0.5,
        **ROUTES[path],
    }
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    whole = text_of(r.json()["choices"][0])
    assert whole and NEVER not in whole  # the premise: text to hold back
    # all of the answer could be the start of this stop string: held back to the end
    chat = path == "/v1/chat/completions"
    pace.start(base=1 if chat else 0)
    try:
        got = chunks(client, path, {**body, "stop": [whole + NEVER]})
    finally:
        pace.stop()
    assert (pace.steps, pace.late) == (body["max_tokens"] - 1, 0)  # each token paced
    if chat:
        assert got[0]["choices"][0]["delta"] == {"role": "assistant"}
        got = got[1:]
    # a chunk per token, then the finish; every token but the last held back
    assert len(got) == body["max_tokens"] + 1, [text_of(c["choices"][0]) for c in got]
    assert [text_of(c["choices"][0]) for c in got[:-2]] == [""] * (body["max_tokens"] - 1)
    assert all(c["choices"][0]["finish_reason"] is None for c in got[:-1])
    first = got[0]["choices"][0]
    assert text_of(first) == "" and first["finish_reason"] is None, got[:3]
    assert "".join(text_of(c["choices"][0]) for c in got) == whole  # nothing lost
    assert got[-1]["choices"][0]["finish_reason"] == "length"
