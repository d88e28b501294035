"""A library ``HeadRuntime`` fetches like a ``kvmesh head`` once its process is ready
(issue #41: library path = head path).

Real processes: a cache peer holds a ~12 MB prompt; a fresh ``kvmesh head``
fetches it (published by a first head under the same caller, so the hit is
exact, as a library client's is); then a library process
(:mod:`tests.library_head`) fetches the same prompt, first bare (no
:func:`~kvmesh.runtime.ready.prepare_process`: the bench's old client), then
prepared (:func:`~kvmesh.runtime.ready.ready` runs through ``HeadRuntime``'s
warm-up). Asserted on minor page faults during the request, never on time: bare,
the fetch faults in about a page per page fetched; ready, no more than the head
process takes (within a margin of 5% of the pages), and the head process itself
faults in under a third of the pages it fetched: its fetch lands in the heap it
warmed at start, even after idling (glibc gives threads heaps of their own unless
the process limits it to one before its first threads allocate).

The process-wide part of :func:`~kvmesh.runtime.ready.ready` runs only where a
process asked for it, and once; a vLLM worker's warm heap is never trimmed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .library_head import minor_faults
from .procs import Peer
from .test_api import Head

PAGE = os.sysconf("SC_PAGE_SIZE")
TOKENS = 12000  # ~12 MB of demo-tiny KV: ~3k pages
ROOT = Path(__file__).resolve().parent.parent


def head_fetch(peer: Peer) -> dict:
    """A fresh head process's exact remote hit on the prompt: its report and faults."""
    prompt = [5 + (i * 7) % 200 for i in range(TOKENS)]  # the library's prompt
    body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    exact = ("--seed", peer.address, "--exact-reuse-by-address")  # its own tails: exact hits
    first = Head(*exact)
    try:
        first.wait(lambda h: h["peers"] >= 1)
        assert first.http.post("/v1/completions", json=body).status_code == 200
        first.wait(lambda h: h["publish_pending"] == 0, timeout=60)
    finally:
        first.stop()
    fresh = Head(*exact)
    try:
        fresh.wait(lambda h: h["compatible_peers"] >= 1)
        fresh.wait(lambda h: h["memory"]["idle_passes"] >= 1)  # as the library waits
        before = minor_faults(fresh.proc.pid)
        r = fresh.http.post("/v1/completions", json=body, timeout=120).json()
        faults = minor_faults(fresh.proc.pid) - before
    finally:
        fresh.stop()
    return {**r["kvmesh"], "faults": faults}


def library_fetch(peer: Peer, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.library_head", peer.address, str(TOKENS), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_ready_library_head_fetches_into_memory_as_warm_as_a_heads(tmp_path):
    peer = Peer(alias="ready-peer", log_dir=tmp_path)
    try:
        head = head_fetch(peer)
        bare = library_fetch(peer, "bare")
        ready = library_fetch(peer, "ready")
    finally:
        peer.kill()
    for hit in (head, bare, ready):  # the same exact hit, whole prompt fetched
        assert hit["source"] == "remote" and hit["reused_tokens"] == TOKENS, hit
    pages = head["bytes_fetched"] // PAGE
    assert pages > 2000 and bare["bytes_fetched"] == head["bytes_fetched"]
    # a head's fetch lands in the heap it warmed at start (one heap for every thread,
    # kept warm while idle): cold, received blocks and the import buffer take ~2 faults a page
    assert head["faults"] < pages // 3, (head, pages)
    assert bare["faults"] > pages // 2, (bare, pages)  # what the old client paid
    assert ready["faults"] <= head["faults"] + pages // 20, (ready, head, pages)


def test_the_process_wide_part_runs_once_and_only_where_asked():
    """In this (test) process nothing called prepare_process: a HeadRuntime's
    warm-up leaves the collector, the switch interval and the heap alone; asked
    explicitly, it does them once, and a heap that may not be trimmed is not."""
    code = """
import gc, sys
from kvmesh import memory
from kvmesh.engine import load_engine
from kvmesh.runtime import ready as r
engine = load_engine("demo-tiny", "torch")
interval = sys.getswitchinterval()
r.ready(engine, None, None)
assert sys.getswitchinterval() == interval and gc.get_freeze_count() == 0
assert memory.report(None, None, 0)["warm_bytes"] == 0
r.ready(None, None, None, process=True, idle_trim=False)
assert sys.getswitchinterval() == r.SWITCH_INTERVAL_S and gc.get_freeze_count() > 0
assert memory.report(None, None, 0)["warm_bytes"] > 0
memory.after_request(idle=True)  # a trim would be due: none is, with idle_trim off
assert memory._IDLE._thread is None
frozen = gc.get_freeze_count()
r.ready(None, None, None, process=True)  # once per process
assert gc.get_freeze_count() == frozen
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
