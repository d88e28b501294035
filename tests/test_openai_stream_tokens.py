"""A stream sends a chunk as soon as a token is decoded, even while the token's text
is held back (here: text that could still become a stop string), as vLLM does: a
client's first chunk, its time to first token, is the first token's, not the first
printable text's; the text streamed is still exactly the whole answer. On the real
ASGI app in process (the real runtime, scheduler and engine on demo-tiny).
"""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def client(tiny_engine) -> Iterator[TestClient]:
    rt = HeadRuntime(tiny_engine, None, publish=False)
    with TestClient(create_app(rt, "demo-tiny", 256), raise_server_exceptions=False) as c:
        yield c
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
def test_a_token_whose_text_is_held_back_is_still_a_chunk(client, path):
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
    assert len(whole) > 4 and NEVER not in whole  # the premise: text to hold back
    # the answer's first characters could be the start of this stop string: held back
    got = chunks(client, path, {**body, "stop": [whole[:4] + NEVER]})
    if path == "/v1/chat/completions":
        assert got[0]["choices"][0]["delta"] == {"role": "assistant"}
        got = got[1:]
    first = got[0]["choices"][0]
    assert text_of(first) == "" and first["finish_reason"] is None, got[:3]
    assert "".join(text_of(c["choices"][0]) for c in got) == whole  # nothing lost
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    assert len(got) <= body["max_tokens"] + 1  # a chunk per token at most, and the last
