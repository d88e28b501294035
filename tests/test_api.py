"""End to end through HTTP with real head and peer processes."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest

from .procs import Peer


class Head:
    """``kvmesh head`` in its own process; ``verify`` is the TLS check for https."""

    def __init__(self, *args: str, log=None, model: str = "demo-tiny", verify=True) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "head",
                "--model",
                model,
                "--listen",
                "127.0.0.1:0",
                "--gossip-interval",
                "0.3",
                "--ttl",
                "2",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=log or subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()
        m = re.search(r"(https?://\S+) grpc (\S+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"head did not start: {line!r}")
        self.url, self.grpc = m.group(1), m.group(2)
        self.http = httpx.Client(base_url=self.url, timeout=60, verify=verify)

    def health(self) -> dict:
        return self.http.get("/healthz").json()

    def wait(self, cond, timeout=15.0) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            h = self.health()
            if cond(h):
                return h
            time.sleep(0.05)
        raise AssertionError(f"head never ready: {self.health()}")

    def metric(self, name: str) -> float:
        text = self.http.get("/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    p = Peer(alias="api-peer", log_dir=tmp_path_factory.mktemp("logs"))
    yield p
    p.kill()


@pytest.fixture(scope="module")
def head(peer):
    h = Head("--seed", peer.address, "--alias", "api-head")
    h.wait(lambda s: s["peers"] >= 1)
    yield h
    h.stop()


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Explain prefill caching across a small fleet of machines. " * 6},
]


def test_restart_scenario_remote_hit_same_output(peer):
    body = {"model": "demo-tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    h1 = Head("--seed", peer.address, "--exact-reuse-by-address", "--alias", "first")
    try:
        h1.wait(lambda s: s["peers"] >= 1)
        cold = h1.http.post("/v1/chat/completions", json=body).json()
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        h1.wait(lambda s: s["publish_pending"] == 0)
    finally:
        h1.stop()
    h2 = Head("--seed", peer.address, "--exact-reuse-by-address", "--alias", "second")
    try:
        h2.wait(lambda s: s["compatible_peers"] >= 1)
        hit = h2.http.post("/v1/chat/completions", json=body).json()
        n = hit["usage"]["prompt_tokens"]
        assert (
            hit["usage"]["prompt_tokens_details"]["cached_tokens"]
            == n
            == cold["usage"]["prompt_tokens"]
        )
        assert hit["kvmesh"]["source"] == "remote" and hit["kvmesh"]["bytes_fetched"] > 0
        assert hit["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        assert h2.metric("kvmesh_kv_assisted_tokens_total") == n
        assert h2.metric('kvmesh_prefill_total{source="remote"}') == 1
    finally:
        h2.stop()


def test_openai_client_streaming_and_not(head):
    client = openai.OpenAI(base_url=head.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["demo-tiny"]
    full = client.chat.completions.create(
        model="demo-tiny", messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="demo-tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content, (
        full.model_extra,
        [c.model_extra for c in chunks],
    )
    assert chunks[-1].usage.completion_tokens == 6
    # the second identical request was served from the head's live session
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    report = chunks[-1].model_extra["kvmesh"]  # what kvmesh did, as a whole answer says it
    assert report["reused_tokens"] == chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert report["breakdown"].keys() == full.model_extra["kvmesh"]["breakdown"].keys()
    assert 0 < sum(report["breakdown"].values()) <= report["ttft_s"] + 1e-6
    comp = client.completions.create(
        model="demo-tiny", prompt="The cache never decides", max_tokens=5, temperature=0
    )
    assert comp.usage.prompt_tokens == len(b"The cache never decides")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="demo-tiny",
            prompt="The cache never decides",
            max_tokens=5,
            stream=True,
            temperature=0,
        )
    )
    assert streamed == comp.choices[0].text


def test_greedy_output_identical_with_and_without_a_hit(head, peer):
    prompt = "Identical with and without a hit. " * 10
    a = head.http.post(
        "/v1/completions",
        json={"model": "demo-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
    ).json()
    plain = Head("--no-publish", "--alias", "alone")  # no seed: no mesh at all
    try:
        b = plain.http.post(
            "/v1/completions",
            json={"model": "demo-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        ).json()
    finally:
        plain.stop()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_peer_killed_before_request_same_answer(tmp_path):
    p = Peer(alias="doomed", log_dir=tmp_path)
    body = {
        "model": "demo-tiny",
        "prompt": "A peer that dies costs only a recompute. " * 8,
        "max_tokens": 8,
        "temperature": 0,
    }
    h1 = Head("--seed", p.address, "--alias", "pub")
    try:
        h1.wait(lambda s: s["peers"] >= 1)
        cold = h1.http.post("/v1/completions", json=body).json()
        h1.wait(lambda s: s["publish_pending"] == 0)
    finally:
        h1.stop()
    h2 = Head("--seed", p.address, "--alias", "after")
    try:
        h2.wait(lambda s: s["compatible_peers"] >= 1)
        p.kill()
        out = h2.http.post("/v1/completions", json=body).json()
        assert out["choices"][0]["text"] == cold["choices"][0]["text"]
        assert (
            out["kvmesh"]["source"] == "compute" and out["kvmesh"]["fallback"] == "peer_unreachable"
        )
        assert h2.metric('kvmesh_fallbacks_total{reason="peer_unreachable"}') == 1
    finally:
        h2.stop()


@pytest.mark.parametrize(
    "path,body,status,code",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        (
            "/v1/completions",
            json.dumps({"model": "nope", "prompt": "x"}).encode(),
            404,
            "model_not_found",
        ),
        (
            "/v1/completions",
            json.dumps({"model": "demo-tiny", "prompt": "x", "max_tokens": -1}).encode(),
            400,
            None,
        ),
        (
            "/v1/completions",
            json.dumps({"model": "demo-tiny", "prompt": "x" * 40000}).encode(),
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            json.dumps({"model": "demo-tiny", "prompt": [99999]}).encode(),
            400,
            None,
        ),
        ("/v1/completions", json.dumps({"model": "demo-tiny"}).encode(), 400, None),
        (
            "/v1/chat/completions",
            json.dumps({"model": "demo-tiny", "messages": []}).encode(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json.dumps({"model": "demo-tiny", "messages": [{"role": "wizard"}]}).encode(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    "model": "demo-tiny",
                    "messages": [{"role": "user", "content": "x"}],
                    "temperature": 9,
                }
            ).encode(),
            400,
            None,
        ),
        ("/v1/nothing-here", b"{}", 404, None),
        (
            "/v1/completions",
            json.dumps({"model": "demo-tiny", "prompt": "x", "logit_bias": {"1": 5}}).encode(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    "model": "demo-tiny",
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": [{"type": "function"}],
                }
            ).encode(),
            400,
            None,
        ),
        (
            "/v1/completions",
            json.dumps({"model": "demo-tiny", "prompt": "x", "presence_penalty": 2.5}).encode(),
            400,
            None,
        ),
    ],
)
def test_bad_requests_get_openai_errors_and_the_head_keeps_serving(head, path, body, status, code):
    r = head.http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code:
        assert err["code"] == code
    assert head.health()["status"] == "ok"


def test_a_session_never_hides_a_longer_hit_on_a_peer(peer):
    """After a restart, a short prompt leaves a live session; the longer prompt that
    starts with it must still be looked up, and its whole prefix fetched."""
    from transformers import AutoTokenizer

    from kvmesh.engine.embedded import ensure_demo

    tok = AutoTokenizer.from_pretrained(str(ensure_demo("demo-tiny")))
    # long enough that fetching beats computing even for the short one (the planner
    # computes a prefix of a block or two: on a fast machine that is faster)
    long_ids = tok.encode("A session must not hide a longer hit on a peer. " * 30)
    short_ids = long_ids[:300]

    def ask(h: Head, ids: list[int]) -> dict:
        body = {"model": "demo-tiny", "prompt": ids, "max_tokens": 4, "temperature": 0}
        return h.http.post("/v1/completions", json=body).json()

    h1 = Head("--seed", peer.address, "--alias", "long-publisher")
    try:
        h1.wait(lambda s: s["peers"] >= 1)
        cold = ask(h1, long_ids)
        h1.wait(lambda s: s["publish_pending"] == 0)
    finally:
        h1.stop()
    h2 = Head("--seed", peer.address, "--alias", "restarted")
    try:
        h2.wait(lambda s: s["compatible_peers"] >= 1)
        first = ask(h2, short_ids)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, first["kvmesh"]
        second = ask(h2, long_ids)
        reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused >= 0.9 * len(long_ids), second["kvmesh"]
        assert second["kvmesh"]["source"] == "remote"
        assert second["choices"][0]["text"] == cold["choices"][0]["text"]
    finally:
        h2.stop()


def test_served_names_default_max_tokens_and_a_model_without_a_chat_template(tmp_path):
    """vLLM's conventions: ``--model`` as given, its directory name and every
    ``--served-model-name`` are accepted; the first served name is canonical. No
    ``max_tokens`` means the rest of the window (capped by --max-tokens-default).
    A chat request to a model without a chat template is a 400 that says so."""
    from kvmesh.engine.embedded import ensure_demo

    model = tmp_path / "plain-model"
    shutil.copytree(ensure_demo("demo-tiny"), model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for f in model.glob("chat_template.*"):
        f.unlink()
    h = Head(
        "--served-model-name",
        "house-model",
        "--served-model-name",
        "alias-2",
        "--max-tokens-default",
        "40",
        model=str(model),
    )
    try:
        assert [m["id"] for m in h.http.get("/v1/models").json()["data"]] == ["house-model"]
        for name in ("house-model", "alias-2", str(model), "plain-model"):
            body = {"model": name, "prompt": "Served names", "max_tokens": 2, "temperature": 0}
            r = h.http.post("/v1/completions", json=body)
            assert r.status_code == 200, (name, r.text)
        body = {"model": "house-model", "prompt": "no max_tokens", "temperature": 0}
        out = h.http.post("/v1/completions", json=body).json()
        n = out["usage"]["completion_tokens"]
        assert n == 40 or out["choices"][0]["finish_reason"] == "stop", out
        chat = {"model": "house-model", "messages": [{"role": "user", "content": "hi"}]}
        r = h.http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "no_chat_template"
        assert "chat template" in r.json()["error"]["message"]
        assert h.health()["status"] == "ok"
    finally:
        h.stop()


def test_completions_keep_bos_and_chat_does_not_double_it():
    """A Llama-style tokenizer adds BOS to a plain prompt (as vLLM and transformers
    tokenize it); a chat prompt gets exactly the BOS its template writes."""
    from transformers import AutoTokenizer

    from .zoo import hf_model

    path = hf_model("llama")
    tok = AutoTokenizer.from_pretrained(str(path))
    h = Head(model=str(path))
    try:
        text = "the cache never decides correctness"
        body = {"model": path.name, "prompt": text, "max_tokens": 1, "temperature": 0}
        out = h.http.post("/v1/completions", json=body).json()
        with_bos = tok.encode(text)
        assert with_bos[0] == tok.bos_token_id and with_bos[1] != tok.bos_token_id
        assert out["usage"]["prompt_tokens"] == len(with_bos)
        msgs = [{"role": "user", "content": text}]
        chat = {"model": path.name, "messages": msgs, "max_tokens": 1, "temperature": 0}
        out = h.http.post("/v1/chat/completions", json=chat).json()
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert ids.count(tok.bos_token_id) == 1
        assert out["usage"]["prompt_tokens"] == len(ids)
    finally:
        h.stop()


def test_an_idle_connection_is_the_clients_to_close(head):
    """A keep-alive connection idle past the expiry clients use (httpx's and guidellm's
    5 s; uvicorn's default keep-alive was the same 5 s, so a request sent just then
    met a closing socket: a ReadError) still serves: the head closes it much later."""
    host, port = head.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock
        time.sleep(6.0)  # idle past 5 s
        conn.request("GET", "/v1/models")  # on the same socket: closed, this raises
        assert conn.getresponse().status == 200 and conn.sock is first
    finally:
        conn.close()
