"""The torch engine's batched decode step (kvmesh/engine/hf.py), real forwards on a
real architecture:

- The batch cache persists while the same sequences step together: steps write
  into its buffer in place (no copy of the batch's KV per step), across a buffer
  growth, and every step's logits match each sequence decoded alone.
- A sequence that leaves (``detach``) takes its batch with it: no live batch keeps
  its buffer; the others rebuild and stay exact.
- Every linear kernel the start-up measurement may pick gives the same logits as
  ``F.linear``, and SDPA keeps its fused kernel (a transposed projection output
  would push it onto the slower unfused path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import profile

from kvmesh.engine import attention, load_engine
from kvmesh.engine.hf import _BUCKETS, GROW, KERNELS, MAX_ROWS_FIRST, MORE_ROWS, _calibrate

from . import zoo

_engine: list = []


def engine():
    if not _engine:
        # plain weights: the tests below swap the kernel table (packed weights ignore it)
        _engine.append(load_engine(str(zoo.hf_model("qwen2")), "torch", pack=False))
    return _engine[0]


def twins(eng, lengths=(7, 40, 90)):
    """Two independent sets of prefilled states, each with a pending token."""
    toks = zoo.prompt_tokens(zoo.hf_model("qwen2"), max(lengths))
    out = []
    for _ in range(2):
        states = [eng.prefill(toks[:n]) for n in lengths]
        for st in states:
            st.tokens.append(int(torch.argmax(st.logits)))
        out.append(states)
    return out


def step_both(eng, batched, alone):
    eng.decode_batch(batched)
    for st in alone:
        eng.decode_batch([st])
    for a, b in zip(alone, batched, strict=True):
        assert b.cached == a.cached == len(a.tokens)
        np.testing.assert_allclose(b.logits.numpy(), a.logits.numpy(), rtol=1e-4, atol=1e-4)
    for a, b in zip(alone, batched, strict=True):  # both go on with the same token
        tok = int(torch.argmax(a.logits))
        a.tokens.append(tok)
        b.tokens.append(tok)


def buffer(eng):
    (batch,) = eng._batches.values()
    return batch.cache.layers[0].kvmesh_buf[0]


def test_a_persistent_batch_steps_in_place_and_matches_each_alone():
    eng = engine()
    batched, alone = twins(eng)
    step_both(eng, batched, alone)
    first = buffer(eng)
    step_both(eng, batched, alone)
    assert buffer(eng) is first  # the same buffer, written in place
    assert batched[0].cache.layers[0].keys.untyped_storage().data_ptr() == (
        first.untyped_storage().data_ptr()
    )  # each row is a view of it: nothing copied out
    for _ in range(GROW + 2):  # across a growth of the buffer
        step_both(eng, batched, alone)
    assert buffer(eng) is not first and buffer(eng).shape[-2] > first.shape[-2]
    for st in batched + alone:
        eng.detach(st)
    assert not eng._batches


def test_a_leaving_sequence_drops_its_batch_and_the_rest_stay_exact():
    eng = engine()
    batched, alone = twins(eng)
    for _ in range(3):
        step_both(eng, batched, alone)
    gone = batched.pop(1)
    alone.pop(1)
    eng.detach(gone)
    assert not eng._batches  # its buffer is not kept alive by a stale batch
    assert gone.cache.layers[0].keys.untyped_storage().nbytes() == (
        gone.cache.layers[0].keys.nbytes
    )  # it owns a copy of its own rows, no more
    for _ in range(3):
        step_both(eng, batched, alone)
    assert len(eng._batches) == 1
    # one of them steps alone: the batch holding it is stale and goes
    eng.decode_batch([batched[0]])
    assert not eng._batches


@pytest.mark.parametrize("kernel", ["linear", *KERNELS])
def test_every_kernel_matches_and_attention_stays_fused(kernel):
    eng = engine()
    # SDPA (transformers' default on torch >= 2.1), split mask-free for a lone
    # continuing prefill (kvmesh.engine.attention): the premise
    assert eng.attn_implementation == attention.NAME
    saved = eng.kernels
    eng.kernels = {} if kernel == "linear" else dict.fromkeys(range(2, 4), kernel)
    try:
        batched, alone = twins(eng)
        with profile() as prof:
            step_both(eng, batched, alone)
        step_both(eng, batched, alone)
    finally:
        eng.kernels = saved
        for st in batched + alone:
            eng.detach(st)
    ops = {ev.key for ev in prof.key_averages()}
    assert any("flash_attention" in op for op in ops), sorted(ops)
    assert "aten::bmm" not in ops  # the unfused math path


def test_calibration_names_a_kernel_for_row_counts_only():
    eng = engine()
    chosen = _calibrate(eng.model, reps=1)
    assert set(chosen) <= {*range(1, MAX_ROWS_FIRST + 1), MORE_ROWS}
    assert set(chosen.values()) <= set(KERNELS)
    for low, high in zip((1, *(b + 1 for b in _BUCKETS)), _BUCKETS, strict=False):
        assert len({chosen.get(r) for r in range(low, high + 1)}) == 1  # one per bucket


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_every_kernel_prefills_and_steps_alone_as_f_linear_does(kernel, monkeypatch):
    """A prefill chunk (over MAX_ROWS_FIRST rows), batched prefill rows and a lone
    decode step take the table's kernel for their row count: each gives what
    ``F.linear`` gives, within float rounding, and the same greedy token."""
    eng = engine()
    toks = zoo.prompt_tokens(zoo.hf_model("qwen2"), 90)
    saved, real, seen = eng.kernels, KERNELS[kernel], set()

    def counted(w, b, x):
        seen.add(x.shape[0])
        return real(w, b, x)

    monkeypatch.setitem(KERNELS, kernel, counted)
    try:
        runs = []
        for table in ({}, {1: kernel, MORE_ROWS: kernel}):
            eng.kernels = table
            lone = eng.prefill(toks)
            rows = [eng.begin_prefill(toks[:n]) for n in (40, 90)]
            eng.prefill_batch(rows, [40, 90])
            lone.tokens.append(int(torch.argmax(lone.logits)))
            first = lone.logits.clone()
            eng.decode_batch([lone])
            runs.append((first, rows[1].logits, lone.logits))
            for st in (lone, *rows):
                eng.detach(st)
    finally:
        eng.kernels = saved
    assert {1, 90, 2 * 90} <= seen  # the lone step, the lone prefill, the two padded rows
    for want, got in zip(*runs, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
        assert int(torch.argmax(got)) == int(torch.argmax(want))
