"""The chat prompt memo (kvmesh/api/prompt_memo.py): the same template input within
its time is one render; anything else renders; it never holds more than its entries.
The head's own use (a router's render, then the chat) is in tests/test_tokenize.py."""

from __future__ import annotations

import pytest

from kvmesh.api.prompt_memo import ENTRIES, TTL_S, PromptMemo

MSGS = [{"role": "user", "content": "hello"}]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def counting(ids: list[int]):
    calls: list[int] = []

    def render() -> list[int]:
        calls.append(1)
        return list(ids)

    return render, calls


def test_the_same_input_within_its_time_is_rendered_once():
    hits: list[int] = []
    clock = Clock()
    memo = PromptMemo(lambda: hits.append(1), clock)
    render, calls = counting([1, 2, 3])
    assert memo.ids(None, MSGS, None, render) == [1, 2, 3]
    got = memo.ids(None, [dict(m) for m in MSGS], None, render)  # equal, not the same objects
    assert got == [1, 2, 3] and len(calls) == 1 and len(hits) == 1
    got.append(9)  # a caller's list is its own
    assert memo.ids(None, MSGS, None, render) == [1, 2, 3]
    clock.t += TTL_S + 1
    assert memo.ids(None, MSGS, None, render) == [1, 2, 3] and len(calls) == 2


def test_other_messages_tools_or_chain_roots_are_rendered_anew():
    memo = PromptMemo()
    render, calls = counting([7])
    memo.ids(None, MSGS, None, render)
    memo.ids(None, MSGS, [{"type": "function", "function": {"name": "f"}}], render)
    memo.ids(None, [{"role": "user", "content": "hello!"}], None, render)
    memo.ids(None, [{"role": "system", "content": "hello"}], None, render)
    memo.ids(b"tenant-root", MSGS, None, render)  # another tenant's: its own
    memo.ids(b"tenant-root", MSGS, None, render)
    assert len(calls) == 5


def test_it_keeps_at_most_its_entries_the_oldest_going_first():
    memo = PromptMemo()
    render, calls = counting([1])
    for i in range(ENTRIES + 1):
        memo.ids(None, [{"role": "user", "content": str(i)}], None, render)
    memo.ids(None, [{"role": "user", "content": str(ENTRIES)}], None, render)  # kept
    assert len(calls) == ENTRIES + 1
    memo.ids(None, [{"role": "user", "content": "0"}], None, render)  # dropped
    assert len(calls) == ENTRIES + 2


def test_a_failed_render_or_input_that_is_not_json_is_never_kept():
    memo = PromptMemo()

    def refuses() -> list[int]:
        raise ValueError("the template refused")

    with pytest.raises(ValueError):
        memo.ids(None, MSGS, None, refuses)
    render, calls = counting([4])
    assert memo.ids(None, MSGS, None, render) == [4]
    odd = [{"role": "user", "content": object()}]
    memo.ids(None, odd, None, render)
    memo.ids(None, odd, None, render)
    assert len(calls) == 3
