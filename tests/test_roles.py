"""Roles with real head and peer processes, as the audit of issue #36 attacked them:
a tenant's key is never an admin's (no fleet key, no other tenant's numbers, no
addresses), a keyless caller gets whole blocks only, a restarted head keeps its
tenants' caches without being told where their secret lives, and bodies that ask
for unbounded work are refused before any runs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import pytest

from kvmesh.api.credentials import KeyFileError, default_secret_file, head_secret
from kvmesh.api.requests import MAX_STOP_CHARS

from .procs import Peer
from .test_api import Head
from .test_head_robust import _own_address

ADMIN = "admin-key-0123456789"
ACME, TENANT_B = "acme-key-0123456789", "b-key-0123456789"
B = 32  # demo-tiny's block tokens
SECRET_PROMPT = "The PIN for the acme vault is 4 8 1 5 1 6 2 3 4 2, tell no one. " * 6


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(h: Head, prompt: str | list[int], key: str | None = None, **extra) -> httpx.Response:
    body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return h.http.post("/v1/completions", json=body, headers=bearer(key) if key else {})


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("roles")
    (d / "fleet.key").write_text("cd" * 32)
    (d / "admins").write_text(ADMIN + "\n")
    (d / "tenants").write_text(f"{ACME} acme\n{TENANT_B} tenant-b\n")
    peer = Peer("--fleet-key-file", str(d / "fleet.key"), alias="roles-peer", log_dir=d)
    args = ("--seed", peer.address, "--fleet-key-file", str(d / "fleet.key"))
    keys = ("--admin-key-file", str(d / "admins"), "--api-key-file", str(d / "tenants"))
    head = Head(*args, *keys, "--alias", "roles-head")
    try:
        head.wait(lambda s: s["compatible_peers"] >= 1)
        yield head, peer, args, keys
    finally:
        head.stop()
        peer.kill()


def test_a_tenant_key_never_administers_nor_pairs(fleet):
    head, peer, _, _ = fleet
    assert cached(complete(head, SECRET_PROMPT, ACME)) == 0
    b = bearer(TENANT_B)
    assert head.http.get("/v1/admin/tenants", headers=b).status_code == 403
    assert head.http.post("/v1/network/nodes/register", headers=b).status_code == 403
    assert head.http.post("/v1/network/groups", json={"name": "x"}, headers=b).status_code == 403
    nodes = head.http.get("/v1/network/nodes", headers=b).json()["nodes"]
    assert all("endpoints" not in n and "node_id" not in n for n in nodes)
    assert peer.address not in head.http.get("/v1/network/prefill", headers=b).text
    assert "kvmesh_tenant_" not in head.http.get("/metrics", headers=b).text
    # the admin sees acme's numbers and may pair a node: the fleet key goes to it alone
    rows = head.http.get("/v1/admin/tenants", headers=bearer(ADMIN)).json()["tenants"]
    assert rows["acme"]["requests"] >= 1
    token = head.http.post("/v1/network/nodes/register", headers=bearer(ADMIN)).json()
    r = head.http.post("/v1/network/pair", json={"token": token["pairing_token"]})
    assert r.status_code == 200 and r.json()["fleet_key"] == "cd" * 32


def test_a_tenant_header_is_refused_without_a_gateway(fleet):
    """``--tenant-header`` needs gateway keys: the head refuses to start without."""
    _, _, args, keys = fleet
    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "head", *args, *keys, "--tenant-header", "x-t"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--gateway-key-file" in r.stderr


def test_a_keyless_caller_gets_whole_blocks_only(fleet):
    """Behind a proxy or a NAT one address is many people: a keyless repeat is
    served whole blocks, never its exact tail (a guess learns nothing finer)."""
    head, _, _, _ = fleet
    prompt = "A keyless caller's own prompt, repeated word for word by the same address. " * 3
    first = complete(head, prompt)
    n = first.json()["usage"]["prompt_tokens"]
    assert n % B and cached(first) == 0
    again = cached(complete(head, prompt))
    assert again == n - n % B  # whole blocks, not the tail it sent itself
    assert cached(complete(head, prompt, ACME)) == 0  # and never acme's cache


def test_restarted_head_keeps_tenants_caches_without_a_secret_flag(fleet):
    """No ``--tenant-secret-file``: the head keeps one (0600) in its home, so a
    restarted head derives the same roots and finds acme's blocks on the peer."""
    head, _, args, keys = fleet
    prompt = "Acme's long onboarding document, chapter one, for restart tests. " * 8
    first = complete(head, prompt, ACME)
    n = first.json()["usage"]["prompt_tokens"]
    head.wait(lambda s: s["publish_pending"] == 0)
    secret = default_secret_file()
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    second = Head(*args, *keys, "--alias", "roles-head-2")  # RAM empty: only the peer holds it
    try:
        second.wait(lambda s: s["compatible_peers"] >= 1)
        q = second.http.post(
            "/v1/cache/query",
            json={"model": "demo-tiny", "prompt": prompt},
            headers=bearer(ACME),
        ).json()
        assert q["prefix"]["roles-peer"] >= n - n % B
        other = second.http.post(
            "/v1/cache/query",
            json={"model": "demo-tiny", "prompt": prompt},
            headers=bearer(TENANT_B),
        ).json()
        assert other["prefix"]["roles-peer"] == 0
    finally:
        second.stop()


def test_a_tenant_secret_others_can_read_is_refused(tmp_path):
    p = tmp_path / "secret"
    head_secret(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    os.chmod(p, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        head_secret(p)


@pytest.mark.parametrize("ids", [[True, 1], [1.0], [1, 2.5], [1, "a"]])
def test_token_ids_are_json_integers(fleet, ids):
    head, _, _, _ = fleet
    r = complete(head, ids)
    assert r.status_code == 400, r.text


def test_a_stop_longer_than_the_bound_is_a_400(fleet):
    head, _, _, _ = fleet
    r = complete(head, "hello", stop=["x" * (MAX_STOP_CHARS + 1)])
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert complete(head, "hello", stop=["x" * MAX_STOP_CHARS]).status_code == 200
    # more than OpenAI's 4, as vLLM takes them (lm-eval's humaneval sends 5 and the EOS)
    many = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "</s>"]
    assert complete(head, "hello", stop=many).status_code == 200


def test_forwarded_proto_from_off_the_host_does_not_make_plaintext_pairing(tmp_path):
    ip = _own_address()
    (tmp_path / "fleet.key").write_text("ef" * 32)
    (tmp_path / "admins").write_text(ADMIN + "\n")
    h = Head(
        "--listen",
        "0.0.0.0:0",
        "--fleet-key-file",
        str(tmp_path / "fleet.key"),
        "--admin-key-file",
        str(tmp_path / "admins"),
    )
    outside = f"http://{ip}:{urlsplit(h.url).port}"
    try:
        reg = httpx.post(outside + "/v1/network/nodes/register", headers=bearer(ADMIN))
        forged = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "127.0.0.1"}
        r = httpx.post(
            outside + "/v1/network/pair",
            json={"token": reg.json()["pairing_token"]},
            headers=forged,
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "plaintext_pairing"
        assert "ef" * 32 not in r.text
    finally:
        h.stop()


def test_key_files_of_two_roles_never_share_a_key(tmp_path):
    (tmp_path / "a").write_text("same-key\n")
    (tmp_path / "t").write_text("same-key acme\n")
    flags = ["--admin-key-file", str(tmp_path / "a"), "--api-key-file", str(tmp_path / "t")]
    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "head", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "one role" in r.stderr


def test_admin_key_file_errors_name_the_flag(tmp_path):
    (tmp_path / "a").write_text("key with-a-tenant\n")
    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "head", "--admin-key-file", str(tmp_path / "a")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--admin-key-file" in r.stderr and ":1:" in r.stderr


def test_a_gateway_names_tenants_and_nobody_else_can(tmp_path):
    """With real processes: only a request carrying the gateway's key may name its
    tenant by header; a tenant's key with the header (the audit's B + acme) is a 400
    and reads nothing of acme's."""
    (tmp_path / "tenants").write_text(f"{TENANT_B} tenant-b\n")
    (tmp_path / "gateways").write_text("gateway-key-0123456789\n")
    h = Head(
        "--api-key-file",
        str(tmp_path / "tenants"),
        "--gateway-key-file",
        str(tmp_path / "gateways"),
        "--tenant-header",
        "x-tenant-id",
    )
    gw = {**bearer("gateway-key-0123456789"), "x-tenant-id": "acme"}
    body = {"model": "demo-tiny", "prompt": SECRET_PROMPT, "max_tokens": 2, "temperature": 0}
    try:
        assert cached(h.http.post("/v1/completions", json=body, headers=gw)) == 0
        again = h.http.post("/v1/completions", json=body, headers=gw)
        n = again.json()["usage"]["prompt_tokens"]
        # acme's cache, whole blocks (many users behind one key; the last token is computed)
        assert cached(again) == min(n - n % B, n - 1)
        forged = {**bearer(TENANT_B), "x-tenant-id": "acme"}
        r = h.http.post("/v1/completions", json=body, headers=forged)
        assert r.status_code == 400 and r.json()["error"]["code"] == "untrusted_tenant_header"
        r = h.http.post("/v1/completions", json=body, headers={"x-tenant-id": "acme"})
        assert r.status_code == 401
        assert cached(complete(h, SECRET_PROMPT, TENANT_B)) == 0  # b's own cache: cold
    finally:
        h.stop()
