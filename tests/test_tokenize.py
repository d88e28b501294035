"""vLLM's tokenizer routes on a real head (``kvmesh.api.tokenize``): ``/tokenize``,
``/detokenize`` and ``/v1/chat/completions/render``, as vLLM's router calls them
before routing a chat request. A chat's ids are the ones its completion prefills
(the zoo's tools model: the template renders tools and tool-call turns); bad bodies
are the head's typed 4xx; keys are checked as on the OpenAI routes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import zoo
from .test_api import Head
from .test_fuzz_http import JSONS
from .test_tools import TOOLS

KEY = "sk-tokenize-test"
MODEL = "qwen2-tools-float32-r1"
CALL = {
    "id": "call_000000000000000000000001",
    "type": "function",
    "function": {"name": "search", "arguments": json.dumps({"query": "flush"})},
}
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "Find where the cache is flushed, then check the weather."},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": "store.py:120 flush()"},
]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY} acme\n")
    h = Head(
        "--no-publish",
        "--alias",
        "tools",
        "--api-key-file",
        str(keys),
        "--api-key-scope",
        "all",
        model=str(zoo.tools_model()),
    )
    h.http.headers["Authorization"] = f"Bearer {KEY}"
    yield h
    h.stop()


def post(head: Head, path: str, body: Any) -> httpx.Response:
    return head.http.post(path, json=body)


def refused(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The head's error body, with ``status`` (and ``param`` when given)."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "plain"])
def test_render_and_tokenize_count_what_the_chat_prefills(head, tools):
    chat: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    if tools:
        chat["tools"] = tools
    done = post(head, "/v1/chat/completions", {**chat, "temperature": 0})
    assert done.status_code == 200, done.text
    n = done.json()["usage"]["prompt_tokens"]
    rendered = post(head, "/v1/chat/completions/render", chat)
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    assert len(body["token_ids"]) == n
    assert body["request_id"].startswith("chatcmpl-") and body["features"] is None
    assert body["sampling_params"]["max_tokens"] == 1 and body["model"] == MODEL
    tok = post(head, "/tokenize", {k: v for k, v in chat.items() if k != "max_tokens"})
    assert tok.status_code == 200, tok.text
    out = tok.json()
    assert out["tokens"] == body["token_ids"] and out["count"] == n
    assert out["max_model_len"] == head.http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert out["token_strs"] is None
    if tools:  # the ids are the same whatever tool_choice, and longer than without tools
        for choice in ("auto", "none", "required"):
            same = post(
                head, "/tokenize", {"messages": MESSAGES, "tools": tools, "tool_choice": choice}
            )
            assert same.json()["tokens"] == out["tokens"], choice
        plain = post(head, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
        assert plain["count"] < n
        text = post(head, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}).json()
        assert "get_weather" in text["prompt"] and "store.py:120 flush()" in text["prompt"]


def test_prompt_tokenize_detokenize_round_trip(head):
    text = "Hello, world! The cache is flushed at store.py:120 — ünïcode too."
    out = post(head, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    back = post(head, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    done = post(head, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert done.json()["usage"]["prompt_tokens"] == body["count"]  # the completion's own ids
    bare = post(head, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert post(head, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": text}
    assert post(head, "/tokenize", {"prompt": ""}).json()["count"] == 0


ALL = ("/tokenize", "/detokenize", "/v1/chat/completions/render")


def test_bad_bodies_are_typed_400s(head):
    for path in ALL:
        r = head.http.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
        refused(r, 400)
        refused(post(head, path, [1, 2, 3]), 400)
    refused(post(head, "/tokenize", {"model": MODEL, "messages": "hi"}), 400, "messages")
    refused(post(head, "/tokenize", {"model": MODEL, "messages": []}), 400, "messages")
    refused(post(head, "/v1/chat/completions/render", {"model": MODEL, "messages": "hi"}), 400)
    refused(post(head, "/tokenize", {"model": MODEL}), 400, "prompt")
    both = {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    refused(post(head, "/tokenize", both), 400, "messages")
    refused(post(head, "/tokenize", {"prompt": 7}), 400, "prompt")
    surrogate = b'{"prompt": "\\ud800"}'  # valid JSON, not text
    refused(head.http.post("/tokenize", content=surrogate), 400)
    chat = {"model": MODEL, "messages": MESSAGES}
    for field, value in (
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("add_special_tokens", True),
        ("chat_template", "{{ messages }}"),
    ):
        err = refused(post(head, "/tokenize", {**chat, field: value}), 400, field)
        assert err["code"] == "unsupported_parameter"
    bad_tools = [{"type": "function", "function": {"name": "bad name!"}}]
    refused(post(head, "/tokenize", {**chat, "tools": bad_tools}), 400, "tools[0].function.name")
    refused(
        post(head, "/v1/chat/completions/render", {**chat, "tools": bad_tools}),
        400,
        "tools[0].function.name",
    )
    refused(post(head, "/detokenize", {"tokens": [1, -1]}), 400, "tokens")
    refused(post(head, "/detokenize", {"tokens": [1 << 40]}), 400, "tokens")
    refused(post(head, "/detokenize", {"tokens": ["a"]}), 400)
    refused(post(head, "/detokenize", {"tokens": [1.0]}), 400)
    # the chat route's own checks, before anything runs
    refused(post(head, "/v1/chat/completions/render", {**chat, "temperature": 9}), 400)
    refused(post(head, "/v1/chat/completions/render", {**chat, "top_k": 5}), 400, "top_k")
    err = refused(post(head, "/v1/chat/completions/render", {**chat, "max_tokens": 10**7}), 400)
    assert err["code"] == "context_length_exceeded"
    refused(
        post(head, "/v1/chat/completions/render", {**chat, "cache_salt": ""}), 400, "cache_salt"
    )
    # an unknown model: the chat route's (and vLLM's) 404
    for path, body in (
        ("/tokenize", {"model": "nope", "prompt": "a"}),
        ("/detokenize", {"model": "nope", "tokens": [1]}),
        ("/v1/chat/completions/render", {"model": "nope", "messages": MESSAGES}),
    ):
        assert refused(post(head, path, body), 404, "model")["code"] == "model_not_found"
    assert head.health()["status"] == "ok"


def test_keys_are_checked_as_on_the_openai_routes(head):
    bodies = {
        "/tokenize": {"model": MODEL, "prompt": "a"},
        "/detokenize": {"model": MODEL, "tokens": [1]},
        "/v1/chat/completions/render": {"model": MODEL, "messages": MESSAGES},
    }
    with httpx.Client(base_url=head.url, timeout=60) as anon:
        for path, body in bodies.items():
            wrong = anon.post(path, json=body, headers={"Authorization": "Bearer sk-wrong"})
            assert refused(wrong, 401)["code"] == "invalid_api_key"
            none = anon.post(path, json=body)  # --api-key-scope all: a key is needed
            assert refused(none, 401)["code"] == "invalid_api_key"
            ok = anon.post(path, json=body, headers={"X-API-Key": KEY})
            assert ok.status_code == 200, ok.text


FIELDS = (
    "model",
    "prompt",
    "messages",
    "tokens",
    "tools",
    "tool_choice",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    "chat_template_kwargs",
    "max_tokens",
    "n",
    "cache_salt",
)
VALUES = st.one_of(
    JSONS,
    st.just(MODEL),
    st.just(MESSAGES),
    st.just(TOOLS),
    st.lists(st.integers(min_value=-5, max_value=200_000), max_size=8),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(ALL),
    body=st.one_of(JSONS, st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5)),
)
def test_fuzzed_bodies_are_answered_never_a_500(head, path, body):
    r = head.http.post(path, content=json.dumps(body).encode())
    assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
    if r.status_code != 200:
        refused(r, r.status_code)


def test_a_chat_after_its_render_is_not_templated_again(head):
    """vLLM's router renders a chat on the worker it then sends it to: the chat
    takes the render's ids (counted), and they are the ones its answer reports."""
    messages = [*MESSAGES, {"role": "user", "content": "And the other file? (memo test)"}]
    chat: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 1}
    before = head.metric("kvmesh_renders_reused_total")
    rendered = post(head, "/v1/chat/completions/render", chat)
    assert rendered.status_code == 200, rendered.text
    done = post(head, "/v1/chat/completions", {**chat, "temperature": 0})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == len(rendered.json()["token_ids"])
    assert head.metric("kvmesh_renders_reused_total") == before + 1
    more = [*messages, {"role": "user", "content": "One more."}]
    again = post(head, "/v1/chat/completions", {**chat, "messages": more})
    assert again.status_code == 200, again.text
    assert head.metric("kvmesh_renders_reused_total") == before + 1
