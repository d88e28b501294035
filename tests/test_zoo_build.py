"""The model zoo builds real, loadable, non-degenerate tiny models (see tests/zoo.py)."""

from __future__ import annotations

import json
import threading

import pytest

from . import zoo

CHAT_MARKERS = {
    "llama": "<|start_header_id|>user<|end_header_id|>",
    "qwen2": "<|im_start|>user\n",
    "mistral": "[INST] ",
    "gemma2": "<start_of_turn>user\n",
    "gemma3": "<start_of_turn>user\n",
    "phi3": "<|user|>\n",
}


@pytest.mark.parametrize("arch", zoo.ARCHS)
def test_hf_model_loads_and_follows_its_family(arch):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.hf_model(arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tok) == zoo.VOCAB

    text = "The cache key is 1234 hashes of the prefix, again!"
    ids = tok.encode(text)
    assert ids == Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (ids[0] == tok.bos_token_id) == (arch in zoo.BOS_FAMILIES)

    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert CHAT_MARKERS[arch] in chat
    if arch in zoo.BOS_FAMILIES and arch != "phi3":  # templates that write the BOS themselves
        assert chat.startswith(tok.bos_token)

    prompt = zoo.prompt_tokens(path, 24)
    assert prompt == zoo.prompt_tokens(path, 24) != zoo.prompt_tokens(path, 24, seed=1)
    assert not set(prompt) & set(tok.all_special_ids)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert len(set(out[0, 24:].tolist())) > 1, "degenerate random weights"


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_configs_are_hub_style(arch):
    from transformers import AutoConfig

    path = zoo.hf_model(arch)
    raw = json.loads((path / "config.json").read_text())
    assert raw["sliding_window"] == zoo.SLIDING_WINDOW and "layer_types" not in raw
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.sliding_window == zoo.SLIDING_WINDOW
    if arch != "mistral":  # transformers fills in alternating sliding / full layers
        assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2


def test_cast_variant_and_deterministic_rebuild(tmp_path):
    import torch
    from safetensors.torch import load_file

    base, half = zoo.hf_model("llama"), zoo.hf_model("llama", "bfloat16")
    w32, w16 = load_file(base / "model.safetensors"), load_file(half / "model.safetensors")
    assert w32.keys() == w16.keys() and all(v.dtype == torch.bfloat16 for v in w16.values())
    assert all(torch.equal(w32[k].to(torch.bfloat16), w16[k]) for k in w32)
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"

    zoo._build_hf("llama", tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (base / name).read_bytes()


def test_concurrent_builds_share_one_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    paths, errors = [], []

    def build():
        try:
            paths.append(zoo.hf_model("qwen2"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert sorted(p.name for p in (tmp_path / "zoo").iterdir() if not p.name.startswith(".")) == [
        paths[0].name
    ]


@pytest.mark.parametrize("variant", zoo.MLX_VARIANTS)
def test_mlx_variants_load_with_promised_dtypes(variant):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.nn as nn

    path = zoo.mlx_model("gemma3", variant)
    model, tok = mlx_lm.load(str(path))
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "q4": mx.float16, "q8": mx.bfloat16}
    q_proj = model.layers[0].self_attn.q_proj
    if variant.startswith("q"):
        assert isinstance(q_proj, nn.QuantizedLinear)
        assert q_proj.bits == int(variant[1:]) and q_proj.group_size == 64
        assert q_proj.scales.dtype == dtype[variant]
    else:
        assert isinstance(q_proj, nn.Linear) and q_proj.weight.dtype == dtype[variant]
    assert model.model.norm.weight.dtype == dtype[variant]
    assert tok.encode("hello")[0] == tok.bos_token_id
    logits = model(mx.array([zoo.prompt_tokens(path, 16)]))
    assert logits.shape == (1, 16, zoo.VOCAB) and logits.dtype == dtype[variant]
