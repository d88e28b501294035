"""KV events from real head and peer processes, read by ZMQ subscribers.

The scenarios take the decoder as a parameter: here kvmesh's own structs decode
the payloads; ``tests/vllm/test_kv_events.py`` runs the same scenarios with
vLLM's own ``KVEventBatch`` decoder."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from .procs import Peer
from .test_api import Head

VOCAB, B = 320, 32  # demo-tiny's
Decode = Callable[[bytes], Any]


def our_decoder() -> Decode:
    from kvmesh.mesh.events import decode_batch

    return decode_batch


class Subscriber:
    """A SUB socket on a node's endpoint, keeping (seq, batch) in arrival order."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, decode: Decode, hwm: int = 100_000, rcvbuf: int = -1
    ) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.decode = decode
        self.got: list[tuple[int, Any]] = []

    def drain(self, quiet: float = 1.0, timeout: float = 20.0) -> list[tuple[int, Any]]:
        """Read until nothing came for ``quiet`` seconds; returns what was new."""
        start, deadline = len(self.got), time.time() + timeout
        while time.time() < deadline and self.sock.poll(int(quiet * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            self.got.append((int.from_bytes(seq, "big"), self.decode(payload)))
        return self.got[start:]


def events(batches: list[tuple[int, Any]]) -> list[Any]:
    return [e for _, b in batches for e in b.events]


def kind(e: Any) -> str:
    return type(e).__name__


def prompt(seed: int, n: int = 3 * B + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def complete(head: Head, tokens: list[int]) -> dict:
    body = {"model": "demo-tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0}
    r = head.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    head.wait(lambda s: s["publish_pending"] == 0)
    return r.json()


def held(head: Head, tokens: list[int], alias: str) -> int:
    q = head.http.post("/v1/cache/query", json={"model": "demo-tiny", "token_ids": tokens})
    return int(q.json()["prefix"].get(alias, 0))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    d = tmp_path_factory.mktemp("ev")
    ep = {n: f"ipc://{d}/{n}.sock" for n in ("head", "peer", "replay")}
    # RAM for about five blocks: four prompts of three blocks make it evict
    peer = Peer(
        "--kv-events",
        ep["peer"],
        "--kv-events-replay",
        ep["replay"],
        "--kv-events-topic",
        "kv",
        "--budget",
        "180KiB",
        alias="evpeer",
        log_dir=d,
    )
    head = None
    try:
        head = Head(
            "--seed",
            peer.address,
            "--alias",
            "evhead",
            "--kv-events",
            ep["head"],
            "--kv-events-topic",
            "kv",
        )
        head.wait(lambda s: s["compatible_peers"] >= 1)
        yield head, peer, ep
    finally:
        if head is not None:
            head.stop()
        peer.kill()


def run_stored_removed_restart(nodes: Any, decode: Decode) -> None:
    """The Done-when scenario: a head's BlockStored carry the prompt's full blocks;
    a peer's BlockRemoved are exactly its evicted keys; a restart clears."""
    head, peer, ep = nodes
    ctx = zmq.Context()
    try:
        hsub = Subscriber(ctx, ep["head"], decode)
        psub = Subscriber(ctx, ep["peer"], decode)
        time.sleep(0.5)  # subscriptions reach the publishers
        prompts = [prompt(i) for i in range(4)]
        chains: list[list[int]] = []
        for i, tokens in enumerate(prompts):
            complete(head, tokens)
            new = events(hsub.drain())
            stored = [e for e in new if kind(e) == "BlockStored"]
            assert stored and all(e.medium == "CPU" and e.block_size == B for e in stored)
            assert [t for e in stored for t in e.token_ids] == tokens[: 3 * B]  # full blocks
            chains.append([h for e in stored for h in e.block_hashes])
            assert stored[0].parent_block_hash is None
            if i == 0:
                assert kind(new[0]) == "AllBlocksCleared"  # the epoch, with the first changes
        pev = events(psub.drain())
        assert kind(pev[0]) == "AllBlocksCleared"
        put = [h for e in pev if kind(e) == "BlockStored" for h in e.block_hashes]
        gone = [h for e in pev if kind(e) == "BlockRemoved" for h in e.block_hashes]
        assert all(e.token_ids == [] for e in pev if kind(e) == "BlockStored")  # hashes only
        assert sorted(put) == sorted(h for c in chains for h in c)  # the same keys as the head
        still = {
            h
            for c, t in zip(chains, prompts, strict=True)
            for h in c[: held(head, t, "evpeer") // B]
        }
        assert gone and set(gone) == set(put) - still and len(gone) == len(set(gone))
        peer.restart()
        # a fresh subscriber (libzmq's SUB may not resume after its publisher was
        # down for a while: docs/routing.md); the new epoch starts at seq 0, clear
        fresh = Subscriber(ctx, ep["peer"], decode)
        time.sleep(0.5)
        again = prompt(99)
        deadline = time.time() + 20
        while not held(head, again, "evpeer") and time.time() < deadline:
            complete(head, again)  # until the head publishes to the new epoch
        after = fresh.drain()
        assert after and after[0][0] == 0 and kind(after[0][1].events[0]) == "AllBlocksCleared"
        assert {h for e in events(after) for h in getattr(e, "block_hashes", ())} <= {
            h for _, b in hsub.drain() for e in b.events for h in getattr(e, "block_hashes", ())
        } | set(put)  # blocks the head computed
        replayed = replay(ctx, ep["replay"], decode)
        assert [s for s, _ in replayed] == [s for s, _ in after]
        assert kind(replayed[0][1].events[0]) == "AllBlocksCleared"
    finally:
        ctx.destroy(linger=0)


def replay(ctx: zmq.Context, endpoint: str, decode: Decode, start: int = 0) -> list:
    """vLLM's replay protocol: ask from ``start``; batches until seq -1."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    req.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while req.poll(5000):
        _, seq, payload = req.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            return out
        out.append((int.from_bytes(seq, "big"), decode(payload)))
    raise AssertionError("the replay never ended")


def run_stuck_subscriber(nodes: Any, decode: Decode) -> None:
    """A subscriber that stops reading: requests go on, the head's memory stays
    flat, and a reading subscriber still gets every batch in order."""
    head, _, ep = nodes
    ctx = zmq.Context()
    try:
        stuck = Subscriber(ctx, ep["head"], decode, hwm=1, rcvbuf=1024)
        live = Subscriber(ctx, ep["head"], decode)
        time.sleep(0.5)
        stuck.sock.poll(0)  # it never reads again
        complete(head, prompt(1000))  # warm: the first request's allocations are not growth
        before = rss_kib(head.proc.pid)
        for i in range(12):
            complete(head, prompt(2000 + i, 2 * B + 3))
        grown = rss_kib(head.proc.pid) - before
        got = live.drain()
        seqs = [s for s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap for the reader
        hashes = [h for e in events(got) if kind(e) == "BlockStored" for h in e.block_hashes]
        assert len(hashes) >= 24  # two full blocks a request
        assert grown < 64 << 10, grown  # KiB: the stuck reader holds nothing on the head
        changes = head.metric('kvmesh_kv_events_total{outcome="changes"}')
        assert (
            changes >= len(hashes) and head.metric('kvmesh_kv_events_total{outcome="dropped"}') == 0
        )
        assert (
            head.metric('kvmesh_kv_events_total{outcome="send_failed"}') == 0
        )  # PUB never refuses
    finally:
        ctx.destroy(linger=0)


def test_stored_removed_and_restart(nodes):
    run_stored_removed_restart(nodes, our_decoder())


def test_a_stuck_subscriber_costs_the_head_nothing(nodes):
    run_stuck_subscriber(nodes, our_decoder())
