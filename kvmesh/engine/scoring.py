"""Prompt log-probabilities: each prompt token's log-probability given the tokens
before it, and the most likely alternatives there (``/v1/completions`` with
``echo`` and ``logprobs``, what lm-evaluation-harness scores answers with).

What it costs: one full forward over the whole prompt, with logits at every
position, on a fresh cache of its own: **nothing cached is reused**. A cached
prefix (a session, local or imported blocks) holds keys and values, not the
logits of its positions, and those logits need every position's hidden state,
which only the forward makes. So scoring ``P`` prompt tokens costs a prefill of
``P`` tokens computed from nothing (plus a ``P x vocab`` log-softmax), whatever
the cache holds; the generation that follows (``max_tokens`` > 0) still takes
its prefix from the cache as any request does, so an echoed request computes its
prompt at most twice, never more. Recording every prompt token's logprob in
published blocks instead would tax every published prefill by 40-52% (the LM head
at every position) to save work only where echoes are about a third of all
prefills (``bench/echo_cost.py``). The forward runs in chunks of
``SCORE_CHUNK`` positions (each on the cache of the chunks before it): the logits
held at once are ``SCORE_CHUNK x vocab`` floats, never the whole prompt's, and
with ``lock`` given the lock is held for one chunk at a time, so running streams
decode between chunks as they do between prefill chunks.

Values are the raw logits' log-softmax in float32 (before temperature and
penalties), as :meth:`kvmesh.engine.base.Engine.logprob` reports generated
tokens'; the first token has none (nothing precedes it), as OpenAI and vLLM say.
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
) -> list[TokenLogprob | None]:
    """Per token of ``tokens``: its log-probability after the tokens before it and
    the ``top`` most likely tokens there (most likely first); None for the first.
    ``lock`` (the engine lock) is held for each chunk's forward; ``cancel`` set
    stops before the next chunk (raising :class:`Cancelled`)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        return []
    out: list[TokenLogprob | None] = [None]
    run = _torch_chunks if engine.name == "torch" else _mlx_chunks
    for lps in run(engine, tokens, top, lock or contextlib.nullcontext(), cancel, chunk):
        out.extend(lps)
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


def _torch_chunks(
    engine: Any,
    tokens: list[int],
    top: int,
    lock: Any,
    cancel: threading.Event | None,
    chunk: int,
) -> Any:
    import torch
    from transformers import DynamicCache

    model = engine.model
    cache = DynamicCache(config=model.config)
    kw_name = getattr(engine, "_cache_kw", "past_key_values")
    n = len(tokens)
    for start in range(0, n - 1, chunk):  # the last position predicts nothing in the prompt
        if cancel is not None and cancel.is_set():
            raise Cancelled()
        stop = min(start + chunk, n - 1)
        with lock, torch.inference_mode():
            ids = torch.tensor([tokens[start:stop]], dtype=torch.long, device=engine.device)
            logits = model(
                input_ids=ids, use_cache=True, logits_to_keep=0, **{kw_name: cache}
            ).logits[0]
            lp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(tokens[start + 1 : stop + 1], device=lp.device)
            token_lp = lp.gather(1, targets[:, None])[:, 0].cpu().numpy()
            if top > 0:
                vals, idx = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
                top_ids, top_lp = idx.cpu().numpy(), vals.cpu().numpy()
            else:
                top_ids = top_lp = np.zeros((stop - start, 0))
        yield _rows(token_lp, top_ids, top_lp, tokens[start + 1 : stop + 1])


def _mlx_chunks(
    engine: Any,
    tokens: list[int],
    top: int,
    lock: Any,
    cancel: threading.Event | None,
    chunk: int,
) -> Any:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(engine.model)
    n = len(tokens)
    for start in range(0, n - 1, chunk):
        if cancel is not None and cancel.is_set():
            raise Cancelled()
        stop = min(start + chunk, n - 1)
        with lock:
            logits = engine.model(mx.array([tokens[start:stop]]), cache=cache)[0]
            logits = logits.astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets = mx.array(tokens[start + 1 : stop + 1])
            token_lp = mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
            if top > 0:
                k = min(top, lp.shape[-1])
                idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
                vals = mx.take_along_axis(lp, idx, axis=-1)
                mx.eval(token_lp, idx, vals)
                order = np.argsort(-np.asarray(vals), axis=-1, kind="stable")
                top_ids = np.take_along_axis(np.asarray(idx), order, axis=-1)
                top_lp = np.take_along_axis(np.asarray(vals), order, axis=-1)
            else:
                mx.eval(token_lp)
                top_ids = top_lp = np.zeros((stop - start, 0))
            token_np = np.asarray(token_lp)
        yield _rows(token_np, top_ids, top_lp, tokens[start + 1 : stop + 1])
