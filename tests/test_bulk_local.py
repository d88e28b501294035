"""Nodes on one host exchange block bytes over a Unix socket (kvmesh/mesh/bulk_*.py).

A real cache peer process and a real head node: the peer's card says it is on this
host, so the head's fetch dials the peer's Unix socket, at a path both derive from
the peer's node id, and gets the producer's output from verified bytes. A peer
that opts out (``--no-local-socket``), a socket file that is gone, and a node of
another host identity all fall back to TCP with nothing lost and no peer blamed.
The socket lives in a private directory, and a head ended by SIGTERM removes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvmesh.engine import Sampling
from kvmesh.mesh import bulk_wire as bulk
from kvmesh.mesh.bulk_server import BulkServer
from kvmesh.mesh.bulk_wire import local_socket_path
from kvmesh.mesh.server import CacheService
from kvmesh.runtime.head import HeadRuntime
from kvmesh.runtime.telemetry import Source
from kvmesh.store import BlockStore

from .helpers import wait_for
from .procs import Peer
from .test_fresh_fetch import close, head, head_node

PROMPT = [3 + (i * 11) % 200 for i in range(150)]  # 4 blocks of 32 and a tail
SAMPLING = Sampling(max_tokens=4)


@pytest.fixture
def runtime_dir(monkeypatch):
    """Socket files of this test's nodes (and of its peer processes) go here: a short
    path of its own (a socket's path fits 108 bytes; pytest's tmp_path under
    parallel workers can be longer, and the node then uses none)."""
    base = tempfile.mkdtemp(prefix="kvrt-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    yield Path(base) / f"kvmesh-{os.getuid()}"
    shutil.rmtree(base, ignore_errors=True)


def publish(engine, peer):
    """A head computes PROMPT and publishes it to ``peer``; its output (head closed)."""
    first = head(engine, [peer.address])
    try:
        wait_for(lambda: first.fleet.members(), 10)
        cold = first.complete(PROMPT, SAMPLING)
        first.flush(30)
        return cold
    finally:
        close(first)


def fetch(engine, peer, host=None):
    """A fresh head (of host identity ``host`` if given) completes PROMPT: (its
    output, how many of its bulk streams went over a Unix socket), the head closed."""
    node = head_node([peer.address])
    fresh = HeadRuntime(engine, node)
    try:
        if host is not None:
            node.node.client.local_host = host  # what its card says, and whom it dials locally
        ns = engine.card.namespace_hex
        wait_for(lambda: any(ns in c.namespaces for c in fresh.fleet.members()), 10)
        out = fresh.complete(PROMPT, SAMPLING)
        counted = fresh.telemetry.snapshot()["counters"]
        assert not [k for k in counted if k.startswith("peer_failed")], counted
    finally:
        close(fresh)
    return out, fresh.fleet.local_streams()


def publish_then_fetch(engine, peer):
    cold = publish(engine, peer)
    return (cold, *fetch(engine, peer))


def test_a_fetch_from_a_peer_on_this_host_goes_over_its_unix_socket(tiny_engine, runtime_dir):
    peer = Peer(alias="cache", log_dir=runtime_dir.parent)
    try:
        wait_for(lambda: any(runtime_dir.glob("bulk-*.sock")), 10)
        cold, hit, local_streams = publish_then_fetch(tiny_engine, peer)
    finally:
        peer.kill()
    r = hit.report
    assert r is not None and r.source == Source.REMOTE and r.fallback is None
    assert r.reused_tokens == len(PROMPT) and hit.tokens == cold.tokens
    assert local_streams >= 1  # the fetch (and the first head's publish) went local


def test_a_peer_that_opts_out_is_fetched_over_tcp(tiny_engine, runtime_dir):
    peer = Peer("--no-local-socket", alias="cache", log_dir=runtime_dir.parent)
    try:
        cold, hit, local_streams = publish_then_fetch(tiny_engine, peer)
        assert not any(runtime_dir.glob("bulk-*.sock"))  # the heads' went; the peer made none
    finally:
        peer.kill()
    assert hit.report is not None and hit.report.source == Source.REMOTE
    assert hit.tokens == cold.tokens
    assert local_streams == 0


def test_a_socket_that_is_gone_or_another_hosts_falls_back_to_tcp(tiny_engine, runtime_dir):
    peer = Peer(alias="cache", log_dir=runtime_dir.parent)
    try:
        cold = publish(tiny_engine, peer)
        for host, remove in ((b"another host", False), (None, True)):
            sockets = list(runtime_dir.glob("bulk-*.sock"))
            assert len(sockets) == 1  # the peer's (each head's own went when it closed)
            if remove:
                sockets[0].unlink()
            hit, local_streams = fetch(tiny_engine, peer, host)
            assert hit.report is not None and hit.report.source == Source.REMOTE
            assert hit.report.fallback is None and hit.tokens == cold.tokens
            assert local_streams == 0
    finally:
        peer.kill()


def test_the_socket_is_private_and_removed_at_stop(runtime_dir):
    server = BulkServer(CacheService(BlockStore(1 << 20)))
    path = local_socket_path("node-a")
    assert path.startswith(str(runtime_dir))
    server.start("127.0.0.1", 0, path)
    try:
        assert server.local_path == path
        assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        server.stop()
    assert not os.path.exists(path)


def test_a_directory_others_may_use_is_refused_and_tcp_still_serves(runtime_dir):
    runtime_dir.mkdir(mode=0o777)
    os.chmod(runtime_dir, 0o777)  # the mode a hostile local user would leave
    server = BulkServer(CacheService(BlockStore(1 << 20)))
    port = server.start("127.0.0.1", 0, local_socket_path("node-b"))
    try:
        assert port > 0 and server.local_path == ""  # TCP only; the refusal is logged
        assert not any(runtime_dir.iterdir())
    finally:
        server.stop()


def test_host_identity_names_this_kernel_mount_namespace_and_user():
    me = bulk.host_identity()
    assert len(me) == 16 and me == bulk.host_identity()  # stable within one host
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvmesh.mesh import bulk_wire; print(bulk_wire.host_identity().hex())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == me.hex()  # another process here agrees


def test_sigterm_closes_the_head_and_removes_its_socket(runtime_dir):
    args = ["head", "--model", "demo-tiny", "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None and "http://" in proc.stdout.readline()
        assert len(list(runtime_dir.glob("bulk-*.sock"))) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # ended through its finally blocks, not killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(runtime_dir.glob("bulk-*.sock"))


def test_a_live_nodes_socket_is_never_taken_over_and_a_dead_ones_is(runtime_dir):
    path = local_socket_path("node-c")
    first = BulkServer(CacheService(BlockStore(1 << 20)))
    first.start("127.0.0.1", 0, path)
    try:
        second = BulkServer(CacheService(BlockStore(1 << 20)))
        second.start("127.0.0.1", 0, path)  # the same node id twice: TCP only
        assert second.local_path == ""
        second.stop()
        assert os.path.exists(path)  # still the first node's
    finally:
        first.stop()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # a file nobody listens on, as a killed node leaves it
    dead.close()
    third = BulkServer(CacheService(BlockStore(1 << 20)))
    third.start("127.0.0.1", 0, path)
    try:
        assert third.local_path == path
    finally:
        third.stop()
    assert not os.path.exists(path)


def dead_socket_file(path: Path, age_s: float) -> None:
    """A socket file nobody listens on, as a killed node leaves it, ``age_s`` old."""
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_a_starting_node_removes_dead_nodes_socket_files_and_no_live_ones(runtime_dir):
    live = BulkServer(CacheService(BlockStore(1 << 20)))
    live.start("127.0.0.1", 0, local_socket_path("node-live"))
    try:
        long_ago = time.time() - 3600
        os.utime(live.local_path, (long_ago, long_ago))  # a node up for an hour
        stale = runtime_dir / "bulk-killed-an-hour-ago.sock"
        young = runtime_dir / "bulk-killed-just-now.sock"  # or bound, not yet listening
        dead_socket_file(stale, 3600)
        dead_socket_file(young, 1)
        other = runtime_dir / "bulk-not-a-socket.sock"
        other.write_text("")
        os.utime(other, (long_ago, long_ago))
        starting = BulkServer(CacheService(BlockStore(1 << 20)))
        starting.start("127.0.0.1", 0, local_socket_path("node-new"))
        starting.stop()
        assert not stale.exists()
        assert young.exists() and other.exists() and os.path.exists(live.local_path)
        # the live node answered the probe: a connection, not a refused request
        wait_for(lambda: live.counters["bulk_local_connections"] == 1, 10)
        wait_for(lambda: live.gate.counts() == (0, 0), 10)  # its handler is done
        assert not [k for k in live.counters if k.startswith("bulk_rejected")], live.counters
    finally:
        live.stop()
