"""A hostile cache peer for tests: a real node speaking the real protocol, lying.

    python -m tests.hostile_peer MODE --listen HOST:PORT [--seed ADDR ...] [--block-tokens B]

It gossips like any peer (so heads find it) and answers every lookup with a
claim chosen by MODE:

- ``lie-length``: "1,000,000 tokens" with no blocks at all.
- ``wrong-bytes``: every asked block, well-formed infos, then random bytes.
- ``oversize``: every asked block, announced at 1 TiB each.
- ``stall``: every asked block, then a fetch that never sends a byte.
- ``stall-mid``: every asked block, then half of the first block and silence.
- ``trickle``: every asked block, then a byte every half second: never silent for
  a progress timeout, never done.
- ``parts-flip``, ``parts-missing``, ``manifest-lie``: an honest store (it takes
  publishes and answers lookups truly), whose trimmed fetches (PARTS frames) lie:
  a flipped byte in the last part sent, the first part left out, a part digest
  that does not make the block's digest.

Fetches lie the same way on the bulk data path and over gRPC (``--no-bulk``).
It prints ``kvmesh peer ... listening on ADDR epoch E`` like ``kvmesh peer``.

The other half of this module is the hostile *publisher* side, used by tests and
``bench/hostile_publish.py`` against a real ``kvmesh peer``: :func:`attack`
streams one kind of bad publish (:data:`ATTACKS`) and returns the reason the
peer gave; :func:`rss`, :func:`peak_rss`, :func:`reset_peak_rss` read a
process's memory from ``/proc``; :func:`scrape` reads a node's ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.codec import ALL, Block, chunks, parts_frame, want_mask
from kvmesh.compat import CompatCard
from kvmesh.mesh.bulk_server import BulkServer
from kvmesh.mesh.bulk_wire import BLOCK, FRAME, PARTS
from kvmesh.mesh.node import MeshNode, NodeConfig
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.mesh.server import CacheService

MODES = (
    "lie-length",
    "wrong-bytes",
    "oversize",
    "stall",
    "stall-mid",
    "trickle",
    "parts-flip",
    "parts-missing",
    "manifest-lie",
)
PARTS_MODES = ("parts-flip", "parts-missing", "manifest-lie")
FAKE_BLOCK_BYTES = 4096
TRICKLE_S = 0.5  # a byte this often: well under any progress timeout


class HostileCache(CacheService):
    def __init__(self, node: MeshNode, mode: str, block_tokens: int) -> None:
        super().__init__(node.store)
        self.mode = mode
        self.block_tokens = block_tokens
        self.fetches = 0

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        if self.mode in PARTS_MODES:  # an honest store: only its trimmed fetches lie
            return await super().Lookup(request, context)
        self.counters["lookups"] += 1
        if self.mode == "lie-length":
            return pb.LookupResponse(epoch=self.store.epoch, matched_tokens=1_000_000)
        size = 1 << 40 if self.mode == "oversize" else FAKE_BLOCK_BYTES
        infos = [
            pb.BlockInfo(key=k, nbytes=size, digest=os.urandom(32), tokens=self.block_tokens)
            for k in request.block_keys
        ]
        n = len(infos) * self.block_tokens
        return pb.LookupResponse(epoch=self.store.epoch, blocks=infos, matched_tokens=n)

    async def Fetch(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[bytes]:
        self.fetches += 1
        if self.mode in PARTS_MODES:  # gRPC sends whole blocks: honest here
            async for chunk in super().Fetch(request, context):
                yield chunk
            return
        if self.mode == "stall":
            await asyncio.sleep(3600)
        if self.mode == "stall-mid":
            yield os.urandom(FAKE_BLOCK_BYTES // 2)
            await asyncio.sleep(3600)
        if self.mode == "trickle":
            for _ in range(FAKE_BLOCK_BYTES):
                yield os.urandom(1)
                await asyncio.sleep(TRICKLE_S)
        for _ in request.keys:
            yield os.urandom(FAKE_BLOCK_BYTES)


class HostileBulk(BulkServer):
    """The same lies on the bulk data path."""

    def __init__(self, cache: HostileCache) -> None:
        super().__init__(cache)
        self.hostile = cache
        self.forever = threading.Event()  # never set: a stall lasts until the node stops

    def _fetch(self, stream: Any, body: bytes) -> None:
        request = pb.FetchRequest.FromString(body)
        self.hostile.fetches += 1
        if self.hostile.mode in PARTS_MODES:
            self._lying_parts(stream, request)
            return
        if self.hostile.mode == "stall":
            self.forever.wait()
        if self.hostile.mode == "stall-mid":
            stream.send(FRAME.pack(BLOCK, FAKE_BLOCK_BYTES) + os.urandom(FAKE_BLOCK_BYTES // 2))
            self.forever.wait()
        if self.hostile.mode == "trickle":
            stream.send(FRAME.pack(BLOCK, FAKE_BLOCK_BYTES))
            while not self.forever.wait(TRICKLE_S):
                stream.send(os.urandom(1))
        for _ in request.keys:
            stream.send(FRAME.pack(BLOCK, FAKE_BLOCK_BYTES) + os.urandom(FAKE_BLOCK_BYTES))

    def _lying_parts(self, stream: Any, request: pb.FetchRequest) -> None:
        """Honest whole blocks where no trim was asked; else PARTS frames that lie."""
        keep = tuple(request.keep_from) or None
        for block in self.cache.serve_fetch(request):
            mask = want_mask(block.header, keep)
            if mask == ALL:
                stream.send(FRAME.pack(BLOCK, block.nbytes) + block.blob)
                continue
            if self.hostile.mode == "parts-missing":
                mask &= ~(1 << next(i for i in range(64) if mask >> i & 1))
            data = b"".join(bytes(p) for p in parts_frame(block, mask))
            if self.hostile.mode == "parts-flip":
                data = data[:-1] + bytes([data[-1] ^ 1])
            elif self.hostile.mode == "manifest-lie":
                at = 8 + len(block.blob[8 : block.payload_offset]) + 2 + 3
                data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
            stream.send(FRAME.pack(PARTS, len(data)) + data)


# -- hostile publishers ---------------------------------------------------------

PUBLISH = "/kvmesh.v1.PrefillCache/Publish"
CHUNK = 1 << 20
# kind -> the reasons a peer may rightly give (store_full: the in-flight cap was reached)
ATTACKS: dict[str, tuple[str, ...]] = {
    "oversize": ("oversize_payload",),  # a terabyte announced
    "over_cap": ("oversize_payload",),  # just over the receiver's --max-block-bytes
    "truncated": ("malformed_payload", "store_full"),  # all but the last bytes, then EOF
    "garbage": ("malformed_payload", "store_full"),  # random bytes under a plausible size
    "wrong_digest": ("checksum_mismatch", "store_full"),  # a whole block, another SHA-256
    "bad_card": ("malformed_payload",),  # a card that does not parse
    "orphan": ("orphan_block", "store_full"),  # a real block whose parent is not stored
    "silent": ("timeout", "store_full"),  # half a block, then nothing (server cuts it off)
}


@dataclass(frozen=True)
class Target:
    """What the attackers know: the peer, a card, an honest chain (its bytes are
    reused so that headers parse) and a chain the peer never saw (for orphans)."""

    address: str
    card: CompatCard
    honest: list[Block]
    foreign: list[Block]
    max_block_bytes: int


def messages(card_json: str, nbytes: int, digest: bytes, data: bytes) -> Iterator[bytes]:
    """One block's publish stream, serialized: its first chunk carries the card."""
    for i, c in enumerate(chunks(data, CHUNK) if data else [memoryview(b"")]):
        msg = pb.PublishChunk(data=bytes(c))
        if i == 0:
            msg.card_json, msg.nbytes, msg.digest = card_json, nbytes, digest
        yield msg.SerializeToString()


def publish_stream(card: CompatCard, blocks: Iterable[Block]) -> Iterator[bytes]:
    """An honest publish of ``blocks``, as ``MeshClient.publish`` sends it."""
    card_json = json.dumps(card.to_json())
    for i, b in enumerate(blocks):
        yield from messages(card_json if i == 0 else "", b.nbytes, b.digest, b.blob)


def _stream(kind: str, t: Target, rng: random.Random) -> Iterator[bytes] | AsyncIterator[bytes]:
    card_json = json.dumps(t.card.to_json())
    block = t.honest[0]
    if kind == "oversize":
        return messages(card_json, 1 << 40, rng.randbytes(32), block.blob[:CHUNK])
    if kind == "over_cap":
        return messages(card_json, t.max_block_bytes + 1, rng.randbytes(32), block.blob[:CHUNK])
    if kind == "truncated":
        return messages(card_json, block.nbytes, block.digest, block.blob[:-1024])
    if kind == "garbage":
        return messages(card_json, 1 << 20, rng.randbytes(32), rng.randbytes(1 << 20))
    if kind == "wrong_digest":
        return messages(card_json, block.nbytes, rng.randbytes(32), block.blob)
    if kind == "bad_card":
        return messages(rng.randbytes(64).hex()[: rng.randint(1, 128)], 10, b"", b"x" * 10)
    if kind == "orphan":
        b = t.foreign[1 + rng.randrange(len(t.foreign) - 1)]
        return messages(card_json, b.nbytes, b.digest, b.blob)
    if kind == "silent":
        return _silent(
            messages(card_json, block.nbytes, block.digest, block.blob[: block.nbytes // 2])
        )
    raise ValueError(kind)


async def _silent(msgs: Iterator[bytes]) -> AsyncIterator[bytes]:
    for m in msgs:
        yield m
    await asyncio.sleep(3600)  # the peer's publish progress deadline ends this


async def attack(channel: grpc.aio.Channel, kind: str, t: Target, rng: random.Random) -> str:
    """One hostile publish of ``kind``; the peer's reason (or the gRPC status name)."""
    call = channel.stream_unary(
        PUBLISH, request_serializer=None, response_deserializer=pb.PublishResponse.FromString
    )
    try:
        resp = await call(_stream(kind, t, rng), timeout=60)
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return resp.reason if resp.rejected else "stored" if resp.stored else "nothing"


async def publish(channel: grpc.aio.Channel, card: CompatCard, blocks: list[Block]) -> Any:
    call = channel.stream_unary(
        PUBLISH, request_serializer=None, response_deserializer=pb.PublishResponse.FromString
    )
    return await call(publish_stream(card, blocks), timeout=60)


def own_connection(address: str) -> grpc.aio.Channel:
    """A channel on its own TCP connection, as a separate publisher would have."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


# -- what the peer shows --------------------------------------------------------


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def rss(pid: int) -> int:
    """Resident set size of ``pid`` now, in bytes."""
    return _status(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """Highest resident set size of ``pid`` since start or :func:`reset_peak_rss`."""
    return _status(pid, "VmHWM")


def reset_peak_rss(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def scrape(metrics_address: str) -> dict[str, float]:
    """A node's /metrics as ``{'name{label=value,...}': value}`` (labels sorted)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# -- the hostile cache peer's entry point -----------------------------------------


async def run(args: argparse.Namespace) -> None:
    node = MeshNode(
        NodeConfig(
            listen=args.listen,
            seeds=list(args.seed),
            alias=f"hostile-{args.mode}",
            gossip_interval=0.3,
            ttl=2,
            bulk=False,  # its own lying bulk server instead, below
        )
    )
    node.cache = HostileCache(node, args.mode, args.block_tokens)
    await node.start()
    if not args.no_bulk:
        lying = HostileBulk(node.cache)
        node.data_port = lying.start(args.listen.rpartition(":")[0])
    print(
        f"kvmesh peer {node.alias} listening on {node.address} epoch {node.store.epoch}", flush=True
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await node.stop(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--seed", action="append", default=[])
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--no-bulk", action="store_true", help="lie over gRPC only")
    args, _ = ap.parse_known_args()  # the flags `kvmesh peer` takes are accepted and ignored
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
