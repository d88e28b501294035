"""KV events: the store's changes in vLLM's wire format over real ZMQ sockets.

The format is checked field by field against vLLM 0.32's documented layout with
plain msgpack (an array batch, tagged-map events); tests/vllm decodes the same
bytes with vLLM's own classes."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvmesh.blocks import MEDIA_IDS, BlockKeyer, MediaItem
from kvmesh.codec import Layout
from kvmesh.mesh.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventsConfig,
    RecordingKeyer,
    StoreEvents,
    TokenMemo,
    decode_batch,
    external_hash,
)
from kvmesh.store import BlockStore, DiskConfig

from .helpers import small_card, synthetic_chain
from .procs import free_port

CARD = small_card()
B = CARD.block_tokens


def recording(memo: TokenMemo) -> RecordingKeyer:
    return RecordingKeyer(BlockKeyer(CARD.namespace, B), memo)


def events_of(sink: StoreEvents) -> list:
    out = []
    while batch := sink.take():
        out += batch
    return out


def test_stored_events_carry_the_prompts_blocks_and_tokens():
    memo = TokenMemo()
    sink = StoreEvents(memo)
    store = BlockStore(1 << 20, listener=sink)
    tokens = list(range(3 * B + 2))
    keys = recording(memo).keys(tokens)  # a head keys the prompt before storing it
    for blk in synthetic_chain(CARD, tokens):
        store.put(blk)
    got = events_of(sink)
    assert isinstance(got[0], AllBlocksCleared)  # a new store is a new epoch
    (stored,) = got[1:]  # one chain, one event; the tail is not announced
    assert stored.block_hashes == [external_hash(k) for k in keys.blocks]
    assert stored.parent_block_hash is None
    assert stored.token_ids == tokens[: 3 * B]
    assert (stored.block_size, stored.medium, stored.lora_id) == (B, "CPU", None)
    assert stored.extra_keys is None  # no picture: no extra keys (omitted on the wire)


def test_a_blocks_pictures_are_its_extra_keys_as_vllm_names_them():
    memo = TokenMemo()
    sink = StoreEvents(memo)
    store = BlockStore(1 << 20, listener=sink)
    item = MediaItem(bytes(range(32)), placeholder=7, length=B + 3)
    # the picture from position B - 2 to 2B + 1: blocks 0, 1 and 2 overlap it, 3 does not
    tokens = list(range(10, 10 + B - 2)) + MEDIA_IDS.ids(item) + list(range(2 * B))
    keys = recording(memo).keys(tokens)
    for blk in synthetic_chain(CARD, tokens):
        store.put(blk)
    (stored,) = events_of(sink)[1:]
    assert stored.block_hashes == [external_hash(k) for k in keys.blocks]
    pic = item.digest.hex()  # offsets from each block's start, as vLLM's extra keys
    assert stored.extra_keys == [((pic, B - 2),), ((pic, -2),), ((pic, -2 - B),), None]
    assert stored.token_ids[B - 3 : B + 1] == [10 + B - 3, 7, 7, 7]  # the placeholder id
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(stored))
    assert raw["extra_keys"] == [[[pic, B - 2]], [[pic, -2]], [[pic, -2 - B]], None]
    hashes_only = StoreEvents(token_ids=False)  # no tokens: no pictures either
    store = BlockStore(1 << 20, listener=hashes_only)
    for blk in synthetic_chain(CARD, tokens):
        store.put(blk)
    assert events_of(hashes_only)[1].extra_keys is None


def test_a_block_whose_tokens_were_never_seen_carries_hashes_only():
    sink = StoreEvents()
    store = BlockStore(1 << 20, listener=sink)
    chain = synthetic_chain(CARD, list(range(2 * B)), tail=False)
    store.put(chain[0])
    sink.take()
    store.put(chain[1])
    (ev,) = sink.take()
    assert ev.token_ids == [] and ev.block_hashes == [external_hash(chain[1].header.key)]
    assert ev.parent_block_hash == external_hash(chain[0].header.key)


def test_eviction_removes_exactly_the_evicted_keys():
    sink = StoreEvents()
    chains = [synthetic_chain(CARD, [i] * (2 * B), tail=False) for i in range(4)]
    size = chains[0][0].nbytes
    store = BlockStore(4 * size, listener=sink)  # room for two chains of two blocks
    held: set[int] = set()
    for chain in chains:
        for blk in chain:
            store.put(blk)
    for ev in events_of(sink):
        if isinstance(ev, BlockStored):
            held.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert ev.medium == "CPU" and set(ev.block_hashes) <= held
            held.difference_update(ev.block_hashes)
    stored_now = {external_hash(b.header.key) for c in chains for b in c if b.header.key in store}
    assert held == stored_now and len(held) == 4 and store.stats.evictions == 4


def test_disk_tier_events_and_a_restart(tmp_path):
    sink = StoreEvents()
    one, two = (synthetic_chain(CARD, [t] * B, tail=False)[0] for t in (1, 2))
    size = one.nbytes
    store = BlockStore(size, disk=DiskConfig(str(tmp_path), 10 * size), listener=sink)
    store.put(one)
    store.flush(5)
    store.put(two)  # RAM holds one block: the first leaves RAM, stays on disk
    store.flush(5)
    store.close()
    got = [
        (type(e).__name__, getattr(e, "medium", None), getattr(e, "block_hashes", None))
        for e in events_of(sink)
    ]
    k1, k2 = (external_hash(b.header.key) for b in (one, two))
    assert got == [
        ("AllBlocksCleared", None, None),
        ("BlockStored", "CPU", [k1]),
        ("BlockStored", "STORAGE", [k1]),
        ("BlockRemoved", "CPU", [k1]),
        ("BlockStored", "CPU", [k2]),
        ("BlockStored", "STORAGE", [k2]),
    ]
    again = StoreEvents()
    BlockStore(size, disk=DiskConfig(str(tmp_path), 10 * size), listener=again).close()
    restarted = events_of(again)  # the new epoch, then the rebuilt tier
    assert isinstance(restarted[0], AllBlocksCleared)
    assert sorted((e.medium, e.block_hashes[0]) for e in restarted[1:]) == sorted(
        [("STORAGE", k1), ("STORAGE", k2)]
    )


def test_a_full_queue_drops_counts_and_resyncs():
    sink = StoreEvents(max_pending=3)
    store = BlockStore(1 << 20, listener=sink)
    for blk in synthetic_chain(CARD, list(range(5 * B)), tail=False):
        store.put(blk)  # never blocks
    assert sink.dropped == 3  # AllBlocksCleared and two changes fit
    got = events_of(sink)
    assert isinstance(got[0], AllBlocksCleared)  # routers forget what may be stale
    assert sum(len(e.block_hashes) for e in got if isinstance(e, BlockStored)) == 2


def test_wire_format_is_vllms_field_by_field():
    ev = BlockStored([1, 2], None, [5] * 2 * B, B, None, "CPU", None)
    raw = msgspec.msgpack.decode(
        msgspec.msgpack.encode(
            decode_batch(
                msgspec.msgpack.encode(
                    _batch([ev, BlockRemoved([2], "STORAGE"), AllBlocksCleared()])
                )
            )
        )
    )
    ts, events, rank = raw  # EventBatch: array-like [ts, events, data_parallel_rank]
    assert isinstance(ts, float) and rank == 0
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [5] * 2 * B,
        "block_size": B,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [2], "medium": "STORAGE"}
    assert events[2] == {"type": "AllBlocksCleared"}
    assert external_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")


def _batch(events):  # type: ignore[no-untyped-def]
    from kvmesh.mesh.events import EventBatch

    return EventBatch(1.5, events, 0)


@pytest.fixture
def publisher(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/ev.sock", f"tcp://127.0.0.1:{free_port()}"
    sink = StoreEvents()
    pub = EventPublisher(EventsConfig(endpoint, replay, topic="kv", hwm=4), sink)
    yield pub, endpoint, replay
    pub.close()


def subscribe(ctx: zmq.Context, endpoint: str, hwm: int = 1000, rcvbuf: int = -1) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, hwm)
    sub.setsockopt(zmq.RCVBUF, rcvbuf)
    sub.setsockopt(zmq.LINGER, 0)
    if endpoint:
        sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    return sub


def curve_client(sock: zmq.Socket, pub: EventPublisher) -> zmq.Socket:
    """``sock`` as a CURVE client of ``pub`` (a fresh key pair: no client list)."""
    assert pub.public_key is not None
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = pub.public_key
    return sock


def test_pub_frames_sequence_and_replay(publisher):
    pub, endpoint, replay_endpoint = publisher
    ctx = zmq.Context()
    try:
        sub = subscribe(ctx, endpoint)
        time.sleep(0.3)  # a late joiner misses the first batch: the replay has it
        store = BlockStore(1 << 20, listener=pub.source)
        for blk in synthetic_chain(CARD, list(range(2 * B)), tail=False):
            store.put(blk)
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        first = int.from_bytes(seq, "big")
        assert any(isinstance(e, BlockStored) for e in decode_batch(payload).events)
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(replay_endpoint)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            assert req.poll(5000)
            _, s, body = req.recv_multipart()
            if s == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(s, "big"))
            decode_batch(body)
        assert seqs == list(range(first + 1)) and pub.stats.replays == 1
        req.send_multipart((b"", b"short"))  # hostile: ignored, counted
        deadline = time.time() + 5
        while pub.stats.bad_replays == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert pub.stats.bad_replays == 1
    finally:
        ctx.destroy(linger=0)


def test_a_subscriber_that_stops_reading_never_blocks_the_store(tmp_path):
    port = free_port()  # TCP (its kernel buffers, which rcvbuf bounds); CURVE: beyond loopback
    memo = TokenMemo(max_blocks=64)
    key = tmp_path / "events.key"
    key.write_text(zmq.curve_keypair()[1].decode() + "\n")  # a bare Z85 secret will do
    key.chmod(0o600)  # a secret key is this user's alone
    cfg = EventsConfig(f"tcp://*:{port}", "", "kv", hwm=4, max_batch_events=1, curve_key=str(key))
    pub = EventPublisher(cfg, StoreEvents(memo))
    ctx = zmq.Context()
    try:
        stuck = curve_client(subscribe(ctx, "", hwm=4, rcvbuf=4096), pub)  # never reads
        stuck.connect(f"tcp://127.0.0.1:{port}")
        reader = curve_client(subscribe(ctx, ""), pub)
        reader.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        layout, tokens = Layout(CARD), [1 << 20] * 256  # 1.3 KB an event: past any buffer
        n = 20_000
        for i in range(n):  # the store's side: note each change and return
            key = i.to_bytes(32, "big")
            memo.record(key, tokens)
            pub.source("stored", "ram", layout.header("block", key, CARD.namespace, 0, B))
        deadline = time.time() + 30
        while pub.stats.events <= n and time.time() < deadline:
            reader.recv_multipart() if reader.poll(10) else None
        assert pub.stats.events == n + 1 and pub.source.dropped == 0  # and AllBlocksCleared
        got = 0
        while stuck.poll(300):
            stuck.recv_multipart()
            got += 1
        assert 0 < got < pub.stats.batches  # ZMQ dropped for it alone past its marks
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_a_sink_inside_vllm_never_clears():
    """vLLM's stream carries its GPU blocks too: the connector's sink must never
    send AllBlocksCleared (it would wipe them from a router's view)."""
    memo = TokenMemo()
    sink = StoreEvents(memo, max_pending=2, clears=False)
    store = BlockStore(1 << 20, listener=sink)
    tokens = list(range(4 * B))
    recording(memo).keys(tokens)
    for blk in synthetic_chain(CARD, tokens, tail=False):
        store.put(blk)
    got = events_of(sink)
    assert sink.dropped == 2 and not any(isinstance(e, AllBlocksCleared) for e in got)
    (ev,) = got
    assert ev.token_ids == tokens[: 2 * B] and len(ev.block_hashes) == 2


@pytest.mark.parametrize(
    "sec,error",
    [
        ({"kv_events": "tcp://*:5557"}, r"refusing --kv-events on \*"),  # prompts' tokens, to all
        ({"kv_events": "tcp://*:5557", "plaintext": True}, "--kv-events-curve-key"),  # not enough
        ({"kv_events": "tcp://10.0.0.2:5557", "plaintext": True}, "--kv-events-curve-key"),
        ({"kv_events": "udp://x:1"}, "invalid --kv-events"),
        ({"kv_events": "tcp://127.0.0.1:x"}, "invalid --kv-events"),
        ({"kv_events_replay": "tcp://127.0.0.1:5558"}, "needs --kv-events"),
        (
            {"kv_events": "ipc:///tmp/a", "kv_events_replay": "tcp://*:1", "plaintext": True},
            "refusing --kv-events-replay",
        ),
    ],
)
def test_event_options_are_checked(sec, error):
    from kvmesh.errors import ConfigError
    from kvmesh.mesh.settings import node_config

    with pytest.raises(ConfigError, match=error):
        node_config("127.0.0.1:0", "1MiB", (), None, (), ("cache",), sec)


def test_event_options_make_a_config():
    from kvmesh.mesh.settings import node_config

    sec = {
        "kv_events": "tcp://127.0.0.1:5557",
        "kv_events_replay": "tcp://127.0.0.1:5558",
        "kv_events_topic": "t",
    }
    cfg = node_config("127.0.0.1:0", "1MiB", (), None, (), ("cache",), sec).kv_events
    assert cfg == EventsConfig("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "t")
    assert node_config("127.0.0.1:0", "1MiB", (), None, (), ("cache",), {}).kv_events is None


def test_a_taken_endpoint_is_a_clear_error():
    from kvmesh.errors import ConfigError

    taken = EventsConfig("inproc://a", f"tcp://127.0.0.1:{free_port()}")
    first = EventPublisher(taken, StoreEvents())
    try:
        with pytest.raises(ConfigError, match="KV events"):
            EventPublisher(taken, StoreEvents())
    finally:
        first.close()


def test_the_replay_ring_is_bounded_in_bytes():
    pub = EventPublisher(
        EventsConfig(f"tcp://127.0.0.1:{free_port()}", buffer_bytes=4096), StoreEvents()
    )
    try:
        big = [BlockStored([i], None, list(range(256)), 256, None, "CPU", None) for i in range(4)]
        for _ in range(20):
            pub.publish(big)  # each batch ~1.3 KB
        assert 0 < pub._ring_bytes <= 4096 and len(pub._ring) < 20
        assert pub._ring_bytes == sum(len(p) for _, p in pub._ring)
    finally:
        pub.close()
