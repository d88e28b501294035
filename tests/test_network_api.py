"""The network API: public vs admin reads, admin writes (a tenant's key is not an
admin's), pairing, bad bodies."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from kvmesh.api.network import MIN_PUBLIC_REQUESTS

from .procs import Peer
from .test_api import Head

KEY = "s3cret-api-key-for-tests"
TENANT_KEY = "tenant-b-key"
HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("net")
    keyfile = d / "admin-keys"
    keyfile.write_text(f"# operators\n{KEY}\nanother-key\n")
    (d / "tenant-keys").write_text(f"{TENANT_KEY} tenant-b\n")
    p1 = Peer(alias="peer-one", log_dir=d)
    p2 = Peer("--seed", p1.address, alias=HOSTILE, log_dir=d)
    head = Head(
        "--seed",
        p1.address,
        "--admin-key-file",
        str(keyfile),
        "--api-key-file",
        str(d / "tenant-keys"),
        "--alias",
        "head",
    )
    head.wait(lambda s: s["peers"] >= 2)
    yield head, p1, p2
    head.stop()
    p1.kill()
    p2.kill()


IP = re.compile(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b")
AUTH_CASES = [
    ({}, False),
    ({"X-API-Key": KEY}, True),
    ({"Authorization": f"Bearer {KEY}"}, True),
    ({"X-API-Key": TENANT_KEY}, False),
    ({"Authorization": "Bearer"}, False),
    ({"Authorization": f"Basic {KEY}"}, False),
]
WRONG = [{"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}]


@pytest.mark.parametrize("headers,private", AUTH_CASES)
def test_reads_are_public_and_keys_add_detail(fleet, headers, private):
    head, p1, p2 = fleet
    body = {"model": "demo-tiny", "prompt": "hello " * 40, "max_tokens": 3, "ignore_eos": True}
    head.http.post("/v1/completions", json=body)  # 3 tokens: sampled, an early EOS would end it
    for path in ("summary", "nodes", "groups", "tokens", "prefill"):
        r = head.http.get(f"/v1/network/{path}", headers=headers)
        assert r.status_code == 200
        text = r.text
        if not private:
            assert not IP.search(text), (path, text)  # no exact addresses
            assert p1.epoch not in text and "node_id" not in text
            assert not re.search(r"[0-9a-f]{32,}", text)  # no hashes of any kind
    nodes = head.http.get("/v1/network/nodes", headers=headers).json()["nodes"]
    assert {n["alias"] for n in nodes} >= {"peer-one", HOSTILE, "head"}
    if private:
        one = next(n for n in nodes if n["alias"] == "peer-one")
        assert one["epoch"] == p1.epoch and one["endpoints"][0]["address"] == p1.address
        assert one["endpoints"][0]["rtt_ms"] is not None
    tokens = head.http.get("/v1/network/tokens", headers=headers).json()
    assert tokens["completed_tokens"] >= 3
    # one request's prompt length shows only to an admin: a public window needs company
    least = 1 if private else MIN_PUBLIC_REQUESTS
    assert all(w["requests"] >= least for w in tokens["series"]) and (
        tokens["series"] or not private
    )
    prefill = head.http.get("/v1/network/prefill", headers=headers).json()
    assert private or prefill["recent_transfers"] == []


@pytest.mark.parametrize("headers", WRONG)
def test_a_key_the_head_does_not_know_is_a_401_everywhere(fleet, headers):
    head, _, _ = fleet
    for path in ("summary", "nodes", "tokens"):
        r = head.http.get(f"/v1/network/{path}", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    body = {"model": "demo-tiny", "prompt": "hi", "max_tokens": 1}
    assert head.http.post("/v1/completions", json=body, headers=headers).status_code == 401


@pytest.mark.parametrize("headers", [h for h, ok in AUTH_CASES if not ok] + WRONG)
def test_writes_need_an_admin_key_and_change_nothing_without(fleet, headers):
    head, _, _ = fleet
    before = head.http.get("/v1/network/groups").json()
    tenant = headers.get("X-API-Key") == TENANT_KEY
    want = 403 if tenant else 401
    r = head.http.post("/v1/network/groups", json={"name": "x"}, headers=headers)
    assert r.status_code == want, r.text
    assert r.json()["error"]["code"] == ("admin_only" if tenant else "invalid_api_key")
    assert head.http.post("/v1/network/nodes/register", headers=headers).status_code == want
    assert head.http.delete("/v1/network/groups/anything", headers=headers).status_code == want
    assert head.http.get("/v1/admin/tenants", headers=headers).status_code == want
    assert head.http.get("/v1/network/groups").json() == before


def test_duplicate_credential_headers_are_a_400(fleet):
    head, _, _ = fleet
    two = [("X-API-Key", TENANT_KEY), ("X-API-Key", KEY)]
    r = head.http.get("/v1/admin/tenants", headers=two)
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_credentials"
    mixed = {"X-API-Key": TENANT_KEY, "Authorization": f"Bearer {KEY}"}
    assert head.http.get("/v1/admin/tenants", headers=mixed).status_code == 400
    same = {"X-API-Key": KEY, "Authorization": f"Bearer {KEY}"}
    assert head.http.get("/v1/admin/tenants", headers=same).status_code == 200


def test_forwarded_headers_count_for_nothing_by_default(fleet):
    """From loopback too: X-Forwarded-Proto cannot make the plaintext listener look
    like TLS, nor X-Forwarded-For make one caller another."""
    head, _, _ = fleet
    r = head.http.post("/v1/network/nodes/register", headers={"X-API-Key": KEY})
    token = r.json()["pairing_token"]
    forged = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"}
    r = head.http.post("/v1/network/pair", json={"token": token}, headers=forged)
    assert r.status_code == 200  # loopback itself is the head's own host: allowed ...
    assert "fleet_key" not in r.json()  # ... and this fleet has no key to hand out


def test_groups_create_list_delete(fleet):
    head, _, _ = fleet
    auth = {"X-API-Key": KEY}
    r = head.http.post(
        "/v1/network/groups", json={"name": HOSTILE, "members": ["peer-one"]}, headers=auth
    )
    assert r.status_code == 201
    gid = r.json()["id"]
    assert any(g["id"] == gid for g in head.http.get("/v1/network/groups").json()["groups"])
    for bad in (
        b"{nope",
        b'{"name": ""}',
        b'{"name": 5}',
        b'{"name": "a", "extra": 1}',
        b"[]",
        b'{"name": "' + b"x" * 100 + b'"}',
    ):
        r = head.http.post(
            "/v1/network/groups", content=bad, headers={**auth, "Content-Type": "application/json"}
        )
        assert r.status_code == 400, bad
    assert head.http.delete(f"/v1/network/groups/{gid}", headers=auth).status_code == 204
    assert head.http.delete(f"/v1/network/groups/{gid}", headers=auth).status_code == 404


def test_pairing_token_joins_a_peer_once(fleet, tmp_path):
    head, _, _ = fleet
    r = head.http.post("/v1/network/nodes/register", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 201
    token = r.json()["pairing_token"]
    joined = Peer("--join", head.url, "--pairing-token", token, alias="joiner", log_dir=tmp_path)
    try:
        head.wait(lambda s: s["peers"] >= 3)
        aliases = {n["alias"] for n in head.http.get("/v1/network/nodes").json()["nodes"]}
        assert "joiner" in aliases
    finally:
        joined.kill()
    reuse = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--join",
            head.url,
            "--pairing-token",
            token,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert reuse.returncode != 0 and "403" in reuse.stderr
    assert (
        head.http.post("/v1/network/pair", json={"token": "never-issued-token"}).status_code == 403
    )


def test_expired_pairing_token_is_refused(fleet, monkeypatch):
    from kvmesh.api.network import NetworkState

    state = NetworkState()
    token, _ = state.issue_token()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    assert state.redeem(token) is False


def test_metrics_count_prefill_work_and_cancellations_by_stage(fleet):
    head, _, _ = fleet
    body = {"model": "demo-tiny", "prompt": "count my prefill " * 30, "max_tokens": 1}
    assert head.http.post("/v1/completions", json=body).status_code == 200
    text = head.http.get("/metrics").text
    assert head.metric("kvmesh_prefill_forwards_total") >= 1
    assert head.metric("kvmesh_prefill_computed_tokens_total") >= 1
    assert 0 < head.metric("kvmesh_prefill_peak_chunk_tokens") <= 512
    for name in ("shared_tokens", "share_waits", "share_rescued_tokens", "partial_blocks"):
        assert f"kvmesh_{name}_total " in text, name
    assert head.metric("kvmesh_batch_ridden_steps_total") == 0  # nothing decoded beside it
    for stage in ("queued", "prefilling", "running"):
        assert f'kvmesh_requests_cancelled_total{{stage="{stage}"}}' in text


def fetched_from_a_peer(fleet, engine) -> str:
    """Publish prompts to the fleet's peers until the head fetches one from a peer
    (a publisher's blocks may land on the head itself: local, no link); its alias."""
    from .test_mesh import prompt, published

    head, p1, p2 = fleet
    for i in range(8):
        toks = prompt(engine, 200, f"link rate {i} ")
        published(engine, [p1], toks)
        body = {"model": "demo-tiny", "prompt": toks, "max_tokens": 1}
        report = head.http.post("/v1/completions", json=body).json()["kvmesh"]
        if report["source"] == "remote" and report["peer"] in {p1.alias, p2.alias}:
            return report["peer"]
    pytest.fail("no prompt was fetched from a peer")


def test_the_heads_link_to_a_peer_shows_to_admins_only(fleet, tiny_engine):
    """A prompt published to a peer and fetched by the head: an admin's node rows
    show the link rate the head measured to that peer and its choice there
    (fetch); public rows show neither."""
    head, _, _ = fleet
    peer = fetched_from_a_peer(fleet, tiny_engine)
    admin = head.http.get("/v1/network/nodes", headers={"X-API-Key": KEY}).json()["nodes"]
    row = next(n for n in admin if n["alias"] == peer)
    assert row["link_mbps"] > 0 and row["last_choice"] == "fetch"
    me = next(n for n in admin if n["status"] == "self")
    assert me["link_mbps"] is None and me["last_choice"] is None
    public = head.http.get("/v1/network/nodes").json()["nodes"]
    assert not any({"link_mbps", "link_rtt_ms", "last_choice"} & set(n) for n in public)
