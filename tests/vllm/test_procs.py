"""vLLM processes sharing prefill through a kvmesh peer (needs ``.venv-vllm``).

Every vLLM here runs in vLLM's default process layout (its engine core and its
worker each in a process of their own: the connector's scheduler and worker sides
never share memory) unless said otherwise, with no environment variable of ours.
Process A serves prompts cold and publishes their pages to a ``kvmesh peer``
(reached through a fault-injecting proxy). A fresh process B, with an empty
cache, gets a remote hit with log-probabilities bit-identical to A's; bytes
corrupted in flight (in a process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a
killed peer and an incompatible card each fall back to computing, with the same
log-probabilities. What kvmesh did comes back with each request, in vLLM's
``kv_transfer_params``. Run with ``.venv-vllm/bin/python -m pytest tests/vllm``.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from ..procs import FaultProxy, Peer, free_port  # noqa: E402
from .serve import APIServer, VLLMProcess, token_ids  # noqa: E402

BLOCK = 128  # vLLM's CPU page
PAGE_BYTES = 4 * 2 * 1 * BLOCK * 32 * 4  # demo-tiny: 4 layers, 1 KV head of 32, float32


def vllm_node_pids(address: str) -> set[int]:
    """The process ids of the vLLM mesh nodes a peer knows (aliases ``vllm-HOST-PID``)."""
    from kvmesh.mesh.status import fetch_cards

    cards = asyncio.run(fetch_cards(address, None, None))
    return {int(c.alias.rsplit("-", 1)[1]) for c in cards if c.alias.startswith("vllm-")}


def prompt(first: int, n: int = 420) -> list[int]:
    """Distinct from the first token on, so no two prompts share a page."""
    return [first] + [(first * 31 + i * 7) % 250 + 3 for i in range(n - 1)]


NAMES = ("hit", "corrupt", "card", "killed", "serve", "tp")
PROMPTS = {name: prompt(i + 4) for i, name in enumerate(NAMES)}
FULL_PAGES = (420 - 1) // BLOCK  # pages a load may cover (vLLM computes the last token)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_dir):
    """A peer behind proxies (gRPC, and the bulk data path that carries block bytes),
    holding what process A published; A's cold results."""
    logs = tmp_path_factory.mktemp("vllm")
    port, data_port = free_port(), free_port()
    grpc_proxy, proxy = FaultProxy(port), FaultProxy(data_port)
    peer = Peer(
        "--advertise",
        f"{grpc_proxy.address},interface=ethernet",
        "--data-port",
        str(data_port),
        "--advertise-data-port",
        str(proxy.port),
        "--no-local-socket",  # "across the network": block bytes only through the proxy
        port=port,
        alias="cache",
        log_dir=logs,
    )
    try:
        a = VLLMProcess(str(tiny_dir), {"seed": peer.address}, logs / "a.log", prefix_caching=True)
        try:
            cold = {name: a.generate(p) for name, p in PROMPTS.items()}
            # A again: vLLM's own prefix-cache hit, i.e. continuing from A's cache
            cold["hit:cached"] = a.generate(PROMPTS["hit"])
            # its worker is a mesh node in a process of its own, not this one's
            workers = vllm_node_pids(peer.address)
            assert workers and a.proc.pid not in workers
        finally:
            a.close()  # a clean stop flushes its publishes
        assert a.proc.returncode == 0
        for out in cold.values():
            if out["kvmesh"] is not None:  # asked (A's own prefix-cache hit was not)
                assert out["kvmesh"]["pages"] == 0 and out["kvmesh"]["loaded"] == 0
        yield {
            "peer": peer,
            "proxy": proxy,
            "cold": cold,
            "logs": logs,
            "cards": cold["hit"]["kvmesh"]["cards"],
            "dir": str(tiny_dir),
        }
    finally:
        peer.kill()
        proxy.close()
        grpc_proxy.close()


@pytest.fixture(scope="module")
def b(mesh):
    """A fresh vLLM process with an empty cache, vLLM's prefix caching on."""
    proc = VLLMProcess(
        mesh["dir"], {"seed": mesh["peer"].address}, mesh["logs"] / "b.log", prefix_caching=True
    )
    yield proc
    proc.close()


def same(out, ref):
    assert out["tokens"] == ref["tokens"]
    assert out["logprobs"] == ref["logprobs"]  # bit for bit: floats survive JSON exactly


def test_a_fresh_process_gets_a_remote_hit_with_identical_logprobs(mesh, b):
    out = b.generate(PROMPTS["hit"])
    assert mesh["cold"]["hit"]["num_cached_tokens"] == 0
    assert out["num_cached_tokens"] >= FULL_PAGES * BLOCK
    got = out["kvmesh"]
    assert got["source"] == "remote" and got["peer"] == "cache"
    assert got["pages"] == got["loaded"] == FULL_PAGES and "fallback" not in got
    assert got["load"] in ("sync", "async")  # in-step if the stream ended within its step
    assert b.proc.pid not in vllm_node_pids(mesh["peer"].address)
    assert mesh["cold"]["hit:cached"]["num_cached_tokens"] == FULL_PAGES * BLOCK
    same(out, mesh["cold"]["hit:cached"])  # kvmesh's promise: as if continuing A's cache
    same(out, mesh["cold"]["hit"])  # and, at this length in float32, as A's cold run


@pytest.fixture
def fresh_b(mesh):
    """B as it starts: its planner has not yet measured vLLM's prefill on this tiny
    model (after one request it may rightly prefer computing a 420-token prompt to
    fetching it, and the corruption under test would never be on the wire). This one
    runs vLLM's engine and worker in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    proc = VLLMProcess(
        mesh["dir"],
        {"seed": mesh["peer"].address},
        mesh["logs"] / "b2.log",
        prefix_caching=True,
        inprocess=True,
    )
    yield proc
    proc.close()


def test_corrupted_bytes_load_the_verified_pages_and_recompute_the_rest(mesh, fresh_b):
    b = fresh_b
    proxy = mesh["proxy"]
    proxy.corrupt_at(PAGE_BYTES + PAGE_BYTES // 2)  # inside the second page of the stream
    out = b.generate(PROMPTS["corrupt"])
    got = out["kvmesh"]
    assert proxy.corrupted == 1, got
    assert got["source"] == "remote" and got["pages"] == FULL_PAGES
    # the first page arrived verified and was loaded; the failed one and those after it
    # were reported as load errors and recomputed by vLLM
    assert 1 <= got["loaded"] < FULL_PAGES and got.get("fallback"), got
    assert got["load"] == "async"  # fewer pages verified than promised: never in-step
    same(out, mesh["cold"]["corrupt"])


def test_an_incompatible_card_is_a_miss_and_computes(mesh):
    """Another page size is another card: A's pages are never offered to it. Its own
    pages, saved by the first request, are a local hit for the second (vLLM's own
    prefix cache is off in this process). A ``cache_salt`` is a key chain of its
    own: the same prompt salted finds nothing unsalted, is saved under its salt, hit
    with that salt and never with another."""
    c = VLLMProcess(
        mesh["dir"], {"seed": mesh["peer"].address}, mesh["logs"] / "c.log", block_size=64
    )
    try:
        out = c.generate(PROMPTS["card"])
        again = c.generate(PROMPTS["card"])
        salted = [c.generate(PROMPTS["card"], cache_salt=s) for s in ("s1", "s1", "s2")]
    finally:
        c.close()
    pages = (420 - 1) // 64
    first, hit, other = (o["kvmesh"] for o in salted)
    assert first["pages"] == 0 and other["pages"] == 0  # nothing shared across salts
    assert hit["source"] == "local" and hit["loaded"] == pages
    # pages in the worker's memory when offered: loaded in the step that scheduled it
    assert hit["load"] == "sync", hit
    assert salted[1]["num_cached_tokens"] >= pages * 64
    for o in salted:
        same(o, mesh["cold"]["card"])
    assert out["kvmesh"]["cards"] != mesh["cards"]  # another namespace
    assert out["num_cached_tokens"] == 0 and out["kvmesh"]["pages"] == 0
    same(out, mesh["cold"]["card"])
    assert again["num_cached_tokens"] >= pages * 64
    assert again["kvmesh"]["source"] == "local" and again["kvmesh"]["loaded"] == pages
    assert again["kvmesh"]["load"] == "sync"
    same(again, mesh["cold"]["card"])


def test_vllm_serve_gets_a_remote_hit_through_the_openai_client(mesh):
    """The OpenAI server vLLM's ``vllm serve`` runs, with the connector, driven by the
    official ``openai`` client: a remote hit, bit-identical to A's outputs."""
    openai = pytest.importorskip("openai")
    peer = mesh["peer"]
    with APIServer(mesh["dir"], {"seed": peer.address}, mesh["logs"] / "serve.log") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=300)
        resp = client.completions.create(
            model=mesh["dir"], prompt=PROMPTS["serve"], max_tokens=4, temperature=0, logprobs=5
        )
        assert srv.proc.pid not in vllm_node_pids(peer.address)
    tokens, top = token_ids(resp.choices[0])
    assert tokens == mesh["cold"]["serve"]["tokens"]
    assert top == mesh["cold"]["serve"]["logprobs"]  # bit for bit
    assert resp.usage.prompt_tokens_details.cached_tokens >= FULL_PAGES * BLOCK
    got = (resp.model_extra or {})["kv_transfer_params"]["kvmesh"]
    assert got["source"] == "remote" and got["loaded"] == FULL_PAGES


CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason="TP=2 needs two CPU cores")
def test_tensor_parallel_ranks_save_and_load_their_own_shards(mesh):
    """TP=2 on vLLM's CPU build: each rank's worker is its own mesh node with its own
    card (rank and world size in it) and page stream. A prompt computed once is
    saved by both ranks and loaded by both the second time (vLLM's own prefix cache
    off), bit-identical; what a TP=1 server published is never offered to it.
    (``VLLM_CPU_OMP_THREADS_BIND``: vLLM's CPU workers bind one core each, here the
    first two this process may use; on one NUMA node vLLM cannot choose them itself.)"""
    tp = VLLMProcess(
        mesh["dir"],
        {"seed": mesh["peer"].address},
        mesh["logs"] / "tp.log",
        env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, CORES[:2]))},
        tensor_parallel_size=2,
    )
    try:
        other = tp.generate(PROMPTS["hit"])  # published by TP=1 servers only
        out = tp.generate(PROMPTS["tp"])
        again = tp.generate(PROMPTS["tp"])
    finally:
        tp.close()
    cards = out["kvmesh"]["cards"]
    assert [e for e, _ in cards.values()] == [
        mesh["cards"]["0"][0].replace("tp=0of1", f"tp={r}of2") for r in (0, 1)
    ]
    assert len({ns for _, ns in cards.values()} | {mesh["cards"]["0"][1]}) == 3
    assert other["kvmesh"]["pages"] == 0 and other["num_cached_tokens"] == 0
    assert out["kvmesh"]["pages"] == 0
    got = again["kvmesh"]
    assert got["source"] == "local" and got["pages"] == got["loaded"] == FULL_PAGES
    assert got["load"] == "sync"  # both ranks held every page when they answered
    assert again["num_cached_tokens"] >= FULL_PAGES * BLOCK
    same(again, out)


def test_a_killed_peer_computes(mesh, b):
    mesh["peer"].kill()
    out = b.generate(PROMPTS["killed"])
    assert out["num_cached_tokens"] == 0
    same(out, mesh["cold"]["killed"])


def test_vllm_and_head_cards_never_share_a_namespace(mesh, tiny_dir):
    """The card vLLM actually ran under (rebuilt from the engine string its worker
    reported, and checked against the namespace it reported), against a head's card
    for the same model (built as the torch engine builds it: kvmesh's torch engine
    needs transformers >= 5.2x, which vLLM 0.32 does not allow in this environment)."""
    from kvmesh.engine.base import CacheGeometry, card_from_hf_dir
    from kvmesh.vllm.pages import CacheSpec, model_card

    engine, namespace = mesh["cards"]["0"]
    assert engine.endswith("/tp=0of1")  # one rank of one: never mixed with TP shards
    spec = CacheSpec(
        num_layers=4, num_kv_heads=1, head_dim=32, block_size=BLOCK, kv_dtype="float32"
    )
    vcard = model_card(tiny_dir, tiny_dir, spec, engine=engine)
    assert vcard.namespace_hex == namespace
    geometry = CacheGeometry.attention(
        vcard.kv_dtype, vcard.num_kv_heads, vcard.head_dim, vcard.sliding_windows
    )
    for engine in ("transformers/sdpa", "transformers/eager", "mlx"):
        hcard = card_from_hf_dir(tiny_dir, engine, geometry, "none", vcard.block_tokens)
        assert hcard.weights_digest == vcard.weights_digest
        assert hcard.namespace != vcard.namespace
    assert vcard.engine.startswith("vllm/0.") and "/cpu/" in vcard.engine
