"""Agent-shaped reuse (issue 39): a 6-turn agent loop (system prompt and tool schemas,
a forced tool call each turn, the tool's result appended, ask again) against real
heads with the official ``openai`` client, on the zoo model whose template renders
tools (random weights: ``tool_choice`` ``required`` / named makes every answer a valid
call). From turn 2 on every turn reuses at least 90% of its prompt, and the answers are
the greedy answers of a head with the cache off; after a head restart the new head
reuses the conversation from the peer; and two heads sharing one peer behind a router
that does not pin sessions (turns alternating) reuse at least 90% each turn."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from . import zoo
from .procs import Peer
from .test_api import Head
from .test_tools import SEARCH, WEATHER

TOOLS = [WEATHER, SEARCH]
TURNS = 6
MAX_TOKENS = 160
# the system prompt and tools come to ~4.5k tokens: each turn adds ~400 (call + result)
SYSTEM = (
    "You are a careful coding agent working in a large repository. Read the files you "
    "need with the search tool, check the weather only when asked, run the tests that "
    "cover your change, and report what you did in one short paragraph. "
) * 30
CHOICES: list[Any] = [
    "required",
    {"type": "function", "function": {"name": "search"}},
    "required",
    {"type": "function", "function": {"name": "get_weather"}},
    "required",
    {"type": "function", "function": {"name": "search"}},
]


def tool_result(turn: int) -> str:
    """A few hundred tokens of a tool's output, different each turn."""
    lines = [
        f"kvmesh/module_{turn}_{i}.py:{10 * i + turn}: cache.flush(block_{i})" for i in range(8)
    ]
    return f"Search results for turn {turn}:\n" + "\n".join(lines)


def run_loop(
    clients: list[openai.OpenAI],
    user: str,
    model: str,
    before: Callable[[int], None] | None = None,
) -> tuple[list[tuple[str | None, list[tuple[str, str]]]], list[tuple[int, int, Any]], list]:
    """The agent loop, turn i sent to ``clients[i % len(clients)]`` (after
    ``before(i)``): each turn's (content, calls), (prompt_tokens, cached_tokens,
    kvmesh report), and the last turn's messages."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user},
    ]
    answers, usage = [], []
    for turn in range(TURNS):
        if before is not None:
            before(turn)
        r = clients[turn % len(clients)].chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice=CHOICES[turn],
            max_tokens=MAX_TOKENS,
            temperature=0,
            parallel_tool_calls=False,  # a random model would add calls for ever
        )
        assert r.choices[0].finish_reason in ("tool_calls", "stop"), (turn, r.choices[0])
        msg = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        assert calls, (turn, msg)  # forced: a call every turn
        for _, args in calls:
            json.loads(args)
        answers.append((msg.content or None, calls))
        usage.append(
            (
                r.usage.prompt_tokens,
                r.usage.prompt_tokens_details.cached_tokens,
                (r.model_extra or {}).get("kvmesh"),
            )
        )
        if turn == TURNS - 1:
            break
        # the ids are the test's own: both loops send byte-identical conversations
        ids = [f"call_{turn}_{i}" for i in range(len(calls))]
        messages.append(
            {
                "role": "assistant",
                "content": msg.content,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                    for i, (n, a) in zip(ids, calls, strict=True)
                ],
            }
        )
        for i in ids:
            messages.append({"role": "tool", "tool_call_id": i, "content": tool_result(turn)})
    return answers, usage, messages


def assert_reused(usage: list[tuple[int, int, Any]]) -> None:
    for turn, (n, cached, _) in enumerate(usage):
        assert n > 2000, (turn, n)
        if turn:
            assert cached >= 0.9 * n, (turn, cached, n, usage)


@pytest.fixture(scope="module")
def model() -> str:
    return str(zoo.tools_model())


@pytest.fixture(scope="module")
def peer(tmp_path_factory) -> Iterator[Peer]:
    p = Peer(alias="agents-peer", log_dir=tmp_path_factory.mktemp("logs"))
    yield p
    p.kill()


def client(h: Head) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def seeded(peer: Peer, model: str, alias: str) -> Head:
    h = Head("--seed", peer.address, "--exact-reuse-by-address", "--alias", alias, model=model)
    h.wait(lambda s: s["compatible_peers"] >= 1, timeout=60)
    return h


@pytest.fixture(scope="module")
def cache_off(model) -> Iterator[Head]:
    """No peer, nothing published, no session kept: every prompt computed."""
    h = Head("--no-publish", "--max-sessions", "0", "--alias", "off", model=model)
    yield h
    h.stop()


USER_A = "Find where the cache is flushed, then check the weather in Paris."
USER_B = "Find why the block store evicts too early and fix it."


def test_agent_loop_reuses_each_turn_same_answers_as_cache_off_and_after_restart(
    peer, model, cache_off
):
    off, off_usage, _ = run_loop([client(cache_off)], USER_A, model)
    assert all(cached == 0 for _, cached, _ in off_usage), off_usage

    first = seeded(peer, model, "first")
    try:
        on, on_usage, last = run_loop([client(first)], USER_A, model)
        first.wait(lambda s: s["publish_pending"] == 0, timeout=60)
    finally:
        first.stop()
    assert_reused(on_usage)
    assert on == off
    assert [n for n, _, _ in on_usage] == [n for n, _, _ in off_usage]

    # a restarted head: the last turn again, its prefix from the peer
    second = seeded(peer, model, "second")
    try:
        r = client(second).chat.completions.create(
            model=model,
            messages=last,
            tools=TOOLS,
            tool_choice=CHOICES[TURNS - 1],
            max_tokens=MAX_TOKENS,
            temperature=0,
            parallel_tool_calls=False,
        )
    finally:
        second.stop()
    n, cached = r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    assert n == on_usage[-1][0] and cached >= 0.9 * n, (cached, n)
    assert (r.model_extra or {})["kvmesh"]["source"] == "remote"
    calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert calls == on[-1][1]


def test_two_heads_behind_a_router_that_does_not_pin_sessions(peer, model, cache_off):
    """Turns alternate between two heads sharing one peer: each turn's new head finds
    the turn before it in the fleet (published by the other head: on the peer, or in
    its own store where placement put it), not in its session, and reuses at least
    90%; the answers are those of the head with the cache off."""
    off, _, _ = run_loop([client(cache_off)], USER_B, model)
    a, b = seeded(peer, model, "left"), seeded(peer, model, "right")
    heads = [a, b]
    try:
        # a router between two turns: the tool's run lets the last head publish
        def published(turn: int) -> None:
            heads[(turn - 1) % 2].wait(lambda s: s["publish_pending"] == 0, timeout=60)

        answers, usage, _ = run_loop([client(a), client(b)], USER_B, model, published)
    finally:
        for h in heads:
            h.stop()
    assert_reused(usage)
    assert answers == off
    # the turn before came from the fleet, not this head's session: fetched from the
    # peer, or from this head's own store where placement put the other head's publish
    sources = [rep["source"] for _, _, rep in usage[1:]]
    assert set(sources) <= {"remote", "local"}, sources
