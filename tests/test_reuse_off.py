"""A model whose cache kvmesh cannot ship exactly yet (DeepSeek-V3's latent
attention: keys and values of different shapes) is served with prefix reuse off:
no error at start, one clear log line, every prompt computed, nothing exported or
imported, and the answers are the model's own."""

from __future__ import annotations

import pytest
import torch

from kvmesh.blocks import BlockKeyer
from kvmesh.engine.base import Sampling
from kvmesh.engine.hf import TransformersEngine
from kvmesh.errors import CacheMiss

from . import zoo
from .procs import Peer
from .test_api import Head


def test_the_engine_serves_it_and_refuses_every_copy():
    engine = TransformersEngine(zoo.latent_model())
    assert engine.reuse_off is not None and "latent attention" in engine.reuse_off
    tokens = zoo.prompt_tokens(zoo.latent_model(), 70)
    state = engine.prefill(tokens)
    assert engine.export(state, BlockKeyer(engine.card.namespace, 32)) == []
    with pytest.raises(CacheMiss):
        engine.importer(32)
    assert engine.begin_resume(state, 64, tokens + [5]).cached == 0  # no crop of it
    twin = engine.fork(state)  # n > 1: the prompt computed again, not copied
    assert twin.cache is not state.cache and torch.equal(twin.logits, state.logits)
    sampling = Sampling(max_tokens=6, stop_on_eos=False)
    assert list(engine.generate(twin, sampling)) == list(engine.generate(state, sampling))


def test_a_head_serves_it_with_reuse_off_and_says_so_once(tmp_path):
    model = str(zoo.latent_model())
    log = (tmp_path / "head.log").open("w")
    peer = Peer(alias="latent-peer", log_dir=tmp_path)
    try:
        head = Head("--seed", peer.address, "--exact-reuse-by-address", model=model, log=log)
        try:
            body = {"model": model, "prompt": "the cache of the model " * 40, "max_tokens": 6}
            first = head.http.post("/v1/completions", json={**body, "temperature": 0})
            again = head.http.post("/v1/completions", json={**body, "temperature": 0})
            two = head.http.post("/v1/completions", json={**body, "n": 2, "temperature": 0})
            assert first.status_code == again.status_code == two.status_code == 200, first.text
            a, b = first.json(), again.json()
            assert a["choices"][0]["text"] == b["choices"][0]["text"]
            assert [c["text"] for c in two.json()["choices"]] == [a["choices"][0]["text"]] * 2
            for reply in (a, b):
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert head.health()["status"] == "ok"
        finally:
            head.stop()
    finally:
        peer.kill()
        log.close()
    lines = [x for x in (tmp_path / "head.log").read_text().splitlines() if "reuse is off" in x]
    assert len(lines) == 1 and "latent attention" in lines[0]
