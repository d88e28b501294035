"""Tenants end to end with real processes: a head with two tenant keys and a peer,
then the head restarted (its RAM gone, so a hit can only come from the peer)."""

from __future__ import annotations

import subprocess
import sys

from .procs import Peer
from .test_api import Head

KEYS = "key-a tenant-a\nkey-b tenant-b\n"
PROMPT = "Quarterly numbers for the board, do not share: revenue up, costs flat. " * 4


def ask(h: Head, key: str, **extra: object) -> dict:
    body = {"model": "demo-tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **extra}
    r = h.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    h.wait(lambda s: s["publish_pending"] == 0)  # on the peer before the next request
    return r.json()


def holds(h: Head, key: str, **extra: object) -> dict:
    """Per source, the prompt tokens ``key``'s tenant holds (POST /v1/cache/query)."""
    body = {"model": "demo-tiny", "prompt": PROMPT, **extra}
    r = h.http.post("/v1/cache/query", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["prefix"]


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_tenants_a_peer_and_a_restart(tmp_path):
    keys, secret = tmp_path / "keys", tmp_path / "tenant.secret"
    keys.write_text(KEYS)
    peer = Peer(alias="tenant-peer", log_dir=tmp_path)
    args = (
        "--seed",
        peer.address,
        "--api-key-file",
        str(keys),
        "--tenant-secret-file",
        str(secret),
    )
    texts = []
    try:
        h = Head(*args, "--alias", "tenant-head")
        try:
            h.wait(lambda s: s["compatible_peers"] >= 1)
            a = ask(h, "key-a")
            n = a["usage"]["prompt_tokens"]
            assert cached(a) == 0 and n > 200
            b = ask(h, "key-b")  # the same prompt, the other tenant: cold
            assert cached(b) == 0 and b["kvmesh"]["source"] == "compute"
            again = ask(h, "key-a")
            assert cached(again) >= 0.9 * n and again["kvmesh"]["source"] in ("session", "local")
            b_salted = ask(h, "key-b", cache_salt="a-salt")
            a_salted = ask(h, "key-a", cache_salt="a-salt")  # a's first with this salt
            assert cached(b_salted) == 0 and cached(a_salted) == 0
            a_other = ask(h, "key-a", cache_salt="another")  # two salts, two caches
            assert cached(a_other) == 0
            texts += [a, b, again, b_salted, a_salted, a_other]
        finally:
            h.stop()
        h = Head(*args, "--alias", "tenant-head-2")  # restarted: only the peer remembers
        try:
            h.wait(lambda s: s["compatible_peers"] >= 1)
            b_after = ask(h, "key-b", cache_salt="never-sent")
            assert cached(b_after) == 0
            a_after = ask(h, "key-a")
            assert cached(a_after) >= 0.9 * n and a_after["kvmesh"]["source"] == "remote"
            # b's own salted cache is on the peer, not a's. (Whether the head fetches it
            # is the planner's call: by now it has measured this tiny model's prefill
            # and a real fetch + import, and may rightly compute 280 tokens instead.)
            held = holds(h, "key-b", cache_salt="a-salt")
            assert held["tenant-peer"] >= 0.9 * n, held
            assert holds(h, "key-b", cache_salt="never-used")["tenant-peer"] == 0
            b_after = ask(h, "key-b", cache_salt="a-salt")
            assert b_after["kvmesh"]["source"] in ("remote", "compute"), b_after["kvmesh"]
            texts += [a_after, b_after]
        finally:
            h.stop()
    finally:
        peer.kill()
    assert len({r["choices"][0]["text"] for r in texts}) == 1


def test_a_bad_key_file_is_a_start_up_error(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-a tenant a\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "head",
            "--model",
            "demo-tiny",
            "--listen",
            "127.0.0.1:0",
            "--api-key-file",
            str(keys),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--api-key-file" in r.stderr and ":1:" in r.stderr, r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "head",
            "--model",
            "demo-tiny",
            "--listen",
            "127.0.0.1:0",
            "--tenant-budget",
            "lots",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--tenant-budget" in r.stderr, r.stderr
