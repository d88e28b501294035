"""vLLM processes sharing prefill through a kvmesh peer (needs ``.venv-vllm``).

Process A serves prompts cold and publishes their pages to a ``kvmesh peer``
(reached through a fault-injecting proxy). A fresh process B, with an empty
cache, gets a remote hit with log-probabilities bit-identical to A's cold run;
bytes corrupted in flight, a killed peer and an incompatible card each fall
back to computing, with the same log-probabilities. Run with
``.venv-vllm/bin/python -m pytest tests/vllm``.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from ..procs import FaultProxy, Peer, free_port  # noqa: E402
from .serve import VLLMProcess  # noqa: E402

BLOCK = 128  # vLLM's CPU page
PAGE_BYTES = 4 * 2 * 1 * BLOCK * 32 * 4  # demo-tiny: 4 layers, 1 KV head of 32, float32


def prompt(first: int, n: int = 420) -> list[int]:
    """Distinct from the first token on, so no two prompts share a page."""
    return [first] + [(first * 31 + i * 7) % 250 + 3 for i in range(n - 1)]


PROMPTS = {name: prompt(i + 4) for i, name in enumerate(("hit", "corrupt", "card", "killed"))}
FULL_PAGES = (420 - 1) // BLOCK  # pages a load may cover (vLLM computes the last token)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_dir):
    """A peer behind proxies (gRPC, and the bulk data path that carries block bytes),
    holding what process A published; A's cold results."""
    logs = tmp_path_factory.mktemp("vllm")
    port, data_port = free_port(), free_port()
    grpc_proxy, proxy = FaultProxy(port), FaultProxy(data_port)
    peer = Peer("--advertise", f"{grpc_proxy.address},interface=ethernet", "--data-port",
                str(data_port), "--advertise-data-port", str(proxy.port), port=port,
                alias="cache", log_dir=logs)  # fmt: skip
    try:
        a = VLLMProcess(str(tiny_dir), {"seed": peer.address}, logs / "a.log",
                        prefix_caching=True)  # fmt: skip
        try:
            cold = {name: a.generate(p) for name, p in PROMPTS.items()}
            # A again: vLLM's own prefix-cache hit, i.e. continuing from A's cache
            cold["hit:cached"] = a.generate(PROMPTS["hit"])
            a.call("flush")
            published = a.counters().get("pages_published", 0)
            card = a.ready["card"]
        finally:
            a.close()
        assert published == (420 // BLOCK) * len(PROMPTS)  # every full page of every prompt
        yield {"peer": peer, "proxy": proxy, "cold": cold, "logs": logs, "card": card,
               "dir": str(tiny_dir)}  # fmt: skip
    finally:
        peer.kill()
        proxy.close()
        grpc_proxy.close()


@pytest.fixture(scope="module")
def b(mesh):
    """A fresh vLLM process with an empty cache, vLLM's prefix caching on."""
    proc = VLLMProcess(mesh["dir"], {"seed": mesh["peer"].address}, mesh["logs"] / "b.log",
                       prefix_caching=True)  # fmt: skip
    yield proc
    proc.close()


def same(out, ref):
    assert out["tokens"] == ref["tokens"]
    assert out["logprobs"] == ref["logprobs"]  # bit for bit: floats survive JSON exactly


def test_a_fresh_process_gets_a_remote_hit_with_identical_logprobs(mesh, b):
    out = b.generate(PROMPTS["hit"])
    assert mesh["cold"]["hit"]["num_cached_tokens"] == 0
    assert out["num_cached_tokens"] >= FULL_PAGES * BLOCK
    c = b.counters()
    assert c["remote_hits"] == 1 and c["pages_loaded"] == FULL_PAGES
    assert mesh["cold"]["hit:cached"]["num_cached_tokens"] == FULL_PAGES * BLOCK
    same(out, mesh["cold"]["hit:cached"])  # kvmesh's promise: as if continuing A's cache
    same(out, mesh["cold"]["hit"])  # and, at this length in float32, as A's cold run


@pytest.fixture
def fresh_b(mesh):
    """B as it starts: its planner has not yet measured vLLM's prefill on this tiny
    model (after one request it may rightly prefer computing a 420-token prompt to
    fetching it, and the corruption under test would never be on the wire)."""
    proc = VLLMProcess(mesh["dir"], {"seed": mesh["peer"].address}, mesh["logs"] / "b2.log",
                       prefix_caching=True)  # fmt: skip
    yield proc
    proc.close()


def test_corrupted_bytes_load_the_verified_pages_and_recompute_the_rest(mesh, fresh_b):
    b = fresh_b
    proxy = mesh["proxy"]
    proxy.corrupt_at(PAGE_BYTES + PAGE_BYTES // 2)  # inside the second page of the stream
    before = b.counters()
    out = b.generate(PROMPTS["corrupt"])
    after = b.counters()
    assert proxy.corrupted == 1, (before, after)
    failed = {k for k in after if k.startswith("peer_failed:") and after[k] > before.get(k, 0)}
    assert failed, after
    loaded = after.get("pages_loaded", 0) - before.get("pages_loaded", 0)
    # the first page arrived verified and was loaded; the failed one and those after it
    # were reported as load errors and recomputed by vLLM
    assert 1 <= loaded < FULL_PAGES
    same(out, mesh["cold"]["corrupt"])


def test_an_incompatible_card_is_a_miss_and_computes(mesh):
    """Another page size is another card: A's pages are never offered to it. Its own
    pages, saved by the first request, are a local hit for the second (vLLM's own
    prefix cache is off in this process)."""
    c = VLLMProcess(mesh["dir"], {"seed": mesh["peer"].address}, mesh["logs"] / "c.log",
                    block_size=64)  # fmt: skip
    try:
        assert c.ready["card"]["block_tokens"] == 64
        out = c.generate(PROMPTS["card"])
        first = c.counters()
        again = c.generate(PROMPTS["card"])
        second = c.counters()
    finally:
        c.close()
    assert out["num_cached_tokens"] == 0 and "pages_loaded" not in first
    assert first.get("lookup_misses") == 1 and "remote_hits" not in first
    same(out, mesh["cold"]["card"])
    pages = (420 - 1) // 64
    assert again["num_cached_tokens"] >= pages * 64 and second["pages_loaded"] == pages
    assert "remote_hits" not in second and second.get("lookup_misses") == 1
    same(again, mesh["cold"]["card"])


def test_a_killed_peer_computes(mesh, b):
    mesh["peer"].kill()
    out = b.generate(PROMPTS["killed"])
    assert out["num_cached_tokens"] == 0
    same(out, mesh["cold"]["killed"])


def test_vllm_and_head_cards_never_share_a_namespace(mesh, tiny_dir):
    """The card vLLM actually ran under, against a head's card for the same model
    (built as the torch engine builds it: kvmesh's torch engine needs transformers
    >= 5.2x, which vLLM 0.32 does not allow in this environment)."""
    from kvmesh.compat import CompatCard
    from kvmesh.engine.base import CacheGeometry, card_from_hf_dir

    vcard = CompatCard.from_json(mesh["card"])
    geometry = CacheGeometry(vcard.kv_dtype, vcard.num_kv_heads, vcard.head_dim,
                             vcard.sliding_windows)  # fmt: skip
    for engine in ("transformers/sdpa", "transformers/eager", "mlx"):
        hcard = card_from_hf_dir(tiny_dir, engine, geometry, "none", vcard.block_tokens)
        assert hcard.weights_digest == vcard.weights_digest
        assert hcard.namespace != vcard.namespace
    assert vcard.engine.startswith("vllm/0.") and "/cpu/" in vcard.engine
