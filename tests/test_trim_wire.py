"""Trimmed and compressed blocks on the bulk wire (PARTS frames), on real sockets.

An honest server sends a fetch that names the import's window only the parts the
import needs, each verified against the producer's digest; compressed parts
decode to the same bytes. A hostile server's every deviation (a part missing, one
extra, a flipped byte, a manifest that does not make the digest, parts when whole
blocks were asked, a part longer than raw, a codec not asked for) is a typed
error before anything is handed on.
"""

from __future__ import annotations

import queue
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvmesh import codec
from kvmesh.codec import ALL, Layout, new_blob, parts_frame, trim
from kvmesh.errors import ChecksumMismatch, KVMeshError, MalformedPayload
from kvmesh.mesh import bulk_client
from kvmesh.mesh.bulk_client import Cancel, Dialer
from kvmesh.mesh.bulk_server import BulkServer
from kvmesh.mesh.bulk_wire import FRAME, HELLO, PARTS
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.mesh.server import CacheService
from kvmesh.mesh.transport import StreamTimes, Want
from kvmesh.store import BlockStore

from .helpers import small_card, synthetic_chain

CARD = small_card(num_layers=3, sliding_windows=(8, 0, 8), head_dim=16)
LAYOUT = Layout(CARD)
TOKENS = list(range(41))  # 10 blocks of 4 and a tail of 1
CHAIN = synthetic_chain(CARD, TOKENS)
KEEP = LAYOUT.keep_from(len(TOKENS))
HASHERS = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]


def smooth_chain():
    """The chain's headers with low-entropy payloads (what compresses)."""
    out = []
    for b in CHAIN:
        blob, view = new_blob(b.header)
        ramp = np.arange(len(view), dtype=np.uint32) // 64
        view[:] = (ramp % 7).astype(np.uint8).tobytes()
        out.append(LAYOUT.seal(b.header, blob))
    return out


def infos(blocks):
    return [
        pb.BlockInfo(key=b.key, nbytes=b.nbytes, digest=b.digest, tokens=b.header.tokens)
        for b in blocks
    ]


class Served:
    def __init__(self, blocks=CHAIN):
        self.blocks = blocks
        self.store = BlockStore(1 << 26)
        for b in blocks:
            self.store.put(b)
        self.cache = CacheService(self.store, max_block_bytes=1 << 20, max_inflight_bytes=1 << 21)
        self.server = BulkServer(self.cache)
        self.address = f"127.0.0.1:{self.server.start('127.0.0.1')}"

    def fetch(self, want: Want | None, times: StreamTimes | None = None):
        return fetch(self.address, self.blocks, self.store.epoch, want, times)

    def close(self):
        self.server.stop()


def request(blocks, epoch: str, want: Want | None) -> bytes:
    req = pb.FetchRequest(namespace=CARD.namespace, keys=[b.key for b in blocks], epoch=epoch)
    if want is not None:
        req.keep_from.extend(want.keep_from or ())
        req.codecs.extend(want.codecs)
    return req.SerializeToString()


def fetch(address, blocks, epoch, want, times=None):
    return bulk_client.fetch(
        address,
        Dialer(None),
        "",
        request(blocks, epoch, want),
        infos(blocks),
        LAYOUT,
        HASHERS,
        None,
        5.0,
        30.0,
        Cancel(),
        times=times,
        want=want,
    )


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def test_a_window_fetch_gets_exactly_the_parts_the_import_needs(served):
    assert KEEP == (32, 0, 32)
    whole_times, trimmed_times = StreamTimes(), StreamTimes()
    whole = served.fetch(None, whole_times)
    assert all(b.whole for b in whole) and [b.blob for b in whole] == [b.blob for b in CHAIN]
    got = served.fetch(Want(KEEP), trimmed_times)
    for blk, orig in zip(got, CHAIN, strict=True):
        want = LAYOUT.want(orig.header, KEEP)
        assert blk.present == want and blk.digest == orig.digest
        assert blk.blob == trim(orig, want).blob  # the very bytes, nothing else
        codec.check_block(blk, LAYOUT)
    assert sum(not b.whole for b in got) == 8  # blocks ending at or before 32
    assert trimmed_times.wire_bytes < whole_times.wire_bytes
    # the sliding layers' 8 of 10 blocks stay home: their share of the payload
    saved = sum(len(b.blob) for b in CHAIN) - sum(len(b.blob) for b in got)
    per_layer = CHAIN[0].header.part_sizes[0]
    assert saved == 2 * 8 * per_layer
    assert served.cache.counters["bulk_parts_frames"] == 8


def test_compressed_parts_decode_to_the_producers_bytes():
    chain = smooth_chain()
    s = Served(chain)
    try:
        plain, squeezed = StreamTimes(), StreamTimes()
        raw = s.fetch(Want(KEEP), plain)
        got = s.fetch(Want(KEEP, ("bp-zstd1",)), squeezed)
        assert [b.blob for b in got] == [b.blob for b in raw]
        assert [b.digest for b in got] == [b.digest for b in chain]
        assert squeezed.wire_bytes < plain.wire_bytes / 2
        whole = s.fetch(Want(None, ("lz4",)))  # compression alone: every part, in parts
        assert [b.blob for b in whole] == [b.blob for b in chain] and all(b.whole for b in whole)
    finally:
        s.close()


def test_a_bad_keep_from_is_refused_and_the_server_keeps_serving(served):
    with pytest.raises(MalformedPayload):
        served.fetch(Want((0, 0)))  # two layers named, the card has three
    assert len(served.fetch(Want(KEEP))) == len(CHAIN)


# -- a hostile server ------------------------------------------------------------


def one_shot_server(frames: list[bytes]) -> tuple[str, threading.Thread]:
    """A listener that reads one fetch's hello and body, answers ``frames`` and closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            head = conn.recv(HELLO.size, socket.MSG_WAITALL)
            body_len = HELLO.unpack(head)[2]
            conn.recv(body_len, socket.MSG_WAITALL)
            for f in frames:
                conn.sendall(f)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return address, t


def frame(pieces) -> bytes:
    data = b"".join(bytes(p) for p in pieces)
    return FRAME.pack(PARTS, len(data)) + data


def lie(blk, mask, mutate=None, encode=None) -> bytes:
    """A PARTS frame of ``blk`` sending ``mask``, then ``mutate``d (bytes -> bytes)."""
    data = frame(parts_frame(blk, mask, encode))
    return mutate(data) if mutate else data


def flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def flip_digest(data: bytes) -> bytes:
    hlen = int.from_bytes(data[FRAME.size + 4 : FRAME.size + 8], "little")
    at = FRAME.size + 8 + hlen + 2 + 5  # inside the first part digest
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


BLK = CHAIN[0]
WANT = LAYOUT.want(BLK.header, KEEP)
MISSING = WANT & ~1 << 1  # the full layer's part left out
EXTRA = WANT | 1  # a sliding layer's part the import does not need


def grown(raw, itemsize):  # a part "compressed" to more than its raw bytes
    return 1, bytes(raw) + b"x"


def unasked(raw, itemsize):  # a real lz4 stream, in a codec the client did not ask for
    from kvmesh import squeeze

    return squeeze.codec_id("lz4"), squeeze.encode("lz4", bytes(len(raw)), itemsize)


@pytest.mark.parametrize(
    ("name", "data", "want", "error"),
    [
        ("parts-missing", lie(BLK, MISSING), Want(KEEP), MalformedPayload),
        ("parts-extra", lie(BLK, EXTRA), Want(KEEP), MalformedPayload),
        ("parts-flip", lie(BLK, WANT, flip_last), Want(KEEP), ChecksumMismatch),
        ("manifest-lie", lie(BLK, WANT, flip_digest), Want(KEEP), ChecksumMismatch),
        ("parts-when-whole", lie(BLK, WANT), None, MalformedPayload),
        (
            "part-longer-than-raw",
            lie(BLK, WANT, None, grown),
            Want(KEEP, ("lz4",)),
            MalformedPayload,
        ),
        ("codec-not-asked", lie(BLK, WANT, None, unasked), Want(KEEP), MalformedPayload),
        ("truncated", lie(BLK, WANT)[:-3], Want(KEEP), KVMeshError),
    ],
)
def test_a_hostile_parts_frame_is_a_typed_error(name, data, want, error):
    address, t = one_shot_server([data])
    with pytest.raises(error):
        fetch(address, [BLK], "e", want)
    t.join(5)


class FrameServer:
    """A listener that answers each fetch (hello and body read) with the next queued
    frame and closes that connection: one listener for many hostile answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frames: queue.Queue[bytes | None] = queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.listener:
            while (data := self.frames.get()) is not None:
                conn, _ = self.listener.accept()
                with conn:
                    head = conn.recv(HELLO.size, socket.MSG_WAITALL)
                    conn.recv(HELLO.unpack(head)[2], socket.MSG_WAITALL)
                    conn.sendall(data)

    def answer(self, data: bytes) -> list:
        self.frames.put(data)
        return fetch(self.address, [BLK], "e", Want(KEEP))

    def close(self) -> None:
        self.frames.put(None)
        self.thread.join(5)


def test_every_byte_of_a_parts_frame_is_checked():
    """Flip each byte of an honest PARTS frame (past the frame code), one at a time:
    every flip is a typed error, or the very block when the reader never uses that
    byte; never another block and never another exception."""
    honest = lie(BLK, WANT)
    want = trim(BLK, WANT).blob
    server = FrameServer()
    refused = unused = 0
    try:
        assert server.answer(honest)[0].blob == want
        for at in range(1, len(honest)):
            bad = honest[:at] + bytes([honest[at] ^ 0x40]) + honest[at + 1 :]
            try:
                got = server.answer(bad)
            except KVMeshError:
                refused += 1
            else:
                assert got[0].blob == want, f"byte {at} flipped was imported"
                unused += 1
    finally:
        server.close()
    assert refused + unused == len(honest) - 1 and refused > unused


def test_a_whole_block_answers_a_window_fetch():
    """A server that ignores keep_from (an older one, or --no-window-trim's
    reference) sends whole blocks: they carry every part the import needs."""
    address, t = one_shot_server([FRAME.pack(0, BLK.nbytes) + BLK.blob])
    got = fetch(address, [BLK], "e", Want(KEEP))
    assert got[0].present == ALL and got[0].blob == BLK.blob
    t.join(5)


def test_every_byte_of_a_compressed_parts_frame_is_checked():
    """The same over a frame whose parts are compressed (bp-zstd1): a flipped byte
    in a compressed part fails its decode or its part's digest, never imports."""
    from kvmesh import squeeze

    blk = smooth_chain()[0]

    def zstd(raw, itemsize):
        used, wire = squeeze.encode_or_raw("bp-zstd1", raw, itemsize)
        return squeeze.codec_id(used), wire

    honest = lie(blk, WANT, None, zstd)
    assert len(honest) < len(lie(blk, WANT)) - 256  # it did compress
    want = Want(KEEP, ("bp-zstd1",))
    address, t = one_shot_server([honest])
    assert fetch(address, [blk], "e", want)[0].blob == trim(blk, WANT).blob
    t.join(5)
    refused = 0
    for at in range(1, len(honest), max(1, len(honest) // 61)):
        bad = honest[:at] + bytes([honest[at] ^ 0x40]) + honest[at + 1 :]
        address, t = one_shot_server([bad])
        try:
            got = fetch(address, [blk], "e", want)
        except KVMeshError:
            refused += 1
        else:
            assert got[0].blob == trim(blk, WANT).blob
        t.join(5)
    assert refused > 0
