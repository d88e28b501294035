"""KV events for routers: what they cost the store, and the rate they sustain.

    python bench/events.py --json bench/results/events.json [--smoke]

Three measurements, each side by side with its baseline:

- ``per_block``: keying a 32-block prompt and storing its blocks, with KV
  events on (the head's recording keyer, the store listener, the ZMQ publisher
  thread and a subscriber reading on ipc) against the same without; the added
  microseconds per stored block and the ratio. Blocks use a tiny card: a put
  stores a reference, so the ratio is the worst case (bigger blocks cost the
  same absolute time).
- ``rate``: store changes pushed through the listener as fast as one thread can,
  until a reading subscriber holds them all: events per second, sequence gaps and
  drops (both must be 0).
- ``head``: a real ``kvmesh head`` (demo-tiny) serving distinct prompts, with a
  subscriber on its events, against the same head without ``--kv-events``:
  median request latency (ratio), events received, gaps and drops (from its
  ``/metrics``). Processes are stopped on every exit.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import zmq
from _common import demo_card, machine, synthetic_blocks

from kvmesh.blocks import BlockKeyer
from kvmesh.mesh.events import (
    EventPublisher,
    EventsConfig,
    RecordingKeyer,
    StoreEvents,
    TokenMemo,
    decode_batch,
)
from kvmesh.store import BlockStore

CARD = demo_card(layers=1, kv_heads=1, head_dim=4)
CHAIN = 32  # blocks a prompt
PROCS: list[subprocess.Popen[str]] = []


class Reader:
    """A SUB socket read by its own thread: counts batches, events and seq gaps."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.batches = self.events = self.hashes = self.gaps = 0
        self.last = -1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            _, seq_b, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.last >= 0 and seq != self.last + 1:
                self.gaps += 1
            self.last = seq
            batch = decode_batch(payload)
            self.batches += 1
            self.events += len(batch.events)
            self.hashes += sum(len(getattr(e, "block_hashes", ())) for e in batch.events)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)


def per_block(prompts: int, repeats: int) -> dict[str, Any]:
    chains = [synthetic_blocks(CARD, CHAIN * CARD.block_tokens, seed=s) for s in range(prompts)]
    budget = 4 * sum(b.nbytes for blocks, _ in chains for b in blocks)
    plain_keyer = BlockKeyer(CARD.namespace, CARD.block_tokens)

    def run(events: bool) -> float:
        ctx = zmq.Context()
        sink = StoreEvents(TokenMemo())
        endpoint = f"ipc://{tempfile.mkdtemp()}/ev.sock"
        pub = EventPublisher(EventsConfig(endpoint), sink) if events else None
        reader = Reader(ctx, endpoint) if events else None
        time.sleep(0.2)
        keyer = RecordingKeyer(plain_keyer, sink.memo) if events else plain_keyer
        store = BlockStore(budget, listener=sink if events else None)
        t0 = time.perf_counter()
        for blocks, tokens in chains:
            keyer.keys(tokens)
            for b in blocks:
                store.put(b)
        dt = time.perf_counter() - t0
        if pub is not None and reader is not None:
            pub.close()
            reader.close()
        ctx.destroy(linger=0)
        return dt

    plain, evented = [], []
    for _ in range(repeats):  # interleaved: drift hits both sides alike
        plain.append(run(False))
        evented.append(run(True))
    n = prompts * CHAIN
    p, e = statistics.median(plain), statistics.median(evented)
    return {
        "blocks": n,
        "repeats": repeats,
        "plain_us_per_block": p / n * 1e6,
        "events_us_per_block": e / n * 1e6,
        "added_us_per_block": (e - p) / n * 1e6,
        "ratio": e / p,
    }


def rate(changes: int) -> dict[str, Any]:
    blocks, _ = synthetic_blocks(CARD, CHAIN * CARD.block_tokens)
    headers = [b.header for b in blocks if b.header.kind == "block"]  # tails are not announced
    ctx = zmq.Context()
    endpoint = f"ipc://{tempfile.mkdtemp()}/rate.sock"
    sink = StoreEvents(max_pending=changes + 1)
    pub = EventPublisher(EventsConfig(endpoint), sink)
    reader = Reader(ctx, endpoint)
    time.sleep(0.3)
    t0 = time.perf_counter()
    for i in range(changes):
        sink("stored" if i % 2 == 0 else "removed", "ram", headers[(i // 2) % len(headers)])
    pushed = time.perf_counter() - t0
    deadline = time.time() + 120
    while reader.hashes < changes and time.time() < deadline:
        time.sleep(0.01)
    dt = time.perf_counter() - t0
    out = {
        "changes": changes,
        "received": reader.hashes,
        "seconds": dt,
        "events_per_s": reader.hashes / dt,
        "listener_us_per_change": pushed / changes * 1e6,
        "batches": reader.batches,
        "gaps": reader.gaps,
        "dropped": sink.dropped,
    }
    reader.close()
    pub.close()
    ctx.destroy(linger=0)
    return out


def start_head(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "head",
            "--model",
            "demo-tiny",
            "--listen",
            "127.0.0.1:0",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    PROCS.append(proc)
    assert proc.stdout is not None
    m = re.search(r"(https?://\S+) grpc", proc.stdout.readline())
    if not m:
        raise RuntimeError("the head did not start")
    return proc, m.group(1)


def serve(url: str, requests: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    lat = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(requests):
            prompt = [rng.randrange(320) for _ in range(4 * 32 + 5)]
            body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json=body)
            lat.append(time.perf_counter() - t0)
            r.raise_for_status()
    return lat


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def head(requests: int) -> dict[str, Any]:
    endpoint = f"ipc://{tempfile.mkdtemp()}/head.sock"
    out: dict[str, Any] = {"requests": requests}
    for side, args in (("plain", ()), ("events", ("--kv-events", endpoint))):
        proc, url = start_head(*args)
        ctx = zmq.Context()
        reader = Reader(ctx, endpoint) if args else None
        try:
            serve(url, 2, seed=999)  # warm: first-request setup is no side's cost
            t0 = time.perf_counter()
            lat = serve(url, requests, seed=1)
            wall = time.perf_counter() - t0
            out[f"{side}_median_s"] = statistics.median(lat)
            if reader is not None:
                time.sleep(1.0)  # the last batches arrive
                out.update(
                    events_received=reader.events,
                    blocks_announced=reader.hashes,
                    events_per_s=reader.events / wall,
                    gaps=reader.gaps,
                    dropped=metric(url, 'kvmesh_kv_events_total{outcome="dropped"}'),
                )
        finally:
            if reader is not None:
                reader.close()
            ctx.destroy(linger=0)
            proc.terminate()
            proc.wait(15)
    out["latency_ratio"] = out["events_median_s"] / out["plain_median_s"]
    return out


def cleanup(*_: object) -> None:
    for p in PROCS:
        if p.poll() is None:
            p.kill()
    sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="small sizes (CI)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, cleanup)
    try:
        result = {
            "machine": machine(),
            "smoke": a.smoke,
            "per_block": per_block(8 if a.smoke else 200, 3 if a.smoke else 7),
            "rate": rate(5_000 if a.smoke else 200_000),
            "head": head(4 if a.smoke else 40),
        }
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.kill()
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
