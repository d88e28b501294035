"""LoRA adapters on the head (``kvmesh head --lora NAME=PATH``).

Engine: an adapter's forward is the base model with the adapter merged into its
weights (computed here independently: ``W + scale * B @ A`` in a plain
transformers model), prompts with different adapters in one batch each get their
own, and adapters the model cannot take are refused before anything is attached.

Head processes with a real peer: a prompt served with adapter ``a`` is published
under a root of a's weights digest; a fresh head serving the same files under
another name gets it from the peer, tokens and log-probabilities identical to the
cold answer (and its audit, a recompute with the adapter, agrees), while the
same prompt with adapter ``b`` or with no adapter finds none of it. /v1/models lists the adapters as vLLM does (``parent``: the base).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from kvmesh.engine.hf import TransformersEngine
from kvmesh.errors import ConfigError

from . import zoo
from .helpers import assert_whole_remote_hit, wait_for
from .procs import Peer
from .test_api import Head

PROMPT = "Prefill caching across a small fleet of machines, adapters and all. " * 12


@pytest.fixture(scope="module")
def adapters(tiny_dir):
    return zoo.lora_adapter(tiny_dir, 1), zoo.lora_adapter(tiny_dir, 2)


@pytest.fixture(scope="module")
def engine(tiny_dir, adapters):
    eng = TransformersEngine(tiny_dir)
    for name, path in zip("ab", adapters, strict=True):
        eng.load_adapter(name, str(path))
    return eng


def merged_logits(base, adapter, tokens: list[int]) -> torch.Tensor:
    """The last position's logits of ``base`` with ``adapter`` merged into its
    weights, by plain transformers (no kvmesh code on the path)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in weights.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = weights[key.replace(".lora_A.", ".lora_B.")]
                modules[name].weight += scale * (b @ a)
        return model(torch.tensor([tokens])).logits[0, -1].float()


def test_an_adapters_forward_is_the_merged_model(engine, tiny_dir, adapters):
    tokens = engine.encode(PROMPT)
    base = engine.prefill(tokens).logits
    with_a = engine.prefill(tokens, adapter="a").logits
    ref = merged_logits(tiny_dir, adapters[0], tokens)
    assert torch.allclose(with_a, ref, atol=2e-3, rtol=1e-3), (with_a - ref).abs().max()
    assert (with_a - base).abs().max() > 0.1  # the adapter changes the answer
    assert int(with_a.argmax()) == int(ref.argmax())


def test_a_batch_of_mixed_adapters_gives_each_row_its_own(engine):
    tokens = engine.encode(PROMPT)[:96]
    names = (None, "a", "b", "a")
    states = [engine.prefill(tokens, adapter=n) for n in names]
    for s in states:  # one decode step of the same token, the four rows in one forward
        s.tokens.append(7)
    engine.decode_batch(states)
    for n, s in zip(names, states, strict=True):
        alone = engine.prefill(tokens, adapter=n)
        alone.tokens.append(7)
        engine.decode_batch([alone])
        assert torch.allclose(s.logits, alone.logits, atol=1e-4, rtol=1e-4), n
    assert not torch.allclose(states[1].logits, states[2].logits, atol=1e-2)
    prompts = [engine.begin_prefill(tokens, adapter=n) for n in names]  # one prefill forward
    engine.prefill_batch(prompts, [len(tokens)] * len(names))
    for n, s in zip(names, prompts, strict=True):
        alone = engine.prefill(tokens, adapter=n).logits
        assert torch.allclose(s.logits, alone, atol=1e-4, rtol=1e-4), n
    fork = engine.fork(states[2])  # n > 1 sequences keep their adapter
    assert fork.adapter == "b"


def test_adapters_the_model_cannot_take_are_refused(engine, tmp_path, adapters):
    from safetensors.torch import load_file, save_file

    other = shutil.copytree(adapters[0], tmp_path / "other")  # as for a wider base model
    weights = load_file(str(other / "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] * 2)
    save_file(weights, str(other / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="does not fit"):
        engine.load_adapter("other", str(other))
    dora = shutil.copytree(adapters[0], tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ConfigError, match="use_dora"):
        engine.load_adapter("dora", str(dora))
    (dora / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        engine.load_adapter("dora", str(dora))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapters[0] / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pickled"):
        engine.load_adapter("pickled", str(pickled))
    with pytest.raises(ConfigError, match="two adapters"):
        engine.load_adapter("a", str(adapters[1]))
    assert set(engine.adapters) == {"a", "b"}


def lora(**adapters: object) -> list[str]:
    return [a for name, path in adapters.items() for a in ("--lora", f"{name}={path}")]


def complete(head: Head, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    r = head.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def answer(out: dict) -> tuple:
    c = out["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]


def test_an_adapters_prompt_is_shared_under_its_weights_and_no_others(tmp_path, adapters):
    a, b = adapters
    renamed = shutil.copytree(a, tmp_path / "renamed-a")  # the same files elsewhere
    peer = Peer(alias="lora-peer", log_dir=tmp_path)
    try:
        h1 = Head("--seed", peer.address, "--exact-reuse-by-address", *lora(a=a, b=b))
        try:
            h1.wait(lambda s: s["peers"] >= 1)
            listed = h1.http.get("/v1/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in listed] == [
                ("demo-tiny", None),
                ("a", "demo-tiny"),
                ("b", "demo-tiny"),
            ]
            cold = complete(h1, "a")
            assert cold["model"] == "a" and cold["kvmesh"]["source"] != "remote"
            h1.wait(lambda s: s["publish_pending"] == 0)
        finally:
            h1.stop()
        # every remote hit audited: the recompute takes the request's adapter
        args = ("--exact-reuse-by-address", "--audit-rate", "1", *lora(mine=renamed, b=b))
        h2 = Head("--seed", peer.address, *args)
        try:
            h2.wait(lambda s: s["compatible_peers"] >= 1)
            warm = complete(h2, "mine")
            wait_for(lambda: h2.metric("kvmesh_audits_total") == 1, 60, "the audit")
            assert h2.metric("kvmesh_audit_mismatches_total") == 0
            other = complete(h2, "b")
            base = complete(h2, "demo-tiny")
        finally:
            h2.stop()
    finally:
        peer.kill()
    assert_whole_remote_hit(warm, cold, answer)
    for miss in (other, base):  # neither finds a's blocks
        assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, miss["kvmesh"]
    # the adapters change the model: a's answer is neither b's nor the base's
    assert len({str(answer(warm)), str(answer(other)), str(answer(base))}) == 3


def test_bad_lora_options_are_usage_errors_before_the_model_loads(tmp_path, adapters):
    def head(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "kvmesh.cli", "head", "--model", "demo-tiny", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    for args, said in [
        (("--lora", str(adapters[0])), "NAME=PATH"),
        (("--lora", f"demo-tiny={adapters[0]}"), "is taken"),
        (("--lora", f"a={adapters[0]}", "--lora", f"a={adapters[1]}"), "is taken"),
        (("--lora", f"a={tmp_path}"), "adapter_config.json"),
        (("--lora", f"a={adapters[0]}", "--deterministic"), "torch engine"),
    ]:
        done = head(*args)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr[-400:])
