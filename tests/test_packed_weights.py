"""Linear weights packed in oneDNN's layout (kvmesh/engine/kernels.py): the packed
kernel serves every row count or none (its layout is the only copy of the
weights), it computes what ``F.linear`` does, the plain weights' memory is given
back (the model file's mapping included), and deterministic mode never packs.

The engines are real (the embedded ``demo-tiny``, seeded weights); which kernels a
start takes is forced through the kept-choice record, as a first start on another
machine would have measured it."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh import memory
from kvmesh.engine.kernels import BASE, MORE_ROWS, PACKED, _choose, packs

from .test_kernel_cache import choice_files

ALL = list(range(1, MORE_ROWS + 1))
DECODE = [
    (range(1, 2), 1),
    (range(2, 3), 2),
    (range(3, 5), 4),
    (range(5, 9), 8),
    (range(9, 17), 16),
]


def totals(prefill: dict[str, float], decode: dict[str, float]):
    """Calibration's per-bucket times: ``decode`` at every decode bucket."""
    return [*((rows, dict(decode)) for rows, _ in DECODE), ((MORE_ROWS,), dict(prefill))]


def test_packed_serves_every_row_count_or_none():
    # fastest at the prefill rows, 3% behind at every decode bucket: nowhere (it loses
    # overall), each bucket its fastest other kernel
    chosen = _choose(totals({PACKED: 0.9, "onednn": 1.0}, {PACKED: 1.03, "streamed": 1.0}))
    assert chosen == {**dict.fromkeys(range(1, 17), "streamed"), MORE_ROWS: "onednn"}
    assert not packs(chosen)
    # 15% behind at one row, 40% ahead at the other decode buckets and the prefill
    # rows: everywhere (a sum of 4.35 against 6)
    ahead = totals({PACKED: 0.8, "onednn": 1.0}, {PACKED: 0.6, "streamed": 1.0})
    ahead[0] = (ahead[0][0], {PACKED: 1.15, "streamed": 1.0})
    chosen = _choose(ahead)
    assert chosen == dict.fromkeys(ALL, PACKED) and packs(chosen)
    # but 30% behind anywhere: nowhere, however far ahead elsewhere
    ahead[0] = (ahead[0][0], {PACKED: 1.3, "streamed": 1.0})
    assert not packs(_choose(ahead))
    # F.linear's time counts where no other kernel beat it
    slow = totals({PACKED: 0.8, BASE: 1.0}, {PACKED: 0.6, BASE: 1.0})
    assert packs(_choose(slow))
    slow[1] = (slow[1][0], {PACKED: 0.6, BASE: 0.2})  # it lost to F.linear there
    assert _choose(slow) == {}
    # not the fastest at the prefill rows: nowhere
    chosen = _choose(totals({PACKED: 1.0, "onednn": 0.9}, {PACKED: 0.5, "streamed": 1.0}))
    assert chosen == {**dict.fromkeys(range(1, 17), "streamed"), MORE_ROWS: "onednn"}
    # it lost to F.linear at one bucket (not a candidate there): nowhere
    lost = totals({PACKED: 0.9}, {PACKED: 0.9})
    lost[0] = (lost[0][0], {"streamed": 0.4, PACKED: 0.5, BASE: 0.5})
    assert _choose(lost) == {1: "streamed"}
    assert _choose([]) == {} and not packs({})


@pytest.fixture
def home(tmp_path, monkeypatch, tiny_dir):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(tiny_dir.parent)
    monkeypatch.setenv("KVMESH_HOME", str(home))
    return home


def forced(home, kernels: dict[int, str], **kw):
    """An engine whose start takes ``kernels`` from the kept record."""
    from kvmesh.engine import load_engine

    if not choice_files(home):
        load_engine("demo-tiny", "torch")  # measures and keeps a record
    (kept,) = choice_files(home)
    rec = json.loads(kept.read_text())
    kept.write_text(json.dumps({**rec, "value": {str(r): k for r, k in kernels.items()}}))
    return load_engine("demo-tiny", "torch", **kw)


def linears(eng):
    return [m for m in eng.model.modules() if type(m) is torch.nn.Linear]


def mapped_ranges(path) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def greedy(eng, toks, steps=6):
    st = eng.prefill(toks)
    first = st.logits.clone()
    out = []
    for _ in range(steps):
        st.tokens.append(int(torch.argmax(st.logits)))
        out.append(st.tokens[-1])
        eng.decode_batch([st])
    eng.detach(st)
    return first, out


def test_a_packed_engine_computes_what_plain_weights_do(home, tiny_dir):
    plain = forced(home, {})  # F.linear at every row count
    packed = forced(home, dict.fromkeys(ALL, PACKED))
    assert packs(packed.kernels) and not plain.kernels
    tied = {
        id(m) for m in linears(packed) if m.weight is packed.model.get_input_embeddings().weight
    }
    for m in linears(packed):  # every layer packed but the one sharing the embeddings
        assert m.weight.is_mkldnn == (id(m) not in tied)
    assert not any(m.weight.is_mkldnn for m in linears(plain))
    # the same bytes of weights, none of them left in the model file's mapping
    assert memory.model_bytes(packed.model) == memory.model_bytes(plain.model)
    files = [r for f in tiny_dir.glob("*.safetensors") for r in mapped_ranges(f.resolve())]
    for t in packed.model.parameters():
        if not t.is_mkldnn:
            assert not any(lo <= t.data_ptr() < hi for lo, hi in files)
    toks = list(range(5, 5 + 90))
    want_first, want = greedy(plain, toks)
    got_first, got = greedy(packed, toks)
    torch.testing.assert_close(got_first, want_first, rtol=1e-4, atol=1e-4)
    assert got == want
    # a batched prefill and a batched decode step (two rows) on the packed weights
    rows = [packed.begin_prefill(toks[:n]) for n in (40, 90)]
    packed.prefill_batch(rows, [40, 90])
    torch.testing.assert_close(rows[1].logits, want_first, rtol=1e-4, atol=1e-4)
    for st in rows:
        st.tokens.append(int(torch.argmax(st.logits)))
    packed.decode_batch(rows)
    assert rows[1].tokens[-1] == want[0]
    for st in rows:
        packed.detach(st)


def test_deterministic_mode_keeps_plain_weights(home):
    eng = forced(home, dict.fromkeys(ALL, PACKED), deterministic_grid=64)
    assert not any(m.weight.is_mkldnn for m in linears(eng))


def test_packing_is_not_measured_where_a_copy_would_not_fit(plain_tiny_engine, monkeypatch, caplog):
    """Calibration times the packed kernel on a packed copy of every layer: where that
    copy (with as much again to spare) exceeds the memory available, the kernel is no
    candidate and the start takes the others."""
    import logging

    from kvmesh.engine import kernels

    assert not kernels._room_for(1 << 60) and kernels._room_for(1)
    # room for a layer of each shape (the correctness check's copies), not for all
    layers = [m for m in plain_tiny_engine.model.modules() if type(m) is torch.nn.Linear]
    every = 2 * sum(m.weight.nbytes for m in layers)
    assert every > 2 * sum({m.weight.shape: m.weight.nbytes for m in layers}.values())
    monkeypatch.setattr(kernels, "_room_for", lambda n: n < every)
    calls = []
    real = kernels.KERNELS[PACKED]
    monkeypatch.setitem(kernels.KERNELS, PACKED, lambda *a: calls.append(1) or real(*a))
    with caplog.at_level(logging.INFO, "kvmesh.kernels"), torch.inference_mode():
        chosen = kernels._calibrate(plain_tiny_engine.model, reps=1)
    assert not calls and PACKED not in chosen.values()  # not checked, not timed
    assert "packed weights not measured" in caplog.text
