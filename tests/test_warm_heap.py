"""A fresh ``kvmesh head`` imports a fetched prefix into memory it already faulted in.

A head keeps freed heap and touches a warm region at start (:mod:`kvmesh.memory`),
so that a fetch's buffers take no page faults. That holds only if the fetch's
threads allocate from that heap: glibc gives threads heaps of their own unless
the process limits it to one before its first threads allocate. Measured here
on real processes: a peer holds a prompt a first head published, a second head
(a new process) fetches it, and the minor page faults the second head takes
during that request are a small part of the prefix's pages (without the limit
its hashers fault in the whole import buffer). The fresh head has been idle
first: what an idle head gives back (issue #37) leaves its warm heap warm.
"""

from __future__ import annotations

import os

from .procs import Peer
from .test_api import Head

PAGE = os.sysconf("SC_PAGE_SIZE")


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_a_fresh_heads_fetch_lands_in_its_warm_heap(tmp_path):
    peer = Peer(alias="heap-peer", log_dir=tmp_path)
    prompt = [5 + (i * 7) % 200 for i in range(12000)]  # ~12 MB of demo-tiny KV
    body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        first = Head("--seed", peer.address)
        try:
            first.wait(lambda h: h["peers"] >= 1)
            assert first.http.post("/v1/completions", json=body).status_code == 200
            first.wait(lambda h: h["publish_pending"] == 0, timeout=60)
        finally:
            first.stop()
        fresh = Head("--seed", peer.address)
        try:
            h = fresh.wait(lambda h: h["compatible_peers"] >= 1)
            if "memory" in h:  # an idle head's first pass (cycles, trim) spoils nothing
                fresh.wait(lambda h: h["memory"]["idle_passes"] >= 1)
            before = minor_faults(fresh.proc.pid)
            r = fresh.http.post("/v1/completions", json=body).json()
            faults = minor_faults(fresh.proc.pid) - before
        finally:
            fresh.stop()
    finally:
        peer.kill()
    kv = r["kvmesh"]
    assert kv["source"] == "remote" and kv["fallback"] is None
    pages = kv["bytes_fetched"] // PAGE
    assert pages > 2000
    # received blocks and the import buffer are ~2 pages per fetched page when cold
    assert faults < pages // 3, (faults, pages)
