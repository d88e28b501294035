"""kvmesh.squeeze: lossless codecs for KV bytes, bounded decoding, and the choice of codec.

Round trips per codec and dtype (float32, bfloat16 as its uint16 words, float16, int8, odd
lengths), and on real KV exported by a zoo model; every hostile stream (a bomb, a truncated
or garbage stream, a wrong length, trailing bytes, a part not shorter than raw, an unknown
codec, any one-byte flip) is a MalformedPayload and never another exception, with nothing
allocated beyond the part's raw size; the planner's choice follows the link's speed.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import torch

from kvmesh import squeeze
from kvmesh.blocks import BlockKeyer
from kvmesh.engine import load_engine
from kvmesh.errors import MalformedPayload

from . import zoo

COMPRESSING = ("lz4", "bp-lz4", "bp-zstd1")
DTYPES = {  # name -> (torch dtype, itemsize)
    "float32": (torch.float32, 4),
    "bfloat16": (torch.bfloat16, 2),
    "float16": (torch.float16, 2),
    "int8": (torch.int8, 1),
}
ELEMENTS = (0, 1, 7, 33, 1001, 8192)


def kv_like(dtype: str, n: int, seed: int = 0) -> bytes:
    """``n`` elements of KV-like values (normal, a few large channels) as raw bytes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * (1 + 20 * (torch.arange(n) % 16 == 3))
    if dtype == "int8":
        return x.clamp(-127, 127).to(torch.int8).numpy().tobytes()
    t = x.to(DTYPES[dtype][0])
    return (t.view(torch.uint16) if dtype == "bfloat16" else t).numpy().tobytes()


def roundtrip(codec: str, raw: bytes, itemsize: int) -> bytes:
    wire = squeeze.encode(codec, raw, itemsize)
    out = memoryview(bytearray(len(raw)))
    if codec != "raw" and len(wire) >= len(raw):
        # not shorter: refused on receipt, so a sender sends raw (encode_or_raw)
        with pytest.raises(MalformedPayload):
            squeeze.decode_into(codec, memoryview(wire), out, itemsize)
        assert squeeze.encode_or_raw(codec, raw, itemsize)[0] == "raw"
        return raw
    squeeze.decode_into(codec, memoryview(wire), out, itemsize)
    return bytes(out)


def test_codecs_and_ids() -> None:
    assert squeeze.available_codecs() == squeeze.CODECS == ("raw", "lz4", "bp-lz4", "bp-zstd1")
    assert squeeze.CODEC_IDS["raw"] == 0
    assert [squeeze.codec_name(squeeze.codec_id(c)) for c in squeeze.CODECS] == list(squeeze.CODECS)
    with pytest.raises(MalformedPayload):
        squeeze.codec_name(len(squeeze.CODECS))
    raw = memoryview(b"abcd")
    assert squeeze.encode("raw", raw, 2) is not None
    assert squeeze.encode("raw", raw, 2).obj is raw.obj  # no copy


@pytest.mark.parametrize("codec", squeeze.CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ELEMENTS)
def test_round_trip(codec: str, dtype: str, n: int) -> None:
    raw = kv_like(dtype, n)
    assert roundtrip(codec, raw, DTYPES[dtype][1]) == raw
    sent, wire = squeeze.encode_or_raw(codec, raw, DTYPES[dtype][1])
    assert sent == "raw" or len(wire) <= 0.95 * len(raw)


@pytest.mark.parametrize("codec", COMPRESSING)
@pytest.mark.parametrize("nbytes", (1, 3, 4097, 65539))
def test_lengths_not_a_multiple_of_the_item(codec: str, nbytes: int) -> None:
    """Trailing bytes past the last whole element travel as they are."""
    raw = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    for itemsize in (2, 4):
        assert roundtrip(codec, raw, itemsize) == raw


def test_byte_planes_make_16_bit_kv_compress() -> None:
    """Why planes: bfloat16 KV hardly compresses as it is, its exponent plane does."""
    raw = kv_like("bfloat16", 1 << 16)
    plain = len(squeeze.encode("lz4", raw, 2))
    planes = len(squeeze.encode("bp-zstd1", raw, 2))
    assert plain > 0.95 * len(raw) and planes < 0.8 * len(raw)


def _bounded(fn, raw_size: int) -> None:
    """``fn`` raises MalformedPayload having allocated (Python-tracked, which includes the
    libraries' output bytes) no more than about the part's raw size."""
    tracemalloc.start()
    try:
        with pytest.raises(MalformedPayload):
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < raw_size + (64 << 10), peak


def _zstd_frame(data: bytes, content_size: bool = True) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=1, write_content_size=content_size).compress(data)


def _planes_stream(*frames: bytes, tail: bytes = b"") -> bytes:
    return b"".join(struct.pack("<I", len(f)) for f in frames) + b"".join(frames) + tail


def test_bombs_are_refused_without_allocating() -> None:
    import lz4.block

    size = 8192
    out = memoryview(bytearray(size))
    big = bytes(64 << 20)  # 64 MiB of zeros: a frame of a few KiB
    zbomb = _zstd_frame(big)
    lbomb = lz4.block.compress(big[: 1 << 20], store_size=False)
    cases = [
        ("bp-zstd1", _planes_stream(zbomb)),  # states 64 MiB
        ("bp-zstd1", _planes_stream(_zstd_frame(big[: 1 << 20], content_size=False))),
        ("bp-lz4", _planes_stream(lbomb)),  # decodes to 1 MiB
        ("lz4", lbomb),
    ]
    for codec, data in cases:
        assert len(data) < size
        _bounded(lambda c=codec, d=data: squeeze.decode_into(c, memoryview(d), out, 1), size)


@pytest.mark.parametrize("codec", COMPRESSING)
def test_truncated_garbage_and_wrong_lengths(codec: str) -> None:
    itemsize = 2
    raw = kv_like("bfloat16", 4096)
    wire = bytes(squeeze.encode(codec, raw, itemsize))
    if codec == "lz4":  # plain LZ4 does not shrink this: make bytes it does shrink
        raw = bytes(range(64)) * 128
        wire = bytes(squeeze.encode(codec, raw, itemsize))
    assert len(wire) < len(raw)

    def refused(data: bytes, size: int = len(raw)) -> None:
        out = memoryview(bytearray(size))
        _bounded(lambda: squeeze.decode_into(codec, memoryview(data), out, itemsize), size)

    for cut in (1, 7, len(wire) // 2, len(wire) - 1):
        refused(wire[:cut])  # truncated
    refused(wire + b"\0")  # trailing byte
    refused(wire, len(raw) + 2)  # the header said otherwise
    refused(wire, len(raw) - 2)
    refused(raw)  # "compressed" but as long as raw
    rng = np.random.default_rng(1)
    for n in (0, 3, 100, len(wire)):
        refused(rng.integers(0, 256, n, dtype=np.uint8).tobytes())


def test_bp_trailing_frame_data_and_table_lies() -> None:
    raw = kv_like("bfloat16", 4096)
    wire = bytes(squeeze.encode("bp-zstd1", raw, 2))
    l0, l1 = struct.unpack_from("<II", wire)
    out = memoryview(bytearray(len(raw)))
    lies = [
        struct.pack("<II", l0 - 1, l1 + 1) + wire[8:],  # plane boundary moved
        struct.pack("<II", l0, l1 + 2) + wire[8:] + b"\0\0",  # a frame with trailing bytes
        struct.pack("<II", 4096, 4096) + raw,  # both planes "raw": as long as raw
    ]
    for data in lies:
        with pytest.raises(MalformedPayload):
            squeeze.decode_into("bp-zstd1", memoryview(data), out, 2)


@pytest.mark.parametrize("codec", COMPRESSING)
def test_a_valid_stream_of_other_bytes_is_refused(codec: str) -> None:
    """A well-formed stream of a shorter or longer part (LZ4 stops short without complaint
    when told a larger size): the part's size comes from the header, never from the peer."""
    raw = bytes(range(64)) * 64
    out = memoryview(bytearray(len(raw)))
    for other in (raw[:-64], raw + raw[:64]):
        wire = squeeze.encode(codec, other, 1)
        assert len(wire) < len(raw)
        with pytest.raises(MalformedPayload):
            squeeze.decode_into(codec, memoryview(wire), out, 1)


def test_unknown_or_unavailable_codec() -> None:
    out = memoryview(bytearray(8))
    with pytest.raises(MalformedPayload):
        squeeze.decode_into("zstd", memoryview(b"abc"), out, 1)
    with pytest.raises(MalformedPayload):
        squeeze.decode_into("raw", memoryview(b"abc"), out, 1)


@pytest.mark.parametrize("codec", COMPRESSING)
def test_every_one_byte_flip_is_refused_or_decodes_to_the_size(codec: str) -> None:
    """Never another exception type, never another length: a flipped stream that is not
    refused writes every byte of the part's size, the same bytes whatever the buffer
    held before (the part digest, checked after decoding, catches bytes that decode to
    other bytes)."""
    raw = kv_like("bfloat16", 384) if codec == "bp-zstd1" else bytes(range(32)) * 24
    wire = bytearray(squeeze.encode(codec, raw, 2))
    assert len(wire) < len(raw)
    refused = decoded = 0
    for i in range(len(wire)):
        for flip in (0x01, 0x80):
            wire[i] ^= flip
            outs = []
            for fill in (0x00, 0xFF):  # a byte left unwritten keeps its fill
                out = memoryview(bytearray([fill]) * len(raw))
                try:
                    squeeze.decode_into(codec, memoryview(wire), out, 2)
                except MalformedPayload:
                    refused += 1
                    break
                outs.append(bytes(out))
            else:
                decoded += 1
                assert outs[0] == outs[1], f"byte {i} ^ {flip:#x}: part not wholly written"
            wire[i] ^= flip
    assert refused + decoded == 2 * len(wire) and refused > 0
    out = memoryview(bytearray(len(raw)))
    squeeze.decode_into(codec, memoryview(wire), out, 2)
    assert bytes(out) == raw


def _calibrated(ratio: float, speed: float, codecs=("bp-zstd1",)) -> squeeze.Calibration:
    cal = squeeze.Calibration()
    raw = 1 << 20
    for c in codecs:
        cal.observe(c, raw, round(raw / ratio), encode_s=raw / speed)
        cal.observe(c, raw, round(raw / ratio), decode_s=raw / speed)
    return cal


def test_best_follows_the_link() -> None:
    cal = _calibrated(1.4, 500e6)
    nbytes = 64 << 20
    assert cal.best(10e9, nbytes) == "raw"  # 10 GB/s: the codec is the bottleneck
    assert cal.best(12.5e6, nbytes) == "bp-zstd1"  # 100 Mbit/s: 1.4x fewer bytes wins
    assert cal.best(12.5e6, nbytes, allowed=("raw", "lz4")) == "raw"  # the peer's list
    assert cal.best(0, nbytes) == "raw"  # an unknown link
    t = cal.seconds("bp-zstd1", 12.5e6, nbytes)
    assert t == pytest.approx(nbytes / 1.4 / 12.5e6)
    # a codec that compresses more but encodes slower loses on a fast-ish link only
    cal.observe("bp-lz4", 100, 50, encode_s=100 / 50e6, decode_s=100 / 50e6)
    assert cal.best(12.5e6, nbytes) == "bp-lz4"
    assert cal.best(100e6, nbytes) == "bp-zstd1"


def test_a_gain_within_the_noise_keeps_raw() -> None:
    """Plain LZ4 on float KV: a few parts shrink (ratio 1.01), at a speed above the link."""
    cal = _calibrated(1.01, 2e9, codecs=("lz4",))
    assert cal.best(1.25e9, 1 << 26) == "raw"
    assert cal.best(1.25e9, 1 << 26, min_gain=0.0) == "lz4"


def test_unmeasured_codecs_are_not_picked() -> None:
    cal = squeeze.Calibration()
    assert cal.best(1e3, 1 << 20) == "raw"
    cal.observe("bp-zstd1", 1000, 100, encode_s=1e-6)  # no decode speed yet
    assert cal.best(1e3, 1 << 20) == "raw"
    cal.observe("bp-zstd1", 1000, 100, decode_s=1e-6)
    assert cal.best(1e3, 1 << 20) == "bp-zstd1"


def test_observe_is_an_ewma() -> None:
    cal = squeeze.Calibration(alpha=0.5)
    cal.observe("lz4", 200, 100)
    cal.observe("lz4", 400, 100)
    assert cal.stats()["lz4"]["ratio"] == pytest.approx(3.0)


def test_sample_measures_every_codec_at_most_once_a_minute() -> None:
    now = [1000.0]
    cal = squeeze.Calibration(clock=lambda: now[0])
    raw = kv_like("bfloat16", 1 << 15)
    assert cal.sample(raw, 2)
    stats = cal.stats()
    assert set(stats) == {"bp-lz4", "bp-zstd1"} | ({"lz4"} & set(stats))
    for c in ("bp-lz4", "bp-zstd1"):
        assert stats[c]["ratio"] > 1 and stats[c]["enc"] > 0 and stats[c]["dec"] > 0
    now[0] += 59
    assert not cal.sample(raw, 2)
    now[0] += 2
    assert cal.sample(raw, 2)


def test_sample_records_what_a_sender_realizes() -> None:
    """A part that a codec shortens by less than MIN_SAVING is sent raw: the sample
    records ratio 1.0 for that codec (not the 1.0x it nearly saved), so the planner
    never asks for a codec whose parts would all go raw; one that saves more is
    recorded as it is."""
    rng = np.random.default_rng(5)
    raw = bytearray(rng.integers(0, 256, 1 << 14, dtype=np.uint8).tobytes())
    raw[: len(raw) * 3 // 100] = bytes(len(raw) * 3 // 100)  # ~3% compressible: a zero run
    cal = squeeze.Calibration()
    assert cal.sample(bytes(raw), 4)
    stats = cal.stats()
    assert {"bp-lz4", "bp-zstd1"} <= set(stats)
    for codec, st in stats.items():
        wire = squeeze.encode(codec, memoryview(raw), 4)
        assert len(raw) * (1 - squeeze.MIN_SAVING) < len(wire) < len(raw)  # nearly saved
        assert squeeze.encode_or_raw(codec, bytes(raw), 4)[0] == "raw"
        assert st["ratio"] == 1.0, (codec, len(wire), len(raw))
    half = bytes(len(raw) // 2) + bytes(raw[len(raw) // 2 :])  # half zeros: saves a lot
    cal = squeeze.Calibration()
    assert cal.sample(half, 4)
    assert cal.stats()["bp-zstd1"]["ratio"] > 1.5


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_real_kv_of_a_zoo_model_round_trips(dtype: str) -> None:
    """KV exported by a real forward of a seeded zoo model (trained tokenizer, random
    weights): every codec gives the exact bytes back, per (layer, block) part as the bulk
    wire sends them; byte planes compress it (bfloat16: measured 1.46x with bp-zstd1)."""
    path = zoo.hf_model("llama", dtype)
    eng = load_engine(str(path), "torch", dtype=dtype)
    state = eng.prefill(zoo.prompt_tokens(path, 200))
    blocks = eng.export(state, BlockKeyer(eng.card.namespace, eng.card.block_tokens))
    itemsize = DTYPES[dtype][1]
    raw_total, wire_total = 0, 0
    for block in blocks:
        specs = list(block.kv_tensors())
        assert specs and all(s.dtype == dtype for s, _ in specs)
        for k, v in zip(specs[::2], specs[1::2], strict=True):
            part = bytes(k[1]) + bytes(v[1])  # one layer's K then V: contiguous in the blob
            for codec in squeeze.CODECS:
                assert roundtrip(codec, part, itemsize) == part
            sent, wire = squeeze.encode_or_raw("bp-zstd1", part, itemsize)
            raw_total, wire_total = raw_total + len(part), wire_total + len(wire)
    assert raw_total / wire_total > (1.2 if dtype == "bfloat16" else 1.05)
