"""The ids of the last few chat prompts rendered, by what was rendered, for a little while.

vLLM's router (``cache_aware``, ``kv_aware``) renders a chat request on every worker
(``/v1/chat/completions/render``) and then sends it to one, which renders the same
messages again: templating and tokenizing a long agent prompt twice, the second time
on the request's path to its first token. :class:`PromptMemo` keeps the ids of the
last :data:`ENTRIES` renders for :data:`TTL_S` seconds, keyed by a digest of the
template's input (the messages as templated and the tools) and the caller's chain
root (a tenant's and ``cache_salt``'s: whether another tenant sent the same
messages is never told by a render's speed), so the second render is a lookup.
The ids are a pure function of that input and the model's tokenizer,
so a hit is the same answer; the time bound keeps a template that reads the clock
(a date line) from serving an old day's prompt. Memory is bounded: at most
:data:`ENTRIES` prompts, each at most a context's ids. Thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

ENTRIES = 32
TTL_S = 30.0


class PromptMemo:
    """See the module. :meth:`ids` answers from the memo (calling ``on_hit``) or
    computes and keeps."""

    def __init__(
        self,
        on_hit: Callable[[], object] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kept: OrderedDict[bytes, tuple[float, tuple[int, ...]]] = OrderedDict()
        self._on_hit, self._clock = on_hit, clock
        self._lock = threading.Lock()

    def ids(
        self,
        root: bytes | None,
        msgs: list[dict[str, Any]],
        tools: Any,
        render: Callable[[], list[int]],
    ) -> list[int]:
        """``render()``'s ids for ``msgs`` and ``tools``: kept ones when the same were
        rendered for the same chain ``root`` within :data:`TTL_S`, else computed now
        and kept (an error is raised, never kept). Input that is not JSON is
        rendered, never kept."""
        key = _key(root, msgs, tools)
        if key is None:
            return render()
        now = self._clock()
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and now - kept[0] <= TTL_S:
                self._kept.move_to_end(key)
            else:
                kept = None
        if kept is not None:
            self._on_hit()
            return list(kept[1])
        ids = render()
        with self._lock:
            self._kept[key] = (now, tuple(ids))
            self._kept.move_to_end(key)
            while len(self._kept) > ENTRIES:
                self._kept.popitem(last=False)
        return ids


def _key(root: bytes | None, msgs: list[dict[str, Any]], tools: Any) -> bytes | None:
    try:
        text = json.dumps([msgs, tools], sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    h = hashlib.blake2b(b"-" if root is None else b"+" + root, digest_size=32)
    h.update(text.encode())
    return h.digest()
