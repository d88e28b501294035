"""A head that stays responsive and secure by default, with real head processes.

Health, metrics and network reads answer while the request queue is full; a full
queue is a 503 with Retry-After; a client that leaves cancels its request (queued:
it never runs; streaming: its decode stops); oversize bodies are 413s; the API
key can protect the OpenAI routes; the fleet key never crosses plaintext; nothing
public shows a local path. Outcomes are asserted, never wall-clock times.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from kvmesh.api.network import pairing_refusal

from .test_api import Head

PROMPT = "A head that stays responsive while its queue is full. " * 4
# decodes for minutes unless cancelled: every test below ends it by leaving
LONG = {
    "model": "demo-tiny",
    "prompt": PROMPT,
    "max_tokens": 20000,
    "ignore_eos": True,
    "temperature": 0,
}
READS = (
    "/healthz",
    "/metrics",
    "/",
    "/v1/network/summary",
    "/v1/network/nodes",
    "/v1/network/tokens",
    "/v1/network/prefill",
    "/v1/network/groups",
)


class Raw:
    """One request on its own socket: the client can read a little, then leave."""

    def __init__(self, url: str, body: dict, path: str = "/v1/completions") -> None:
        u = urlsplit(url)
        self.sock = socket.create_connection((u.hostname, u.port))
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + data)

    def read_until(self, marker: bytes) -> bytes:
        buf = b""
        while marker not in buf:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed before {marker!r}: {buf[-300:]!r}"
            buf += chunk
        return buf

    def leave(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def head():
    h = Head(
        "--max-queue", "2", "--max-batch", "1", "--max-body-bytes", "64KiB", "--alias", "robust"
    )
    yield h
    h.stop()


def _idle(h: Head) -> dict:
    return h.wait(lambda s: s["queue"]["waiting"] == 0 and s["queue"]["running"] == 0, 60)


def test_a_full_queue_is_a_503_health_answers_and_clients_that_leave_cancel(head):
    requests = head.metric("kvmesh_requests_total")
    running = Raw(head.url, {**LONG, "stream": True})
    running.read_until(b"data:")  # decoding: the engine is taken
    queued = [Raw(head.url, LONG), Raw(head.url, {**LONG, "stream": True})]
    health = head.wait(lambda s: s["queue"]["waiting"] == 2)
    assert health["status"] == "ok" and health["queue"]["running"] == 1

    r = head.http.post("/v1/completions", json=LONG)
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "server_error" and err["message"]
    for path in READS:  # nothing here waits on the engine or on a generation's thread
        assert head.http.get(path).status_code == 200, path
    assert head.metric("kvmesh_queue_rejected_total") == 1
    assert head.metric("kvmesh_queue_waiting") == 2

    for q in queued:  # they leave while queued: they never run
        q.leave()
    health = head.wait(lambda s: s["queue"]["waiting"] == 0)
    assert health["queue"]["running"] == 1
    assert head.metric('kvmesh_requests_cancelled_total{stage="queued"}') == 2

    running.leave()  # a streaming client that leaves stops its decode
    _idle(head)
    assert head.metric('kvmesh_requests_cancelled_total{stage="running"}') == 1
    assert head.metric("kvmesh_requests_total") == requests + 1  # only the running one ran
    assert 1 <= head.metric("kvmesh_completion_tokens_total") < LONG["max_tokens"]
    ok = head.http.post("/v1/completions", json={**LONG, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_waiting_prompts_are_bounded_by_their_tokens(head):
    """Besides their count (--max-queue, 1024 by default: vLLM queues without one),
    the waiting requests' prompt tokens are bounded (--max-queued-tokens): a request
    past it is a 503 with Retry-After; one alone in the queue always may wait."""
    n = head.http.post("/v1/completions", json={**LONG, "max_tokens": 1}).json()["usage"]
    n = n["prompt_tokens"]
    h = Head("--max-batch", "1", "--max-queued-tokens", str(n + n // 2), "--alias", "tokens")
    try:
        running = Raw(h.url, {**LONG, "stream": True})
        running.read_until(b"data:")  # the engine is taken
        first = Raw(h.url, LONG)  # waits alone: its n tokens fit
        # counted once tokenized (waiting counts it from admission, before that)
        h.wait(lambda s: s["queue"]["waiting"] == 1 and s["queue"]["queued_tokens"] == n)
        r = h.http.post("/v1/completions", json=LONG)  # 2n would wait
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "queue_full" and "prompt tokens" in err["message"]
        first.leave()
        running.leave()
        _idle(h)
        ok = h.http.post("/v1/completions", json={**LONG, "max_tokens": 3})
        assert ok.status_code == 200, ok.text
    finally:
        h.stop()


def test_a_non_streaming_client_that_leaves_mid_decode_stops_it(head):
    cancelled = head.metric('kvmesh_requests_cancelled_total{stage="running"}')
    tokens = head.metric("kvmesh_completion_tokens_total")
    client = Raw(head.url, LONG)
    # decoding, not only scheduled: a loaded machine may still be prefilling it
    head.wait(lambda s: s["queue"]["running"] == 1 and s["batch"]["sequences"] == 1)
    client.leave()
    _idle(head)
    assert head.metric('kvmesh_requests_cancelled_total{stage="running"}') == cancelled + 1
    assert head.metric("kvmesh_completion_tokens_total") - tokens < LONG["max_tokens"]


def test_an_oversize_body_is_a_413_with_an_openai_error(head):
    big = {"model": "demo-tiny", "prompt": "x" * 70_000, "max_tokens": 1}
    r = head.http.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked():  # no Content-Length: refused once the cap is passed
        yield b'{"model": "demo-tiny", "prompt": "'
        for _ in range(8):
            yield b"y" * 16384
        yield b'"}'

    r = head.http.post(
        "/v1/chat/completions", content=chunked(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert head.http.post("/v1/network/pair", json={"token": "t" * 70_000}).status_code == 413
    small = head.http.post("/v1/completions", json={**big, "prompt": "x" * 1000})
    assert small.status_code == 200
    assert head.health()["status"] == "ok"


KEY = "scope-all-test-key"


def test_api_key_scope_all_protects_openai_routes_and_no_local_path_is_public(tmp_path):
    from kvmesh.engine.embedded import ensure_demo

    model = tmp_path / "private-dir" / "house-model"
    shutil.copytree(ensure_demo("demo-tiny"), model)
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    h = Head("--api-key-file", str(keys), "--api-key-scope", "all", model=str(model))
    try:
        body = {"model": "house-model", "prompt": "protected", "max_tokens": 2}
        for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            for method, path in (
                ("GET", "/v1/models"),
                ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"),
            ):
                r = h.http.request(method, path, json=body, headers=bad)
                assert r.status_code == 401, (path, bad, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        # unauthenticated garbage is a 401 too, never parsed
        r = h.http.post("/v1/completions", content=b"{nope", headers={"Content-Type": "x"})
        assert r.status_code == 401
        client = openai.OpenAI(base_url=h.url + "/v1", api_key=KEY)  # Authorization: Bearer
        assert [m.id for m in client.models.list().data] == ["house-model"]
        out = client.completions.create(model=str(model), prompt="protected", max_tokens=2)
        assert out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=h.url + "/v1", api_key="wrong").models.list()
        assert h.http.get("/v1/models", headers={"X-API-Key": KEY}).status_code == 200
        for path in READS:  # public reads stay public, and show no local path
            r = h.http.get(path)
            assert r.status_code == 200, path
            assert str(tmp_path) not in r.text and "private-dir" not in r.text, (path, r.text)
        assert h.health()["model"] == "house-model"
    finally:
        h.stop()


def test_api_key_scope_admin_leaves_openai_routes_open(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    h = Head("--admin-key-file", str(keys))  # admin is the default scope
    try:
        assert h.http.get("/v1/models").status_code == 200
        body = {"model": "demo-tiny", "prompt": "open", "max_tokens": 1}
        assert h.http.post("/v1/completions", json=body).status_code == 200
        r = h.http.post("/v1/network/nodes/register")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (
            h.http.post("/v1/network/nodes/register", headers={"X-API-Key": KEY}).status_code == 201
        )
    finally:
        h.stop()


def test_api_key_scope_all_without_a_key_file_is_refused():
    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "head", "--api-key-scope", "all"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--api-key-file" in r.stderr


@pytest.mark.parametrize(
    "scheme,client,fleet_key,refused",
    [
        ("http", "192.0.2.7", True, True),
        ("http", "10.1.2.3", True, True),
        ("https", "192.0.2.7", True, False),
        ("http", "127.0.0.1", True, False),
        ("http", "::1", True, False),
        ("http", "192.0.2.7", False, False),
        ("http", None, True, True),
    ],
)
def test_pairing_refusal_decision(scheme, client, fleet_key, refused):
    why = pairing_refusal(scheme, client, fleet_key)
    assert (why is not None) == refused
    if why:
        assert "--http-tls-cert" in why


def _own_address() -> str:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    ips = [a for a in out if "." in a and not a.startswith("127.")]
    if not ips:
        pytest.skip("no non-loopback IPv4 address on this machine")
    return ips[0]


def _pairing_head(tmp_path, *extra: str, verify=True) -> Head:
    (tmp_path / "fleet.key").write_text("ab" * 32)
    (tmp_path / "keys").write_text(KEY + "\n")
    return Head(
        "--listen",
        "0.0.0.0:0",
        "--fleet-key-file",
        str(tmp_path / "fleet.key"),
        "--admin-key-file",
        str(tmp_path / "keys"),
        *extra,
        verify=verify,
    )


def _token(h: Head, url: str, verify=True) -> str:
    r = httpx.post(url + "/v1/network/nodes/register", headers={"X-API-Key": KEY}, verify=verify)
    assert r.status_code == 201, r.text
    return r.json()["pairing_token"]


def test_pairing_never_hands_the_fleet_key_out_over_plaintext(tmp_path):
    ip = _own_address()
    h = _pairing_head(tmp_path)
    port = urlsplit(h.url).port
    outside, local = f"http://{ip}:{port}", f"http://127.0.0.1:{port}"
    try:
        token = _token(h, outside)
        r = httpx.post(outside + "/v1/network/pair", json={"token": token})
        assert r.status_code == 403 and "fleet_key" not in r.text
        err = r.json()["error"]
        assert err["code"] == "plaintext_pairing" and "--http-tls-cert" in err["message"]
        r = httpx.post(
            local + "/v1/network/pair", json={"token": token}
        )  # not spent by the refusal
        assert r.status_code == 200 and r.json()["fleet_key"] == "ab" * 32
    finally:
        h.stop()


def test_pairing_over_https_on_a_non_loopback_address(tmp_path):
    import trustme

    ip = _own_address()
    ca = trustme.CA()
    cert = ca.issue_cert(ip, "127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(tmp_path / "cert.pem"), append=True)
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    h = _pairing_head(
        tmp_path,
        "--http-tls-cert",
        str(tmp_path / "cert.pem"),
        "--http-tls-key",
        str(tmp_path / "key.pem"),
        verify=ctx,
    )
    url = f"https://{ip}:{urlsplit(h.url).port}"
    try:
        assert h.url.startswith("https://")
        token = _token(h, url, verify=ctx)
        r = httpx.post(url + "/v1/network/pair", json={"token": token}, verify=ctx)
        assert r.status_code == 200 and r.json()["fleet_key"] == "ab" * 32
        with pytest.raises(httpx.HTTPError):  # the listener speaks only TLS
            httpx.get(f"http://{ip}:{urlsplit(h.url).port}/healthz", timeout=5)
    finally:
        h.stop()


def test_cancel_stops_decode_within_a_step_and_a_queued_request_never_runs(tiny_engine):
    """In process, exactly: the engine thread checks a request's cancel event at
    every step (a cancelled sequence decodes at most the step under way), and a
    request waiting for room in the batch leaves without touching the engine."""
    import threading

    from kvmesh.engine import Sampling
    from kvmesh.runtime.head import Generation, HeadRuntime

    h = HeadRuntime(tiny_engine, publish=False, max_batch=1)
    toks = tiny_engine.encode(PROMPT)
    sampling = Sampling(max_tokens=50, stop_on_eos=False)
    cancel, out = threading.Event(), Generation()
    seen = 0
    for i, _ in enumerate(h.generate(toks, sampling, out, cancel=cancel)):
        if i == 2:
            seen = len(out.tokens)  # decoded so far (the engine does not wait for readers)
            cancel.set()  # the client left while token 3 was being sent
    assert out.cancelled and 3 <= len(out.tokens) <= seen + 1 < 50
    assert h.telemetry.counters["cancelled:running"] == 1

    # the batch (of one) is taken by a long request: a second one waits, then leaves
    long_cancel, long_out, first = threading.Event(), Generation(), threading.Event()

    def long_request() -> None:
        for _ in h.generate(
            toks, Sampling(max_tokens=10_000, stop_on_eos=False), long_out, long_cancel
        ):
            first.set()

    runner = threading.Thread(target=long_request)
    runner.start()
    assert first.wait(30)
    started, queued = [], Generation()
    cancel = threading.Event()
    waiter = threading.Thread(
        target=lambda: list(h.generate(toks, sampling, queued, cancel, lambda: started.append(1)))
    )
    waiter.start()
    time_limit = 30
    while h.batch.waiting == 0 and time_limit > 0:  # it is queued behind the long one
        first.wait(0.05)
        time_limit -= 0.05
    cancel.set()
    waiter.join(30)
    assert not waiter.is_alive() and queued.cancelled and queued.tokens == [] and not started
    assert h.telemetry.counters["cancelled:queued"] == 1
    long_cancel.set()
    runner.join(30)
    assert h.telemetry.counters["requests"] == 2  # the queued one never ran
    h.close()
