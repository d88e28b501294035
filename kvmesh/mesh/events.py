"""KV events for routers, in vLLM's wire format, from a node's block store.

Routers that place requests by cached prefix (llm-d's precise prefix-cache
scorer, Dynamo's KV router) learn what each server holds from vLLM's KV events:
an ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``,
msgpack-encoded (msgspec), sent on a ZMQ PUB socket as ``(topic, seq as 8 bytes
big-endian, payload)``, with an optional ROUTER socket that replays the last
batches from a sequence number. The structs below mirror
``vllm.distributed.kv_events`` (vLLM 0.32); ``tests/vllm`` decodes them with
vLLM's own classes.

- :class:`StoreEvents` is a store listener: each full block stored in or removed
  from a tier becomes a pending record, never blocking nor holding more than
  ``max_pending``: past that a change is dropped and counted, and the next batch
  starts with ``AllBlocksCleared`` so no router keeps a stale view.
  :meth:`StoreEvents.take` drains them as vLLM-shaped events (consecutive blocks
  of one chain are one ``BlockStored``); a vLLM connector's ``take_events()``
  drains the same sink.
- Hashes are kvmesh's block keys in vLLM's integer form (the key's last 8 bytes,
  big-endian), opaque to a router; ``parent_block_hash`` is None for a first
  block; ``medium`` is ``CPU`` (RAM tier) or ``STORAGE`` (disk tier).
  ``token_ids`` are the blocks' tokens where this process saw them
  (:class:`TokenMemo`, filled by :class:`RecordingKeyer` on a head), else empty;
  a picture's positions carry its placeholder id, and the block's ``extra_keys``
  entry names each picture it overlaps as vLLM does, ``(identifier, offset from
  the block's start)``, the identifier the picture's digest in hex (None for a
  block without one; no ``extra_keys`` at all when no block of the event has one).
  Tails (partial blocks) are not announced, nor blocks of a namespace that holds
  no KV (a picture's encoder rows, :attr:`~kvmesh.compat.CompatCard.rows`: the
  node marks it :attr:`StoreEvents.quiet` before storing one).
- :class:`EventPublisher` owns the ZMQ sockets and one thread. A slow or absent
  subscriber never slows the store: PUB drops past its high-water mark (the gap
  in ``seq`` tells the subscriber to ask for a replay) and the replay ring holds
  at most ``buffer_batches``. Replay requests are checked (three frames, an
  8-byte sequence number) before anything is sent.

Who may listen (docs/security.md, "KV events"; :meth:`EventsConfig.check`):

- Events name prompts' tokens, so an endpoint that reaches beyond this host
  (``tcp://*:P``, ``0.0.0.0``, a LAN address or name, an interface) is a
  :class:`ConfigError` unless (a) ``curve_key`` names a CURVE secret key file
  (``--kv-events-curve-key``; made, mode 0600, when missing): both sockets are
  CURVE servers, so a subscriber must know the node's public key (logged at
  start; ``python -m kvmesh.mesh.events FILE`` prints it) and, with
  ``curve_clients`` (``--kv-events-curve-clients``, one Z85 public key a line),
  hold a listed key (a ZAP handler on the publisher thread); or (b) ``token_ids``
  is off (``--kv-events-hashes-only``): hashes only, never tokens, whatever the
  source fed the publisher. ``--plaintext`` does not unlock events. Loopback
  TCP, ``ipc://`` and ``inproc://`` need neither.
- Every socket is bounded inbound: ``ZMQ_MAXMSGSIZE`` (:data:`MAX_IN_BYTES`, plus
  the topic's length on the PUB), so a peer announcing a larger frame is
  disconnected before anything is allocated; ``RCVHWM`` :data:`IN_HWM` messages a
  peer, ``SNDHWM`` ``hwm`` batches a subscriber. Not bounded: how many
  connections a reachable socket accepts (the firewall's job).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import sys
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils import z85

from ..blocks import BlockKeyer, media_spans
from ..codec import BlockHeader
from ..errors import ConfigError
from ..private import PrivateFileError, read_private

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
    # per block: its pictures' (identifier, offset from the block's start), or None
    extra_keys: list[tuple[Any, ...] | None] | None = None


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
    so a block stored soon after its request was keyed carries its tokens.
    ``max_blocks=0`` keeps nothing (events that carry hashes only)."""

    def __init__(self, max_blocks: int = 16384) -> None:
        self.max_blocks = max_blocks
        self._tokens: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, key: bytes, tokens: Sequence[int], media: bytes | None = None) -> None:
        """``key``'s block holds ``tokens`` (model ids) and ``media`` (what it hashes
        besides them: :func:`~kvmesh.blocks.media_bytes`; None: what was recorded)."""
        if self.max_blocks <= 0:
            return
        packed = array("I", tokens).tobytes()
        with self._lock:
            if media is None:
                media = self._tokens.get(key, (b"", b""))[1]
            self._tokens[key] = (packed, media)
            self._tokens.move_to_end(key)
            while len(self._tokens) > self.max_blocks:
                self._tokens.popitem(last=False)

    def get(self, key: bytes) -> list[int] | None:
        with self._lock:
            found = self._tokens.get(key)
        return None if found is None else array("I", found[0]).tolist()

    def pictures(self, key: bytes, start: int) -> tuple[tuple[str, int], ...] | None:
        """The media items ``key``'s block (at position ``start``) overlaps, as vLLM's
        events name them: (digest in hex, offset from the block's start); None: none."""
        with self._lock:
            found = self._tokens.get(key)
        if found is None or not found[1]:
            return None
        return tuple((m.digest.hex(), m.offset - start) for m in media_spans(found[1]))

    def __len__(self) -> int:
        return len(self._tokens)


class RecordingKeyer(BlockKeyer):
    """A :class:`BlockKeyer` that remembers each full block's tokens in a memo."""

    def __init__(self, keyer: BlockKeyer, memo: TokenMemo) -> None:
        super().__init__(
            keyer.namespace, keyer.block_tokens, keyer._fleet_key, keyer.root, keyer.caller
        )
        self.memo = memo

    def block_key(self, parent: bytes, tokens: Sequence[int], media: bytes = b"") -> bytes:
        key = super().block_key(parent, tokens, media)
        self.memo.record(key, tokens, media)
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
    ``msgspec.structs.asdict(event)`` by ``type(event).__name__``).

    With ``token_ids=False`` its events carry hashes only and its memo (unless one
    is given) keeps no tokens, so a keyer recording into it holds none either."""

    def __init__(
        self,
        memo: TokenMemo | None = None,
        max_pending: int = 100_000,
        clears: bool = True,
        token_ids: bool = True,
    ) -> None:
        self.memo = memo if memo is not None else TokenMemo(16384 if token_ids else 0)
        self.token_ids = token_ids
        self.max_pending = max_pending
        self.clears = clears
        self.dropped = 0  # changes refused for a full queue
        self.changes = 0  # changes queued
        self.quiet: set[bytes] = set()  # namespaces never announced (pictures' rows: no KV)
        self._pending: deque[tuple[str, str, BlockHeader | None]] = deque(
            [_CLEARED] if clears else []
        )
        self._overflow = False
        # not woken for the clear alone: it leaves with the first changes, by when a
        # router that knew the last epoch has had time to reconnect (replay has it too)
        self._wake = threading.Event()

    def recording(self, keyer: BlockKeyer) -> BlockKeyer:
        """``keyer``, wrapped to record each block's tokens in :attr:`memo` when
        these events carry token ids (else ``keyer`` itself: nothing to record)."""
        return RecordingKeyer(keyer, self.memo) if self.token_ids else keyer

    def __call__(self, change: str, tier: str, header: BlockHeader) -> None:
        """The store's listener (called under its lock: append and return)."""
        if header.kind != "block" or header.namespace in self.quiet:
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
        tokens = self.memo.get(h.key) if self.token_ids else None
        pictures = self.memo.pictures(h.key, h.start) if tokens is not None else None
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
            _add_extra_keys(last, pictures)
            return
        ev = BlockStored([external_hash(h.key)], parent, tokens or [], h.tokens, None, medium, None)
        _add_extra_keys(ev, pictures)
        out.append(ev)

    @staticmethod
    def _removed(out: list[Event], medium: str, h: BlockHeader) -> None:
        last = out[-1] if out else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_hash(h.key))
        else:
            out.append(BlockRemoved([external_hash(h.key)], medium))


def _add_extra_keys(event: BlockStored, pictures: tuple[tuple[str, int], ...] | None) -> None:
    """The ``extra_keys`` entry of ``event``'s last block (its list made, None for
    each block before, at the first block that has pictures)."""
    if pictures is None and event.extra_keys is None:
        return
    if event.extra_keys is None:
        event.extra_keys = [None] * (len(event.block_hashes) - 1)
    event.extra_keys.append(pictures)


# -- who may listen -----------------------------------------------------------------

#: Largest message a socket takes from a peer (ZMQ_MAXMSGSIZE, checked by libzmq on
#: each frame's announced size, handshake commands included, before it allocates):
#: the biggest legitimate one is CURVE's INITIATE (~300 bytes with a socket's
#: metadata); subscriptions and replay requests (8 bytes) are smaller. The PUB adds
#: its topic's length (a subscription is a topic prefix).
MAX_IN_BYTES = 4096
#: Messages queued from one peer (subscriptions on the PUB, replay requests on the
#: ROUTER) before libzmq stops reading its connection.
IN_HWM = 64
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (RFC 27)
_Z85 = "0-9a-zA-Z.\\-:+=^!/*?&<>()\\[\\]{}@%$#"
_KEY = re.compile(f"[{_Z85}]{{40}}")  # a 32-byte CURVE key, Z85-encoded
_PROPERTY = re.compile(r'\s*(public-key|secret-key)\s*=\s*"([^"]*)"\s*')  # ZPL certificates
_ZPL_LINE = re.compile(r'\s*(curve|metadata|[\w-]+\s*=\s*"[^"]*")\s*')  # a certificate's others
_KEY_HEADER = (
    "# kvmesh KV events: CURVE key pair (ZeroMQ certificate format). Keep this file\n"
    "# private; subscribers connect with the public key as their server key.\n"
)


def endpoint_reaches_beyond(endpoint: str, option: str = "--kv-events") -> bool:
    """Whether ``endpoint`` can be reached (or reaches) beyond this host: any TCP
    address but a loopback one (a wildcard, ``0.0.0.0``, a LAN address, a name, an
    interface); ``ipc://`` and ``inproc://`` cannot. A malformed endpoint is a
    :class:`ConfigError` naming ``option``."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ConfigError(
            f"invalid {option} {endpoint!r}: expected tcp://HOST:PORT, ipc:// or inproc://"
        )
    if scheme != "tcp":
        return False
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"invalid {option} {endpoint!r}: expected tcp://HOST:PORT")
    return not _loopback(host)


def _loopback(host: str) -> bool:
    """``localhost`` or a loopback address, written as an address: not a name that
    starts like one (``127.example.com``), nor ``src;dst`` (a source address)."""
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class CurveKeys:
    """A node's CURVE key pair (Z85) and, when restricted, the clients it admits."""

    public: bytes
    secret: bytes = field(repr=False)
    clients: frozenset[bytes] | None = None  # None: any client that knows ``public``


def load_curve_key(path: str | Path) -> tuple[bytes, bytes]:
    """``(public, secret)``, Z85, from a CURVE secret key file, made (mode 0600,
    with a fresh pair) when missing. The file is a ZeroMQ certificate (``secret-key
    = "..."``, as ``zmq.auth.create_certificates`` writes, optionally with its
    ``public-key``) or one line of the 40-character Z85 secret key."""
    if not zmq.has("curve"):
        raise ConfigError("this pyzmq's libzmq has no CURVE: KV events cannot be authenticated")
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass  # the usual case
    except OSError as e:
        raise ConfigError(f"{path}: cannot make a CURVE key ({e.strerror})") from None
    else:
        new_public, new_secret = (k.decode() for k in zmq.curve_keypair())
        with os.fdopen(fd, "w") as f:
            f.write(_KEY_HEADER + f'curve\n    public-key = "{new_public}"\n')
            f.write(f'    secret-key = "{new_secret}"\n')
        log.info("kv events: made a CURVE key pair in %s", path)
    try:
        text = read_private(p)  # a secret key: this user's alone, or refused
    except PrivateFileError as e:
        raise ConfigError(f"the CURVE key {e}") from None
    found = {m.group(1): m.group(2) for m in map(_PROPERTY.fullmatch, text.splitlines()) if m}
    if not found:  # a bare key: the first line that is not a comment
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        bare = [ln for ln in lines if _KEY.fullmatch(ln) or not ln.startswith("#")]
        found = {"secret-key": bare[0]} if bare else {}
    secret = found.get("secret-key", "")
    if not _KEY.fullmatch(secret):
        raise ConfigError(
            f"{path}: no CURVE secret key (a ZeroMQ certificate's secret-key, or 40 Z85 "
            "characters); a missing file is made with a fresh pair"
        )
    public = zmq.curve_public(secret.encode())
    if "public-key" in found and found["public-key"].encode() != public:
        raise ConfigError(f"{path}: its public-key is not the secret key's")
    return public, secret.encode()


def load_curve_clients(path: str | Path) -> frozenset[bytes]:
    """The public keys (Z85) in ``path``: one a line, optionally followed by a name;
    ``#`` comments and blank lines are skipped, and ZeroMQ public certificates
    (``public-key = "..."`` lines) may be pasted as they are. A secret key, a line
    that is no key, or a file with none is a :class:`ConfigError`."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the CURVE client keys ({e})") from None
    keys = set()
    for n, line in enumerate(lines, 1):
        word = line.split()[0] if line.split() else ""
        prop = _PROPERTY.fullmatch(line)
        if prop and prop.group(1) == "secret-key":
            raise ConfigError(f"{path}:{n}: a secret key; list clients' public keys only")
        if prop:
            word = prop.group(2)
        elif not _KEY.fullmatch(word) and (
            not word or word.startswith("#") or _ZPL_LINE.fullmatch(line)
        ):
            continue  # blank, a comment, a certificate's other lines
        if not _KEY.fullmatch(word):
            raise ConfigError(f"{path}:{n}: not a CURVE public key (40 Z85 characters)")
        keys.add(word.encode())
    if not keys:
        raise ConfigError(f"{path}: no CURVE public key (one a line, 40 Z85 characters)")
    return frozenset(keys)


# -- the ZMQ publisher -------------------------------------------------------------


@dataclass(frozen=True)
class EventsConfig:
    """Where and how a node publishes (``--kv-events*``), checked when made
    (:meth:`check`): a config that would send prompts' tokens beyond this host
    without authentication cannot exist."""

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
    # who may listen (the module's docstring)
    curve_key: str = ""  # CURVE secret key file: both sockets are CURVE servers
    curve_clients: str = ""  # public keys admitted (none given: any that knows ours)
    token_ids: bool = True  # False: BlockStored carry hashes only

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` for a malformed endpoint, or one beyond this
        host that would publish tokens without CURVE."""
        for option, endpoint in (
            ("--kv-events", self.endpoint),
            ("--kv-events-replay", self.replay_endpoint),
        ):
            if (endpoint or option == "--kv-events") and (
                endpoint_reaches_beyond(endpoint, option) and self.token_ids and not self.curve_key
            ):
                host = endpoint.partition("://")[2].rpartition(":")[0]
                raise ConfigError(
                    f"refusing {option} on {host}: it reaches beyond this host and KV events "
                    "carry prompts' token ids. Pass --kv-events-curve-key FILE (subscribers "
                    "authenticate with CURVE; FILE is made when missing), or "
                    "--kv-events-hashes-only to publish block hashes without tokens to anyone "
                    "who connects; or use ipc:// or a loopback address (--plaintext does not "
                    "cover events)"
                )
        if self.curve_clients and not self.curve_key:
            raise ConfigError("--kv-events-curve-clients needs --kv-events-curve-key")

    def keys(self) -> CurveKeys | None:
        """The CURVE keys (the key file made when missing), or None without CURVE."""
        if not self.curve_key:
            return None
        public, secret = load_curve_key(self.curve_key)
        clients = load_curve_clients(self.curve_clients) if self.curve_clients else None
        return CurveKeys(public, secret, clients)


#: The ``--kv-events*`` options (:data:`kvmesh.mesh.options.EVENTS`) that mean
#: nothing without ``--kv-events``.
_NEEDS_ENDPOINT = (
    "kv_events_replay",
    "kv_events_curve_key",
    "kv_events_curve_clients",
    "kv_events_hashes_only",
)


def events_config(values: Mapping[str, object]) -> EventsConfig | None:
    """The checked config of the ``--kv-events*`` option values (by their declared
    names), None without ``--kv-events``. The CURVE key file is made now when
    missing and both key files are read, so a bad one fails before the node starts."""
    if not values.get("kv_events"):
        for name in _NEEDS_ENDPOINT:
            if values.get(name):
                raise ConfigError(f"--{name.replace('_', '-')} needs --kv-events")
        return None
    cfg = EventsConfig(
        str(values["kv_events"]),
        str(values.get("kv_events_replay") or ""),
        str(values.get("kv_events_topic") or ""),
        curve_key=str(values.get("kv_events_curve_key") or ""),
        curve_clients=str(values.get("kv_events_curve_clients") or ""),
        token_ids=not values.get("kv_events_hashes_only"),
    )
    cfg.keys()
    return cfg


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
    denied: int = 0  # CURVE clients refused for a key not in --kv-events-curve-clients


class EventPublisher:
    """Publishes a :class:`StoreEvents`' changes on ZMQ from one daemon thread."""

    POLL_S = 0.02  # how long the thread sleeps when nothing happens
    GATHER_S = 0.002  # after a wake, let a request's blocks gather into one batch
    MAX_REPLAYS = 8  # replay requests served between two batches
    MAX_ZAP = 64  # handshakes judged between two batches

    def __init__(self, config: EventsConfig, source: StoreEvents) -> None:
        self.config = config
        self.source = source
        self.stats = PublisherStats()
        self._topic = config.topic.encode()
        self._seq = count()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._ring_bytes = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._keys = config.keys()  # a ConfigError before any socket exists
        self._ctx = zmq.Context()
        self._zap: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if self._keys is not None and self._keys.clients is not None:
                self._zap = self._ctx.socket(zmq.REP)  # before any handshake can happen
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(ZAP_ENDPOINT)
            self._pub = self._socket(zmq.PUB, config.endpoint, MAX_IN_BYTES + len(self._topic))
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._socket(zmq.ROUTER, config.replay_endpoint, MAX_IN_BYTES)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:  # e.g. the port is taken: one clear line, not a traceback
            self._ctx.destroy(linger=0)
            raise ConfigError(
                f"cannot open the KV events sockets ({config.endpoint}): {e}"
            ) from None
        self._announce()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, endpoint: str, max_in: int) -> zmq.Socket[bytes]:
        """A socket bounded both ways and, with keys, a CURVE server (whether it
        binds or connects: the subscriber is always the client)."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, IN_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, max_in)
        if "[" in endpoint:  # tcp://[::1]:P: libzmq parses IPv6 only when asked
            sock.setsockopt(zmq.IPV6, 1)
        if self._keys is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._keys.secret)
        return sock

    def _announce(self) -> None:
        keys, cfg = self._keys, self.config
        if keys is not None:
            who = (
                f"the {len(keys.clients)} client keys of {cfg.curve_clients}"
                if keys.clients is not None
                else "any client that knows it (no --kv-events-curve-clients)"
            )
            log.info(
                "kv events: CURVE on; subscribers' server key: %s; admitted: %s",
                keys.public.decode(),
                who,
            )
        elif any(
            e and endpoint_reaches_beyond(e) for e in (cfg.endpoint, cfg.replay_endpoint)
        ):  # allowed by check() only without token ids
            log.warning(
                "kv events: %s is unauthenticated (--kv-events-hashes-only): anyone who "
                "reaches it sees which blocks this node holds, never their tokens",
                cfg.endpoint,
            )

    @property
    def public_key(self) -> bytes | None:
        """The CURVE public key subscribers connect with (Z85), None without CURVE."""
        return None if self._keys is None else self._keys.public

    @property
    def dropped(self) -> int:
        return self.source.dropped

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_zap()
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
        returns its sequence number. Without ``token_ids`` no tokens leave."""
        if not self.config.token_ids:
            for ev in events:
                if isinstance(ev, BlockStored) and ev.token_ids:
                    ev.token_ids = []
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

    def _serve_zap(self) -> None:
        """Judge the CURVE handshakes waiting (ZAP, RFC 27): a client whose public
        key is not listed is refused before it can subscribe or ask a replay."""
        zap, keys = self._zap, self._keys
        for _ in range(self.MAX_ZAP):
            if zap is None or keys is None or not zap.poll(0):
                return
            # version, request id, domain, address, routing id, mechanism, credentials
            frames = zap.recv_multipart()
            client = z85.encode(frames[6]) if len(frames) == 7 and len(frames[6]) == 32 else b""
            ok = (
                frames[0] == b"1.0" and frames[5:6] == [b"CURVE"] and client in (keys.clients or ())
            )
            if not ok:
                self.stats.denied += 1
                if self.stats.denied & (self.stats.denied - 1) == 0:  # 1, 2, 4...: a bounded log
                    log.warning(
                        "kv events: refused a subscriber from %s (key %s not in %s; %d refused)",
                        frames[3].decode(errors="replace") if len(frames) > 3 else "?",
                        client.decode() or "?",
                        self.config.curve_clients,
                        self.stats.denied,
                    )
            request_id = frames[1] if len(frames) > 1 else b""
            status = (b"200", b"OK") if ok else (b"400", b"unknown key")
            zap.send_multipart((b"1.0", request_id, *status, b"", b""))

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
        self.source = StoreEvents(max_pending=config.max_pending, token_ids=config.token_ids)
        self.publisher = EventPublisher(config, self.source)

    def close(self) -> None:
        self.publisher.close()


def print_curve_public_key(argv: Sequence[str] | None = None) -> int:
    """``python -m kvmesh.mesh.events KEYFILE``: print the CURVE public key that
    subscribers of ``--kv-events-curve-key KEYFILE`` connect with (KEYFILE is made,
    mode 0600, with a fresh pair when missing)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m kvmesh.mesh.events KEYFILE", file=sys.stderr)
        return 2
    try:
        public, _ = load_curve_key(args[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(public.decode())
    return 0


__all__ = [
    "IN_HWM",
    "MAX_IN_BYTES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CurveKeys",
    "EventBatch",
    "EventPublisher",
    "EventsConfig",
    "KVEventBatch",
    "NodeEvents",
    "RecordingKeyer",
    "StoreEvents",
    "TokenMemo",
    "decode_batch",
    "endpoint_reaches_beyond",
    "events_config",
    "external_hash",
    "load_curve_clients",
    "load_curve_key",
]

if __name__ == "__main__":
    sys.exit(print_curve_public_key())
