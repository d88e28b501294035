"""Tenants through the real ASGI app in process (real runtime, engine on demo-tiny,
a real mesh node for the local store; no peer): one tenant's prompts are never
another's cache hits, ``cache_salt`` separates within a tenant, a guess learns
nothing finer than a block, and nothing public names a tenant."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.api.app import Access, TenantOptions, create_app
from kvmesh.api.credentials import KeyFileError, read_key_file
from kvmesh.blocks import MAX_CACHE_SALT_CHARS
from kvmesh.runtime.head import HeadRuntime

from .test_mesh import close, make_head

KEYS = """# key tenant
alice-1 alice
alice-2 alice
alice-3 alice
alice-4 alice
bob-1 bob
solo-1
pub-1 public
"""
ADMIN = "root-admin-1"
GATEWAY = "gw-1"
SECRET = "Idle memory in a fleet becomes a shared prefill cache, one block at a time. " * 2


def hdr(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    (d / "admin.txt").write_text(ADMIN + "\n")
    (d / "gateway.txt").write_text(GATEWAY + "\n")
    p = d / "keys.txt"
    p.write_text(KEYS)
    return p


def make(engine, keyfile: Path, **opts: Any) -> tuple[HeadRuntime, TestClient]:
    rt = make_head(engine, [], alias="tenant-head")
    access = Access(str(keyfile.parent / "admin.txt"), str(keyfile.parent / "gateway.txt"))
    app = create_app(
        rt,
        "demo-tiny",
        4096,
        str(keyfile),
        b"f" * 32,
        tenant_options=TenantOptions(**opts),
        access=access,
    )
    return rt, TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def head(tiny_engine, keyfile) -> Iterator[tuple[HeadRuntime, TestClient]]:
    rt, client = make(tiny_engine, keyfile, shared=("public",))
    with client:
        yield rt, client
    close(rt)


def ask(head, key: str | None, prompt: str, **extra: Any) -> dict[str, Any]:
    rt, client = head
    body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    r = client.post("/v1/completions", json=body, headers=hdr(key) if key else {})
    assert r.status_code == 200, r.text
    rt.flush()  # its blocks are in the local store before the next request
    return r.json()


def cached(resp: dict[str, Any]) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_tenants_identical_prompt_is_cold_and_a_repeat_hits(head):
    p = "Tenant isolation: " + SECRET
    a = ask(head, "alice-1", p)
    n = a["usage"]["prompt_tokens"]
    assert cached(a) == 0 and n > 64
    b = ask(head, "bob-1", p)  # identical prompt, other tenant: cold
    assert cached(b) == 0 and b["kvmesh"]["source"] == "compute"
    s = ask(head, "solo-1", p)  # a key without a tenant is its own tenant
    assert cached(s) == 0
    anon = ask(head, None, p)  # the default tenant
    assert cached(anon) == 0
    again = ask(head, "alice-1", p)
    assert cached(again) == n  # her own conversation: token-exact
    mate = ask(head, "alice-2", p)  # same tenant, another caller: whole blocks only
    assert cached(mate) == n - n % 32
    texts = {r["choices"][0]["text"] for r in (a, b, s, anon, again, mate)}
    assert len(texts) == 1


def test_cache_salt_separates_within_a_tenant_and_never_crosses_one(head):
    p = "Salted: " + SECRET
    a1 = ask(head, "alice-1", p, cache_salt="s1")
    assert cached(a1) == 0
    assert cached(ask(head, "alice-1", p)) == 0  # unsalted: another cache
    assert cached(ask(head, "alice-1", p, cache_salt="s2")) == 0  # two salts, two caches
    assert cached(ask(head, "bob-1", p, cache_salt="s1")) == 0  # her salt is no way in
    assert cached(ask(head, None, p, cache_salt="s1")) == 0
    again = ask(head, "alice-1", p, cache_salt="s1")
    assert cached(again) == again["usage"]["prompt_tokens"]
    assert again["choices"][0]["text"] == a1["choices"][0]["text"]
    # chat honours it too
    rt, client = head
    body = {
        "model": "demo-tiny",
        "messages": [{"role": "user", "content": p}],
        "max_tokens": 2,
        "temperature": 0,
        "cache_salt": "chat",
    }
    first = client.post("/v1/chat/completions", json=body, headers=hdr("alice-1")).json()
    rt.flush()
    other = client.post("/v1/chat/completions", json=body, headers=hdr("bob-1")).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_shared_tenant_uses_the_shared_cache(head):
    p = "Public system prompt: " + SECRET
    ask(head, None, p)
    pub = ask(head, "pub-1", p)
    assert cached(pub) >= 64 and cached(pub) % 32 == 0  # shared, across callers by blocks
    assert cached(ask(head, "bob-1", p)) == 0


def test_guessing_attack_learns_nothing_finer_than_a_block(head):
    """The issue's attack: a victim sends S + a PIN; guesses that share more or
    fewer digits get the same cached_tokens, whole blocks, and so does the exact
    guess; another tenant gets nothing at all. Each guess from a fresh caller (its
    own earlier guesses are its own conversation)."""
    s = "Account notes for the support desk, keep private. " * 2
    victim = ask(head, "alice-1", s + "PIN=4829 name=Alice")
    n = victim["usage"]["prompt_tokens"]
    guesses = {
        "alice-2": "PIN=48__ name=Alice",
        "alice-3": "PIN=47__ name=Alice",
        "alice-4": "PIN=4829 name=Alice",
    }
    seen = {k: cached(ask(head, k, s + g)) for k, g in guesses.items()}
    assert len(set(seen.values())) == 1, seen  # two digits, one, all: indistinguishable
    got = seen["alice-2"]
    assert got % 32 == 0 and got < n
    assert cached(ask(head, "alice-1", s + "PIN=4829 name=Alice")) == n  # the victim's own
    # across tenants, nothing: the exact guess, and a near one (each a fresh tenant's first)
    assert cached(ask(head, "bob-1", s + guesses["alice-4"])) == 0
    assert cached(ask(head, "solo-1", s + guesses["alice-2"])) == 0


BAD_SALTS = ["", "x" * (MAX_CACHE_SALT_CHARS + 1), "x" * 200_000, 5, 1.5, True, ["s"], {"a": 1}]


@pytest.mark.parametrize("salt", BAD_SALTS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_salts_are_400s_naming_the_field(head, salt, path, stream):
    _, client = head
    body: dict[str, Any] = {
        "model": "demo-tiny",
        "max_tokens": 1,
        "cache_salt": salt,
        "stream": stream,
    }
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = client.post(path, json=body, headers=hdr("alice-1"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_a_lone_surrogate_salt_is_a_400(head):
    _, client = head
    raw = b'{"model": "demo-tiny", "prompt": "hi", "max_tokens": 1, "cache_salt": "\\ud800"}'
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    salt=st.one_of(
        st.none(),
        st.text(max_size=40),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(st.text(max_size=3), max_size=2),
        st.booleans(),
    )
)
def test_fuzzed_salts_are_200_or_400_never_500(head, salt):
    _, client = head
    body = {"model": "demo-tiny", "prompt": "fuzz", "max_tokens": 1, "cache_salt": salt}
    r = client.post("/v1/completions", json=body, headers=hdr("bob-1"))
    ok = salt is None or (isinstance(salt, str) and salt != "")
    assert r.status_code == (200 if ok else 400), (salt, r.text)


def test_a_trusted_header_names_the_tenant(tiny_engine, keyfile):
    rt, client = make(tiny_engine, keyfile, header="x-tenant-id")
    try:
        with client:
            h = (rt, client)
            p = "Behind a gateway: " + SECRET

            def post(headers: dict[str, Any], prompt: str = p) -> Any:
                body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 1}
                return client.post("/v1/completions", json=body, headers=headers)

            def by(tenant: str) -> int:
                r = post({"x-tenant-id": tenant, **hdr(GATEWAY)})
                assert r.status_code == 200, r.text
                rt.flush()
                return cached(r.json())

            assert by("t1") == 0 and by("t2") == 0
            assert by("t1") > 64
            assert by("alice") == 0  # the gateway's tenant alice ...
            assert cached(ask(h, "alice-1", p, max_tokens=1)) >= 64  # ... is alice's cache
            # the header from anyone but the gateway gains nothing: it is refused
            assert post({"x-tenant-id": "alice"}).status_code == 401
            for key in ("bob-1", ADMIN):
                r = post({"x-tenant-id": "alice", **hdr(key)})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["code"] == "untrusted_tenant_header"
            twice = [("x-tenant-id", "t1"), ("x-tenant-id", "alice"), *hdr(GATEWAY).items()]
            r = client.post(
                "/v1/completions",
                headers=twice,
                json={"model": "demo-tiny", "prompt": p, "max_tokens": 1},
            )
            assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_credentials"
            for bad in ("", "a b", "x" * 129, "é".encode("latin-1"), "(default)"):
                r = post({"x-tenant-id": bad, **hdr(GATEWAY)}, "hi")
                assert r.status_code == 400 and r.json()["error"]["param"] == "x-tenant-id", bad

            @settings(max_examples=30, deadline=None)
            @given(
                value=st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=200)
            )
            def fuzz(value: str) -> None:
                r = client.post(
                    "/v1/completions",
                    headers={"x-tenant-id": value.encode("latin-1"), **hdr(GATEWAY)},
                    json={"model": "demo-tiny", "prompt": "hi", "max_tokens": 1},
                )
                assert r.status_code in (200, 400), (value, r.text)

            fuzz()
    finally:
        close(rt)


def test_metrics_show_tenants_only_to_admins(head):
    ask(head, "bob-1", "Metrics: " + SECRET)
    ask(head, "bob-1", "Metrics: " + SECRET)  # a hit
    _, client = head
    public = client.get("/metrics").text
    assert "kvmesh_tenant_" not in public and "alice" not in public and "bob" not in public
    assert re.search(r"^kvmesh_requests_total \d", public, re.M)  # aggregates stay public
    assert "kvmesh_tenant_" not in client.get("/metrics", headers=hdr("alice-1")).text
    private = client.get("/metrics", headers=hdr(ADMIN)).text
    m = re.search(r'^kvmesh_tenant_requests_total\{tenant="bob"\} (\S+)$', private, re.M)
    assert m and float(m.group(1)) >= 1
    assert re.search(r'^kvmesh_tenant_stored_bytes\{tenant="bob",tier="ram"\} [1-9]', private, re.M)
    assert client.get("/v1/admin/tenants").status_code == 401
    assert client.get("/v1/admin/tenants", headers=hdr("bob-1")).status_code == 403
    rows = client.get("/v1/admin/tenants", headers=hdr(ADMIN)).json()["tenants"]
    assert rows["bob"]["reused_tokens"] > 0 and rows["bob"]["hits"] >= 1
    assert rows["bob"]["ram_bytes"] > 0


def test_a_tenant_over_its_budget_evicts_only_its_own(tiny_engine, keyfile):
    nb = tiny_engine.card.kv_bytes_per_token * 32  # about one block
    rt, client = make(tiny_engine, keyfile, budget_bytes=6 * nb)
    try:
        with client:
            h = (rt, client)
            ask(h, "bob-1", "Bob's long-lived context. " + SECRET)
            store = rt.fleet.store  # type: ignore[union-attr]
            bob = store.owned_bytes("bob")
            assert 0 < bob <= 6 * nb
            for i in range(6):  # alice floods with distinct prompts
                ask(h, "alice-1", f"{i} flood {i} " + SECRET)
                assert store.owned_bytes("alice") <= 6 * nb
            assert store.owned_bytes("bob") == bob  # none of bob's evicted
            for i in range(6):  # so does everyone without a key: the default tenant
                ask(h, None, f"{i} keyless flood {i} " + SECRET)
                assert 0 < store.owned_bytes("(default)") <= 6 * nb
            assert store.owned_bytes("bob") == bob
            again = ask(h, "bob-1", "Bob's long-lived context. " + SECRET)
            assert cached(again) == again["usage"]["prompt_tokens"]
    finally:
        close(rt)


@pytest.mark.parametrize(
    "text, why",
    [
        ("k1 a b\n", "fields"),
        ("k1 tenant with space\n", "fields"),
        ("k1 ténant\n", "ASCII"),
        ("k1 " + "t" * 129 + "\n", "1 to"),
        ("k1 a\nk1 b\n", "twice"),
        ("k\x01 a\n", "printable"),
        ("k1 #alice\n", "#"),
        ("k" * 5000 + "\n", "printable"),
    ],
)
def test_bad_key_files_are_start_up_errors(tmp_path, text, why):
    p = tmp_path / "keys"
    p.write_text(text)
    with pytest.raises(KeyFileError, match=why):
        read_key_file(p)


def test_key_file_edge_cases(tmp_path):
    p = tmp_path / "keys"
    p.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(KeyFileError, match="UTF-8"):
        read_key_file(p)
    p.write_text("\n# only comments\n   \n")
    assert read_key_file(p) == []
    p.write_text("  k1   t1  \r\nk2\n#k3 t3\n")
    assert read_key_file(p) == [("k1", "t1"), ("k2", None)]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=300) | st.binary(max_size=300))
def test_fuzzed_key_files_parse_or_fail_cleanly(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("fuzz") / "keys"
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        entries = read_key_file(p)
    except KeyFileError as e:
        assert str(p) in str(e)
        return
    for key, tenant in entries:
        assert key and key.isprintable() and (tenant is None or tenant.isascii())
