"""The batch runner's KV budget: what a job is charged while admitted, what other
holders (the head's kept sessions) reserve, and the padding rule every batched
forward keeps.

A job of ``n`` sequences is charged its KV at their longest (each fork holds its
own copy); for an engine that batches, ``STEP_FACTOR`` times that plus
``PAD_TOKENS`` a sequence (a step's padded working copy, the old and the new copy
alive together when the group changes). Until its prompt is computed it is also
charged its largest prefill forward's working memory (:func:`forward_work_bytes`),
given back once prefilled. A forward batches only rows whose padding stays within
``PAD_SLACK`` of their real tokens plus ``PAD_TOKENS`` a row.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..compat import dtype_size
from ..engine.base import Engine
from .jobs import Job

PAD_SLACK = 0.25  # a forward's padding stays within 25% of its real KV ...
PAD_TOKENS = 256  # ... plus this many tokens a sequence (short chats stay one batch)
STEP_FACTOR = 2.0 + PAD_SLACK  # a sequence's KV + its padded working copy in a step


@dataclass(frozen=True)
class Geometry:
    heads: int  # query heads
    hidden: int
    intermediate: int
    itemsize: int  # bytes of one activation


def model_geometry(engine: Engine) -> Geometry:
    """What sizes a forward's activations: the loaded model's config where the
    engine has one (transformers' ``model.config``, mlx-lm's ``model.args``), else
    a guess from the card that errs high (8 query heads a KV head, an MLP 4 times
    the hidden size)."""
    card = engine.card
    model = getattr(engine, "model", None)
    cfg = getattr(model, "config", None) or getattr(model, "args", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)

    def read(name: str) -> int:
        v = getattr(cfg, name, None)
        return v if isinstance(v, int) and v > 0 else 0

    kv_heads = max((g.kv_heads for g in card.geometry), default=0) or 1
    head_dim = max((g.head_dim for g in card.geometry), default=0) or 128
    heads = read("num_attention_heads") or 8 * kv_heads
    hidden = read("hidden_size") or heads * head_dim
    intermediate = read("intermediate_size") or 4 * hidden
    size = getattr(getattr(engine, "dtype", None), "itemsize", None)
    itemsize = size if isinstance(size, int) and size > 0 else dtype_size(card.kv_dtype)
    return Geometry(heads, hidden, intermediate, itemsize)


def forward_work_bytes(engine: Engine, q: int, ctx: int, geometry: Geometry | None = None) -> int:
    """Memory a forward of ``q`` prompt tokens attending to ``ctx`` positions holds
    beside the KV, an estimate that errs high (an engine's own
    ``forward_work_bytes(q, ctx)`` is taken when it has one): one layer's attention
    scores and their mask (attention with a mask on the CPU materialises them: a
    score a head and a mask byte per query-key pair), the layer's activations
    (hidden states, Q/K/V/O, the MLP's three), and a second copy of one layer's KV
    while the cache grows by concatenation. Computing a prompt in one forward holds
    the scores of all of it at once: chunks keep this bounded by ``q``."""
    own = getattr(engine, "forward_work_bytes", None)
    if callable(own):
        return int(own(q, ctx))
    g = geometry or model_geometry(engine)
    card = engine.card
    scores = q * ctx * (g.heads * g.itemsize + 1)
    acts = q * (4 * g.hidden + 3 * g.intermediate) * g.itemsize
    layer = ctx * card.kv_bytes_per_token // max(1, card.num_layers)
    return scores + acts + layer


def pads_within(pasts: Sequence[int], chunks: Sequence[int]) -> bool:
    """Whether rows of ``pasts`` cached positions, computing ``chunks`` more, pad
    (cached positions right-aligned, chunks after them) within the rule."""
    widths = [max(pasts) + max(chunks)] * len(pasts)  # what the padded batch holds
    real = [n + q for n, q in zip(pasts, chunks, strict=True)]
    padding = sum(widths) - sum(real)
    return padding <= PAD_SLACK * sum(real) + PAD_TOKENS * len(real)


class KVBudget:
    """The budget's books: bytes charged to admitted jobs and reserved by others.
    Guarded by the runner's condition ``cv`` (admission reads them under it)."""

    def __init__(
        self, engine: Engine, budget_bytes: int | None, prefill_chunk: int, cv: threading.Condition
    ) -> None:
        self.engine = engine
        self.budget_bytes = budget_bytes  # None: no budget
        self.prefill_chunk = prefill_chunk
        self.cv = cv
        self.held = 0  # charged to admitted jobs
        self.reserved = 0  # held by others (sessions) against the same budget
        self._geometry = model_geometry(engine)  # for forward_work_bytes

    def charge(self, kv_bytes: int, n: int = 1, prompt_tokens: int | None = None) -> int:
        """What a job of ``n`` sequences holding ``kv_bytes`` of KV in all counts
        against the budget while it prefills its ``prompt_tokens`` (None: as many
        as ``kv_bytes`` holds): its KV (with a step's working copy) and its
        :meth:`prefill_work`."""
        work = self.prefill_work(kv_bytes, n, prompt_tokens)
        if not self.engine.batches:
            return kv_bytes + work
        pad = n * PAD_TOKENS * self.engine.card.kv_bytes_per_token
        return int(kv_bytes * STEP_FACTOR) + pad + work

    def prefill_work(self, kv_bytes: int, n: int = 1, prompt_tokens: int | None = None) -> int:
        """The working memory of a job's largest prefill forward: one chunk of its
        prompt attending to all of it (:func:`forward_work_bytes`). A prompt whose
        length is not given is taken to fill its ``kv_bytes``."""
        ctx = self._context(kv_bytes, n, prompt_tokens)
        if ctx <= 0:
            return 0
        q = min(self.prefill_chunk, ctx)
        return forward_work_bytes(self.engine, q, ctx, self._geometry)

    def _context(self, kv_bytes: int, n: int, prompt_tokens: int | None) -> int:
        if prompt_tokens is not None:
            return prompt_tokens
        return kv_bytes // max(1, n * self.engine.card.kv_bytes_per_token)

    def widen(self, job: Job, q: int) -> int | None:
        """Reserve what a forward of ``q`` of ``job``'s prompt tokens needs beyond
        the prefill work it was charged: the bytes reserved (:meth:`unreserve`
        them after the forward), or None when the budget lacks them."""
        ctx = self._context(job.kv_bytes, job.sampling.n, job.prompt_tokens)
        need = forward_work_bytes(self.engine, q, max(ctx, q), self._geometry)
        extra = max(0, need - job._work)
        return extra if self.reserve(extra) else None

    def job_charge(self, job: Job) -> tuple[int, int]:
        """``job``'s charge and, of it, its prefill forwards' working memory."""
        args = (job.kv_bytes, job.sampling.n, job.prompt_tokens)
        return self.charge(*args), self.prefill_work(*args)

    def reserve(self, nbytes: int) -> bool:
        """Hold ``nbytes`` for something else; False when they do not fit."""
        with self.cv:
            budget = self.budget_bytes
            if budget is not None and self.held + self.reserved + nbytes > budget:
                return False
            self.reserved += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        with self.cv:
            self.reserved -= nbytes
            self.cv.notify()

    def short(self, need: int) -> int:
        """Under ``cv``: how many bytes ``need`` lacks (0 without a budget)."""
        return need - self.free() if self.budget_bytes is not None else 0

    def free(self) -> int:
        assert self.budget_bytes is not None
        return self.budget_bytes - self.held - self.reserved

    def fits(self, need: int, alone: bool) -> bool:
        """Under ``cv``: whether a job charged ``need`` may start now; ``alone`` (no
        other job admitted or resident) it runs whatever reservations hold."""
        return self.budget_bytes is None or need <= self.free() or alone

    def take(self, job: Job, need: int, work: int) -> None:
        """Under ``cv``: charge an admitted ``job``."""
        self.held += need
        job._charged, job._work = need, work

    def release(self, job: Job) -> None:
        """Give back all of ``job``'s charge."""
        with self.cv:
            self.held -= job._charged
            job._charged = job._work = 0

    def unwork(self, job: Job) -> None:
        """Give back the part of ``job``'s charge its prefill forwards needed."""
        with self.cv:
            self.held -= job._work
            job._charged -= job._work
            job._work = 0
