"""The connector's KV events in vLLM's own stream (needs the vLLM venv).

A real ``vllm serve`` (its OpenAI server, vLLM's default process layout) with the
connector and vLLM's ``--kv-events-config`` (publisher ``zmq``, connecting to a
loopback SUB socket this test binds). Every message is decoded by vLLM's own
``KVEventBatch`` decoder. A request produces ``BlockStored`` events of medium
``CPU`` (kvmesh's RAM tier, from the worker through the scheduler's
``take_events()``) whose ``token_ids`` concatenate to the prompt's full blocks, in
the same stream as vLLM's own ``GPU`` blocks, hashed as kvmesh keys them; a
``cache_salt`` request's blocks carry their tokens too, under its salt's keys;
under a budget of three pages, blocks evicted from RAM come as ``BlockRemoved``
of kvmesh's keys; the connector never clears.
"""

from __future__ import annotations

import json
import time
import urllib.request

import msgspec
import pytest

kv = pytest.importorskip(
    "vllm.distributed.kv_events",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)
zmq = pytest.importorskip("zmq")

from kvmesh.blocks import BlockKeyer, chain_root  # noqa: E402
from kvmesh.mesh.events import external_hash  # noqa: E402

from ..procs import free_port  # noqa: E402
from .serve import APIServer  # noqa: E402

BLOCK = 128  # vLLM's CPU page, kvmesh's block
PAGE_BYTES = 4 * 2 * 1 * BLOCK * 32 * 4  # demo-tiny: 4 layers, 1 KV head of 32, float32
TOPIC = b"kvmesh-test"
VLLM = msgspec.msgpack.Decoder(type=kv.KVEventBatch)


def prompt(first: int, n: int = 300) -> list[int]:
    return [first] + [(first * 17 + i * 11) % 240 + 5 for i in range(n - 1)]


def complete(url: str, model: str, tokens: list[int], salt: str | None = None) -> dict:
    body: dict = {"model": model, "prompt": tokens, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


class Stream:
    """The events a SUB socket received, decoded by vLLM's classes."""

    def __init__(self, sub: zmq.Socket) -> None:
        self.sub = sub
        self.events: list[object] = []

    def read(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000)):
                return
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            self.events.extend(VLLM.decode(payload).events)

    def stored(self, medium: str) -> list[kv.BlockStored]:
        return [e for e in self.events if isinstance(e, kv.BlockStored) and e.medium == medium]


def cpu_chain(stream: Stream, full: list[int], skip: set[int]) -> list[kv.BlockStored]:
    """The CPU BlockStored events (hashes not in ``skip``) that chain from a first
    block (no parent) carrying ``full``'s first tokens, in order."""
    out: list[kv.BlockStored] = []
    for e in stream.stored(kv.MEDIUM_CPU):
        if set(e.block_hashes) & skip:
            continue
        done = sum(len(x.token_ids) for x in out)
        parent = out[-1].block_hashes[-1] if out else None
        if e.parent_block_hash == parent and e.token_ids == full[done : done + len(e.token_ids)]:
            out.append(e)
    return out


def await_chain(
    srv: APIServer, model: str, stream: Stream, tokens: list[int], skip: set[int]
) -> list[kv.BlockStored]:
    """Reads until the prompt's full blocks arrived as CPU events. A worker reports
    its store's changes with vLLM's steps, and a save lands just after its step: a
    short request (no full block, so nothing of kvmesh's) gives vLLM a step."""
    full = tokens[: len(tokens) // BLOCK * BLOCK]
    for _ in range(10):
        stream.read(2.0)
        chain = cpu_chain(stream, full, skip)
        if [t for e in chain for t in e.token_ids] == full:
            return chain
        complete(srv.url, model, [7, 8, 9])
    return cpu_chain(stream, full, skip)


def _kvmesh_lines(tmp_path) -> list[str]:
    text = (tmp_path / "v.log").read_text(errors="replace").splitlines()
    return [line for line in text if "kvmesh" in line or "Error" in line][-30:]


def kvmesh_keys(resp: dict, tokens: list[int], salt: str | None = None) -> list[int]:
    """The full blocks' keys the connector uses (its namespace from the response's
    ``kv_transfer_params``), as events carry them."""
    ns = bytes.fromhex(resp["kv_transfer_params"]["kvmesh"]["cards"]["0"][1])
    keyer = BlockKeyer(ns, BLOCK, None)
    if salt is not None:
        keyer = keyer.rooted(chain_root(ns, None, salt))
    return [external_hash(k) for k in keyer.keys(tokens).blocks]


def warm_up(srv: APIServer, model: str, stream: Stream) -> list[int]:
    """Requests until the stream carries events: the first batches vLLM publishes
    after its start may be lost before its PUB socket's connection to ours is up
    (we saw a first request's events, GPU and CPU alike, never arrive)."""
    keys: list[int] = []
    for i in range(10):
        tokens = prompt(200 + i)
        keys += kvmesh_keys(complete(srv.url, model, tokens), tokens)
        stream.read(2.0)
        if stream.events:
            stream.read(2.0)  # the rest of this request's events
            stream.events.clear()
            return keys
    raise AssertionError("vLLM published no events")


def test_a_request_produces_cpu_block_stored_events_with_its_tokens(tiny_dir, tmp_path):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")  # vLLM connects to a host:port
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": TOPIC.decode(),
    }
    model = str(tiny_dir)
    stream = Stream(sub)
    try:
        kvmesh = {"grpc_listen": f"127.0.0.1:{free_port()}", "budget": 3 * PAGE_BYTES + 4096}
        with APIServer(
            model,
            kvmesh,
            tmp_path / "v.log",
            "--kv-events-config",
            json.dumps(events),
            "--enable-prefix-caching",
        ) as srv:
            sent = warm_up(srv, model, stream)  # kvmesh keys of every prompt sent
            plain = prompt(11)
            keys = kvmesh_keys(complete(srv.url, model, plain), plain)
            chain = await_chain(srv, model, stream, plain, set())
            salted = prompt(11)  # the same tokens, another key chain
            salted_keys = kvmesh_keys(
                complete(srv.url, model, salted, salt="tenant-a"), salted, "tenant-a"
            )
            hashes = {h for e in chain for h in e.block_hashes}
            salted_chain = await_chain(srv, model, stream, salted, hashes)
    finally:
        ctx.destroy(linger=0)
    full = plain[: len(plain) // BLOCK * BLOCK]
    seen = [
        (
            type(e).__name__,
            getattr(e, "medium", None),
            getattr(e, "token_ids", [])[:1],
            len(getattr(e, "token_ids", ())),
        )
        for e in stream.events
    ]
    assert [t for e in chain for t in e.token_ids] == full, (seen, _kvmesh_lines(tmp_path))
    assert all(e.block_size == BLOCK for e in chain)
    assert [h for e in chain for h in e.block_hashes] == keys  # kvmesh's own keys
    assert len(keys) == len(full) // BLOCK
    # vLLM's own GPU blocks of the same prompt, in the same stream
    gpu = [t for e in stream.stored(kv.MEDIUM_GPU) for t in e.token_ids]
    assert gpu[: len(full)] == full
    # a salted chain: recorded tokens, keys of its own (the salt is not in the events)
    assert [t for e in salted_chain for t in e.token_ids] == full
    assert [h for e in salted_chain for h in e.block_hashes] == salted_keys
    assert not hashes & set(salted_keys)
    # three pages of RAM: storing the salted chain evicted older blocks, announced by
    # kvmesh key; never one just stored
    removed = [
        h
        for e in stream.events
        if isinstance(e, kv.BlockRemoved) and e.medium == kv.MEDIUM_CPU
        for h in e.block_hashes
    ]
    assert removed, seen
    assert set(removed) <= set(sent + keys) and len(set(removed)) == len(removed)
    assert not any(isinstance(e, kv.AllBlocksCleared) for e in stream.events)


def test_the_scheduler_buffer_is_bounded_and_speaks_vllms_classes():
    """What a worker sends (kvmesh's events as msgpack, over vLLM's metadata) comes
    out of ``take_events()`` as vLLM's classes; past the bound the newest are
    dropped and counted with the worker's own drops; a clear never passes."""
    from kvmesh.mesh import events as ours
    from kvmesh.vllm.connector import EventBuffer, KVMeshWorkerMeta

    def payload(*events: object) -> bytes:
        return msgspec.msgpack.encode(list(events))

    stored = ours.BlockStored([1, 2], None, list(range(2 * BLOCK)), BLOCK, None, "CPU", None)
    removed = ours.BlockRemoved([1], "STORAGE")
    rank0 = KVMeshWorkerMeta(events=[payload(ours.AllBlocksCleared(), stored)], events_dropped=3)
    rank1 = KVMeshWorkerMeta(events=[payload(removed)], events_dropped=1)
    meta = rank0.aggregate(rank1)
    buf = EventBuffer(max_events=2)
    buf.keep(meta.events, meta.events_dropped)
    got = buf.take()
    assert got == [
        kv.BlockStored(
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=list(range(256)),
            block_size=BLOCK,
            lora_id=None,
            medium=kv.MEDIUM_CPU,
            lora_name=None,
        ),
        kv.BlockRemoved(block_hashes=[1], medium=kv.MEDIUM_STORAGE),
    ]
    assert buf.dropped == 4 and buf.take() == []
    buf.keep([payload(stored, stored, removed), b"\xc1not msgpack"])
    assert len(buf) == 2 and buf.dropped == 5  # one over the bound
    assert buf.undecodable == 1  # the bad payload skipped
