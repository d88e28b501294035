"""Today's zoo architectures (zoo.TODAY) build, load and run in transformers and mlx-lm."""

from __future__ import annotations

import json

import pytest

from . import zoo

HF_CLASS = {
    "gemma4": "Gemma4ForCausalLM",
    "gemma4_hub": "Gemma4ForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_hub": "Qwen3_5ForCausalLM",  # AutoModelForCausalLM drops the vision tower
    "gpt_oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}
CONVERSATION = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi, how can I help"},
    {"role": "user", "content": "tell me a story"},
]
# (marker of the second user turn, end of the generation prompt)
CHAT = {
    "gemma4": ("<|turn>user\ntell me a story<turn|>\n", "<|turn>model\n"),
    "qwen3_5": (
        "<|im_start|>user\ntell me a story<|im_end|>\n",
        "<|im_start|>assistant\n<think>\n",
    ),
    "gpt_oss": ("<|start|>user<|message|>tell me a story<|end|>", "<|start|>assistant"),
    "lfm2": ("<|im_start|>user\ntell me a story<|im_end|>\n", "<|im_start|>assistant\n"),
    "nemotron_h": ("<|im_start|>user\ntell me a story<|im_end|>\n", "<|im_start|>assistant\n"),
}
CHAT["gemma4_hub"], CHAT["qwen3_5_hub"] = CHAT["gemma4"], CHAT["qwen3_5"]
ASSISTANT_TURN = {
    "gemma4": "<|turn>model\nhi, how can I help<turn|>\n",
    "qwen3_5": "<|im_start|>assistant\nhi, how can I help<|im_end|>\n",
    "gpt_oss": "<|start|>assistant<|channel|>final<|message|>hi, how can I help<|end|>",
    "lfm2": "<|im_start|>assistant\nhi, how can I help<|im_end|>\n",
    "nemotron_h": "<|im_start|>assistant\nhi, how can I help<|im_end|>\n",
}
ASSISTANT_TURN["gemma4_hub"] = ASSISTANT_TURN["gemma4"]
ASSISTANT_TURN["qwen3_5_hub"] = ASSISTANT_TURN["qwen3_5"]
# cache layer classes a 10-token forward leaves in DynamicCache(config=model.config)
CACHE_LAYERS = {
    "gemma4": ["DynamicSlidingWindowLayer"] * 2
    + ["DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer", "DummyLayer"],
    "qwen3_5": ["LinearAttentionLayer"] * 3 + ["DynamicLayer"],
    "gpt_oss": ["DynamicSlidingWindowLayer", "DynamicLayer"] * 2,
    "lfm2": ["LinearAttentionLayer"] * 2
    + ["DynamicLayer", "LinearAttentionLayer", "DynamicLayer", "LinearAttentionLayer"],
    "nemotron_h": ["LinearAttentionLayer", "DynamicLayer", "LinearAttentionLayer", "DummyLayer"],
}
CACHE_LAYERS["gemma4_hub"], CACHE_LAYERS["qwen3_5_hub"] = (
    CACHE_LAYERS["gemma4"],
    CACHE_LAYERS["qwen3_5"],
)
MLX_CACHES = {  # make_prompt_cache(model): one per layer, except gemma4's kv-shared and MLP layers
    "gemma4": ["RotatingKVCache", "RotatingKVCache", "KVCache", "RotatingKVCache"],
    "qwen3_5_hub": ["ArraysCache"] * 3 + ["KVCache"],
    "gpt_oss": ["RotatingKVCache", "KVCache"] * 2,
    "lfm2": ["ArraysCache"] * 2 + ["KVCache", "ArraysCache", "KVCache", "ArraysCache"],
    "nemotron_h": ["ArraysCache", "KVCache", "ArraysCache"],
}
MLX_CACHES["gemma4_hub"] = MLX_CACHES["gemma4"]
MLX_PAIRS = [(a, v) for a in zoo.TODAY for v in zoo.MLX_SUPPORT.get(a, ())]


@pytest.mark.parametrize("arch", zoo.TODAY)
def test_today_hf_model_loads_runs_and_chats(arch):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    path = zoo.hf_model(arch)
    assert set(zoo.MODEL_KINDS[arch]) and arch not in zoo.ARCHS
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == HF_CLASS[arch]
    assert model.config.get_text_config().vocab_size == len(tok) == zoo.VOCAB

    text = "The cache key is 1234 hashes of the prefix, again!"
    ids = tok.encode(text)
    assert ids == Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (ids[0] == tok.bos_token_id) == (arch in zoo.BOS_FAMILIES)

    chat = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    user, prompt_end = CHAT[arch]
    assert ASSISTANT_TURN[arch] in chat and user in chat and chat.endswith(prompt_end)
    assert chat.startswith(tok.bos_token or "<none>") == (arch in zoo.BOS_FAMILIES)
    chat_ids = tok.encode(chat, add_special_tokens=False)
    marker = {"gpt_oss": "<|start|>", "gemma4": "<|turn>", "gemma4_hub": "<|turn>"}
    assert tok.convert_tokens_to_ids(marker.get(arch, "<|im_start|>")) in chat_ids
    assert tok.decode(chat_ids) == chat

    prompt = zoo.prompt_tokens(path, 64)
    assert not set(prompt) & set(tok.all_special_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, 64, zoo.VOCAB) and torch.isfinite(logits).all()
    assert len(set(logits[0].argmax(-1).tolist())) > 8, "degenerate random weights"

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([prompt[:10]]), cache=cache, use_cache=True)
    assert [type(layer).__name__ for layer in cache.layers] == CACHE_LAYERS[arch]


@pytest.mark.parametrize("arch", zoo.TODAY)
def test_today_bfloat16_forward_is_finite(arch):
    import torch
    from transformers import AutoModelForCausalLM

    path = zoo.hf_model(arch, "bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.tensor([zoo.prompt_tokens(path, 64)])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", sorted(zoo.HUB_TEXT))
def test_hub_layout_is_its_text_twin(arch):
    import torch
    from transformers import AutoModelForCausalLM

    hub, text = zoo.hf_model(arch), zoo.hf_model(zoo.HUB_TEXT[arch])
    raw = json.loads((hub / "config.json").read_text())
    assert "text_config" in raw and "vision_config" in raw
    assert (hub / "tokenizer.json").read_bytes() == (text / "tokenizer.json").read_bytes()
    prompt = torch.tensor([zoo.prompt_tokens(hub, 32)])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(hub)(prompt).logits
        b = AutoModelForCausalLM.from_pretrained(text)(prompt).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_today_configs_are_what_the_engines_read():
    raw = {a: json.loads((zoo.hf_model(a) / "config.json").read_text()) for a in zoo.TODAY}
    g4 = raw["gemma4"]
    assert g4["layer_types"].count("full_attention") == 2 and g4["attention_k_eq_v"]
    assert (g4["head_dim"], g4["global_head_dim"]) == (32, 64)
    assert g4["sliding_window"] == raw["gpt_oss"]["sliding_window"] == zoo.SLIDING_WINDOW
    assert raw["gemma4_hub"]["text_config"]["global_head_dim"] == 64
    assert raw["qwen3_5_hub"]["text_config"]["full_attention_interval"] == 4
    assert raw["gpt_oss"]["rope_scaling"]["rope_type"] == "yarn"
    assert raw["nemotron_h"]["hybrid_override_pattern"] == "M*M-"


def test_mlx_refuses_unsupported_pairs():
    with pytest.raises(ValueError, match="GatherMM"):
        zoo.mlx_model("gemma4", "bfloat16")
    with pytest.raises(ValueError, match="qwen3_5_text"):
        zoo.mlx_model("qwen3_5", "float32")
    with pytest.raises(ValueError):
        zoo.hf_model("gemma5")


@pytest.mark.parametrize(("arch", "variant"), MLX_PAIRS)
def test_today_mlx_pairs_load_and_run(arch, variant):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    path = zoo.mlx_model(arch, variant)
    model, tok = mlx_lm.load(str(path))
    prompt = zoo.prompt_tokens(path, 64)
    assert (tok.encode("hello")[0] == tok.bos_token_id) == (arch in zoo.BOS_FAMILIES)
    logits = model(mx.array([prompt]))
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "q4": mx.float16, "q8": mx.bfloat16}
    assert logits.shape == (1, 64, zoo.VOCAB) and logits.dtype == dtype[variant]
    assert mx.all(mx.isfinite(logits)).item()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:10]]), cache=cache))
    assert [type(c).__name__ for c in cache] == MLX_CACHES[arch]


def test_thinking_switches_render_like_the_families():
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(zoo.hf_model("qwen3_5"))
    turn = [{"role": "user", "content": "hi"}]
    off = qwen.apply_chat_template(
        turn, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert "<think>" in qwen.convert_ids_to_tokens(qwen.encode(off))
    old = [*turn, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"}, *turn]
    assert "hmm" not in qwen.apply_chat_template(old, tokenize=False)

    gemma = AutoTokenizer.from_pretrained(zoo.hf_model("gemma4"))
    on = gemma.apply_chat_template(
        turn, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert on == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\n"


@pytest.mark.parametrize("arch", ["gemma4_hub", "nemotron_h"])
def test_today_rebuild_is_deterministic(arch, tmp_path):
    base = zoo.hf_model(arch)
    zoo._build_hf(arch, tmp_path)
    names = sorted(p.name for p in base.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for name in names:
        assert (tmp_path / name).read_bytes() == (base / name).read_bytes(), name
