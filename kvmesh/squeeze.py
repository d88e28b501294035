"""Lossless compression of KV bytes for slow links: bytes in, bytes out, nothing else.

Contract:

- Codecs (:data:`CODECS`, each with a one-byte wire id in :data:`CODEC_IDS`, ``raw`` = 0):
  ``raw`` (the bytes as they are), ``lz4`` (one LZ4 block), ``bp-lz4`` and ``bp-zstd1``
  (byte planes: one NumPy strided copy puts byte 0 of every element first, then byte 1, ...,
  so that the exponent bytes of bfloat16/float16/float32 KV sit together and compress; each
  plane is then compressed alone, by LZ4 or zstd level 1, and a plane that does not shrink is
  stored as it is). A ``bp-`` stream is ``itemsize`` little-endian u32 plane lengths, the
  planes, then the ``len % itemsize`` trailing bytes as they are; a plane whose length equals
  the plane's raw size is stored raw (the encoder never emits a compressed plane that long).
- :func:`encode` compresses; :func:`encode_or_raw` is what a sender sends: the codec's bytes
  when they save at least ``min_saving``, else ``("raw", the view)``, so a compressed part is
  always shorter than its raw bytes.
- :func:`decode_into` decodes exactly ``len(out)`` bytes into the caller's ``out``, whose size
  the caller knows from its own header (never from the peer). It is bounded: a zstd frame
  must state exactly the plane's size before anything is allocated, LZ4 gets the size
  explicitly, trailing bytes are refused, and nothing beyond ``out`` plus one plane (or, for
  ``lz4``, one frame of ``len(out)``) is allocated. Anything wrong (a bomb, a truncated or
  garbage stream, a wrong length, a compressed part not shorter than ``out``, an unknown
  codec) raises :class:`~kvmesh.errors.MalformedPayload` and nothing else.
- The libraries (``zstandard``, ``lz4``) are imported lazily; :func:`available` names the
  codecs usable here. Both release the GIL while compressing and decompressing (measured:
  two threads run ~2x one; docs/ship-less.md §3), so a sender may compress part ``i+1`` on a
  pool while sending part ``i``.
- :class:`Calibration` keeps EWMAs per codec of the ratio (raw/wire as a sender realizes it:
  a part saving under :data:`MIN_SAVING` is sent raw, 1.0) and of the encode and decode
  speeds (a thread's CPU time), and :meth:`Calibration.best` picks the codec that moves
  ``nbytes`` fastest over a link: ``argmin max(wire/link, nbytes/enc, nbytes/dec)`` (raw:
  ``nbytes/link``, which a codec must beat by 5%), so a fast link picks ``raw`` with no
  special case and an unmeasured codec is never picked.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import numpy as np

from kvmesh.errors import MalformedPayload

CODECS: tuple[str, ...] = ("raw", "lz4", "bp-lz4", "bp-zstd1")
CODEC_IDS: dict[str, int] = {name: i for i, name in enumerate(CODECS)}
_LIBRARY = {"raw": "", "lz4": "lz4", "bp-lz4": "lz4", "bp-zstd1": "zstd"}
_U32 = struct.Struct("<I")
_ZSTD_LEVEL = 1
# Level 1 with matches of 7 bytes or more in a tiny hash table: a KV byte plane has few long
# repeats, so the match search mostly costs time; its gain is the entropy coding of the
# literals. Measured on the demo model's bfloat16 KV (16 KiB parts), exponent plane: 2.87x at
# 417 MB/s, against level 1's defaults 2.52x at 130 MB/s (a decoder needs no setting).
_ZSTD_TUNING = {"min_match": 7, "hash_log": 6, "search_log": 1}
_local = threading.local()  # a zstd (de)compressor per thread: they are not thread-safe
_MODULES: dict[str, ModuleType | None] = {}
_AVAILABLE: list[
    tuple[str, ...]
] = []  # available_codecs(), once known (imports do not come and go)


def _module(lib: str) -> ModuleType | None:
    """The library behind ``lib`` ("lz4" or "zstd"), imported on first use; None if absent."""
    if lib not in _MODULES:
        try:
            if lib == "lz4":
                import lz4.block as mod
            else:
                import zstandard as mod
        except ImportError:
            mod = None  # type: ignore[assignment]
        _MODULES[lib] = mod
    return _MODULES[lib]


def available_codecs() -> tuple[str, ...]:
    """The codecs whose library imports here (``raw`` always)."""
    if _AVAILABLE:
        return _AVAILABLE[0]
    names = tuple(c for c in CODECS if not _LIBRARY[c] or _module(_LIBRARY[c]) is not None)
    _AVAILABLE.append(names)
    return names


def codec_id(codec: str) -> int:
    """The wire byte of ``codec``."""
    try:
        return CODEC_IDS[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}") from None


def codec_name(cid: int) -> str:
    """The codec a wire byte names; an unknown byte (from a peer) is MalformedPayload."""
    if not 0 <= cid < len(CODECS):
        raise MalformedPayload(f"unknown codec id {cid}")
    return CODECS[cid]


def _lib(codec: str) -> Any:
    """The library module of a compressing ``codec``; ValueError if unknown or absent."""
    if codec not in _LIBRARY or codec == "raw":
        raise ValueError(f"unknown compressing codec {codec!r}")
    mod = _module(_LIBRARY[codec])
    if mod is None:
        raise ValueError(f"codec {codec!r} is not available (its library does not import)")
    return mod


def _zstd_c() -> Any:
    c = getattr(_local, "zc", None)
    if c is None:
        # no checksum: part digests (blake3, of the raw bytes) verify after decoding
        zstd = _lib("bp-zstd1")
        params = zstd.ZstdCompressionParameters.from_level(
            _ZSTD_LEVEL,
            write_content_size=True,
            write_checksum=False,
            **_ZSTD_TUNING,
        )
        c = _local.zc = zstd.ZstdCompressor(compression_params=params)
    return c


def _zstd_d() -> Any:
    d = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = _lib("bp-zstd1").ZstdDecompressor()
    return d


def _compress_plane(codec: str, plane: memoryview) -> bytes | memoryview:
    """One plane compressed, or the plane itself when that does not shrink it."""
    if codec == "bp-zstd1":
        out = _zstd_c().compress(plane)
    else:
        out = _lib(codec).compress(plane, store_size=False)
    return out if len(out) < len(plane) else plane


def _planes(raw: memoryview, itemsize: int) -> np.ndarray:
    """The byte planes of ``raw``'s whole elements: one strided copy, (itemsize, n)."""
    n = len(raw) // itemsize
    words = np.frombuffer(raw, dtype=np.uint8, count=n * itemsize).reshape(n, itemsize)
    return np.ascontiguousarray(words.T)


def encode(codec: str, raw: memoryview | bytes, itemsize: int) -> bytes | memoryview:
    """``raw`` compressed by ``codec`` (``raw``: the view itself, no copy). ``itemsize``:
    the bytes of one element of the dtype (2 for bfloat16), what ``bp-`` planes split by.
    May be longer than ``raw`` on incompressible bytes: senders use :func:`encode_or_raw`."""
    view = memoryview(raw).cast("B")
    if codec == "raw":
        return view
    if codec == "lz4":
        return bytes(_lib(codec).compress(view, store_size=False))
    _lib(codec)
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1, not {itemsize}")
    if len(view) // itemsize >= 1 << 32:
        raise ValueError("a part of 4 G elements or more is not encoded in planes")
    planes = _planes(view, itemsize)
    parts = [_compress_plane(codec, memoryview(p)) for p in planes]
    head = b"".join(_U32.pack(len(p)) for p in parts)
    tail = view[planes.size :]
    return b"".join([head, *parts, tail])


MIN_SAVING = 0.05  # a compressed part is sent only if this much shorter than its raw bytes


def _sent(raw_len: int, wire_len: int, min_saving: float = MIN_SAVING) -> bool:
    """Whether a part of ``raw_len`` bytes encoded to ``wire_len`` goes compressed."""
    return wire_len <= raw_len * (1.0 - min_saving) and wire_len < raw_len


def encode_or_raw(
    codec: str, raw: memoryview | bytes, itemsize: int, min_saving: float = MIN_SAVING
) -> tuple[str, bytes | memoryview]:
    """(codec, wire bytes) to send: ``codec``'s bytes when they are at least ``min_saving``
    shorter than ``raw``, else ``("raw", raw's view)``."""
    view = memoryview(raw).cast("B")
    if codec == "raw":
        return "raw", view
    wire = encode(codec, view, itemsize)
    if _sent(len(view), len(wire), min_saving):
        return codec, wire
    return "raw", view


def _decompress(codec: str, data: memoryview, size: int) -> bytes:
    """Exactly ``size`` bytes from one frame ``data``, bounded before any allocation."""
    if codec == "bp-zstd1":
        zstd = _lib(codec)
        if zstd.frame_content_size(data) != size:  # a bomb states more, a lie states less
            raise MalformedPayload("zstd frame does not state the part's size")
        out = _zstd_d().decompress(data, max_output_size=size, allow_extra_data=False)
    else:
        out = _lib(codec).decompress(data, uncompressed_size=size)
    if len(out) != size:
        raise MalformedPayload(f"{codec} frame decoded to {len(out)} bytes, not {size}")
    return out


def _decode_planes(codec: str, data: memoryview, out: memoryview, itemsize: int) -> None:
    n = len(out) // itemsize
    head = itemsize * _U32.size
    if len(data) < head:
        raise MalformedPayload("byte-plane stream shorter than its plane table")
    lengths = [_U32.unpack_from(data, i * _U32.size)[0] for i in range(itemsize)]
    tail = len(out) - n * itemsize
    if any(ln > n for ln in lengths) or head + sum(lengths) + tail != len(data):
        raise MalformedPayload("byte-plane table does not match the part's size")
    words = np.frombuffer(out, dtype=np.uint8, count=n * itemsize).reshape(n, itemsize)
    off = head
    for j, ln in enumerate(lengths):
        chunk = data[off : off + ln]
        plane = chunk if ln == n else _decompress(codec, chunk, n)
        words[:, j] = np.frombuffer(plane, dtype=np.uint8)
        off += ln
    out[n * itemsize :] = data[off:]


def decode_into(codec: str, data: memoryview | bytes, out: memoryview, itemsize: int) -> None:
    """Decode ``data`` into exactly all of ``out`` (writable, its size from the caller's
    header). Raises MalformedPayload on any stream that does not decode to exactly
    ``len(out)`` bytes, on a compressed ``data`` not shorter than ``out``, or on a codec this
    side cannot decode."""
    data = memoryview(data).cast("B")
    out = memoryview(out).cast("B")
    if codec not in CODEC_IDS or codec not in available_codecs():
        raise MalformedPayload(f"codec {codec!r} cannot be decoded here")
    if codec == "raw":
        if len(data) != len(out):
            raise MalformedPayload(f"raw part of {len(data)} bytes, expected {len(out)}")
        out[:] = data
        return
    if len(data) >= len(out):
        raise MalformedPayload("compressed part not shorter than its raw bytes")
    if itemsize < 1:
        raise MalformedPayload(f"itemsize {itemsize}")
    try:
        if codec == "lz4":
            out[:] = _decompress(codec, data, len(out))
        else:
            _decode_planes(codec, data, out, itemsize)
    except MalformedPayload:
        raise
    except Exception as e:  # each library's own error types: garbage is one typed error
        raise MalformedPayload(f"{codec} stream does not decode: {e}") from None


class _Ewma:
    """An exponentially weighted mean; the first sample sets it."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float) -> None:
        self.alpha: float = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class Calibration:
    """What each codec achieves here: EWMAs of ratio (raw/wire) and encode/decode bytes/s,
    fed by real parts (:meth:`observe`) and by a periodic sample (:meth:`sample`).
    Thread-safe: the publisher samples, the verifier observes, the planner asks."""

    def __init__(
        self,
        alpha: float = 0.2,
        sample_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.alpha, self.sample_every_s, self._clock = alpha, sample_every_s, clock
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, _Ewma]] = {}
        self._last_sample: float | None = None

    def _ewma(self, codec: str, what: str) -> _Ewma:
        per = self._stats.setdefault(codec, {})
        return per.setdefault(what, _Ewma(self.alpha))

    def observe(
        self,
        codec: str,
        raw_bytes: int,
        wire_bytes: int,
        encode_s: float | None = None,
        decode_s: float | None = None,
    ) -> None:
        """One part's outcome: its raw and wire lengths, and the time to encode or decode
        it where measured (a receiver knows only its decode)."""
        if codec not in CODEC_IDS or codec == "raw" or raw_bytes <= 0 or wire_bytes <= 0:
            return
        with self._lock:
            self._ewma(codec, "ratio").add(raw_bytes / wire_bytes)
            if encode_s is not None and encode_s > 0:
                self._ewma(codec, "enc").add(raw_bytes / encode_s)
            if decode_s is not None and decode_s > 0:
                self._ewma(codec, "dec").add(raw_bytes / decode_s)

    def sample(self, block_bytes: memoryview | bytes, itemsize: int, force: bool = False) -> bool:
        """Encode and decode ``block_bytes`` (one exported block's KV) with every available
        codec and observe the outcome; at most once per ``sample_every_s`` unless ``force``.
        Returns whether it sampled. The ratio observed is what a sender would realize (a
        part that saves less than :data:`MIN_SAVING` goes raw: 1.0), and the speeds are
        this thread's CPU time, so a time slice lost to another process on a busy machine
        does not make a codec look slow."""
        now = self._clock()
        with self._lock:
            last = self._last_sample
            if not force and last is not None and now - last < self.sample_every_s:
                return False
            self._last_sample = now
        view = memoryview(block_bytes).cast("B")
        out = memoryview(bytearray(len(view)))
        for codec in available_codecs():
            if codec == "raw" or not view:
                continue
            t0 = time.thread_time()
            wire = encode(codec, view, itemsize)
            t1 = time.thread_time()
            dec_s = None
            if len(wire) < len(view):  # a part not shorter is sent raw, never decoded
                decode_into(codec, memoryview(wire), out, itemsize)
                dec_s = time.thread_time() - t1
            sent = len(wire) if _sent(len(view), len(wire)) else len(view)
            self.observe(codec, len(view), sent, t1 - t0, dec_s)
        return True

    def stats(self) -> dict[str, dict[str, float]]:
        """{codec: {"ratio", "enc", "dec"}} of what is measured (bytes/s for speeds)."""
        with self._lock:
            return {
                c: {k: e.value for k, e in per.items() if e.value is not None}
                for c, per in self._stats.items()
            }

    def seconds(self, codec: str, link_bytes_per_s: float, nbytes: int) -> float | None:
        """Estimated time to move ``nbytes`` with ``codec`` (pipelined: the slowest of
        wire, encode, decode), or None where not measured."""
        if codec == "raw":
            return nbytes / link_bytes_per_s
        s = self.stats().get(codec, {})
        if not all(k in s and s[k] > 0 for k in ("ratio", "enc", "dec")):
            return None
        return max(nbytes / s["ratio"] / link_bytes_per_s, nbytes / s["enc"], nbytes / s["dec"])

    def best(
        self,
        link_bytes_per_s: float,
        nbytes: int,
        allowed: Iterable[str] | None = None,
        min_gain: float = 0.05,
    ) -> str:
        """The codec (of ``allowed``, default all available) that moves ``nbytes`` fastest
        over a link of ``link_bytes_per_s``; ``raw`` where the link is unknown (<= 0), and
        unless a codec beats raw's time by ``min_gain`` (as a part is sent raw unless it
        saves 5%: a percent is within the estimates' noise and costs both CPUs)."""
        if link_bytes_per_s <= 0 or nbytes <= 0:
            return "raw"
        names = (
            set(available_codecs()) if allowed is None else set(allowed) & set(available_codecs())
        )
        best, best_t = "raw", nbytes / link_bytes_per_s * (1.0 - min_gain)
        for codec in CODECS:  # a fixed order: ties go to the simpler codec
            t = self.seconds(codec, link_bytes_per_s, nbytes) if codec in names else None
            if t is not None and t < best_t:
                best, best_t = codec, t
        return best
