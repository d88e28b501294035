"""Prefix-aware scheduling (kvmesh/runtime/batch.py, "Shared prefixes"): requests
that share whole blocks which neither has cached compute them once, on a real
engine with real forward passes.

- The later request waits (unscheduled) for the earlier one's prefill of their
  common whole blocks, takes them from its state, computes only the rest (beside
  the earlier one's last chunk, in one forward), and both answer as alone.
- A request reuses the whole blocks of one still decoding.
- Never across chain roots (tenants), never with ``max_batch`` 1 (answers bitwise
  as alone, whatever runs beside them).
- If the earlier request is cancelled (or fails) while the later one waits, the
  later one takes the whole blocks it did compute and computes only the rest; the
  cancellation is counted as ``prefilling``. A cancelled prompt's computed blocks
  are kept in the head's store (the next request for them imports them).

Outcomes are asserted in tokens and reports, never in wall-clock time.
"""

from __future__ import annotations

import threading

from kvmesh.blocks import chain_root, tenant_root
from kvmesh.engine import Sampling, load_engine
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.head import CacheScope, Generation, HeadRuntime
from kvmesh.runtime.telemetry import Count

from . import zoo

_engine: list = []
GREEDY = Sampling(max_tokens=6, stop_on_eos=False)
CHUNK = 64  # the head's prefill chunk here: the 256 common tokens take four


def engine():
    if not _engine:
        _engine.append(load_engine(str(zoo.hf_model("qwen2")), "torch"))
    return _engine[0]


def prompts() -> tuple[list[int], list[int]]:
    """Two prompts with 256 tokens (8 blocks of 32) in common, then 40 of their own."""
    assert engine().card.block_tokens == 32
    toks = zoo.prompt_tokens(zoo.hf_model("qwen2"), 500)
    return toks[:296], toks[:256] + toks[400:440]


def head(**kw) -> HeadRuntime:
    h = HeadRuntime(engine(), publish=False, max_sessions=0, **kw)
    h.batch.prefill_chunk = CHUNK
    return h


def start(h: HeadRuntime, tokens, out: Generation, **kw) -> threading.Thread:
    t = threading.Thread(target=lambda: list(h.generate(tokens, GREEDY, out, **kw)), daemon=True)
    t.start()
    return t


def queued_together(h: HeadRuntime, a, b, kw_a=None, kw_b=None):
    """Request ``a`` takes the engine first; ``b`` is queued before ``a``'s first
    forward (the engine lock is held until both are in)."""
    outs, started = (Generation(), Generation()), threading.Event()
    kw_a = {"client": "a", **(kw_a or {})}
    kw_b = {"client": "b", **(kw_b or {})}
    with h._lock:
        threads = [start(h, a, outs[0], on_start=started.set, **kw_a)]
        assert started.wait(60)  # ``a`` is admitted, waiting for the lock to import
        threads.append(start(h, b, outs[1], **kw_b))
        _until(lambda: h.batch.waiting == 1)
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    return outs


def alone(tokens) -> list[int]:
    h = head()
    try:
        return h.complete(tokens, GREEDY).tokens
    finally:
        h.close()


def test_a_common_prefix_is_computed_once_and_both_answer_as_alone():
    a, b = prompts()
    h = head()
    try:
        out_a, out_b = queued_together(h, a, b)
        assert out_a.report.source == "compute" and out_a.report.computed_tokens == 296
        # b came in after a's first 64-token chunk, waited for all 256 common tokens
        assert out_b.report.source == "session" and out_b.report.reused_tokens == 256
        assert out_b.report.computed_tokens == 40 and h.batch.shared_tokens == 256
        assert h.batch.share_waits == 1
        assert h.batch.peak_prefill_batch == 2  # their last 40 tokens in one forward
        assert out_a.tokens == alone(a) and out_b.tokens == alone(b)
    finally:
        h.close()


def test_a_request_reuses_the_blocks_of_one_still_decoding():
    a, b = prompts()
    h = head()
    try:
        cancel, first = threading.Event(), threading.Event()
        out_a, out_b = Generation(), Generation()
        long = Sampling(max_tokens=10_000, stop_on_eos=False)

        def decode_a() -> None:
            for _ in h.generate(a, long, out_a, cancel, client="a"):
                first.set()

        t = threading.Thread(target=decode_a, daemon=True)
        t.start()
        assert first.wait(60)
        start(h, b, out_b, client="b").join(120)
        cancel.set()
        t.join(60)
        assert out_b.report.reused_tokens == 256 and out_b.report.computed_tokens == 40
        assert h.batch.share_waits == 0  # a decoding state holds its prompt: no wait
        assert out_b.tokens == alone(b)
    finally:
        h.close()


def test_tenants_never_share_and_max_batch_one_computes_each_alone():
    a, b = prompts()
    ns = engine().card.namespace
    alice, bob = (
        CacheScope(chain_root(ns, tenant_root(b"secret", t)), t) for t in ("alice", "bob")
    )
    for kw, scopes in (({}, (alice, bob)), ({"max_batch": 1}, (None, None))):
        h = head(**kw)
        try:
            out_a, out_b = queued_together(h, a, b, {"scope": scopes[0]}, {"scope": scopes[1]})
            assert h.batch.shared_tokens == 0
            assert out_a.report.reused_tokens == out_b.report.reused_tokens == 0
            assert out_a.tokens == alone(a) and out_b.tokens == alone(b)
            if kw:  # nothing batched: each answer is bitwise its lone answer
                assert h.batch.peak_prefill_batch == 1 and h.batch.peak_batch == 1
        finally:
            h.close()


def test_a_cancelled_producer_hands_its_computed_blocks_to_the_waiting_request():
    a, b = prompts()
    h = head()
    try:
        gone = threading.Event()
        # a is cancelled as b is admitted: b first waits on a's 64 computed
        # tokens (two blocks), then finds a gone before its next chunk and takes them
        out_a, out_b = queued_together(h, a, b, {"cancel": gone}, {"on_start": gone.set})
        assert out_a.cancelled and not out_a.tokens
        assert out_b.report.reused_tokens == 64 and out_b.report.computed_tokens == 296 - 64
        assert h.batch.share_waits == 1 and h.batch.shared_tokens == 64
        assert h.batch.share_rescued_tokens == 64
        assert h.telemetry.counters["cancelled:prefilling"] == 1
        assert "cancelled:queued" not in h.telemetry.counters
        assert h.batch.prefilling == 0 and h.batch.held_bytes == 0
        assert out_b.tokens == alone(b)
    finally:
        h.close()


def long_prompts() -> tuple[list[int], list[int]]:
    """Two prompts with 1,024 tokens (32 blocks) in common, then 40 of their own."""
    toks = zoo.prompt_tokens(zoo.hf_model("qwen2"), 1200, seed=3)
    return toks[:1064], toks[:1024] + toks[1100:1140]


class LeavesAfter(threading.Event):
    """A client that leaves once ``forwards`` prefill forwards have run: the engine
    thread reads it between forwards, so the request is cancelled before its next
    chunk, and ``done`` is the prompt tokens computed by then."""

    def __init__(self, h: HeadRuntime, forwards: int) -> None:
        super().__init__()
        self.h, self.forwards, self.done = h, forwards, -1

    def is_set(self) -> bool:
        if not super().is_set() and self.h.batch.prefill_forwards >= self.forwards:
            self.done = self.h.batch.prefill_tokens
            self.set()
        return super().is_set()


def test_a_producer_cancelled_midway_leaves_its_blocks_to_its_waiter():
    a, b = long_prompts()
    h = head()
    try:
        # b is queued as a starts, waits for a's 1,024 common tokens after a's first
        # chunk; a's client leaves after its sixth
        gone = LeavesAfter(h, 6)
        out_a, out_b = queued_together(h, a, b, {"cancel": gone})
        assert out_a.cancelled and not out_a.tokens and gone.done == 6 * CHUNK
        assert h.batch.share_waits == 1 and h.batch.share_rescued_tokens == 6 * CHUNK
        # the waiter's cached tokens are every block a computed before it left
        assert out_b.report.reused_tokens == 6 * CHUNK
        assert out_b.report.computed_tokens == len(b) - 6 * CHUNK
        assert h.telemetry.counters["cancelled:prefilling"] == 1
        assert out_b.tokens == alone(b)
    finally:
        h.close()


def test_a_failing_producer_leaves_its_blocks_to_its_waiter(monkeypatch):
    a, b = long_prompts()
    h = head()
    eng = engine()
    real = type(eng).prefill_batch
    failed_at: list[int] = []

    def prefill_batch(self, states, chunks):
        # a's forwards fail from its 257th position on, every time: its restart
        # (computing from nothing) fails there too
        for st, n in zip(states, chunks, strict=True):
            if st.tokens == a and st.cached + n > 256:
                failed_at.append(st.cached)
                raise MemoryError("a's forward failed")
        return real(self, states, chunks)

    monkeypatch.setattr(type(eng), "prefill_batch", prefill_batch)
    try:
        outs, errors, started = (Generation(), Generation()), [], threading.Event()

        def run_a() -> None:
            try:
                list(h.generate(a, GREEDY, outs[0], on_start=started.set, client="a"))
            except MemoryError as e:
                errors.append(e)

        with h._lock:  # b is queued before a's first forward (as in queued_together)
            t_a = threading.Thread(target=run_a, daemon=True)
            t_a.start()
            assert started.wait(60)
            t_b = start(h, b, outs[1], client="b")
            _until(lambda: h.batch.waiting == 1)
        for t in (t_a, t_b):
            t.join(120)
            assert not t.is_alive()
        assert errors and failed_at == [256, 256]  # failed, started over, failed again
        # b waited for a, then took the 256 tokens a's second try had computed
        assert h.batch.share_waits == 1 and h.batch.share_rescued_tokens == 256
        assert outs[1].report.reused_tokens == 256
        assert outs[1].report.computed_tokens == len(b) - 256
        monkeypatch.undo()
        assert outs[1].tokens == alone(b)
    finally:
        h.close()


def test_a_cancelled_prompts_computed_blocks_are_kept_in_the_store():
    a, _ = long_prompts()
    node = NodeThread(NodeConfig(listen="127.0.0.1:0", alias="keeper", gossip_interval=0.3, ttl=2))
    h = HeadRuntime(engine(), node, max_sessions=0)
    h.batch.prefill_chunk = h.batch.lone.most = CHUNK  # chunked though alone
    try:
        gone, out = LeavesAfter(h, 5), Generation()
        start(h, a, out, cancel=gone, client="a").join(120)
        assert out.cancelled and not out.tokens and gone.done == 5 * CHUNK
        assert h.telemetry.counters["cancelled:prefilling"] == 1
        h.flush()
        assert h.telemetry.counters[Count.PARTIAL_BLOCKS] == 5 * CHUNK // 32
        again = h.complete(a, GREEDY)  # imports them from the store
        assert again.report.source == "local" and again.report.reused_tokens == 5 * CHUNK
        assert again.report.computed_tokens == len(a) - 5 * CHUNK
        assert again.tokens == alone(a)
    finally:
        h.close()
        node.close()


def _until(cond, limit: float = 60.0) -> None:
    """Wait (a hang guard, not a time assertion) until ``cond()``."""
    pause = threading.Event()
    while not cond() and limit > 0:
        pause.wait(0.01)
        limit -= 0.01
    assert cond()
