"""/healthz latency while the head's request queue is full.

    python bench/healthz.py --json bench/results/healthz.json [--model demo-tiny]
    python bench/healthz.py --smoke --json /tmp/healthz.json   # CI: demo-tiny, a queue of 2

A real ``kvmesh head`` process; clients on raw sockets start long generations
(``ignore_eos``, thousands of tokens) until one is decoding and the queue is
full, then /healthz (and /metrics, /v1/network/summary) are timed from a
keep-alive client, one request at a time, after a few untimed warm-up calls.
Scenarios:

- ``idle``: nothing queued (the floor).
- ``full``: ``--max-queue`` requests waiting, ``--max-batch`` decoding, and one more client
  refused with 503 at every sample (the overload the queue exists for).
- ``deep``: ``--deep`` requests waiting (46: the issue's report of /healthz
  answering after 6.5 s with 46 requests queued).

Every generation is cancelled at the end by closing its socket; the head's
``kvmesh_requests_cancelled_total`` confirms they stopped. Exits non-zero if a
generation was not cancelled or an overflow client was not refused with 503.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from _common import machine, run_main, spawn_kvmesh, stop

WARMUP = 5
PROMPT = "The head stays responsive while its request queue is full. " * 4


def start_head(model: str, max_queue: int, max_batch: int) -> tuple[subprocess.Popen[str], str]:
    proc, m = spawn_kvmesh(
        "head",
        "--model",
        model,
        "--listen",
        "127.0.0.1:0",
        "--max-queue",
        str(max_queue),
        "--max-batch",
        str(max_batch),
        "--no-publish",
        pattern=r"(http://\S+) grpc",
    )
    return proc, m.group(1)


def long_request(url: str, model: str, stream: bool) -> socket.socket:
    """A generation that decodes for minutes unless its client leaves."""
    u = urlsplit(url)
    body = json.dumps(
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 20000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def wait_queue(http: httpx.Client, waiting: int, running: int, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        q = http.get("/healthz").json()["queue"]
        if q["waiting"] >= waiting and q["running"] >= running:
            return
        time.sleep(0.05)
    raise SystemExit(f"the queue never filled: {http.get('/healthz').json()}")


def timed(http: httpx.Client, path: str, n: int, overflow_url: str | None = None) -> dict:
    for _ in range(WARMUP):  # first calls of a code path (imports, caches) are not its latency
        http.get(path)
    ms, refused = [], 0
    for _ in range(n):
        if overflow_url is not None:  # one more client arrives and is turned away
            r = httpx.post(overflow_url, json={"model": "x", "prompt": "x"}, timeout=30)
            refused += r.status_code == 503
        t0 = time.perf_counter()
        r = http.get(path)
        ms.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, r.text
    worst = max(range(n), key=ms.__getitem__)
    ms.sort()
    return {
        "path": path,
        "samples": n,
        "p50_ms": round(statistics.median(ms), 2),
        "p90_ms": round(ms[int(0.9 * (n - 1))], 2),
        "p99_ms": round(ms[int(0.99 * (n - 1))], 2),
        "max_ms": round(ms[-1], 2),
        "max_at_sample": worst,
        **({"overflow_503": refused} if overflow_url else {}),
    }


def cancelled(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(
        float(v) for v in re.findall(r"^kvmesh_requests_cancelled_total\S* (\S+)$", text, re.M)
    )


def scenario(model: str, max_queue: int, queued: int, samples: int, batch: int) -> dict:
    proc, url = start_head(model, max_queue, batch)
    http = httpx.Client(base_url=url, timeout=60)
    socks: list[socket.socket] = []
    try:
        out: dict = {"max_queue": max_queue, "waiting": queued, "max_batch": batch}
        if queued == 0:
            out["healthz"] = timed(http, "/healthz", samples)
            return out
        socks += [long_request(url, model, stream=True) for _ in range(batch)]
        wait_queue(http, 0, batch)  # the batch is full: what arrives next waits
        socks += [long_request(url, model, stream=i % 2 == 0) for i in range(queued)]
        wait_queue(http, queued, batch)
        overflow = url + "/v1/completions" if queued >= max_queue else None
        out["healthz"] = timed(http, "/healthz", samples, overflow)
        out["metrics"] = timed(http, "/metrics", samples // 4)
        out["summary"] = timed(http, "/v1/network/summary", samples // 4)
        for s in socks:
            s.close()
        deadline = time.time() + 60
        while cancelled(http) < len(socks) and time.time() < deadline:
            time.sleep(0.1)
        out["cancelled"] = cancelled(http)
        return out
    finally:
        for s in socks:
            s.close()
        http.close()
        stop(proc, grace_s=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo", help="demo (0.5B-shaped) or demo-tiny")
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--deep", type=int, default=46)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="the head's --max-batch: this many generations decode before requests wait",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="CI: demo-tiny, a queue of 2, no deep")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.max_queue, a.samples, a.max_batch = "demo-tiny", 2, 8, 1
    result = {
        "benchmark": "healthz latency with the request queue full",
        "model": a.model,
        "machine": machine(),
        "idle": scenario(a.model, a.max_queue, 0, a.samples, a.max_batch),
        "full": scenario(a.model, a.max_queue, a.max_queue, a.samples, a.max_batch),
    }
    if not a.smoke:  # the same path as "full" with a longer queue: a third head start
        result["deep"] = scenario(a.model, max(a.deep, a.max_queue), a.deep, a.samples, a.max_batch)
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if failed := failures(result):
        sys.exit("; ".join(failed))


def failures(result: dict) -> list[str]:  # type: ignore[type-arg]
    """The benchmark's own checks: every generation cancelled, every overflow refused."""
    out = []
    for name in ("full", "deep"):
        if name not in result:
            continue
        r = result[name]
        started = r["waiting"] + r["max_batch"]
        if r["cancelled"] < started:
            out.append(f"{name}: {r['cancelled']:.0f} of {started} generations cancelled")
    hz = result["full"]["healthz"]
    if hz.get("overflow_503") != hz["samples"]:
        out.append(f"full: {hz.get('overflow_503')} of {hz['samples']} overflow clients got 503")
    return out


if __name__ == "__main__":
    run_main(main)
