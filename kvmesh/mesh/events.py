"""KV events for routers, in vLLM's wire format, from a node's block store.

Routers that place requests by cached prefix (llm-d's precise prefix-cache
scorer, Dynamo's KV router) learn what each server holds from vLLM's KV events:
an ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``,
msgpack-encoded by msgspec, sent on a ZMQ PUB socket as the three frames
``(topic, seq as 8 bytes big-endian, payload)``, with an optional ROUTER socket
that replays the last batches from a sequence number. This module speaks exactly
that (the structs below mirror ``vllm.distributed.kv_events`` of vLLM 0.32: the
batch is array-like, the events are tagged maps; ``tests/vllm`` decodes them
with vLLM's own classes).

Contract:

- :class:`StoreEvents` is a store listener (``BlockStore(listener=...)``): it
  turns each change of a tier (a full block stored in or removed from RAM or the
  disk tier) into a pending record and never blocks nor allocates beyond
  ``max_pending`` records: past that a change is dropped and counted, and the
  next batch starts with ``AllBlocksCleared`` so no router keeps a stale view.
  :meth:`StoreEvents.take` drains the pending changes as vLLM-shaped events
  (consecutive blocks of one chain become one ``BlockStored``, as vLLM's own).
  It is also the sink a vLLM connector's ``take_events()`` drains.
- Hashes are kvmesh's own block keys in vLLM's default integer form (the key's
  last 8 bytes, big-endian: what ``maybe_convert_block_hash`` does to vLLM's
  own); they are opaque to a router. ``parent_block_hash`` is None for a first
  block. ``medium`` is ``CPU`` for the RAM tier and ``STORAGE`` (vLLM's name for
  its own disk tiers) for the disk tier. ``token_ids`` are the blocks' tokens when
  this process saw them (:class:`TokenMemo`, filled by :class:`RecordingKeyer`
  on a head); a peer never sees tokens, so its events carry hashes only
  (``token_ids`` empty). Tails (partial blocks) are not announced: vLLM's events
  speak of full blocks only.
- :class:`EventPublisher` owns the ZMQ sockets and one thread. A slow or absent
  subscriber never slows the store: the PUB socket drops past its high-water
  mark (a subscriber sees the gap in ``seq`` and asks the replay socket), and
  the replay ring holds at most ``buffer_batches`` batches. Replay requests are
  checked (three frames, an 8-byte sequence number) before anything is sent.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import msgspec
import zmq

from ..blocks import BlockKeyer
from ..codec import BlockHeader
from ..errors import ConfigError

log = logging.getLogger("kvmesh.events")

MEDIUM = {"ram": "CPU", "disk": "STORAGE"}  # vLLM's MEDIUM_CPU and MEDIUM_STORAGE
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker, as vLLM's


# -- vLLM's wire format (vllm/distributed/kv_events.py, 0.32) -----------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (a tagged map: ``{"type": "BlockStored", ...}``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = BlockStored | BlockRemoved | AllBlocksCleared


def external_hash(key: bytes) -> int:
    """A block key as vLLM's events carry hashes by default: its last 8 bytes."""
    return int.from_bytes(key[-8:], "big")


def decode_batch(payload: bytes) -> KVEventBatch:
    """One payload as a batch (tests, the bench and tools; raises on bad input)."""
    return _DECODER.decode(payload)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


# -- tokens of blocks ----------------------------------------------------------


class TokenMemo:
    """Token ids of recently keyed blocks, by key: bounded LRU (``max_blocks``),
    so a block stored soon after its request was keyed carries its tokens."""

    def __init__(self, max_blocks: int = 16384) -> None:
        self.max_blocks = max_blocks
        self._tokens: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, key: bytes, tokens: Sequence[int]) -> None:
        packed = array("I", tokens).tobytes()
        with self._lock:
            self._tokens[key] = packed
            self._tokens.move_to_end(key)
            while len(self._tokens) > self.max_blocks:
                self._tokens.popitem(last=False)

    def get(self, key: bytes) -> list[int] | None:
        with self._lock:
            packed = self._tokens.get(key)
        return None if packed is None else array("I", packed).tolist()

    def __len__(self) -> int:
        return len(self._tokens)


class RecordingKeyer(BlockKeyer):
    """A :class:`BlockKeyer` that remembers each full block's tokens in a memo."""

    def __init__(self, keyer: BlockKeyer, memo: TokenMemo) -> None:
        super().__init__(
            keyer.namespace, keyer.block_tokens, keyer._fleet_key, keyer.root, keyer.caller
        )
        self.memo = memo

    def block_key(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        key = super().block_key(parent, tokens)
        self.memo.record(key, tokens)
        return key

    def rooted(self, root: bytes, caller: bytes | None = None) -> BlockKeyer:
        """A tenant's or salt's chain records its tokens too."""
        return RecordingKeyer(super().rooted(root, caller), self.memo)


# -- the store listener and sink ------------------------------------------------

_CLEARED = ("cleared", "", None)


class StoreEvents:
    """Listens to a :class:`~kvmesh.store.BlockStore` (``listener``) and hands out
    its changes as vLLM events (:meth:`take`). With ``clears`` (a node's own
    stream) it starts with ``AllBlocksCleared`` (a new store is a new epoch:
    whatever routers knew of the last one is gone) and resyncs with one after a
    drop. Without (a sink inside vLLM, whose stream also carries vLLM's own GPU
    blocks, which a clear would wipe from a router's view) drops are only counted.

    In a vLLM connector: ``sink = StoreEvents(clears=False)``, the store built with
    ``listener=sink`` (or ``store.listener = sink``), the keyer wrapped in
    :class:`RecordingKeyer` with ``sink.memo``, and ``take_events()`` returning
    ``sink.take()`` (vLLM's own classes, if wanted, from
    ``msgspec.structs.asdict(event)`` by ``type(event).__name__``)."""

    def __init__(
        self, memo: TokenMemo | None = None, max_pending: int = 100_000, clears: bool = True
    ) -> None:
        self.memo = memo if memo is not None else TokenMemo()
        self.max_pending = max_pending
        self.clears = clears
        self.dropped = 0  # changes refused for a full queue
        self.changes = 0  # changes queued
        self._pending: deque[tuple[str, str, BlockHeader | None]] = deque(
            [_CLEARED] if clears else []
        )
        self._overflow = False
        # not woken for the clear alone: it leaves with the first changes, by when a
        # router that knew the last epoch has had time to reconnect (replay has it too)
        self._wake = threading.Event()

    def __call__(self, change: str, tier: str, header: BlockHeader) -> None:
        """The store's listener (called under its lock: append and return)."""
        if header.kind != "block":
            return
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            self._overflow = self.clears
            return
        self._pending.append((change, tier, header))
        self.changes += 1
        if not self._wake.is_set():  # after the append: a clear before this check is seen
            self._wake.set()

    def wait(self, timeout: float) -> bool:
        """True when changes came (after at most ``timeout`` seconds)."""
        if not self._wake.wait(timeout):
            return False  # not cleared: a change noted meanwhile keeps its wake-up
        self._wake.clear()  # a change noted from here on sets it again; the take sees it
        return True

    def take(self, limit: int = 4096) -> list[Event]:
        """Up to ``limit`` pending changes as events, oldest first."""
        out: list[Event] = []
        if self._overflow:  # some changes were lost: routers must forget this node's view
            self._overflow = False
            out.append(AllBlocksCleared())
        for _ in range(limit):
            try:
                change, tier, header = self._pending.popleft()
            except IndexError:
                break
            if header is None:
                out.append(AllBlocksCleared())
            elif change == "stored":
                self._stored(out, MEDIUM[tier], header)
            else:
                self._removed(out, MEDIUM[tier], header)
        return out

    def _stored(self, out: list[Event], medium: str, h: BlockHeader) -> None:
        tokens = self.memo.get(h.key)
        parent = None if h.start == 0 else external_hash(h.parent)
        last = out[-1] if out else None
        if (  # the next block of the same chain: one event, as vLLM's
            isinstance(last, BlockStored)
            and last.medium == medium
            and last.block_size == h.tokens
            and last.block_hashes[-1] == parent
            and (tokens is not None) == bool(last.token_ids)
        ):
            last.block_hashes.append(external_hash(h.key))
            last.token_ids.extend(tokens or ())
            return
        out.append(
            BlockStored([external_hash(h.key)], parent, tokens or [], h.tokens, None, medium, None)
        )

    @staticmethod
    def _removed(out: list[Event], medium: str, h: BlockHeader) -> None:
        last = out[-1] if out else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_hash(h.key))
        else:
            out.append(BlockRemoved([external_hash(h.key)], medium))


# -- the ZMQ publisher -------------------------------------------------------------


@dataclass(frozen=True)
class EventsConfig:
    """Where and how a node publishes (``--kv-events*``)."""

    endpoint: str  # tcp://*:5557 binds; tcp://host:port connects (vLLM's rule)
    replay_endpoint: str = ""  # a ROUTER socket that replays the last batches
    topic: str = ""
    # bounds: a batch holds at most max_batch_events blocks' events (~150 bytes each
    # with 32 tokens), so a subscriber's queue holds at most ~hwm * 75 KiB
    hwm: int = 1000  # batches queued per subscriber before ZMQ drops for it
    buffer_batches: int = 10_000  # batches kept for replay...
    buffer_bytes: int = 64 << 20  # ...within these bytes
    max_pending: int = 100_000  # store changes waiting for the publisher thread
    max_batch_events: int = 512  # store changes per batch at most


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6 or local endpoint, connect to the others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass
class PublisherStats:
    batches: int = 0
    events: int = 0
    send_failed: int = 0  # batches ZMQ refused (kept for replay)
    replays: int = 0
    bad_replays: int = 0


class EventPublisher:
    """Publishes a :class:`StoreEvents`' changes on ZMQ from one daemon thread."""

    POLL_S = 0.02  # how long the thread sleeps when nothing happens
    GATHER_S = 0.002  # after a wake, let a request's blocks gather into one batch
    MAX_REPLAYS = 8  # replay requests served between two batches

    def __init__(self, config: EventsConfig, source: StoreEvents) -> None:
        self.config = config
        self.source = source
        self.stats = PublisherStats()
        self._topic = config.topic.encode()
        self._seq = count()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._ring_bytes = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, config.hwm)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:  # e.g. the port is taken: one clear line, not a traceback
            self._ctx.destroy(linger=0)
            raise ConfigError(
                f"cannot open the KV events sockets ({config.endpoint}): {e}"
            ) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-events", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self.source.dropped

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_replays()
                if self.source.wait(self.POLL_S):
                    time.sleep(self.GATHER_S)  # fewer, fuller batches: less GIL ping-pong
                    self._publish_pending()
            except Exception:  # never kill the thread: a router is not worth a node
                log.exception("kv events: publishing failed")
                time.sleep(self.POLL_S)

    def _publish_pending(self) -> None:
        while events := self.source.take(self.config.max_batch_events):
            self.publish(events)

    def publish(self, events: list[Event]) -> int:
        """Send one batch now (from the publisher thread, or a caller's own);
        returns its sequence number."""
        seq = next(self._seq)
        payload = self._encoder.encode(EventBatch(time.time(), events, 0))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.stats.send_failed += 1
        self._keep(seq, payload)
        self.stats.batches += 1
        self.stats.events += len(events)
        return seq

    def _keep(self, seq: int, payload: bytes) -> None:
        """Into the replay ring, oldest out past its count or its bytes."""
        if len(self._ring) == self._ring.maxlen:
            self._ring_bytes -= len(self._ring[0][1])
        self._ring.append((seq, payload))
        self._ring_bytes += len(payload)
        while self._ring_bytes > self.config.buffer_bytes and len(self._ring) > 1:
            self._ring_bytes -= len(self._ring.popleft()[1])

    def _serve_replays(self) -> None:
        replay = self._replay
        for _ in range(self.MAX_REPLAYS):  # per turn: replays never starve publishing
            if replay is None or not replay.poll(0):
                return
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.stats.bad_replays += 1  # a hostile or confused client: ignored
                continue
            who, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            self.stats.replays += 1
            for seq, payload in list(self._ring):
                if seq >= start:
                    replay.send_multipart((who, b"", seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            replay.send_multipart((who, b"", END_SEQ, b""), zmq.NOBLOCK)

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is pending, then stop the thread and close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        try:
            if not self._thread.is_alive():  # a socket is never used by two threads
                self._publish_pending()
        finally:
            self._ctx.destroy(linger=500)  # ms for the last batches to leave


class NodeEvents:
    """A node's events: the store listener and, with a config, its publisher."""

    def __init__(self, config: EventsConfig) -> None:
        self.source = StoreEvents(max_pending=config.max_pending)
        self.publisher = EventPublisher(config, self.source)

    def close(self) -> None:
        self.publisher.close()


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventPublisher",
    "EventsConfig",
    "KVEventBatch",
    "NodeEvents",
    "RecordingKeyer",
    "StoreEvents",
    "TokenMemo",
    "decode_batch",
    "external_hash",
]
