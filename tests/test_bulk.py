"""The bulk data path (kvmesh/mesh/bulk_*.py) on real loopback sockets.

Honest fetch and publish, under a fleet key and TLS / mutual TLS; then every way a
hostile client or server may misbehave: each is a typed error on the other side,
counted, with nothing allocated beyond the caps and the node still serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.codec import Layout
from kvmesh.errors import (
    ChecksumMismatch,
    ConfigError,
    KVMeshError,
    LeaseExpired,
    LocalBusy,
    MalformedPayload,
    PeerBusy,
    PeerTimeout,
    PeerUnavailable,
    StaleEpoch,
    Unauthenticated,
)
from kvmesh.mesh import bulk_client, bulk_server
from kvmesh.mesh import bulk_wire as bulk
from kvmesh.mesh.bulk_client import STREAMS, Cancel, Dialer
from kvmesh.mesh.bulk_server import BulkServer
from kvmesh.mesh.bulk_wire import FRAME, HELLO, FetchStalled, hello
from kvmesh.mesh.client import MeshClient
from kvmesh.mesh.hits import PeerHit
from kvmesh.mesh.membership import Membership
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.mesh.security import FleetAuth, TLSConfig, body_digest
from kvmesh.mesh.server import CacheService
from kvmesh.store import BlockStore

from .helpers import small_card, synthetic_chain

CARD = small_card()
LAYOUT = Layout(CARD)
CHAIN = synthetic_chain(CARD, list(range(41)))  # 10 blocks and a tail
KEY = b"k" * 32
HASHERS = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def infos(blocks):
    return [
        pb.BlockInfo(key=b.key, nbytes=b.nbytes, digest=b.digest, tokens=b.header.tokens)
        for b in blocks
    ]


class Served:
    """A cache service and its bulk server on loopback."""

    def __init__(self, blocks=CHAIN, auth=None, tls=None, **kw):
        self.store = BlockStore(1 << 26)
        for b in blocks:
            self.store.put(b)
        self.cache = CacheService(self.store, max_block_bytes=1 << 16, max_inflight_bytes=1 << 17)
        self.server = BulkServer(self.cache, auth, tls, **kw)
        self.address = f"127.0.0.1:{self.server.start('127.0.0.1')}"

    @property
    def counters(self):
        return self.cache.counters

    def fetch_raw(self, keys=None, epoch=None) -> bytes:
        keys = [b.key for b in CHAIN] if keys is None else keys
        req = pb.FetchRequest(namespace=CARD.namespace, keys=keys, epoch=epoch or self.store.epoch)
        return req.SerializeToString()

    def fetch(self, raw=None, want=CHAIN, cred="", dialer=None, progress=5.0):
        return bulk_client.fetch(
            self.address,
            dialer or Dialer(None),
            cred,
            raw or self.fetch_raw(),
            infos(want),
            LAYOUT,
            HASHERS,
            None,
            progress,
            30.0,
            Cancel(),
        )

    def publish(self, blocks=CHAIN, cred="", body=None, dialer=None):
        body = body or publish_body(blocks)
        return bulk_client.publish(
            self.address,
            dialer or Dialer(None),
            cred,
            body,
            blocks,
            5.0,
            30.0,
            Cancel(),
        )

    def close(self):
        self.server.stop()


def publish_body(blocks, card=CARD, announced=None) -> bytes:
    import json

    msg = pb.BulkPublish(card_json=json.dumps(card.to_json()), blocks=announced or infos(blocks))
    return msg.SerializeToString()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


@pytest.fixture
def empty():
    s = Served(blocks=[])
    yield s
    s.close()


def raw_exchange(address: str, data: bytes, read: int = 4096, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a plain socket; what comes back before the server closes."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while len(out) < read:
            try:
                chunk = s.recv(read)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            out += chunk
        return out


def error_reason(reply: bytes) -> str:
    code, n = FRAME.unpack_from(reply)
    assert code == bulk.ERROR, reply[:32]
    return reply[FRAME.size : FRAME.size + n].decode().split(":", 1)[0]


# -- honest ---------------------------------------------------------------------


def test_fetch_returns_verified_blocks_and_publish_stores_them(served, empty):
    got = served.fetch()
    assert [b.blob for b in got] == [b.blob for b in CHAIN]
    assert [b.digest for b in got] == [b.digest for b in CHAIN]
    assert served.counters["fetches"] == 1 and served.counters["bytes_served"] > 0

    resp = empty.publish()
    assert (resp.stored, resp.duplicates, resp.rejected) == (len(CHAIN), 0, 0)
    assert all(b.key in empty.store for b in CHAIN)
    again = empty.publish()
    assert (again.stored, again.duplicates) == (0, len(CHAIN))
    assert empty.cache.inflight_bytes == 0
    assert [b.blob for b in empty.fetch()] == [b.blob for b in CHAIN]


def test_fleet_key_credentials_are_checked(tmp_path):
    server_auth = FleetAuth(KEY, "srv")
    s = Served(auth=server_auth)
    try:
        client = FleetAuth(KEY, "cli")
        raw = s.fetch_raw()

        def cred(raw, dest="srv", method=bulk.METHODS[bulk.FETCH], auth=client):
            return auth.call_metadata(method, dest, body_digest(raw))[0][1]

        assert len(s.fetch(raw, cred=cred(raw))) == len(CHAIN)
        bad = [
            "",  # none
            cred(raw, dest="other"),  # made for another node
            cred(s.fetch_raw([CHAIN[0].key])),  # bound to another request
            cred(raw, method=bulk.METHODS[bulk.PUBLISH]),  # another method
            cred(raw, auth=FleetAuth(b"x" * 32, "cli")),  # another fleet
        ]
        for c in bad:
            with pytest.raises(Unauthenticated):
                s.fetch(raw, cred=c)
        replay = cred(raw)
        s.fetch(raw, cred=replay)
        with pytest.raises(Unauthenticated):
            s.fetch(raw, cred=replay)
        assert s.counters["unauthenticated"] == len(bad) + 1
        assert s.counters["unauthenticated:wrong_destination"] == 1
        assert s.counters["fetches"] == 2

        # a publish credential binds every block's digest: swapping one is refused
        e = Served(blocks=[], auth=server_auth)
        try:
            body = publish_body(CHAIN)
            pub = client.call_metadata(bulk.METHODS[bulk.PUBLISH], "srv", body_digest(body))
            forged = infos(CHAIN)
            forged[3].digest = bytes(32)
            with pytest.raises(Unauthenticated):
                e.publish(cred=pub[0][1], body=publish_body(CHAIN, announced=forged))
            body2 = publish_body(CHAIN)
            ok = client.call_metadata(bulk.METHODS[bulk.PUBLISH], "srv", body_digest(body2))
            assert e.publish(cred=ok[0][1], body=body2).stored == len(CHAIN)
        finally:
            e.close()
    finally:
        s.close()


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_mutual_tls(certs, mutual):
    tls = TLSConfig(
        cert=certs / "server.pem", key=certs / "server.key", ca=certs / "ca.pem" if mutual else None
    )
    s = Served(tls=tls)
    try:
        client = Dialer(
            TLSConfig(cert=certs / "client.pem", key=certs / "client.key", ca=certs / "ca.pem")
        )
        assert [b.digest for b in s.fetch(dialer=client)] == [b.digest for b in CHAIN]
        with pytest.raises(KVMeshError):  # plaintext to a TLS port
            s.fetch()
        with pytest.raises(KVMeshError):  # a server we cannot verify
            s.fetch(dialer=Dialer(TLSConfig(ca=certs / "client.pem")))
        if mutual:  # no client certificate
            with pytest.raises(KVMeshError):
                s.fetch(dialer=Dialer(TLSConfig(ca=certs / "ca.pem")))
        assert len(s.fetch(dialer=client)) == len(CHAIN)  # still serving
    finally:
        s.close()


# -- hostile clients ----------------------------------------------------------------


def test_fetch_refusals_are_typed_and_the_server_keeps_serving(served):
    with pytest.raises(StaleEpoch):
        served.fetch(served.fetch_raw(epoch="another-life"))
    with pytest.raises(LeaseExpired):
        served.fetch(served.fetch_raw([bytes(32)]), want=CHAIN[:1])
    dup = [CHAIN[0].key, CHAIN[0].key]
    with pytest.raises(MalformedPayload):
        served.fetch(served.fetch_raw(dup), want=[CHAIN[0], CHAIN[0]])
    assert served.counters["bulk_rejected:stale_epoch"] == 1
    assert served.counters["fetch_rejected:duplicate_keys"] == 1
    assert len(served.fetch()) == len(CHAIN)


def test_garbage_requests_get_a_typed_refusal(served):
    assert error_reason(raw_exchange(served.address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")) == (
        "malformed_payload"
    )
    huge = HELLO.pack(bulk.MAGIC, bulk.FETCH, 2**31, bytes(32), 0, b"")  # refused unallocated
    assert error_reason(raw_exchange(served.address, huge)) == "oversize_payload"
    bad_op = HELLO.pack(bulk.MAGIC, 9, 0, bytes(32), 0, b"")
    assert error_reason(raw_exchange(served.address, bad_op)) == "malformed_payload"
    junk = b"\xff" * 40
    not_proto = hello(bulk.FETCH, junk, "") + junk
    assert error_reason(raw_exchange(served.address, not_proto)) == "malformed_payload"
    lying = hello(bulk.FETCH, b"other", "") + served.fetch_raw()  # a body it does not announce
    assert error_reason(raw_exchange(served.address, lying)) == "malformed_payload"
    raw_exchange(served.address, hello(bulk.FETCH, junk, "")[:7], read=0)  # then closes
    wait_for(lambda: served.counters["bulk_rejected:peer_unreachable"] >= 1)
    assert len(served.fetch()) == len(CHAIN)


def _publish_raw(address: str, body: bytes, payload: bytes, read: bool = True) -> bytes:
    head = hello(bulk.PUBLISH, body, "") + body
    return raw_exchange(address, head + payload, read=4096 if read else 0)


def _done(reply: bytes) -> pb.PublishResponse:
    code, n = FRAME.unpack_from(reply)
    assert code == bulk.DONE, reply[:40]
    return pb.PublishResponse.FromString(reply[FRAME.size : FRAME.size + n])


def test_publish_with_a_wrong_digest_keeps_only_the_good_blocks(empty):
    announced = infos(CHAIN[:4])
    announced[2].digest = bytes(32)
    payload = b"".join(b.blob for b in CHAIN[:4])
    resp = _done(_publish_raw(empty.address, publish_body(CHAIN[:4], announced=announced), payload))
    assert resp.rejected == 1 and resp.reason == "checksum_mismatch"
    assert resp.stored == 2  # blocks 0 and 1 arrived whole before the bad one
    assert CHAIN[1].key in empty.store and CHAIN[2].key not in empty.store
    assert empty.counters["publish_rejected:checksum_mismatch"] == 1
    assert empty.cache.inflight_bytes == 0


def test_publish_refusals_before_allocation(empty):
    big = infos(CHAIN[:1])
    big[0].nbytes = 1 << 40  # over this node's cap: refused when announced
    resp = _done(_publish_raw(empty.address, publish_body(CHAIN[:1], announced=big), b""))
    assert resp.reason == "oversize_payload"
    none = pb.BulkPublish(card_json="{}").SerializeToString()
    assert error_reason(_publish_raw(empty.address, none, b"")) == "malformed_payload"
    bad_card = pb.BulkPublish(card_json="[1, 2]", blocks=infos(CHAIN[:1])).SerializeToString()
    assert error_reason(_publish_raw(empty.address, bad_card, b"")) == "malformed_payload"
    assert empty.cache.inflight_bytes == 0 and empty.store.stats.entries == 0
    assert empty.publish().stored == len(CHAIN)  # still serving


def test_an_abandoned_or_silent_publish_frees_its_reservation():
    s = Served(blocks=[], progress_s=0.5)
    try:
        body = publish_body(CHAIN[:3])
        half = CHAIN[0].blob + CHAIN[1].blob[: CHAIN[1].nbytes // 2]
        _publish_raw(s.address, body, half, read=False)  # closes midway
        wait_for(lambda: s.counters["publish_rejected:peer_unreachable"] == 1)
        host, port = s.address.split(":")
        with socket.create_connection((host, int(port))) as silent:  # sends half, then nothing
            silent.sendall(hello(bulk.PUBLISH, body, "") + body + half)
            wait_for(lambda: s.counters["publish_rejected:stalled"] == 1)
        wait_for(lambda: s.cache.inflight_bytes == 0)
        assert CHAIN[0].key in s.store and CHAIN[1].key not in s.store
    finally:
        s.close()


def _hold_streams(address: str, n: int, op: int = bulk.FETCH) -> list[socket.socket]:
    """``n`` authenticated streams (no fleet key) that announce a body and never send it."""
    host, port = address.split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(n)]
    for c in held:
        c.sendall(HELLO.pack(bulk.MAGIC, op, 100, bytes(32), 0, b""))
    return held


def test_streams_beyond_the_cap_are_refused_busy_which_is_not_a_failure():
    s = Served(max_conns=2, progress_s=30.0)
    idle = []
    try:
        idle = _hold_streams(s.address, 2)
        wait_for(lambda: s.server.gate.counts() == (0, 2))
        with pytest.raises(PeerBusy, match="busy"):  # typed: the head does not back off
            s.fetch()
        assert s.counters["bulk_rejected:busy"] == 1
        for c in idle:
            c.close()
        wait_for(lambda: s.server.gate.counts() == (0, 0))
        assert len(s.fetch()) == len(CHAIN)
    finally:
        for c in idle:
            c.close()
        s.close()


def test_a_busy_refusal_reaches_a_client_still_sending_as_busy(monkeypatch):
    """The refusal comes before the body is read: the server drains what the
    client is still sending, so the client reads ``busy`` (not a reset, which
    would blame the peer) even with megabytes of its request unsent."""
    monkeypatch.setattr(bulk_server, "DRAIN_S", 60.0)  # ends when the client closes, not by time
    s = Served(max_conns=1, progress_s=30.0)
    idle = []
    try:
        idle = _hold_streams(s.address, 1)
        wait_for(lambda: s.server.gate.counts() == (0, 1))
        big = b"\0" * (bulk.MAX_BODY - 1)  # not parsed: refused before it is read
        for _ in range(3):
            # one refused connection drains at a time (max_conns): the next is cut at
            # once (a reset) until the server has seen the last client close
            wait_for(lambda: s.server.gate.refusing() == 0)
            with pytest.raises(PeerBusy, match="busy"):
                s.fetch(big)
        assert s.counters["bulk_rejected:busy"] == 3
        wait_for(lambda: s.server.gate.refusing() == 0)  # each drain ended with its client
    finally:
        for c in idle:
            c.close()
        s.close()


def test_connections_refused_busy_are_bounded_and_cut_at_stop(monkeypatch):
    """A connection answered ``busy`` is held (draining) within the gate's
    accounting: at most ``max_conns`` of them, the next closed at once, and all
    cut when the server stops."""
    monkeypatch.setattr(bulk_server, "DRAIN_S", 600.0)
    s = Served(max_conns=1, progress_s=600.0)
    held = []
    try:
        held = _hold_streams(s.address, 1)
        wait_for(lambda: s.server.gate.counts() == (0, 1))
        held += _hold_streams(s.address, 1)  # refused busy, then silent: drains
        wait_for(lambda: s.server.gate.refusing() == 1)
        reply = raw_exchange(s.address, HELLO.pack(bulk.MAGIC, bulk.FETCH, 100, bytes(32), 0, b""))
        assert error_reason(reply) == "busy"  # answered and closed: no place to drain
        assert s.server.gate.refusing() == 1 and s.counters["bulk_rejected:busy"] == 2
        s.server.stop()
        wait_for(lambda: s.server.gate.counts() == (0, 0) and s.server.gate.refusing() == 0)
    finally:
        for c in held:
            c.close()
        s.close()


def test_a_connection_without_a_thread_is_cut_and_the_acceptor_goes_on(monkeypatch):
    s = Served()
    real = threading.Thread
    failures = []

    class Flaky(real):  # type: ignore[misc,valid-type]
        def start(self):
            if getattr(self, "_target", None) == s.server._serve and not failures:
                failures.append(self)
                raise RuntimeError("can't start new thread")
            super().start()

    try:
        monkeypatch.setattr(threading, "Thread", Flaky)
        assert raw_exchange(s.address, b"", read=1) == b""  # cut
        assert failures and s.counters["bulk_rejected:no_thread"] == 1
        assert s.server.gate.counts() == (0, 0)
        assert len(s.fetch()) == len(CHAIN)  # the next one is served
    finally:
        monkeypatch.undo()
        s.close()


# -- before authentication: a fixed-size hello, a deadline for all of it, per-source caps ---


class SlowLoris:
    """``n`` connections from ``source`` that send a byte of a hello every ``every``
    seconds and never authenticate; stops when closed."""

    def __init__(self, address: str, n: int, source: str = "127.0.0.1", every: float = 2.0):
        host, port = address.split(":")
        self.stop = threading.Event()
        self.socks = [
            socket.create_connection((host, int(port)), source_address=(source, 0))
            for _ in range(n)
        ]
        self.thread = threading.Thread(target=self._drip, args=(every,), daemon=True)
        self.thread.start()

    def _drip(self, every: float) -> None:
        data = hello(bulk.FETCH, b"x" * 64, "")
        for i in range(len(data)):
            for c in self.socks:
                with contextlib.suppress(OSError):
                    c.send(data[i : i + 1])
            if self.stop.wait(every):
                return

    def cut(self) -> int:
        """How many of them the server has closed."""
        n = 0
        for c in self.socks:
            c.setblocking(False)
            try:
                n += c.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                n += 1
        return n

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for c in self.socks:
            c.close()


def _auth_fetch(s: Served, client: FleetAuth) -> list:
    raw = s.fetch_raw()
    cred = client.call_metadata(bulk.METHODS[bulk.FETCH], "srv", body_digest(raw))[0][1]
    return s.fetch(raw, cred=cred)


def test_slow_unauthenticated_connections_do_not_stop_an_honest_fetch():
    """32 connections dripping a hello from the honest client's own address (the
    worst case: a per-source cap cannot tell them apart) with a pre-auth deadline
    long enough not to help: only 8 stay, each new one cutting that address's
    oldest, so the honest fetch always gets its turn."""
    s = Served(auth=FleetAuth(KEY, "srv"), auth_s=600.0, progress_s=600.0)
    loris = None
    try:
        loris = SlowLoris(s.address, 32)
        wait_for(lambda: s.counters["bulk_rejected:evicted"] == 32 - bulk_server.PER_SOURCE)
        assert s.server.gate.counts() == (bulk_server.PER_SOURCE, 0)
        client = FleetAuth(KEY, "cli")
        for _ in range(3):
            assert [b.digest for b in _auth_fetch(s, client)] == [b.digest for b in CHAIN]
        assert s.counters["fetches"] == 3 and s.counters["unauthenticated"] == 0
        # the first fetch cut the oldest; the rest found a free place
        assert s.counters["bulk_rejected:evicted"] == 32 - bulk_server.PER_SOURCE + 1
        wait_for(lambda: loris.cut() == 32 - bulk_server.PER_SOURCE + 1)
    finally:
        if loris is not None:
            loris.close()
        s.close()


def test_slow_connections_from_another_address_cost_an_honest_client_nothing():
    s = Served(auth=FleetAuth(KEY, "srv"), auth_s=600.0, progress_s=600.0)
    loris = None
    try:
        loris = SlowLoris(s.address, 32, source="127.0.0.2")
        # 32 connections on a loaded 2-core box: a generous wait, never a time assertion
        wait_for(lambda: s.counters["bulk_rejected:evicted"] == 32 - bulk_server.PER_SOURCE, 60.0)
        assert len(_auth_fetch(s, FleetAuth(KEY, "cli"))) == len(CHAIN)
        assert s.counters["bulk_rejected:evicted"] == 32 - bulk_server.PER_SOURCE  # none of theirs
        assert s.server.gate.counts() == (bulk_server.PER_SOURCE, 0)
    finally:
        if loris is not None:
            loris.close()
        s.close()


def test_the_pre_auth_deadline_is_for_the_whole_hello_not_each_read():
    """Each byte arrives well within the progress timeout; the hello as a whole
    does not arrive within ``auth_s``: cut, counted, and the node keeps serving."""
    s = Served(auth_s=0.5, progress_s=600.0)
    loris = None
    try:
        loris = SlowLoris(s.address, 3, every=0.05)
        wait_for(lambda: s.counters["bulk_rejected:auth_deadline"] == 3)
        wait_for(lambda: loris.cut() == 3)
        assert len(s.fetch()) == len(CHAIN)
    finally:
        if loris is not None:
            loris.close()
        s.close()


def test_a_refused_credential_is_answered_before_any_body_is_read():
    """The hello announces a 4 MiB body that never comes. Were the server to read
    it before checking the credential, it would wait out its 600 s progress
    timeout; it answers ``unauthenticated`` and closes at once instead."""
    s = Served(auth=FleetAuth(KEY, "srv"), progress_s=600.0)
    try:
        body = b"\0" * bulk.MAX_BODY
        for cred in (
            "",
            FleetAuth(b"x" * 32, "cli").call_metadata(
                bulk.METHODS[bulk.FETCH], "srv", body_digest(body)
            )[0][1],
        ):
            reply = raw_exchange(s.address, hello(bulk.FETCH, body, cred), timeout=60.0)
            assert error_reason(reply) == "unauthenticated"
            code, n = FRAME.unpack_from(reply)
            assert len(reply) == FRAME.size + n  # then the server closed the stream
        assert s.counters["unauthenticated"] == 2
        assert s.counters["unauthenticated:malformed"] == 1  # none at all
        assert s.counters["unauthenticated:bad_mac"] == 1
        assert s.counters["bulk_rejected:unauthenticated"] == 2
        assert s.counters["fetches"] == 0
    finally:
        s.close()


def test_a_version_1_hello_is_refused_by_name(served):
    old = struct.pack("<4sBIH", b"KVX1", bulk.FETCH, 0, 0)
    reply = raw_exchange(served.address, old)
    assert error_reason(reply) == "malformed_payload" and b"KVX2" in reply


def test_a_silent_tls_handshake_is_cut_at_the_pre_auth_deadline(certs):
    s = Served(tls=TLSConfig(cert=certs / "server.pem", key=certs / "server.key"), auth_s=0.5)
    try:
        host, port = s.address.split(":")
        with socket.create_connection((host, int(port)), timeout=60) as quiet:
            assert quiet.recv(1) == b""  # closed by the server, no handshake ever sent
        wait_for(lambda: s.counters["bulk_rejected:auth_deadline"] == 1)
    finally:
        s.close()


def test_a_fetch_limit_counts_from_when_its_thread_starts(served):
    """A fetch that waited longer than its whole limit for a thread still gets all
    of it (the wait was ours, not the peer's)."""
    pool = ThreadPoolExecutor(1)
    gate = threading.Event()
    try:
        pool.submit(gate.wait, 60)  # the only thread, busy
        fut = pool.submit(
            bulk_client.fetch,
            served.address,
            Dialer(None),
            "",
            served.fetch_raw(),
            infos(CHAIN),
            LAYOUT,
            HASHERS,
            None,
            5.0,
            0.5,
            Cancel(),
        )
        queued = time.monotonic()
        while time.monotonic() < queued + 1.0:  # longer than its limit, in the queue
            time.sleep(0.05)
        gate.set()
        assert len(fut.result(60)) == len(CHAIN)
    finally:
        gate.set()
        pool.shutdown()


def test_a_fetch_that_cannot_get_a_local_stream_is_local_busy_not_the_peers_fault(served):
    """Every stream thread of the client is held by fetches from a peer that never
    answers: one more fetch gives up waiting for a thread as ``LocalBusy`` (never
    having reached its peer), and gets one once they are gone."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=STREAMS * 2)
    nowhere = f"127.0.0.1:{silent.getsockname()[1]}"

    def hit(address: str) -> PeerHit:
        return PeerHit(
            "p",
            "p",
            address,
            "loopback",
            served.store.epoch,
            tuple(infos(CHAIN)),
            None,
            41,
            data_address=address,
        )

    async def run() -> None:
        client = MeshClient(
            Membership("me", pb.CapabilityCard), fetch_deadline=600.0, progress_timeout=600.0
        )
        stuck = [asyncio.create_task(client.fetch(LAYOUT, hit(nowhere))) for _ in range(STREAMS)]
        try:
            while not client.bulk._stream_slots.locked():
                await asyncio.sleep(0.01)
            with pytest.raises(LocalBusy):
                await client.fetch(LAYOUT, hit(served.address), deadline=0.3)
            assert client.counters["local_busy"] == 1 and served.counters["fetches"] == 0
            for t in stuck:
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
            assert len(await client.fetch(LAYOUT, hit(served.address))) == len(CHAIN)
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        silent.close()


class FakeSlots:
    """Stands in for a client's stream slots: taking one takes ``wait_s`` on the
    client's (fake) clock."""

    def __init__(self, clock: list[float], wait_s: float) -> None:
        self.clock, self.wait_s = clock, wait_s

    async def acquire(self) -> bool:
        self.clock[0] += self.wait_s
        return True

    def release(self) -> None:
        pass


def _budgeted(wait_s: float, limit_s: float):
    """(limit the stream got, or the error raised, the client's counters) after a
    wait of ``wait_s`` for a slot, on a fake clock."""
    got: list[float] = []

    def stream(tag: str, limit: float, cancel: Cancel, digest: bytes) -> str:
        got.append(limit)
        return tag + digest.decode()

    async def run():
        client = MeshClient(Membership("me", pb.CapabilityCard))
        now = [100.0]
        client.bulk._clock = lambda: now[0]
        client.bulk._stream_slots = FakeSlots(now, wait_s)  # type: ignore[assignment]
        try:
            out = await client.bulk._on_stream(stream, "ok", limit_s=limit_s, digest=b"!")
            assert out == "ok!"
            return got[0], client.counters
        except LocalBusy as e:
            assert not got  # the stream never started: the peer was never reached
            return e, client.counters
        finally:
            await client.close()

    return asyncio.run(run())


def test_the_wait_for_a_stream_and_the_stream_share_one_limit():
    """The head's budget is one: a stream gets what the wait for it left, and a
    wait that leaves too little is ours (LocalBusy), never the peer's failure."""
    assert _budgeted(0.0, 10.0)[0] == 10.0
    assert _budgeted(4.0, 10.0)[0] == pytest.approx(6.0)
    assert _budgeted(0.0, 0.01)[0] == pytest.approx(0.01)  # a short limit with no wait still runs
    for wait in (9.99, 10.0):
        err, counters = _budgeted(wait, 10.0)
        assert isinstance(err, LocalBusy) and counters["local_busy"] == 1


def test_a_request_body_is_hashed_once_for_its_credential_and_its_hello(monkeypatch):
    from kvmesh.mesh import bulk_client as client_mod

    s = Served(auth=FleetAuth(KEY, "srv"))
    hashed: list[str] = []
    real = client_mod.body_digest

    def counting(where):
        def digest(raw: bytes) -> bytes:
            hashed.append(where)
            return real(raw)

        return digest

    monkeypatch.setattr(client_mod, "body_digest", counting("client"))
    monkeypatch.setattr(bulk_server, "body_digest", counting("bulk"))
    hit = PeerHit(
        "srv",
        "srv",
        s.address,
        "loopback",
        s.store.epoch,
        tuple(infos(CHAIN)),
        None,
        41,
        data_address=s.address,
    )

    async def run():
        client = MeshClient(Membership("cli", pb.CapabilityCard), FleetAuth(KEY, "cli"))
        try:
            return await client.fetch(LAYOUT, hit)
        finally:
            await client.close()

    try:
        assert len(asyncio.run(run())) == len(CHAIN)
        assert hashed == ["client", "bulk"]  # the client once; the server checks the body
        assert s.counters["fetches"] == 1 and s.counters["unauthenticated"] == 0
    finally:
        s.close()


def test_a_node_id_too_long_for_a_bulk_credential_is_refused_at_setup(served):
    long_id = "n" * 400
    with pytest.raises(ConfigError, match="node id"):
        MeshClient(Membership(long_id, pb.CapabilityCard), FleetAuth(KEY, long_id))
    MeshClient(Membership(long_id, pb.CapabilityCard), FleetAuth(KEY, long_id), use_bulk=False)
    MeshClient(Membership(long_id, pb.CapabilityCard))  # no key: no credential at all

    # a peer whose id is too long for ours is that peer's problem, found before any stream
    hit = PeerHit(
        "p" * 500,
        "p",
        served.address,
        "loopback",
        served.store.epoch,
        tuple(infos(CHAIN)),
        None,
        41,
        data_address=served.address,
    )

    async def run():
        client = MeshClient(Membership("cli", pb.CapabilityCard), FleetAuth(KEY, "cli"))
        try:
            with pytest.raises(MalformedPayload, match="node id"):
                await client.fetch(LAYOUT, hit)
        finally:
            await client.close()

    asyncio.run(run())
    assert served.counters["fetches"] == 0 and served.counters["bulk_rejected:busy"] == 0


# -- hostile servers ------------------------------------------------------------------


class FakeServer:
    """Speaks the bulk protocol's replies wrongly on purpose: ``behave(conn)`` runs
    once the request has been read."""

    def __init__(self, behave):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.behave = behave
        self.started = threading.Event()
        self.release = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            _, _, body_len, *_ = HELLO.unpack(conn.recv(HELLO.size, socket.MSG_WAITALL))
            if body_len:
                conn.recv(body_len, socket.MSG_WAITALL)
            self.started.set()
            with contextlib.suppress(OSError):
                self.behave(self, conn)
            self.release.wait(30)

    def close(self):
        self.release.set()
        self.sock.close()


def _block(conn, blob):
    conn.sendall(FRAME.pack(bulk.BLOCK, len(blob)) + blob)


def _fetch_from(fake, progress=5.0, deadline=20.0, cancel=None):
    raw = pb.FetchRequest(keys=[b.key for b in CHAIN[:3]]).SerializeToString()
    try:
        return bulk_client.fetch(
            fake.address,
            Dialer(None),
            "",
            raw,
            infos(CHAIN[:3]),
            LAYOUT,
            HASHERS,
            None,
            progress,
            deadline,
            cancel or Cancel(),
        )
    finally:
        fake.close()


def _flipped(blob: bytes) -> bytes:
    b = bytearray(blob)
    b[-1] ^= 1
    return bytes(b)


HOSTILE = {
    "wrong_size": (lambda f, c: _block(c, CHAIN[0].blob + b"x"), MalformedPayload),
    "flipped_byte": (lambda f, c: _block(c, _flipped(CHAIN[0].blob)), ChecksumMismatch),
    "another_block": (lambda f, c: _block(c, CHAIN[1].blob), ChecksumMismatch),
    "closes_midway": (
        lambda f, c: c.sendall(FRAME.pack(bulk.BLOCK, CHAIN[0].nbytes)),
        PeerUnavailable,
    ),
    "huge_error": (lambda f, c: c.sendall(FRAME.pack(bulk.ERROR, 10**9)), MalformedPayload),
    "unknown_frame": (lambda f, c: c.sendall(FRAME.pack(7, 3) + b"abc"), MalformedPayload),
    "typed_error": (
        lambda f, c: c.sendall(FRAME.pack(bulk.ERROR, 13) + b"stale_epoch: x"[:13]),
        StaleEpoch,
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_server_gets_a_typed_error(name):
    behave, error = HOSTILE[name]

    def then_close(f, c):
        behave(f, c)
        c.shutdown(socket.SHUT_WR)

    with pytest.raises(error):
        _fetch_from(FakeServer(then_close))


def test_a_silent_server_stalls_and_a_slow_one_meets_the_deadline():
    with pytest.raises(FetchStalled):
        _fetch_from(FakeServer(lambda f, c: None), progress=0.3)

    def trickle(f, c):
        c.sendall(FRAME.pack(bulk.BLOCK, CHAIN[0].nbytes))
        for i in range(CHAIN[0].nbytes):
            if f.release.wait(0.05):
                return
            c.sendall(CHAIN[0].blob[i : i + 1])

    with pytest.raises(PeerTimeout) as e:  # each byte in time, the whole too late
        _fetch_from(FakeServer(trickle), progress=1.0, deadline=0.6)
    assert not isinstance(e.value, FetchStalled)


def test_cancel_aborts_a_blocked_stream_at_once():
    fake = FakeServer(lambda f, c: None)
    cancel = Cancel()
    threading.Thread(target=lambda: (fake.started.wait(10), cancel()), daemon=True).start()
    with pytest.raises(PeerUnavailable):  # not FetchStalled: the progress timeout is 30 s
        _fetch_from(fake, progress=30.0, deadline=60.0, cancel=cancel)


def test_frame_layout_is_fixed():
    assert HELLO.size == struct.calcsize("<4sBI32sH1024s") == 1067 and FRAME.size == 9
    assert bulk.MAGIC == b"KVX2"


_FUZZ: list[Served] = []


def _fuzz_target() -> Served:
    if not _FUZZ:
        _FUZZ.append(Served(progress_s=0.2, auth_s=0.5))
    return _FUZZ[0]


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.builds(  # a well-formed hello over random ops, bodies and credentials
            lambda op, body, cred, digest: (
                HELLO.pack(bulk.MAGIC, op, len(body), digest or body_digest(body), len(cred), cred)
                + body
            ),
            st.sampled_from([bulk.FETCH, bulk.PUBLISH, 0, 255]),
            st.binary(max_size=200),
            st.binary(max_size=40),
            st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
        ),
    )
)
def test_random_bytes_on_the_data_port_never_hurt_the_node(raw):
    s = _fuzz_target()
    reply = raw_exchange(s.address, raw, timeout=3.0)
    if reply:  # whatever came back is a well-formed refusal, never a block
        code, _ = FRAME.unpack_from(reply)
        assert code in (bulk.ERROR, bulk.DONE)
    assert len(s.fetch()) == len(CHAIN)  # and it still serves
