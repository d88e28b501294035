"""Prompt log-probabilities: each prompt token's log-probability given the tokens
before it, and the most likely alternatives there (``/v1/completions`` with
``echo`` and ``logprobs``).

They need every position's logits, which only a forward makes, so scoring runs on
a fresh cache of its own (:meth:`~kvmesh.engine.protocol.Engine.prompt_scorer`)
and reuses nothing cached. The forward runs :data:`SCORE_CHUNK` positions at a
time (the logits held at once are ``SCORE_CHUNK x vocab`` floats); ``lock`` is
held one chunk at a time, so running streams decode between chunks.

Values are the raw logits' log-softmax in float32 (before temperature and
penalties), as :meth:`~kvmesh.engine.protocol.Engine.logprob` reports generated
tokens'; the first token has none.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .decode import TokenLogprob
from .protocol import Engine

SCORE_CHUNK = 512  # positions per forward: bounds the logits held at once


def prompt_logprobs(
    engine: Engine,
    tokens: Sequence[int],
    top: int = 0,
    lock: Any = None,
    cancel: threading.Event | None = None,
    chunk: int = SCORE_CHUNK,
    adapter: str | None = None,
) -> list[TokenLogprob | None]:
    """Per token of ``tokens``: its log-probability after the tokens before it and
    the ``top`` most likely tokens there (most likely first); None for the first.
    ``lock`` (the engine lock) is held for each chunk's forward; ``cancel`` set
    stops before the next chunk (raising :class:`Cancelled`). ``adapter``: with
    that LoRA adapter (:meth:`~kvmesh.engine.protocol.Engine.load_adapter`)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        return []
    out: list[TokenLogprob | None] = [None]
    score = engine.prompt_scorer(adapter)
    lock = lock or contextlib.nullcontext()
    n = len(tokens)
    for start in range(0, n - 1, chunk):  # the last position predicts nothing in the prompt
        if cancel is not None and cancel.is_set():
            raise Cancelled()
        stop = min(start + chunk, n - 1)
        targets = tokens[start + 1 : stop + 1]
        with lock:
            token_lp, top_ids, top_lp = score(tokens[start:stop], targets, top)
        out.extend(_rows(token_lp, top_ids, top_lp, targets))
    return out[: len(tokens)]


class Cancelled(Exception):
    """The caller stopped waiting (its client left)."""


def _rows(
    token_lp: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray, targets: Sequence[int]
) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            int(t),
            float(token_lp[r]),
            tuple((int(j), float(v)) for j, v in zip(top_ids[r], top_lp[r], strict=True)),
        )
        for r, t in enumerate(targets)
    ]
