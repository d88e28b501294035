"""KV events' access flags on real ``kvmesh head`` and ``kvmesh peer`` processes.

``tests/test_events_auth.py`` proves the rules on the publisher itself; here the
flags reach it: ``--kv-events-curve-key`` (the key file made at start, its public
key logged), ``--kv-events-curve-clients`` and ``--kv-events-hashes-only``, and
``--plaintext`` no longer opens events beyond loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvmesh.mesh.events import BlockStored, decode_batch, load_curve_key

from .procs import free_port
from .test_api import Head
from .test_events_nodes import B, complete, prompt


def test_plaintext_does_not_open_events_beyond_loopback():
    """The audit's setup (the README's fleet flags plus --kv-events tcp://*:P) is
    refused at start, naming the ways that are allowed."""
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "peer", "--listen", f"127.0.0.1:{free_port()}"]
        + ["--plaintext", "--kv-events", f"tcp://*:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "--kv-events-curve-key" in out.stderr and "--kv-events-hashes-only" in out.stderr


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def subscriber(ctx: zmq.Context, port: int, curve: tuple[bytes, bytes, bytes] | None):
    """A SUB on ``port``; ``curve``: (its public key, its secret key, the server's)."""
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def stored_after_prompts(
    sock: zmq.Socket, head: Head, seed: int
) -> tuple[list[int], list[BlockStored]]:
    """Complete new prompts until ``sock`` gets ``BlockStored`` (the first may go
    before the subscription is in): the last prompt and its events; at most a minute."""
    deadline = time.time() + 60
    while time.time() < deadline:
        tokens = prompt(seed)
        complete(head, tokens)
        got: list[BlockStored] = []
        while sock.poll(1000):
            got += [
                e
                for e in decode_batch(sock.recv_multipart()[-1]).events
                if isinstance(e, BlockStored)
            ]
        if got:
            return tokens, got
        seed += 1000
    raise AssertionError("no BlockStored came")


def test_a_head_publishes_prompts_to_listed_curve_clients_only(tmp_path, ctx):
    port = free_port()
    key, clients = tmp_path / "events.key", tmp_path / "clients.txt"
    router = zmq.curve_keypair()
    clients.write_text(f"{router[0].decode()} router\n")
    log = open(tmp_path / "head.log", "w")  # noqa: SIM115
    head = Head(
        "--kv-events",
        f"tcp://*:{port}",
        "--kv-events-curve-key",
        str(key),
        "--kv-events-curve-clients",
        str(clients),
        log=log,
    )
    try:
        server, _ = load_curve_key(key)  # made by the head at start
        assert server.decode() in Path(tmp_path / "head.log").read_text()  # and logged
        strangers = [
            subscriber(ctx, port, None),
            subscriber(ctx, port, (*zmq.curve_keypair(), server)),
        ]
        listed = subscriber(ctx, port, (*router, server))
        tokens, got = stored_after_prompts(listed, head, 7)
        assert [t for e in got for t in e.token_ids] == tokens[: 3 * B]  # its full blocks
        assert not any(s.poll(500) for s in strangers)
    finally:
        head.stop()
        log.close()


def test_a_head_with_hashes_only_tells_anyone_hashes_and_nothing_else(tmp_path, ctx):
    port = free_port()
    head = Head("--kv-events", f"tcp://*:{port}", "--kv-events-hashes-only")
    try:
        anyone = subscriber(ctx, port, None)
        _, got = stored_after_prompts(anyone, head, 8)
        assert sum(len(e.block_hashes) for e in got) == 3 and all(e.token_ids == [] for e in got)
    finally:
        head.stop()
