"""Publish and fetch + verify of KV with a real peer process over loopback,
against the machine's limits measured in the same run.

    python bench/transfer.py --json bench/results/transfer.json [--mb 16,64,256]
    python bench/transfer.py --smoke --json /tmp/transfer.json   # CI: 4 MB, once

For each size: synthetic demo-shaped KV blocks (24 KiB/token, 769 KiB blocks)
are published to a `kvmesh peer` process, then fetched by the real client
(lookup, then the blocks under a lease, each block's digest verified and its
header validated on a worker thread while the next arrives). Fetch and publish go
over the bulk data path on TCP, over the peer's same-host Unix socket (what two
nodes on one host use unless ``--no-local-socket``) and, for comparison, over gRPC
(``--no-bulk``'s path). Also measured on the same bytes: BLAKE3 and SHA-256 on one
core, a raw TCP socket copy between two processes (``recv_into`` one preallocated
buffer), and memcpy. Every figure is the best of ``--reps``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import sys
import time

import blake3
import numpy as np
from _common import demo_card, machine, popen, reap, run_main, spawn_peer, stop, synthetic_blocks

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import CHUNK_BYTES, Layout
from kvmesh.memory import keep_heap_warm
from kvmesh.mesh.client import MeshClient
from kvmesh.mesh.membership import Membership
from kvmesh.mesh.proto import kvmesh_pb2 as pb

_SENDER = """
import socket, sys
n = int(sys.argv[2]); buf = bytes(min(n, 8 << 20))
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
sent = 0
while sent < n:
    sent += s.send(memoryview(buf)[: min(len(buf), n - sent)])
s.close()
"""


def socket_gbps(nbytes: int) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    sender = popen([sys.executable, "-c", _SENDER, str(port), str(nbytes)])
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(60)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    t0 = time.perf_counter()
    while got < nbytes:
        n = conn.recv_into(view[got:], min(nbytes - got, 4 << 20))
        if not n:
            break
        got += n
    dt = time.perf_counter() - t0
    assert reap(sender) == 0, "the socket baseline's sender failed"
    conn.close()
    srv.close()
    return got / dt / 1e9


def digest_gbps(blobs: list[bytes], algo: str) -> float:
    """One core hashing each block whole (what a verifier thread does)."""
    new = blake3.blake3 if algo == "blake3" else hashlib.sha256
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for b in blobs:
            new(b).digest()
        best = min(best, time.perf_counter() - t0)
    return sum(map(len, blobs)) / best / 1e9


def memcpy_gbps(nbytes: int) -> float:
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


async def transfer_gbps(  # type: ignore[no-untyped-def]
    address: str, blocks, tokens, card, chunk: int, reps: int, bulk: bool, local: bool = False
) -> dict[str, float]:
    """Best-of-``reps`` publish (every byte received and verified by the peer, stored
    the first time) and fetch + verify, on the bulk path (over TCP, or with
    ``local`` over the peer's same-host Unix socket) or over gRPC."""
    membership = Membership(f"bench-{os.getpid()}", lambda: pb.CapabilityCard(alias="bench"))
    client = MeshClient(
        membership, chunk_bytes=chunk, fetch_deadline=120, use_bulk=bulk, local_socket=local
    )
    await client.exchange(address, None)
    peer = membership.live()[0]
    total = sum(b.nbytes for b in blocks)
    publish_s = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        resp = await client.publish(peer, card, blocks)
        publish_s = min(publish_s, time.perf_counter() - t0)
        assert resp.stored + resp.duplicates == len(blocks) and not resp.rejected, resp
    await client.exchange(address, None)  # learn that the peer now serves the namespace
    keys = BlockKeyer(card.namespace, card.block_tokens).keys(tokens)
    layout = Layout(card)
    best = float("inf")
    for _ in range(reps):
        hits, errors = await client.lookup(card, keys)
        assert hits and not errors and bool(hits[0].data_address) == bulk, errors
        t0 = time.perf_counter()
        got = await client.fetch(layout, hits[0])
        dt = time.perf_counter() - t0
        assert [g.digest for g in got] == [b.digest for b in blocks]
        best = min(best, dt)
        del got
    assert client.local_streams == (2 * reps if local else 0), client.local_streams
    await client.close()
    return {
        "fetch_gbps": total / best / 1e9,
        "fetch_s": best,
        "publish_gbps": total / publish_s / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/transfer.json")
    ap.add_argument("--mb", default="16,64,256", help="KV sizes in MB")
    ap.add_argument("--chunk-kib", type=int, default=CHUNK_BYTES >> 10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CI: 4 MB, best of 1")
    args = ap.parse_args()
    if args.smoke:
        args.mb, args.reps = "4", 1
    card = demo_card()
    rows = []
    sizes = [int(x) for x in args.mb.split(",")]
    # as a head does at start (kvmesh/memory.py): freed memory stays faulted in, for the
    # client's receive buffers and the socket baseline's alike
    keep_heap_warm((max(sizes) + 64) << 20)
    proc, address = spawn_peer()
    try:
        for mb in sizes:
            n_tokens = mb * 10**6 // card.kv_bytes_per_token
            blocks, tokens = synthetic_blocks(card, n_tokens, seed=mb)
            nbytes = sum(b.nbytes for b in blocks)
            run = (address, blocks, tokens, card, args.chunk_kib << 10, args.reps)
            fast = asyncio.run(transfer_gbps(*run, bulk=True))
            unix = asyncio.run(transfer_gbps(*run, bulk=True, local=True))
            grpc = asyncio.run(transfer_gbps(*run, bulk=False))
            sock = max(socket_gbps(nbytes) for _ in range(args.reps))
            row = {
                "mb": round(nbytes / 1e6, 1),
                "blocks": len(blocks),
                **fast,
                "local_fetch_gbps": unix["fetch_gbps"],
                "local_publish_gbps": unix["publish_gbps"],
                "grpc_fetch_gbps": grpc["fetch_gbps"],
                "grpc_publish_gbps": grpc["publish_gbps"],
                "blake3_gbps": digest_gbps([bytes(b.blob) for b in blocks], "blake3"),
                "sha256_gbps": digest_gbps([bytes(b.blob) for b in blocks], "sha256"),
                "socket_gbps": sock,
                "memcpy_gbps": memcpy_gbps(nbytes),
                "chunk_bytes": args.chunk_kib << 10,
            }
            row["fetch_vs_socket"] = row["fetch_gbps"] / sock
            row["publish_vs_socket"] = row["publish_gbps"] / sock
            rows.append(row)
            print(
                f"{row['mb']:7.1f} MB  fetch+verify {row['fetch_gbps']:.2f} GB/s "
                f"({row['fetch_vs_socket']:.2f}x socket {sock:.2f}; Unix socket "
                f"{row['local_fetch_gbps']:.2f}; gRPC "
                f"{row['grpc_fetch_gbps']:.2f})  publish {row['publish_gbps']:.2f} "
                f"({row['publish_vs_socket']:.2f}x; gRPC {row['grpc_publish_gbps']:.2f})  "
                f"blake3 {row['blake3_gbps']:.2f}  sha256 {row['sha256_gbps']:.2f}  "
                f"memcpy {row['memcpy_gbps']:.2f}",
                flush=True,
            )
            del blocks
    finally:
        stop(proc)
    out = {"machine": machine(), "chunk_bytes": args.chunk_kib << 10, "results": rows}
    if rows:
        keys = (
            "fetch_gbps",
            "local_fetch_gbps",
            "publish_gbps",
            "socket_gbps",
            "blake3_gbps",
            "sha256_gbps",
            "memcpy_gbps",
            "fetch_vs_socket",
            "publish_vs_socket",
        )
        out.update({k: rows[-1][k] for k in keys})
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
