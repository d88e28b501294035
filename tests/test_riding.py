"""Decode steps riding a prompt's prefill forward (kvmesh/engine/packed.py,
``Engine.prefill_riding``, the batch runner's riding turn), real forwards on real
architectures.

- One packed forward of a prompt's chunk (continuing its cache, or from nothing)
  and several sequences' steps gives each the logits and KV its own forward gives
  (to float tolerance: another row count may take another kernel), and every
  state continues alone from it.
- Only where that holds: sliding windows, recurrent states, a prefill grid, mlx
  compute one after the other (``rides`` False), with the separate forwards' bits.
- A packed forward that raises leaves every state as it was.
- In the head, steps of running sequences ride a prompt's chunks: the running
  stream keeps decoding, the prompt answers as alone, ``/metrics`` counts them.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvmesh.engine import Sampling, load_engine
from kvmesh.runtime.head import Generation, HeadRuntime

from . import zoo

_engines: dict[str, object] = {}


def engine(arch: str, **kw):
    key = f"{arch}{sorted(kw.items())}"
    if key not in _engines:
        _engines[key] = load_engine(str(zoo.hf_model(arch)), **kw)
    return _engines[key]


def decoding(eng, toks, n: int):
    """A state of ``toks[:n]`` with its next (greedy) token pending."""
    st = eng.prefill(toks[:n])
    st.tokens.append(int(torch.argmax(st.logits)))
    return st


def close(a, b) -> None:
    np.testing.assert_allclose(a.float().numpy(), b.float().numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("past", [0, 33])
def test_a_riding_forward_matches_each_forward_alone(arch, past):
    eng = engine(arch)
    assert eng.rides
    toks = zoo.prompt_tokens(zoo.hf_model(arch), 120)
    prompt = toks[:80]

    def begun():
        st = eng.prefill(prompt[:past]) if past else None
        return eng.begin_resume(st, past, prompt) if st else eng.begin_prefill(prompt)

    riders = [decoding(eng, toks[50:], n) for n in (5, 31, 64)]
    twins = [eng.fork(r) for r in riders]
    alone, packed = begun(), begun()
    eng.prefill_batch([alone], [40])
    for t in twins:
        eng.decode_batch([t])  # each its own single-sequence forward
    eng.prefill_riding(packed, 40, riders)
    assert packed.cached == alone.cached == past + 40
    close(packed.logits, alone.logits)
    for a, b in zip(packed.cache.layers, alone.cache.layers, strict=True):
        assert a.keys.shape == b.keys.shape
        close(a.keys, b.keys)
        close(a.values, b.values)
    for r, t in zip(riders, twins, strict=True):
        assert r.cached == t.cached == len(t.tokens)
        close(r.logits, t.logits)
    # each continues alone from what the packed forward left, as its twin does
    eng.prefill_batch([packed], [len(prompt) - packed.cached])
    eng.prefill_batch([alone], [len(prompt) - alone.cached])
    close(packed.logits, alone.logits)
    for r, t in zip(riders, twins, strict=True):
        for st in (r, t):
            st.tokens.append(int(torch.argmax(t.logits)))
            eng.decode_batch([st])
        close(r.logits, t.logits)


@pytest.mark.parametrize(
    "arch, kw",
    [("gemma3", {}), ("mistral", {}), ("qwen3_5", {}), ("llama", {"deterministic_grid": 64})],
    ids=["sliding", "sliding-all", "recurrent", "deterministic"],
)
def test_engines_that_cannot_pack_compute_one_after_the_other_bitwise(arch, kw):
    eng = engine(arch, **kw)
    assert not eng.rides
    toks = zoo.prompt_tokens(zoo.hf_model(arch), 140)
    riders = [decoding(eng, toks, n) for n in (9, 70)]
    twins = [eng.fork(r) for r in riders]
    p, q = eng.begin_prefill(toks[:64]), eng.begin_prefill(toks[:64])
    eng.prefill_riding(p, 64, riders)
    eng.prefill_batch([q], [64])
    eng.decode_batch(twins)
    assert torch.equal(p.logits, q.logits)
    for r, t in zip(riders, twins, strict=True):
        assert r.cached == t.cached and torch.equal(r.logits, t.logits)


def test_a_riding_forward_that_raises_leaves_every_state_as_it_was():
    eng = engine("llama")
    toks = zoo.prompt_tokens(zoo.hf_model("llama"), 100)
    riders = [decoding(eng, toks, n) for n in (12, 40)]
    prompt = eng.begin_resume(eng.prefill(toks[:20]), 20, toks[:60])
    before = [
        (st.cached, st.logits, [(ly.keys, ly.values) for ly in st.cache.layers])
        for st in (prompt, *riders)
    ]

    def fail(*_):
        raise RuntimeError("layer 1 fails")

    hook = eng.model.model.layers[1].register_forward_hook(fail)  # after layer 0 stored its KV
    try:
        with pytest.raises(RuntimeError, match="layer 1 fails"):
            eng.prefill_riding(prompt, 40, riders)
    finally:
        hook.remove()
    for st, (cached, logits, kv) in zip((prompt, *riders), before, strict=True):
        assert st.cached == cached and st.logits is logits
        for ly, (k, v) in zip(st.cache.layers, kv, strict=True):
            assert ly.keys is k and ly.values is v
    # and the same states then ride as if nothing had happened
    twins = [eng.fork(r) for r in riders]
    alone = eng.begin_resume(eng.prefill(toks[:20]), 20, toks[:60])
    eng.prefill_riding(prompt, 40, riders)
    eng.prefill_batch([alone], [40])
    eng.decode_batch(twins[:1])
    eng.decode_batch(twins[1:])
    close(prompt.logits, alone.logits)
    for r, t in zip(riders, twins, strict=True):
        close(r.logits, t.logits)


def test_running_sequences_ride_a_prompts_chunks_in_the_head():
    eng = engine("llama")
    h = HeadRuntime(eng, publish=False, max_sessions=0)
    h.batch.prefill_chunk = 128
    try:
        toks = zoo.prompt_tokens(zoo.hf_model("llama"), 700)
        greedy = Sampling(max_tokens=1, stop_on_eos=False)
        want = [int(torch.argmax(eng.prefill(toks).logits))]
        running, started = Generation(), threading.Event()

        def go() -> None:
            for _ in h.generate(toks[:30], Sampling(max_tokens=300, stop_on_eos=False), running):
                started.set()

        t = threading.Thread(target=go, daemon=True)
        t.start()
        assert started.wait(60)
        steps_before = len(running.tokens)
        got = h.complete(toks, greedy)
        during = len(running.tokens) - steps_before
        t.join(120)
        assert got.tokens == want
        # 700 tokens in chunks of up to 128 rows with the running step beside them
        assert during >= 5 and h.batch.ridden_steps >= 5
        assert h.batch.peak_prefill_chunk <= 128
        assert len(running.tokens) == 300 and running.choices[0].done
    finally:
        h.close()
