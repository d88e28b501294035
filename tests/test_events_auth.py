"""KV events: who may listen, and what a hostile peer of the sockets can cost.

Issue #36: a subscriber that authenticated nothing read a head's prompts as token
ids, and a raw ZMTP client announcing a 4 GiB frame grew the head by a gigabyte on
each socket. Here, with real sockets and real processes (a ``kvmesh peer``, or a
small process publishing through :class:`NodeEvents` exactly as a node does): an
endpoint beyond loopback is refused unless CURVE authenticates its subscribers or
it publishes hashes only; an unauthenticated subscriber then gets nothing (or,
by the operator's choice, hashes without tokens); and a frame announced at 4 GiB
is refused on every socket with the publisher's RSS unchanged."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvmesh.errors import ConfigError
from kvmesh.mesh.events import (
    MAX_IN_BYTES,
    BlockStored,
    EventPublisher,
    EventsConfig,
    StoreEvents,
    decode_batch,
    events_config,
    load_curve_clients,
    load_curve_key,
)

from .helpers import small_card
from .procs import Peer, free_port
from .test_events_nodes import rss_kib

ROOT = Path(__file__).resolve().parents[1]
B = small_card().block_tokens
END = (-1).to_bytes(8, "big", signed=True)


def tokens_of(i: int) -> list[int]:
    """The tokens the publisher process keys block ``i`` with (its hash is ``i``)."""
    return [7000 + i % 100] * B


# -- which configs may exist ------------------------------------------------------

BEYOND = [
    "tcp://*:5557",
    "tcp://0.0.0.0:5557",
    "tcp://10.0.0.2:5557",
    "tcp://[::]:5557",
    "tcp://eth0:5557",  # an interface: libzmq binds its address
    "tcp://router.example:5557",  # connects to another host
    "tcp://127.0.0.1;10.0.0.2:5557",  # a source address, then another host
    "tcp://127.attacker.example:5557",  # a name, not a loopback address
]
LOCAL = [
    "tcp://127.0.0.1:5557",
    "tcp://localhost:5557",
    "tcp://[::1]:5557",
    "tcp://127.0.0.2:5557",
    "ipc:///tmp/kvmesh-ev.sock",
    "inproc://ev",
]


@pytest.mark.parametrize("endpoint", BEYOND)
def test_an_endpoint_beyond_loopback_needs_curve_or_hashes_only(endpoint, tmp_path):
    for values in (
        {"kv_events": endpoint},
        {"kv_events": endpoint, "plaintext": True},  # the gRPC flag no longer covers events
        {"kv_events": "ipc:///tmp/a", "kv_events_replay": endpoint},
    ):
        with pytest.raises(ConfigError) as e:
            events_config(values)
        assert "--kv-events-curve-key" in str(e.value) and "--kv-events-hashes-only" in str(e.value)
    hashes = events_config({"kv_events": endpoint, "kv_events_hashes_only": True})
    assert hashes is not None and not hashes.token_ids
    key = tmp_path / "events.key"
    curve = events_config({"kv_events": endpoint, "kv_events_curve_key": str(key)})
    assert curve is not None and curve.token_ids and curve.curve_key == str(key)


@pytest.mark.parametrize("endpoint", LOCAL)
def test_loopback_and_local_endpoints_need_no_key(endpoint):
    cfg = events_config({"kv_events": endpoint, "kv_events_replay": "tcp://127.0.0.1:5558"})
    assert cfg == EventsConfig(endpoint, "tcp://127.0.0.1:5558") and cfg.token_ids


def test_the_config_itself_refuses_what_the_options_would():
    """A library caller (the bench, a test) cannot build what the flags may not."""
    with pytest.raises(ConfigError, match="--kv-events-curve-key"):
        EventsConfig("tcp://*:5557")
    with pytest.raises(ConfigError, match="needs --kv-events-curve-key"):
        EventsConfig("ipc:///tmp/a", curve_clients="clients.txt")
    assert not EventsConfig("tcp://*:5557", token_ids=False).token_ids


@pytest.mark.parametrize(
    "name", ["kv_events_replay", "kv_events_curve_key", "kv_events_curve_clients"]
)
def test_event_options_need_an_endpoint(name):
    with pytest.raises(ConfigError, match="needs --kv-events"):
        events_config({name: "x"})
    with pytest.raises(ConfigError, match="--kv-events-hashes-only needs --kv-events"):
        events_config({"kv_events_hashes_only": True})
    assert events_config({}) is None


# -- key files ------------------------------------------------------------------------


def test_a_missing_key_file_is_made_private_and_its_public_key_printed(tmp_path):
    key = tmp_path / "events.key"
    events_config({"kv_events": "tcp://*:5557", "kv_events_curve_key": str(key)})
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(key)  # ZeroMQ's own certificate format
    assert secret is not None and zmq.curve_public(secret) == public
    assert load_curve_key(key) == (public, secret)  # made once: read back, not remade
    shown = subprocess.run(
        [sys.executable, "-m", "kvmesh.mesh.events", str(key)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0 and shown.stdout.strip() == public.decode(), shown.stderr


def test_key_files_zeromq_made_and_bare_keys_are_read(tmp_path):
    public, secret_file = zmq.auth.create_certificates(tmp_path, "node")
    with pytest.raises(ConfigError, match="chmod 600"):  # a secret others may read: refused
        load_curve_key(secret_file)
    os.chmod(secret_file, 0o600)
    assert load_curve_key(secret_file) == zmq.auth.load_certificate(secret_file)
    bare = tmp_path / "bare.key"
    pub, sec = zmq.curve_keypair()
    bare.write_text(f"# an operator's note\n{sec.decode()}\n")
    bare.chmod(0o600)
    assert load_curve_key(bare) == (pub, sec)
    os.chown(bare, 65534, 65534)  # another user's: refused, whatever its mode
    with pytest.raises(ConfigError, match="another user"):
        load_curve_key(bare)


@pytest.mark.parametrize(
    "text,error",
    [
        ("not a key\n", "no CURVE secret key"),
        ("", "no CURVE secret key"),
        (
            f'curve\n    public-key = "{zmq.curve_keypair()[0].decode()}"\n'
            f'    secret-key = "{zmq.curve_keypair()[1].decode()}"\n',
            "not the secret key's",
        ),
    ],
)
def test_a_bad_key_file_is_a_clear_error(tmp_path, text, error):
    key = tmp_path / "bad.key"
    key.write_text(text)
    key.chmod(0o600)
    with pytest.raises(ConfigError, match=error):
        events_config({"kv_events": "tcp://*:5557", "kv_events_curve_key": str(key)})


def test_client_key_files(tmp_path):
    a, b = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    cert_public, _ = zmq.auth.create_certificates(tmp_path, "router")
    listed = tmp_path / "clients.txt"
    listed.write_text(
        f"# routers allowed to subscribe\n\n{a.decode()}  llm-d-scorer\n{b.decode()}\n"
        + Path(cert_public).read_text()  # a ZeroMQ public certificate, pasted as is
    )
    assert load_curve_clients(listed) == {a, b, zmq.auth.load_certificate(cert_public)[0]}
    for text, error in (
        ("", "no CURVE public key"),
        ("# nobody\n", "no CURVE public key"),
        (f"{a.decode()}\nlaptop\n", ":2: not a CURVE public key"),
        (f"{a.decode()[:-1]} short\n", ":1: not a CURVE public key"),
        (f'    secret-key = "{zmq.curve_keypair()[1].decode()}"\n', "a secret key"),
    ):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=error):
            load_curve_clients(bad)


# -- a publishing process ---------------------------------------------------------------

PUBLISHER = r"""
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from kvmesh.codec import Layout
from kvmesh.mesh.events import EventsConfig, NodeEvents
from tests.helpers import small_card
card = small_card()
layout, B = Layout(card), card.block_tokens
node = NodeEvents(EventsConfig(**json.loads(sys.argv[1])))
print("ready", flush=True)
i = 0
while True:  # a block every 20 ms, its tokens seen first, as a head keys a prompt
    key = i.to_bytes(32, "big")
    node.source.memo.record(key, [7000 + i % 100] * B)  # tokens_of(i)
    node.source("stored", "ram", layout.header("block", key, card.namespace, 0, B))
    i += 1
    time.sleep(0.02)
"""


class Publisher:
    """A process publishing a node's events (:class:`NodeEvents`) from ``config``."""

    def __init__(self, log: Path, **config: object) -> None:
        self.log = log
        with open(log, "a") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", PUBLISHER, json.dumps(config)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"publisher did not start: {log.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def sub(ctx: zmq.Context, port: int, keys: tuple[bytes, bytes] | None, server: bytes | None):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        s.curve_publickey, s.curve_secretkey = keys
        s.curve_serverkey = server
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def dealer(ctx: zmq.Context, port: int, keys: tuple[bytes, bytes] | None, server: bytes | None):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        s.curve_publickey, s.curve_secretkey = keys
        s.curve_serverkey = server
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send_multipart((b"", (0).to_bytes(8, "big")))
    return s


def stored(frames: list[bytes]) -> list[BlockStored]:
    return [e for e in decode_batch(frames[-1]).events if isinstance(e, BlockStored)]


def read_batches(sock: zmq.Socket, n: int) -> list[list[bytes]]:
    """``n`` messages (waiting as long as they take to come, up to a minute)."""
    out: list[list[bytes]] = []
    deadline = time.time() + 60
    while len(out) < n and time.time() < deadline:
        if sock.poll(200):
            out.append(sock.recv_multipart())
    assert len(out) == n, f"{len(out)} of {n} messages came"
    return out


def silent(*socks: zmq.Socket) -> bool:
    """Nothing waits on any of ``socks`` (what came is read by now: the caller has
    waited for an authenticated socket's messages meanwhile)."""
    return not any(s.poll(500) for s in socks)


def test_an_unauthenticated_subscriber_gets_nothing(tmp_path, ctx):
    """CURVE with a client list: no subscriber and no replay client gets a byte
    without a listed key; a listed one gets the blocks with their tokens."""
    port, replay = free_port(), free_port()
    listed, unlisted = zmq.curve_keypair(), zmq.curve_keypair()
    clients = tmp_path / "clients.txt"
    clients.write_text(listed[0].decode() + "  the router\n")
    key = tmp_path / "events.key"
    pub = Publisher(
        tmp_path / "publisher.log",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay}",
        curve_key=str(key),
        curve_clients=str(clients),
    )
    try:
        server, _ = load_curve_key(key)
        wrong_server = zmq.curve_keypair()[0]
        strangers = [
            sub(ctx, port, None, None),  # plain ZMTP (what the audit's subscriber was)
            sub(ctx, port, unlisted, server),  # knows the server's key, is not listed
            sub(ctx, port, listed, wrong_server),  # listed, but talks to someone else
        ]
        router = sub(ctx, port, listed, server)
        got = read_batches(router, 10)
        blocks = [e for f in got for e in stored(f)]
        assert blocks and all(e.token_ids == tokens_of(e.block_hashes[0]) for e in blocks)
        assert silent(*strangers)
        asks = [dealer(ctx, replay, None, None), dealer(ctx, replay, unlisted, server)]
        mine = dealer(ctx, replay, listed, server)
        replayed = []
        while (frames := read_batches(mine, 1)[0])[1] != END:
            replayed.append(frames)
        assert [int.from_bytes(f[1], "big") for f in replayed][:10] == list(range(10))
        assert silent(*asks)
        assert "refused a subscriber" in (tmp_path / "publisher.log").read_text()
    finally:
        pub.stop()


def test_without_a_client_list_the_server_key_is_what_admits(tmp_path, ctx):
    """No --kv-events-curve-clients: any CURVE client that knows the node's public
    key subscribes; plain ZMTP and a wrong server key still get nothing."""
    port = free_port()
    key = tmp_path / "events.key"
    pub = Publisher(tmp_path / "publisher.log", endpoint=f"tcp://*:{port}", curve_key=str(key))
    try:
        server, _ = load_curve_key(key)
        strangers = [
            sub(ctx, port, None, None),
            sub(ctx, port, zmq.curve_keypair(), zmq.curve_keypair()[0]),
        ]
        anyone = sub(ctx, port, zmq.curve_keypair(), server)
        assert any(e.token_ids for f in read_batches(anyone, 5) for e in stored(f))
        assert silent(*strangers)
        assert "any client that knows it" in (tmp_path / "publisher.log").read_text()
    finally:
        pub.stop()


def test_hashes_only_is_all_an_unauthenticated_subscriber_gets(tmp_path, ctx):
    """--kv-events-hashes-only on a wildcard without CURVE: anyone may subscribe,
    and what they get are block hashes: no token ids (the node's memo keeps none)."""
    port, replay = free_port(), free_port()
    pub = Publisher(
        tmp_path / "publisher.log",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay}",
        token_ids=False,
    )
    try:
        anyone = sub(ctx, port, None, None)
        blocks = [e for f in read_batches(anyone, 10) for e in stored(f)]
        assert blocks and all(e.token_ids == [] and e.block_size == B for e in blocks)
        asked = dealer(ctx, replay, None, None)
        while (frames := read_batches(asked, 1)[0])[1] != END:
            assert all(e.token_ids == [] for e in stored(frames))
        assert (
            "unauthenticated (--kv-events-hashes-only)" in (tmp_path / "publisher.log").read_text()
        )
    finally:
        pub.stop()


def test_the_publisher_strips_tokens_whatever_its_source_holds(tmp_path, ctx):
    """Hashes only is the publisher's rule, not only its node's memo: a source
    that has tokens (a sink built elsewhere) does not get them out."""
    endpoint = f"ipc://{tmp_path}/ev.sock"
    pub = EventPublisher(EventsConfig(endpoint, token_ids=False), StoreEvents())
    try:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(endpoint)
        deadline = time.time() + 30
        while not s.poll(100) and time.time() < deadline:  # until the subscription is in
            pub.publish([BlockStored([1], None, list(range(B)), B, None, "CPU", None)])
        (ev,) = stored(s.recv_multipart())
        assert ev.token_ids == [] and ev.block_hashes == [1]
    finally:
        pub.close()


def test_a_hashes_only_node_keeps_no_tokens(tmp_path):
    """The head's keyer records into its node's memo: with hashes only, nothing."""
    from kvmesh.mesh.events import NodeEvents

    node = NodeEvents(EventsConfig(f"ipc://{tmp_path}/ev.sock", token_ids=False))
    try:
        node.source.memo.record(bytes(32), list(range(B)))
        assert len(node.source.memo) == 0 and node.source.memo.get(bytes(32)) is None
    finally:
        node.close()


def test_an_ipv6_loopback_pub_binds_without_a_key(ctx):
    """vLLM's rule connects tcp://127.0.0.1:P; tcp://[::1]:P binds, on loopback only."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    pub = EventPublisher(EventsConfig(f"tcp://[::1]:{port}"), StoreEvents())
    try:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.IPV6, 1)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://[::1]:{port}")
        deadline = time.time() + 30
        while not s.poll(100) and time.time() < deadline:
            pub.publish([BlockStored([2], None, list(range(B)), B, None, "CPU", None)])
        (ev,) = stored(s.recv_multipart())
        assert ev.token_ids == list(range(B))  # local: tokens, as before
    finally:
        pub.close()


# -- a frame announced at 4 GiB ---------------------------------------------------------

HUGE = 4 << 30
SENT_CAP = 256 << 20  # what the attacker streams into the frame at most
RSS_BOUND_KIB = 16 << 10  # the publisher's growth allowed: noise, not the frame


def greeting(mechanism: bytes) -> bytes:
    """ZMTP 3.0's greeting (RFC 23): signature, version, mechanism, as-server, filler."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32)


def ready(socket_type: bytes) -> bytes:
    """The NULL mechanism's READY command with the one property a peer checks."""
    body = b"\x05READY\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return b"\x04" + bytes([len(body)]) + body


def flood(conn: socket.socket, preamble: bytes, flags: int) -> int:
    """Send ``preamble``, announce a 4 GiB frame, stream its bytes until the peer
    cuts us off (or ``SENT_CAP``); returns the bytes streamed. The connection is
    left open: a frame held half-sent is what the audit's client did."""
    conn.sendall(preamble + bytes([flags]) + HUGE.to_bytes(8, "big"))
    conn.settimeout(20)
    chunk, sent = bytes(1 << 20), 0
    try:
        while sent < SENT_CAP:
            sent += conn.send(chunk)
    except OSError:  # reset: the peer refused the frame and closed
        pass
    return sent


def assert_refused(pid: int, attack) -> None:  # type: ignore[no-untyped-def]
    """``attack()`` (returning its connection and the bytes it streamed) costs the
    publishing process ``pid`` no memory: measured with the connection still open."""
    before = rss_kib(pid)
    conn, sent = attack()
    try:
        time.sleep(0.5)  # libzmq's I/O thread has read whatever it was going to read
        grown = rss_kib(pid) - before
    finally:
        conn.close()
    assert grown < RSS_BOUND_KIB, f"the publisher grew by {grown} KiB"
    assert sent < SENT_CAP, "the publisher kept reading a frame announced at 4 GiB"


@pytest.fixture
def peer_events(tmp_path) -> Iterator[tuple[Peer, socket.socket, int]]:
    """A real ``kvmesh peer`` whose PUB connects to a listener of ours (loopback:
    whoever holds the port is its subscriber) and whose replay ROUTER binds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    replay = free_port()
    peer = Peer(
        "--kv-events",
        f"tcp://127.0.0.1:{listener.getsockname()[1]}",
        "--kv-events-replay",
        f"tcp://127.0.0.1:{replay}",
        alias="evhostile",
        log_dir=tmp_path,
    )
    try:
        yield peer, listener, replay
    finally:
        peer.kill()
        listener.close()


def test_a_4gib_frame_on_a_peers_replay_socket_is_refused(peer_events, ctx):
    peer, _, replay = peer_events
    assert peer.proc is not None

    def attack() -> tuple[socket.socket, int]:
        conn = socket.create_connection(("127.0.0.1", replay))
        return conn, flood(conn, greeting(b"NULL") + ready(b"DEALER"), 0x02)

    assert_refused(peer.proc.pid, attack)
    asked = dealer(ctx, replay, None, None)  # the socket still serves everyone else
    assert asked.poll(10_000) and asked.recv_multipart()[1] == END


def test_a_4gib_frame_from_a_subscriber_is_refused_by_a_peers_pub(peer_events, ctx):
    """Whoever holds the port a PUB connects to is its subscriber: one that
    announces a 4 GiB frame is cut off (libzmq does not redial a peer that broke
    the protocol) and the node goes on."""
    peer, listener, replay = peer_events
    assert peer.proc is not None
    listener.settimeout(30)

    def attack() -> tuple[socket.socket, int]:
        conn, _ = listener.accept()  # the PUB connecting to its subscriber
        return conn, flood(conn, greeting(b"NULL") + ready(b"SUB"), 0x02)

    assert_refused(peer.proc.pid, attack)
    asked = dealer(ctx, replay, None, None)
    assert asked.poll(10_000) and asked.recv_multipart()[1] == END
    assert peer.proc.poll() is None


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "hashes-only"])
def test_a_4gib_frame_on_a_wildcard_pub_is_refused(tmp_path, curve):
    """Beyond loopback: under CURVE the frame comes before any authentication
    (where HELLO belongs); hashes-only takes plain ZMTP from anyone."""
    port = free_port()
    who: dict[str, object] = {"curve_key": str(tmp_path / "k")} if curve else {"token_ids": False}
    pub = Publisher(tmp_path / "publisher.log", endpoint=f"tcp://*:{port}", **who)
    try:

        def attack() -> tuple[socket.socket, int]:
            conn = socket.create_connection(("127.0.0.1", port))
            if curve:  # a command frame (flags: command, long) in HELLO's place
                return conn, flood(conn, greeting(b"CURVE"), 0x06)
            return conn, flood(conn, greeting(b"NULL") + ready(b"SUB"), 0x02)

        assert_refused(pub.pid, attack)
    finally:
        pub.stop()


def test_the_inbound_bound_admits_a_real_curve_handshake():
    """MAX_IN_BYTES is above what a real client sends (CURVE's INITIATE carries
    the client's metadata): the bound refuses hostile frames, not handshakes."""
    assert MAX_IN_BYTES >= 1024
    big_identity = b"r" * 255  # the largest routing id ZMTP carries
    port = free_port()
    key = zmq.curve_keypair()
    c = zmq.Context()
    try:
        router = c.socket(zmq.ROUTER)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_IN_BYTES)
        router.curve_server, router.curve_secretkey = True, key[1]
        router.bind(f"tcp://127.0.0.1:{port}")
        d = c.socket(zmq.DEALER)
        d.setsockopt(zmq.ROUTING_ID, big_identity)
        d.curve_publickey, d.curve_secretkey = zmq.curve_keypair()
        d.curve_serverkey = key[0]
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send_multipart((b"", bytes(8)))
        assert router.poll(10_000) and router.recv_multipart()[0] == big_identity
    finally:
        c.destroy(linger=0)
