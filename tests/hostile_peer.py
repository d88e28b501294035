"""A hostile cache peer for tests: a real node speaking the real protocol, lying.

    python -m tests.hostile_peer MODE --listen HOST:PORT [--seed ADDR ...] [--block-tokens B]

It gossips like any peer (so heads find it) and answers every lookup with a
claim chosen by MODE:

- ``lie-length``: "1,000,000 tokens" with no blocks at all.
- ``wrong-bytes``: every asked block, well-formed infos, then random bytes.
- ``oversize``: every asked block, announced at 1 TiB each.
- ``stall``: every asked block, then a fetch that never sends a byte.
- ``stall-mid``: every asked block, then half of the first block and silence.

It prints ``kvmesh peer ... listening on ADDR epoch E`` like ``kvmesh peer``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

from kvmesh.mesh.node import MeshNode, NodeConfig
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.mesh.server import CacheService

MODES = ("lie-length", "wrong-bytes", "oversize", "stall", "stall-mid")
FAKE_BLOCK_BYTES = 4096


class HostileCache(CacheService):
    def __init__(self, node: MeshNode, mode: str, block_tokens: int) -> None:
        super().__init__(node.store)
        self.mode = mode
        self.block_tokens = block_tokens
        self.fetches = 0

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
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
        if self.mode == "stall":
            await asyncio.sleep(3600)
        if self.mode == "stall-mid":
            yield os.urandom(FAKE_BLOCK_BYTES // 2)
            await asyncio.sleep(3600)
        for _ in request.keys:
            yield os.urandom(FAKE_BLOCK_BYTES)


async def run(args: argparse.Namespace) -> None:
    node = MeshNode(
        NodeConfig(
            listen=args.listen,
            seeds=list(args.seed),
            alias=f"hostile-{args.mode}",
            gossip_interval=0.3,
            ttl=2,
        )
    )
    node.cache = HostileCache(node, args.mode, args.block_tokens)
    await node.start()
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
    args, _ = ap.parse_known_args()  # the flags `kvmesh peer` takes are accepted and ignored
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
