"""No one request or client stalls, starves or outgrows the head (issue 21: findings
1, 3, 4 and 7), on a real engine with real forward passes.

- A temperature so small that dividing by it overflows (1e-40) samples greedily
  and leaves the streams running beside it with exactly their text alone.
- A sequence whose sampling raises fails its own request only; a failing fork
  fails its own request only; the engine thread keeps serving.
- If the engine thread dies anyway, every waiting and running request fails with
  EngineFailed, later requests are refused at once, and the head says why.
- Fair shares: a one-token request of a second client finishes while an ``n=8``
  generation that fills the batch has decoded under a fifth of its tokens.
- The KV budget: a request whose worst case can never fit is refused before it
  runs; a long sequence is never padded together with short ones.

Outcomes are asserted in tokens and states, never in wall-clock time.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvmesh.engine import Sampling, load_engine
from kvmesh.engine.sampling import distribution, greedy
from kvmesh.runtime import batch as batch_module
from kvmesh.runtime.batch import PAD_SLACK, PAD_TOKENS, EngineFailed, OverBudget
from kvmesh.runtime.head import Generation, HeadRuntime

from . import zoo

_engine: list = []


def engine():
    if not _engine:
        _engine.append(load_engine(str(zoo.hf_model("llama")), "torch"))
    return _engine[0]


def toks(n: int) -> list[int]:
    return zoo.prompt_tokens(zoo.hf_model("llama"), n)


def run(h: HeadRuntime, tokens, sampling: Sampling, client: str = "", started=None):
    """A request on its own thread: returns (thread, Generation, errors)."""
    out, errors = Generation(), []

    def go() -> None:
        try:
            for _ in h.generate(
                tokens, sampling, out, client=client, on_start=started.set if started else None
            ):
                pass
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out, errors


def texts(out: Generation) -> list[list[int]]:
    return [list(c.tokens) for c in out.choices]


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6, float("nan")])
def test_sampling_never_produces_nan(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32) * 30
    p = distribution(logits, temperature, 0.9)
    assert p is None  # below 1e-5 (and NaN): greedy, never a division by it
    assert greedy(logits) == int(np.argmax(logits))
    for t, top_p in ((1e-5, 1.0), (2.0, 1e-9), (1e-4, 0.5)):
        p = distribution(logits, t, top_p)
        assert p is not None and np.isfinite(p).all() and abs(p.sum() - 1) < 1e-9
    bad = logits.copy()
    bad[3], bad[5] = np.nan, np.inf
    assert greedy(bad) == 5 and distribution(bad, 1.0, 1.0)[5] == 1.0


def test_a_tiny_temperature_among_running_streams_changes_nothing():
    # one sequence a forward (the clients take turns): texts exact on every CPU
    h = HeadRuntime(engine(), publish=False, max_sessions=0, max_batch=1)
    try:
        long = Sampling(max_tokens=40, stop_on_eos=False)
        alone = h.complete(toks(50), long)
        started = threading.Event()
        t1, first, e1 = run(h, toks(50), long, "a", started)
        assert started.wait(60)
        t2, tiny, e2 = run(
            h, toks(30), Sampling(max_tokens=20, temperature=1e-40, stop_on_eos=False), "b"
        )
        t3, later, e3 = run(h, toks(50), long, "c")
        for t in (t1, t2, t3):
            t.join(120)
        assert not (e1 or e2 or e3)
        assert texts(first) == texts(alone) == texts(later)
        greedy_alone = h.complete(toks(30), Sampling(max_tokens=20, stop_on_eos=False))
        assert texts(tiny) == texts(greedy_alone)
    finally:
        h.close()


def test_a_request_whose_sampling_raises_fails_alone(monkeypatch):
    eng = engine()
    h = HeadRuntime(eng, publish=False, max_sessions=0, max_batch=1)  # exact texts, any CPU
    real = type(eng).sample

    def sample(self, logits, sampling, rng, counts=None):
        if sampling.seed == 666:
            raise FloatingPointError("poisoned request")
        return real(self, logits, sampling, rng, counts)

    monkeypatch.setattr(type(eng), "sample", sample)
    try:
        long = Sampling(max_tokens=30, stop_on_eos=False)
        alone = h.complete(toks(40), long)
        started = threading.Event()
        t1, first, e1 = run(h, toks(40), long, "a", started)
        assert started.wait(60)
        t2, _, e2 = run(h, toks(20), Sampling(max_tokens=30, seed=666), "b")
        t2.join(60)
        t3, later, e3 = run(h, toks(40), long, "c")
        for t in (t1, t3):
            t.join(120)
        assert isinstance(e2[0], FloatingPointError) and not e1 and not e3
        assert texts(first) == texts(alone) == texts(later)
        assert h.engine_failure is None and h.batch.running == 0
    finally:
        h.close()


def test_a_failing_fork_fails_its_request_and_the_engine_goes_on(monkeypatch):
    eng = engine()
    h = HeadRuntime(eng, publish=False, max_sessions=0)

    def fork(self, state):
        raise MemoryError("no room for another sequence")

    try:
        with monkeypatch.context() as m:
            m.setattr(type(eng), "fork", fork)
            with pytest.raises(MemoryError):
                h.complete(toks(20), Sampling(max_tokens=4, n=2, temperature=1.0, seed=1))
        out = h.complete(toks(20), Sampling(max_tokens=4, n=2, temperature=1.0, seed=1))
        assert [len(c.tokens) for c in out.choices] == [4, 4]
        assert h.engine_failure is None
    finally:
        h.close()


def test_if_the_engine_thread_dies_every_request_fails_and_nothing_hangs(monkeypatch):
    eng = engine()
    h = HeadRuntime(eng, publish=False, max_sessions=0, max_batch=1)
    try:
        started = threading.Event()
        t1, running, e1 = run(
            h, toks(20), Sampling(max_tokens=5000, stop_on_eos=False), "a", started
        )
        assert started.wait(60)
        t2, _, e2 = run(h, toks(20), Sampling(max_tokens=3), "a")  # waits: one per batch
        while h.batch.waiting == 0 or not running.tokens:
            t2.join(0.01)

        def broken(running, max_batch):
            raise RuntimeError("a bug in the scheduler")

        monkeypatch.setattr(batch_module, "_chosen", broken)
        for t in (t1, t2):
            t.join(60)
            assert not t.is_alive()
        assert isinstance(e1[0], EngineFailed) and isinstance(e2[0], EngineFailed)
        assert 0 < len(running.tokens) < 5000
        assert isinstance(h.engine_failure, RuntimeError)
        with pytest.raises(EngineFailed, match="scheduler"):
            h.complete(toks(20), Sampling(max_tokens=2))
    finally:
        h.close()


def test_a_second_client_is_not_starved_by_one_that_fills_the_batch():
    h = HeadRuntime(engine(), publish=False, max_sessions=0, max_batch=8)
    try:
        started = threading.Event()
        big = Sampling(max_tokens=150, n=8, temperature=0.8, seed=3, stop_on_eos=False)
        t1, hog, e1 = run(h, toks(40), big, "hog", started)
        assert started.wait(60)
        t2, small, e2 = run(h, toks(20), Sampling(max_tokens=1), "other")
        t2.join(120)
        decoded = sum(len(c.tokens) for c in hog.choices)  # when the small one was done
        assert not e2 and len(small.tokens) == 1
        t1.join(300)
        assert not e1 and all(len(c.tokens) == 150 for c in hog.choices)
        assert decoded < 0.2 * 8 * 150, decoded
        assert h.batch.peak_resident == 9 and h.batch.peak_batch <= 8
    finally:
        h.close()


def test_a_long_sequence_is_never_padded_with_short_ones():
    h = HeadRuntime(engine(), publish=False, max_sessions=0, max_batch=8)
    try:
        started = threading.Event()
        short = Sampling(max_tokens=40, stop_on_eos=False)
        threads = [run(h, toks(10 + i), short, f"c{i}", started) for i in range(7)]
        assert started.wait(60)
        long = run(h, toks(1200), Sampling(max_tokens=20, stop_on_eos=False), "long")
        for t, out, errors in [*threads, long]:
            t.join(300)
            assert not errors and out.tokens
        padding, real, rows = h.batch.peak_padding
        assert rows >= 2 and padding <= PAD_SLACK * real + PAD_TOKENS * rows
        assert padding < 1000  # the 1200-token sequence never shared a forward with a short one
    finally:
        h.close()


def test_a_request_that_can_never_fit_the_budget_is_refused_before_it_runs():
    eng = engine()
    per = eng.card.kv_bytes_per_token
    h = HeadRuntime(eng, publish=False, kv_budget_bytes=4096 * per)
    try:
        with pytest.raises(OverBudget, match="kv-budget"):
            h.complete(toks(100), Sampling(max_tokens=2000, n=2))
        assert h.batch.held_bytes == 0 and h.batch.steps == 0
        out = h.complete(toks(100), Sampling(max_tokens=4))
        assert len(out.tokens) == 4
        assert 0 < h.batch.held_bytes <= 4096 * per  # the kept session holds its share
    finally:
        h.close()


def poison(monkeypatch, eng, seed: int = 666) -> None:
    """Sampling raises for the sequences of requests seeded ``seed`` (choice 0)."""
    real = type(eng).sample

    def sample(self, logits, sampling, rng, counts=None):
        if sampling.seed == seed:
            raise FloatingPointError("poisoned request")
        return real(self, logits, sampling, rng, counts)

    monkeypatch.setattr(type(eng), "sample", sample)


def test_a_failing_choice_ends_its_siblings_without_touching_the_engine(monkeypatch):
    eng = engine()
    h = HeadRuntime(eng, publish=False, max_sessions=0)
    poison(monkeypatch, eng)
    try:  # choice 0 raises; choice 1 would end on this very step (max_tokens=1)
        with pytest.raises(FloatingPointError):
            h.complete(toks(20), Sampling(max_tokens=1, seed=666, n=2, stop_on_eos=False))
        assert h.engine_failure is None and h.batch.running == 0
        assert len(h.complete(toks(20), Sampling(max_tokens=2)).tokens) == 2
    finally:
        h.close()


def test_failures_during_another_prompts_chunked_prefill_change_no_stream(monkeypatch):
    eng = engine()
    h = HeadRuntime(eng, publish=False, max_sessions=0)
    h.batch.prefill_chunk = 8  # b's 60-token prefill runs in chunks between z's steps
    poison(monkeypatch, eng)
    try:
        alone = h.complete(toks(5), Sampling(max_tokens=20, stop_on_eos=False))
        started = threading.Event()
        t0, first, e0 = run(h, toks(5), Sampling(max_tokens=20, stop_on_eos=False), "z", started)
        assert started.wait(60)
        t1, _, e1 = run(h, toks(5), Sampling(max_tokens=1, seed=666, n=2, stop_on_eos=False), "a")
        # z always decodes alone (a fails at its first step, b ends on its prefill's
        # logits), so its text is exact on every CPU
        t2, chunked, e2 = run(h, toks(60), Sampling(max_tokens=1, stop_on_eos=False), "b")
        for t in (t0, t1, t2):
            t.join(120)
        assert isinstance(e1[0], FloatingPointError) and not e0 and not e2
        assert texts(first) == texts(alone) and chunked.report.source == "compute"
        assert chunked.report.fallback is None and h.engine_failure is None
        assert h.batch.prefill_forwards >= 60 // 8  # b was computed in chunks
    finally:
        h.close()


def test_a_fair_share_follows_issued_keys_and_addresses_never_claims():
    import pytest

    from kvmesh.api.credentials import BadCredentials, Credentials

    def raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    issued = "the-key-the-head-issued"
    keyless = Credentials()  # a head without keys: an SDK's dummy key is no claim
    made_up = {
        keyless.identify(raw({"X-API-Key": f"made-up-{i}"}), "10.0.0.5").share for i in range(5)
    }
    assert made_up == {"host:10.0.0.5"}  # new keys and new connections are one client
    keyed = Credentials({issued: None})
    with pytest.raises(BadCredentials):  # a head with keys refuses one it never issued
        keyed.identify(raw({"X-API-Key": "made-up-0"}), "10.0.0.5")
    assert keyed.identify(raw({}), "10.0.0.5").share == "host:10.0.0.5"
    mine = keyed.identify(raw({"Authorization": f"Bearer {issued}"}), "10.0.0.5").share
    assert mine.startswith("key:") and issued not in mine
