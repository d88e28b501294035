"""The batch runner's prefill rules: which prompts share the next prefill forward
(:class:`PrefillOrder`), and how a prompt takes whole blocks another job of its
chain root computed (:class:`PrefixSharing`).

Order: the prompt with the fewest tokens left goes first (one passed over for
:data:`STARVE_TURNS` forwards goes before it), computing at most ``chunk`` of
its tokens; beside it, up to ``max_rows`` prompts whose next chunks are within
``PAD_SLACK`` of its length and whose positions pad within the rule, while the
forward holds at most ``max_tokens``. A prompt alone on the engine (nothing
decoding, prefilling or waiting beside it: nobody waits between its chunks)
computes up to :data:`LONE_PREFILL` tokens a forward, as many as this engine's
measured prefill speed computes in :data:`LONE_FORWARD_S` (so a request arriving
meanwhile waits no longer than that, or one chunk), when the KV budget holds that
forward's working memory: each forward's fixed cost is paid less often.

Sharing: a job takes the longest run of whole blocks (``card.block_tokens``)
beyond its own prefix that a job of the same root holds (a crop: the producer's
very bytes), or waits, unscheduled, at most :data:`SHARE_WAIT_S` for a
prefilling producer to compute them. A producer that leaves first hands on the
whole blocks it computed; the waiter then looks again or computes the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine.base import Engine, KVState
from .jobs import Job, PrefillPlan
from .kvbudget import PAD_SLACK, KVBudget, pads_within

log = logging.getLogger("kvmesh.batch")

SHARE_WAIT_S = 60.0  # the longest a job waits for another's prefill of their common blocks
# A prefill forward takes more prompts while it holds at most this many tokens: past
# this, batching a CPU's forward saves nothing and delays the first prompt's first token.
PREFILL_BATCH_TOKENS = 256
STARVE_TURNS = 8  # a prompt passed over for this many prefill forwards goes next
# a lone prompt's forward (see the module): vLLM-CPU's serving default, its
# max_num_batched_tokens; measured on the fleet's model (2-core EPYC), a cold
# 1,574-token turn 40-45 ms in 512-token chunks, 26-32 ms in one forward
LONE_PREFILL = 2048
LONE_FORWARD_S = 0.1  # the longest a lone prompt's wider forward is expected to take
SPEED_FROM = 128  # prompt tokens in a forward that measures the prefill speed


class LoneForward:
    """How wide a lone prompt's forward may be (see the module): at most ``most``
    tokens, about as many as this runner's measured prefill speed computes in
    ``seconds`` (none until one of its forwards was measured)."""

    def __init__(self, most: int, seconds: float = LONE_FORWARD_S) -> None:
        self.most, self.seconds = most, seconds
        self._per_token = 0.0  # seconds a prompt token took, a moving average

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= SPEED_FROM and seconds > 0:  # a short forward's is its fixed cost
            now = seconds / tokens
            self._per_token = now if not self._per_token else 0.7 * self._per_token + 0.3 * now

    def width(self) -> int:
        """The most tokens a lone prompt's next forward computes (0: not measured)."""
        if not self._per_token:
            return 0
        return min(self.most, int(self.seconds / self._per_token))

    def widen(self, pre: Prefilling, chunks: list[int], budget: KVBudget) -> int:
        """``pre``, alone on the engine, computes up to :meth:`width` tokens in its
        next forward (``chunks[0]``) when ``budget`` holds that forward's working
        memory. Returns the bytes reserved for it (to give back after)."""
        q = min(pre.left, self.width())
        if q <= chunks[0]:
            return 0
        extra = budget.widen(pre.job, q)  # None: the budget lacks it
        chunks[0] = q if extra is not None else chunks[0]
        return extra or 0


Running = Sequence[tuple[KVState, bytes | None]]  # resident sequences: (state, chain root)


@dataclass(eq=False)
class Prefilling:
    """A job whose prompt is being computed."""

    job: Job
    plan: PrefillPlan
    since: int = 0  # the prefill forward count when it was planned or last advanced
    producer: Prefilling | None = None  # whose prefill of ``want`` positions it waits for
    want: int = 0
    deadline: float = 0.0
    restarted: bool = False  # its fallback was used

    @property
    def left(self) -> int:
        return len(self.plan.state.tokens) - self.plan.state.cached


@dataclass(frozen=True)
class PrefillOrder:
    """Which prompts the next prefill forward computes (see the module docstring)."""

    chunk: int  # most tokens of one prompt in one forward
    max_rows: int
    max_tokens: int  # most tokens in a forward of several prompts
    batches: bool  # the engine runs several prompts in one forward

    def next_chunk(self, pre: Prefilling) -> int:
        return min(pre.left, self.chunk)

    def lead(self, ready: list[Prefilling], forwards: int) -> Prefilling:
        """The prompt with the fewest tokens left (the first listed at a tie: arrival
        order), unless one was passed over too long."""
        starved = [p for p in ready if forwards - p.since >= STARVE_TURNS]
        if starved:
            return min(starved, key=lambda p: p.since)
        return min(ready, key=lambda p: p.left)

    def group(self, ready: list[Prefilling], forwards: int) -> tuple[list[Prefilling], list[int]]:
        """The next prompt and those that share its forward, and the chunk each of
        them computes."""
        lead = self.lead(ready, forwards)
        group, chunks = [lead], [self.next_chunk(lead)]
        if not self.batches:
            return group, chunks
        for pre in sorted(ready, key=lambda p: p.left):
            if len(group) >= self.max_rows:
                break
            n = self.next_chunk(pre)
            qs = [*chunks, n]
            if pre is lead or max(qs) > (1 + PAD_SLACK) * min(qs):
                continue
            if len(qs) * max(qs) > self.max_tokens:
                break
            if pads_within([p.plan.state.cached for p in [*group, pre]], qs):
                group.append(pre)
                chunks.append(n)
        return group, chunks


class PrefixSharing:
    """Prompts continuing from other jobs' states (see the module docstring). Runs
    on the engine thread; ``lock`` is the engine lock."""

    def __init__(self, engine: Engine, lock: AbstractContextManager[Any], enabled: bool) -> None:
        self.engine = engine
        self.lock = lock
        self.enabled = enabled  # never with max_batch 1: each prompt computes as if alone
        self.shared_tokens = 0  # prompt positions taken from another job's state
        self.waits = 0  # jobs that waited for another's prefill of their common blocks
        self.rescued_tokens = 0  # of shared_tokens, those of a producer that left

    def find(self, pre: Prefilling, prefilling: list[Prefilling], running: Running) -> None:
        """Take the longest run of whole blocks another job of ``pre``'s root holds
        beyond ``pre``'s own prefix, or wait for a prefilling one to compute it."""
        root, state = pre.plan.share, pre.plan.state
        if root is None or not self.enabled:
            return
        b = self.engine.card.block_tokens
        cap = (len(state.tokens) - 1) // b * b  # at least one token is computed
        sources: list[tuple[KVState, Prefilling | None, int]] = [
            (p.plan.state, p, len(p.plan.state.tokens))
            for p in prefilling
            if p is not pre and p.producer is None and p.job._root == root
        ]
        sources += [(st, None, st.cached) for st, r in running if r == root]
        best: tuple[int, bool, KVState, Prefilling | None] | None = None
        for src, producer, upto in sources:
            m = min(common_prefix(src.tokens[:upto], state.tokens) // b * b, cap)
            key = (m, src.cached >= m)  # the longest; at a tie, one that holds it now
            if m > state.cached and (best is None or key > best[:2]):
                best = (m, src.cached >= m, src, producer)
        if best is None:
            return
        m, ready, src, producer = best
        if ready:
            self.share(pre, src, m)
        elif producer is not None:  # a running state holds all it has: only a prefill waits
            pre.producer, pre.want = producer, m
            pre.deadline = time.monotonic() + SHARE_WAIT_S
            self.waits += 1

    def settle(self, prefilling: list[Prefilling], running: Running) -> None:
        """Jobs whose producer computed what they wait for take it; those whose
        producer left without it (failed, cancelled, started over) or took too long
        look again, or compute it themselves."""
        now = time.monotonic()
        for pre in list(prefilling):
            producer = pre.producer
            if producer is None:
                continue
            src = producer.plan.state
            want = pre.want
            if src.cached >= want and src.tokens[:want] == pre.plan.state.tokens[:want]:
                pre.producer = None
                self.share(pre, src, want)
            elif producer not in prefilling or producer.producer is not None or now > pre.deadline:
                pre.producer = None
                if now <= pre.deadline:
                    self.find(pre, prefilling, running)

    def share(self, pre: Prefilling, src: KVState, m: int) -> bool:
        """``pre`` continues from the first ``m`` positions of ``src``."""
        try:
            with self.lock:
                state = self.engine.begin_resume(src, m, pre.plan.state.tokens)
                self.engine.detach(state)  # its own tensors, never a view of a batch
        except Exception as e:  # the prompt is computed as it was planned
            log.warning("sharing a prefix failed: %r", e)
            return False
        m = state.cached  # a recurrent state restarts from its last checkpoint
        state.imported_tokens, state.computed_tokens = m, len(state.tokens) - m
        pre.plan.state, pre.plan.shared = state, m
        self.shared_tokens += m
        return True

    def abandon(self, gone: Prefilling, prefilling: list[Prefilling], running: Running) -> None:
        """``gone`` leaves before its prompt is computed (cancelled, failed): the jobs
        waiting for its blocks take the whole blocks it holds (computed by
        successful forwards, or brought), then look for another producer or compute
        the rest; its plan hears of what it holds (the head keeps those blocks)."""
        src, b = gone.plan.state, self.engine.card.block_tokens
        have = src.cached // b * b
        now = time.monotonic()
        for pre in [p for p in prefilling if p.producer is gone]:
            pre.producer = None
            m = min(pre.want, have)
            mine = pre.plan.state
            if m > mine.cached and src.tokens[:m] == mine.tokens[:m] and self.share(pre, src, m):
                self.rescued_tokens += m
            if now <= pre.deadline:
                self.find(pre, prefilling, running)  # another job may hold or compute more
        if gone.plan.abandoned is not None and src.cached:
            try:
                gone.plan.abandoned(src)
            except Exception as e:  # keeping its blocks is optional
                log.warning("keeping an abandoned prefill failed: %r", e)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n
