"""The embedded demo models, built offline and bit-identically on every machine.

A demo model is a real Qwen2 architecture (grouped-query attention, RoPE, SwiGLU)
whose weights come from a seeded NumPy PCG64 stream, plus a byte-level tokenizer
(token id = byte value) and a ChatML template. It is written once as an ordinary
Hugging Face model directory under ``$KVMESH_HOME/models`` and then loaded like
any local model, so the demo exercises exactly the path real models take.

``demo`` has Qwen2.5-0.5B's geometry (24 layers, 14 query / 2 KV heads of 64,
hidden 896, MLP 4864) with a 320-entry vocabulary; ``demo-tiny`` is a few MB;
``demo-8b`` has Llama-3-8B's geometry in float16, for GPU benchmarks.

``demo-vl`` (and ``demo-vl-tiny``) is a LLaVA: a CLIP vision tower and a two-layer
projector in front of a Qwen2 language model, every parameter drawn from the same
kind of seeded stream in name order, the byte-level tokenizer plus ``<image>`` (id
259), and CLIP's PIL image processor at the tower's image size.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RECIPE_VERSION = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class DemoSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 320
    max_positions: int = 32768
    rope_theta: float = 1_000_000.0
    seed: int = 0
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


DEMOS = {
    "demo": DemoSpec("demo", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
    "demo-tiny": DemoSpec("demo-tiny", hidden=64, layers=4, heads=2, kv_heads=1, intermediate=128),
    # Llama-3-8B's geometry in float16 (~14 GB on disk): for GPU benchmarks only
    "demo-8b": DemoSpec(
        "demo-8b",
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        max_positions=8192,
        rope_theta=500_000.0,
        dtype="float16",
    ),
}


@dataclass(frozen=True)
class VisionSpec:
    """A demo LLaVA: the language model ``text`` behind a CLIP tower of this shape."""

    text: DemoSpec
    hidden: int
    layers: int
    heads: int
    intermediate: int
    image_size: int
    patch_size: int

    @property
    def name(self) -> str:
        return self.text.name


IMAGE_TOKEN = "<image>"
VISION_DEMOS = {
    "demo-vl": VisionSpec(
        DemoSpec("demo-vl", hidden=512, layers=12, heads=8, kv_heads=2, intermediate=2048),
        hidden=256,
        layers=4,
        heads=4,
        intermediate=1024,
        image_size=224,
        patch_size=16,
    ),
    "demo-vl-tiny": VisionSpec(
        DemoSpec("demo-vl-tiny", hidden=64, layers=4, heads=2, kv_heads=1, intermediate=128),
        hidden=32,
        layers=2,
        heads=2,
        intermediate=64,
        image_size=32,
        patch_size=8,
    ),
}


def kvmesh_home() -> Path:
    return Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh"))


def hf_config(spec: DemoSpec) -> dict[str, object]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "_name_or_path": f"kvmesh-{spec.name}",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_positions,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "torch_dtype": spec.dtype,
        "bos_token_id": 257,
        "eos_token_id": 258,
        "pad_token_id": 256,
    }


def _weights(spec: DemoSpec) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim

    dt = np.dtype(spec.dtype)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(dt)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(spec.vocab, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(h, dt)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, dt)
        w[p + "self_attn.q_proj.weight"] = normal(h, h)
        w[p + "self_attn.q_proj.bias"] = normal(h)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h)
        w[p + "self_attn.k_proj.bias"] = normal(kv)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h)
        w[p + "self_attn.v_proj.bias"] = normal(kv)
        w[p + "self_attn.o_proj.weight"] = normal(h, h)
        w[p + "mlp.gate_proj.weight"] = normal(spec.intermediate, h)
        w[p + "mlp.up_proj.weight"] = normal(spec.intermediate, h)
        w[p + "mlp.down_proj.weight"] = normal(h, spec.intermediate)
    w["model.norm.weight"] = np.ones(h, dt)
    return w


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _write_tokenizer(out: Path, extra: tuple[str, ...] = ()) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*SPECIAL_TOKENS, *extra])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build(spec: DemoSpec, out: Path) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=1, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 258}))
    save_file(_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(out)


def _vision_config(spec: VisionSpec) -> dict[str, Any]:
    text = hf_config(spec.text)
    del text["architectures"], text["_name_or_path"], text["torch_dtype"]
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "image_size": spec.image_size,
        "patch_size": spec.patch_size,
        "projection_dim": spec.hidden,
    }
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "_name_or_path": f"kvmesh-{spec.name}",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": 259,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu",
        "tie_word_embeddings": True,
        "torch_dtype": spec.text.dtype,
    }


def build_vision(spec: VisionSpec, out: Path) -> None:
    """The demo LLaVA ``spec`` as a model directory in ``out``: parameters in name
    order from one seeded stream (norm weights one, biases zero)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = LlavaConfig(**{k: v for k, v in _vision_config(spec).items() if k != "model_type"})
    model = LlavaForConditionalGeneration(config)
    rng = np.random.Generator(np.random.PCG64(spec.text.seed + 1))
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            else:
                drawn = rng.standard_normal(tuple(param.shape), dtype=np.float32)
                param.copy_(torch.from_numpy(drawn * np.float32(0.02)))
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 258}))
    _write_tokenizer(out, (IMAGE_TOKEN,))
    size = spec.image_size
    CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(str(out))


def ensure_demo(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """Path of the demo model directory, building it (atomically) if absent."""
    if name not in DEMOS and name not in VISION_DEMOS:
        known = sorted([*DEMOS, *VISION_DEMOS])
        raise ValueError(f"unknown demo model {name!r}; choose from {known}")
    root = kvmesh_home() / "models"
    final = root / f"{name}-r{RECIPE_VERSION}"
    if (final / "model.safetensors").is_file():
        return final
    if progress:
        progress(f"building demo model {name} (seeded weights, offline) in {final}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        if name in VISION_DEMOS:
            build_vision(VISION_DEMOS[name], tmp)
        else:
            build(DEMOS[name], tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def resolve_model(model: str, progress: Callable[[str], None] | None = None) -> Path:
    """``demo`` / ``demo-tiny`` or a local model directory."""
    if model in DEMOS or model in VISION_DEMOS:
        return ensure_demo(model, progress)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model!r} is neither a demo model ({', '.join([*DEMOS, *VISION_DEMOS])}) nor a local model "
            "directory with a config.json (nothing is downloaded)"
        )
    return path
