"""Batched prefill (Engine.prefill_batch) and prefill interleaved with decoding
(kvmesh/runtime/batch.py), with real forward passes on real architectures.

- One forward of several prompts' chunks (different cached lengths, different
  chunk lengths) gives each prompt the logits of its own unbatched prefill, to the
  tolerance the batched-decode tests use, and each state then decodes on alone as
  its unbatched twin does. One state alone is bitwise the single-sequence path;
  engines that cannot batch (sliding windows, mlx) loop and stay exact.
- A short prompt submitted while a long prompt is being prefilled gets its first
  token after one of the long prompt's chunks, not after all of them; both answer
  exactly as alone (each prefilled alone, in the same chunks).
- Two short prompts prefilled together share forwards and answer as alone
  (greedy); a batched forward that raises is retried one prompt at a time and
  fails only the prompt whose own forward fails.

Outcomes are asserted in tokens, positions and counters, never in wall-clock time.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvmesh.engine import Sampling
from kvmesh.engine.base import Decoded
from kvmesh.runtime.batch import BatchRunner, Job, PrefillPlan
from kvmesh.runtime.head import Generation, HeadRuntime
from kvmesh.runtime.kvbudget import forward_work_bytes
from kvmesh.runtime.prefill import SPEED_FROM

from . import zoo
from .test_batch import engine  # one loaded engine per (kind, arch) for both files


def as_np(logits) -> np.ndarray:
    if isinstance(logits, torch.Tensor):
        return logits.float().cpu().numpy()
    return np.asarray(logits, dtype=np.float32)


def close(a, b) -> None:
    np.testing.assert_allclose(as_np(a), as_np(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kind, arch", [("torch", "llama"), ("torch", "qwen2"), ("torch", "phi3"), ("mlx", "llama")]
)
def test_several_prompts_in_one_forward_match_each_alone(kind, arch):
    eng = engine(kind, arch)
    toks = zoo.prompt_tokens(zoo.hf_model(arch), 200)
    prompts = [toks[:90], toks[10:200], toks[:7]]
    alone = [eng.prefill(p) for p in prompts]
    states = [eng.begin_prefill(p) for p in prompts]
    eng.prefill_batch(states[:2], [40, 40])  # two fresh prompts, equal chunks
    eng.prefill_batch(states, [50, 100, 7])  # cached 40, 40, 0; chunks of three lengths
    eng.prefill_batch(states[1:2], [50])  # alone: the single-sequence forward
    for a, b in zip(alone, states, strict=True):
        assert b.cached == a.cached == len(a.tokens)
        close(b.logits, a.logits)
        assert int(np.argmax(as_np(b.logits))) == int(np.argmax(as_np(a.logits)))
    for st in alone + states:  # each decodes on from its own rows
        st.tokens.append(int(np.argmax(as_np(st.logits))))
        eng.decode_batch([st])
    for a, b in zip(alone, states, strict=True):
        close(b.logits, a.logits)


@pytest.mark.parametrize("kind, arch", [("torch", "qwen2"), ("torch", "mistral")])
def test_one_prompt_alone_and_engines_that_cannot_batch_stay_bitwise(kind, arch):
    eng = engine(kind, arch)
    toks = zoo.prompt_tokens(zoo.hf_model(arch), 150)
    want = [eng.prefill(toks[:n], between=lambda: None, chunk=64) for n in (150, 60)]
    states = [eng.begin_prefill(toks[:n]) for n in (150, 60)]
    if eng.batches:  # one state alone: the single-sequence path, in the same chunks
        for st in states:
            while st.cached < len(st.tokens):
                eng.prefill_batch([st], [min(64, len(st.tokens) - st.cached)])
    else:  # sliding windows: prefill_batch runs them one after another
        eng.prefill_batch(states, [64, 60])
        eng.prefill_batch(states[:1], [64])
        eng.prefill_batch(states[:1], [22])
    for a, b in zip(want, states, strict=True):
        assert torch.equal(a.logits, b.logits)


def test_a_chunk_past_the_prompt_is_refused_before_any_forward():
    eng = engine("torch", "llama")
    toks = zoo.prompt_tokens(zoo.hf_model("llama"), 30)
    states = [eng.begin_prefill(toks), eng.begin_prefill(toks[:10])]
    for chunks in ([30, 11], [0, 5], [31, 10]):
        with pytest.raises(ValueError, match="chunk"):
            eng.prefill_batch(states, chunks)
    with pytest.raises(ValueError, match="one chunk per state"):
        eng.prefill_batch(states[:1], [1, 2])
    assert [s.cached for s in states] == [0, 0]


def _job(eng, tokens, sampling, on_token=None) -> Job:
    """A job whose prefill is the engine's own, nothing imported."""
    return Job(
        sampling,
        [Decoded()],
        lambda: PrefillPlan(eng.begin_prefill(tokens)),
        eng.card.kv_bytes_per_token * (len(tokens) + sampling.max_tokens),
        on_token=on_token,
    )


def test_a_short_prompt_is_answered_between_a_long_prompts_chunks():
    eng = engine("torch", "llama")
    toks = zoo.prompt_tokens(zoo.hf_model("llama"), 1300)
    lock = threading.RLock()
    runner = BatchRunner(eng, lock, prefill_chunk=64)
    try:
        greedy = Sampling(max_tokens=4, stop_on_eos=False)
        seen: list[int] = []  # the long prompt's computed positions at the short one's token
        long_plan: list[PrefillPlan] = []

        def long_prefill() -> PrefillPlan:
            long_plan.append(PrefillPlan(eng.begin_prefill(toks)))
            return long_plan[0]

        kv = eng.card.kv_bytes_per_token * 1400
        long = Job(greedy, [Decoded()], long_prefill, kv)
        short = _job(eng, toks[:20], greedy, lambda: seen.append(long_plan[0].state.cached))
        with lock:  # both are queued before the engine computes anything
            runner.submit(long)
            runner.submit(short)
        long_tokens, short_tokens = list(long.tokens()), list(short.tokens())
        # the short prompt was computed (fewest tokens left first) at most after the
        # long one's first chunk (the one under way when it came), never its 21st
        assert seen[0] in (0, 64)
        assert runner.peak_prefill_batch == 1  # 20 and 64 tokens never share a forward
        for tokens, got in ((toks, long_tokens), (toks[:20], short_tokens)):
            want = Decoded()
            prefilled = eng.prefill(tokens, between=lambda: None, chunk=64)
            list(eng.generate(prefilled, greedy, want))
            assert got == want.tokens  # prefilled alone, decoded alone or batched: greedy
    finally:
        runner.close()


def test_concurrent_prompts_share_prefill_forwards_and_answer_as_alone():
    eng = engine("torch", "qwen2")
    h = HeadRuntime(eng, publish=False, max_sessions=0)
    try:
        toks = zoo.prompt_tokens(zoo.hf_model("qwen2"), 400)
        # no common block (nothing shared); 60 and 70 tokens: within the padding rule
        prompts = [toks[:60], toks[200:260], toks[100:170]]
        greedy = Sampling(max_tokens=6, stop_on_eos=False)
        alone = [h.complete(p, greedy).tokens for p in prompts]
        outs, started = [Generation() for _ in prompts], threading.Event()
        with h._lock:  # the engine lock: the first waits for it, the others queue behind
            threads = [_generate(h, prompts[0], greedy, outs[0], on_start=started.set)]
            assert started.wait(60)
            threads += [_generate(h, prompts[i], greedy, outs[i]) for i in (1, 2)]
            _until(lambda: h.batch.waiting == 2)
        for t in threads:
            t.join(120)
        assert [o.tokens for o in outs] == alone
        # the first alone; the other two were admitted together and share forwards
        assert h.batch.peak_prefill_batch == 2 and h.batch.shared_tokens == 0
        assert all(o.report.computed_tokens == len(p) for o, p in zip(outs, prompts, strict=True))
    finally:
        h.close()


def _generate(h: HeadRuntime, tokens, sampling, out: Generation, **kw) -> threading.Thread:
    t = threading.Thread(target=lambda: list(h.generate(tokens, sampling, out, **kw)), daemon=True)
    t.start()
    return t


def _until(cond, limit: float = 60.0) -> None:
    """Wait (a hang guard, not a time assertion) until ``cond()``."""
    done = threading.Event()
    while not cond() and limit > 0:
        done.wait(0.01)
        limit -= 0.01
    assert cond()


def test_a_failing_batched_prefill_fails_only_the_prompt_whose_own_forward_fails():
    eng = engine("torch", "llama")
    toks = zoo.prompt_tokens(zoo.hf_model("llama"), 120)
    bad = toks[:20] + [10**6] + toks[21:100]  # no such token: its embedding lookup raises
    h = HeadRuntime(eng, publish=False, max_sessions=0)
    h.batch.prefill_chunk = 40
    try:
        greedy = Sampling(max_tokens=4, stop_on_eos=False)
        want = h.complete(toks[:100], greedy).tokens
        outs, errors, started = [Generation(), Generation()], [], threading.Event()

        def bad_request() -> None:
            try:
                list(h.generate(bad, greedy, outs[1], client="b"))
            except Exception as e:
                errors.append(e)

        # the good one computes its first 40 tokens alone, then its next 40 share a
        # forward with the bad one's first 40
        with h._lock:
            threads = [_generate(h, toks[:100], greedy, outs[0], on_start=started.set)]
            assert started.wait(60)
            threads.append(threading.Thread(target=bad_request, daemon=True))
            threads[-1].start()
            _until(lambda: h.batch.waiting == 1)
        for t in threads:
            t.join(120)
        # the shared forward raised; each alone: the good one answers as alone (every
        # chunk of it computed alone), the bad one starts over from nothing (its
        # fallback), fails again (beside the good one's steps riding it: that forward
        # too is retried each alone), and ends
        retried = 2 if eng.rides else 1
        assert h.batch.prefill_retries == retried and h.batch.peak_prefill_batch == 1
        assert outs[0].tokens == want and isinstance(errors[0], IndexError)
        assert h.engine_failure is None
        assert h.batch.prefilling == h.batch.running == 0 and h.batch.held_bytes == 0
        assert h.complete(toks[:30], greedy).tokens  # the engine goes on
    finally:
        h.close()


def test_a_prompt_alone_is_computed_in_one_forward_when_its_budget_holds_it():
    """Nothing decodes or waits beside a lone prompt, so nobody waits between its
    chunks: once the runner has measured a forward, it computes the prompt in one
    forward of up to ``lone.most`` tokens (as many as its speed computes in
    ``lone.seconds``), with the answer its chunks give; a KV budget that holds the
    chunked forward but not the whole one keeps it chunked (the wider forward's
    working memory is reserved, then given back)."""
    eng = engine("torch", "llama")
    toks = zoo.prompt_tokens(zoo.hf_model("llama"), 300)
    greedy = Sampling(max_tokens=4, stop_on_eos=False)
    h = HeadRuntime(eng, publish=False, max_sessions=0, prefill_chunk=SPEED_FROM)
    h.batch.lone.seconds = 3600.0  # any speed: the width is what is tested here
    try:
        first = h.complete(toks, greedy)  # no forward measured yet: one chunk, then the rest
        assert (h.batch.prefill_forwards, h.batch.peak_prefill_chunk) == (2, 300 - SPEED_FROM)
        assert h.complete(toks, greedy).tokens == first.tokens
        assert (h.batch.prefill_forwards, h.batch.peak_prefill_chunk) == (3, 300)
        h.batch.lone.seconds = 1e-9  # a forward that long computes less than a chunk
        assert h.complete(toks, greedy).tokens == first.tokens
        assert h.batch.prefill_forwards == 3 + 3  # ceil(300 / 128)
        assert h.batch.held_bytes == 0  # nothing left reserved
        kv = h._kv_bytes(len(toks), greedy)
        charge, work = h.batch.charge(kv, 1, len(toks)), h.batch.prefill_work(kv, 1, len(toks))
    finally:
        h.close()
    assert forward_work_bytes(eng, 300, 300) > work
    tight = HeadRuntime(
        eng, publish=False, max_sessions=0, prefill_chunk=SPEED_FROM, kv_budget_bytes=charge + 1
    )
    tight.batch.lone.seconds = 3600.0
    try:
        for _ in range(2):  # the second after a measured forward: still chunked
            assert tight.complete(toks, greedy).tokens == first.tokens
        assert (tight.batch.prefill_forwards, tight.batch.peak_prefill_chunk) == (6, SPEED_FROM)
    finally:
        tight.close()
