"""Continuous batching (kvmesh/runtime/batch.py, Engine.decode_batch) with real
forward passes on real architectures, torch and mlx.

- One batched forward of several sequences of different lengths gives each the
  logits its own single-sequence forward gives (to float tolerance: batching, as in
  every batched server, may round differently), and leaves each state able to
  continue alone.
- A request running alone decodes bitwise as the engine does without batching.
- A short request submitted during a long generation finishes while the long one
  is still decoding; at most ``max_batch`` sequences run; a KV budget queues.
- A long prompt's prefill is chunked and running sequences keep decoding.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvmesh.engine import Sampling, load_engine
from kvmesh.engine.base import PREFILL_CHUNK, Decoded
from kvmesh.runtime.batch import PAD_TOKENS, STEP_FACTOR, forward_work_bytes
from kvmesh.runtime.head import Generation, HeadRuntime

from . import zoo

GREEDY = Sampling(max_tokens=6)
_engines: dict[tuple[str, str], object] = {}


def engine(kind: str, arch: str):
    if (kind, arch) not in _engines:
        if kind == "torch":
            _engines[kind, arch] = load_engine(str(zoo.hf_model(arch)), "torch")
        else:
            pytest.importorskip("mlx_lm")
            _engines[kind, arch] = load_engine(str(zoo.mlx_model(arch, "float32")), "mlx")
    return _engines[kind, arch]


def charge(eng, kv_bytes: int, n: int = 1, prompt: int = 0) -> int:
    """What a job counts against the KV budget (kvmesh.runtime.batch's contract):
    its KV with a step's working copy, and while it prefills its ``prompt`` one
    prefill forward's working memory (a chunk of it attending to all of it)."""
    work = forward_work_bytes(eng, min(PREFILL_CHUNK, prompt), prompt) if prompt else 0
    return int(kv_bytes * STEP_FACTOR) + n * PAD_TOKENS * eng.card.kv_bytes_per_token + work


def as_np(logits) -> np.ndarray:
    if isinstance(logits, torch.Tensor):
        return logits.float().cpu().numpy()
    return np.asarray(logits, dtype=np.float32)


CASES = [
    ("torch", "llama"),
    ("torch", "qwen2"),
    ("torch", "phi3"),
    ("mlx", "llama"),
    ("mlx", "qwen2"),
]


@pytest.mark.parametrize("kind, arch", CASES)
def test_a_batched_step_matches_each_sequence_alone(kind, arch):
    eng = engine(kind, arch)
    assert eng.batches
    toks = zoo.prompt_tokens(zoo.hf_model(arch), 90)
    lengths = (7, 40, 90)
    alone, batched = [], []
    for n in lengths:
        for out in (alone, batched):
            st = eng.prefill(toks[:n])
            st.tokens.append(int(np.argmax(as_np(st.logits))))
            out.append(st)
    for st in alone:
        eng.decode_batch([st])  # one state: the plain single-sequence forward
    eng.decode_batch(batched)
    for a, b in zip(alone, batched, strict=True):
        assert b.cached == a.cached == len(a.tokens)
        np.testing.assert_allclose(as_np(b.logits), as_np(a.logits), rtol=1e-4, atol=1e-4)
    # each continues alone from its rows, as its unbatched twin does
    for st in alone + batched:
        st.tokens.append(int(np.argmax(as_np(st.logits))))
        eng.decode_batch([st])
        eng.detach(st)
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_allclose(as_np(b.logits), as_np(a.logits), rtol=1e-4, atol=1e-4)


def test_sliding_window_models_decode_one_by_one_and_stay_exact():
    eng = engine("torch", "mistral")
    assert not eng.batches
    toks = zoo.prompt_tokens(zoo.hf_model("mistral"), 120)
    states = [eng.prefill(toks[:n]) for n in (30, 120)]
    twins = [eng.prefill(toks[:n]) for n in (30, 120)]
    for s in states + twins:
        s.tokens.append(3)
    eng.decode_batch(states)
    for t in twins:
        eng.decode_batch([t])
    for a, b in zip(states, twins, strict=True):
        assert torch.equal(a.logits, b.logits)


def runtime(kind="torch", arch="llama", **kw) -> HeadRuntime:
    return HeadRuntime(engine(kind, arch), **kw)


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_lone_request_decodes_exactly_as_the_engine_alone(kind):
    eng = engine(kind, "qwen2")
    h = runtime(kind, "qwen2")
    try:
        toks = zoo.prompt_tokens(zoo.hf_model("qwen2"), 50)
        for sampling in (Sampling(max_tokens=12), Sampling(max_tokens=12, temperature=0.8, seed=3)):
            got = h.complete(toks, sampling)
            want = Decoded()
            list(eng.generate(eng.prefill(toks), sampling, want))
            assert got.tokens == want.tokens and got.choices[0].text == want.text
    finally:
        h.close()


def _run(h: HeadRuntime, toks, sampling, out: Generation, started: threading.Event | None = None):
    def go():
        for _ in h.generate(toks, sampling, out):
            if started is not None:
                started.set()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_short_request_finishes_during_a_long_generation(kind):
    h = runtime(kind, "llama")
    try:
        toks = zoo.prompt_tokens(zoo.hf_model("llama"), 60)
        long_out, short_out = Generation(), Generation()
        started = threading.Event()
        long_t = _run(h, toks, Sampling(max_tokens=300, stop_on_eos=False), long_out, started)
        assert started.wait(60)
        short_t = _run(h, toks[:20], Sampling(max_tokens=3, stop_on_eos=False), short_out)
        short_t.join(60)
        decoded_when_short_done = len(long_out.tokens)
        assert short_out.tokens and short_out.choices[0].done
        assert decoded_when_short_done < 300  # the long one was still running
        long_t.join(120)
        assert len(long_out.tokens) == 300
        assert h.batch.peak_batch == 2 and h.batch.batched_tokens > 0
    finally:
        h.close()


def test_max_batch_and_the_kv_budget_bound_what_runs():
    toks = zoo.prompt_tokens(zoo.hf_model("llama"), 40)
    eng = engine("torch", "llama")
    for kw, bound in (
        ({"max_batch": 2}, 2),
        # each request may hold (40 + 20) tokens of KV, charged with a step's working
        # copy and its 40-token prefill forward: the budget fits three
        (
            {
                "max_batch": 8,
                "kv_budget_bytes": 3 * charge(eng, 60 * eng.card.kv_bytes_per_token, 1, 40),
            },
            3,
        ),
    ):
        h = runtime(**kw)
        try:
            outs = [Generation() for _ in range(6)]
            threads = [_run(h, toks, Sampling(max_tokens=20, stop_on_eos=False), o) for o in outs]
            for t in threads:
                t.join(120)
            assert all(len(o.tokens) == 20 for o in outs)
            assert 2 <= h.batch.peak_batch <= bound
        finally:
            h.close()


def test_a_prefills_working_memory_is_charged_until_its_prompt_is_computed():
    eng = engine("torch", "llama")
    per = eng.card.kv_bytes_per_token
    toks = zoo.prompt_tokens(zoo.hf_model("llama"), 1300)
    h = runtime(max_sessions=0)
    try:
        kv, sampling = per * (1300 + 300), Sampling(max_tokens=300, stop_on_eos=False)
        with_work, without = charge(eng, kv, 1, 1300), charge(eng, kv)
        assert with_work - without >= 512 * 1300 * 4  # a chunk's attention scores, at least
        assert h.batch.charge(kv, 1, 1300) == with_work  # the contract, as the runner counts
        # admitted with the work: charged while its 1,300 tokens are computed ...
        seen: list[int] = []
        out = Generation()
        t = threading.Thread(
            target=lambda: list(
                h.generate(toks, sampling, out, on_token=lambda: seen.append(h.batch.held_bytes))
            ),
            daemon=True,
        )
        t.start()
        t.join(300)
        assert len(out.tokens) == 300
        # ... and from its first token on only its KV (with a step's working copy)
        assert seen and set(seen) == {without}
        assert h.batch.held_bytes == 0
        # a budget that fits its KV but not its prefill forward refuses it at once
        small = runtime(max_sessions=0, kv_budget_bytes=with_work - 1)
        try:
            with pytest.raises(ValueError, match="kv-budget"):
                small.complete(toks, sampling)
        finally:
            small.close()
    finally:
        h.close()


def test_n_sequences_share_one_prefill_and_decode_in_one_batch():
    h = runtime()
    try:
        toks = zoo.prompt_tokens(zoo.hf_model("llama"), 30)
        out = h.complete(toks, Sampling(max_tokens=8, temperature=0.9, seed=5, n=3))
        assert len(out.choices) == 3 and all(len(c.tokens) == 8 for c in out.choices)
        assert out.report.computed_tokens == len(toks)  # one prefill for the three
        assert h.batch.peak_batch == 3
        with pytest.raises(ValueError, match="max-batch"):
            runtime(max_batch=2).complete(toks, Sampling(max_tokens=2, n=3))
    finally:
        h.close()


def test_a_long_prefill_is_chunked_while_others_decode():
    eng = engine("torch", "llama")
    h = runtime()
    try:
        toks = zoo.prompt_tokens(zoo.hf_model("llama"), 1300)
        running, started = Generation(), threading.Event()
        t = _run(h, toks[:20], Sampling(max_tokens=400, stop_on_eos=False), running, started)
        assert started.wait(60)
        steps_before = len(running.tokens)
        long = h.complete(toks, Sampling(max_tokens=1))
        steps_during = len(running.tokens) - steps_before
        t.join(120)
        # 1300 tokens in 512-token chunks: the running request decoded between chunks
        assert steps_during >= 2
        want = eng.prefill(toks)
        assert long.tokens == [int(np.argmax(as_np(want.logits)))]
    finally:
        h.close()
