"""A zoo of tiny random-weight models of real architectures, built offline and deterministically.

Contract (other tests rely on it, keep it stable):

- ``ARCHS``: ``llama``, ``qwen2``, ``mistral``, ``gemma2``, ``gemma3``, ``phi3``.
- ``hf_model(arch, dtype="float32") -> Path``: an ordinary Hugging Face model directory
  (hub-style ``config.json``, ``model.safetensors``, ``generation_config.json``, a real
  byte-level BPE ``tokenizer.json`` with the family's special tokens, BOS convention and chat
  template). ``dtype`` is ``float32``, ``bfloat16`` or ``float16``: the same seeded weights cast.
- ``mlx_model(arch, variant) -> Path``: ``mlx_lm.convert`` of ``hf_model(arch)``; ``variant``
  in ``MLX_VARIANTS``: ``float32``, ``bfloat16``, ``q4`` (4-bit, group 64, float16 scales and
  non-quantized params, like mlx-community models) and ``q8`` (8-bit, group 64, bfloat16).
- ``convert_mlx(src, dst, variant) -> Path``: the same conversion for any HF directory.
- ``windowed(src, window, layer_types=None) -> Path``: ``src`` (any of the above) with another
  ``sliding_window`` (and ``layer_types``), the same weights.
- ``prompt_tokens(path, n, seed=0) -> list[int]``: ``n`` ids the model's tokenizer produces for
  deterministic generated text (ordinary vocabulary entries, never special tokens).

Geometry: hidden 64, 4 layers, GQA (fewer KV heads than query heads), head_dim 16 or 32,
intermediate 128, a 512-entry vocabulary (the embedding matches the tokenizer exactly).
``config.json`` is written as the hub ships it (``rope_theta`` at top level, no ``layer_types``
for gemma2/gemma3, ``sliding_window`` 96 for mistral/gemma2/gemma3), since mlx-lm reads the
raw file and ignores transformers 5's ``rope_parameters``. Known engine difference (mlx-lm
0.32): its ``mistral`` (mapped to ``llama``) and ``gemma2`` models ignore ``sliding_window`` and
attend fully, so past 96 tokens their logits differ from transformers'; gemma3 matches.

Everything is cached under ``$KVMESH_HOME/zoo/<name>`` (default ``~/.cache/kvmesh``), built in a
temporary sibling directory under a file lock and moved into place with ``os.replace``, so
concurrent pytest processes and threads never see a partial directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

RECIPE = 1
ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "phi3")
MLX_VARIANTS = ("float32", "bfloat16", "q4", "q8")
HF_DTYPES = ("float32", "bfloat16", "float16")
VOCAB = 512
SLIDING_WINDOW = 96
WEIGHT_STD = 0.2
GEMMA_EMBED_DIV = 4.0
GEMMA_NORM = 1.0
BOS_FAMILIES = ("llama", "mistral", "gemma2", "gemma3", "phi3")  # tokenizer adds BOS

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "for",
    "with",
    "from",
    "by",
    "at",
    "as",
    "and",
    "or",
    "but",
    "not",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "it",
    "its",
    "this",
    "that",
    "these",
    "those",
    "there",
    "here",
    "we",
    "you",
    "they",
    "he",
    "she",
    "i",
    "my",
    "your",
    "our",
    "their",
    "cache",
    "key",
    "value",
    "token",
    "block",
    "prefix",
    "model",
    "layer",
    "head",
    "peer",
    "node",
    "fleet",
    "mesh",
    "network",
    "stream",
    "chunk",
    "store",
    "lease",
    "prompt",
    "answer",
    "question",
    "reason",
    "hash",
    "digest",
    "namespace",
    "window",
    "slide",
    "rotate",
    "attention",
    "query",
    "vector",
    "matrix",
    "tensor",
    "float",
    "half",
    "brain",
    "byte",
    "word",
    "sentence",
    "story",
    "river",
    "mountain",
    "forest",
    "city",
    "garden",
    "kitchen",
    "window",
    "door",
    "table",
    "chair",
    "book",
    "paper",
    "letter",
    "number",
    "seven",
    "twelve",
    "hundred",
    "quick",
    "slow",
    "bright",
    "dark",
    "warm",
    "cold",
    "green",
    "blue",
    "red",
    "small",
    "large",
    "ancient",
    "modern",
    "quiet",
    "loud",
    "runs",
    "walks",
    "reads",
    "writes",
    "builds",
    "sends",
    "moves",
    "holds",
    "keeps",
    "finds",
    "makes",
    "takes",
    "gives",
    "sees",
    "always",
    "never",
    "often",
    "sometimes",
    "today",
    "tomorrow",
    "yesterday",
    "again",
    "still",
    "only",
    "just",
    "very",
]

_GEN = {"do_sample": False}

# --- tokenizer families -------------------------------------------------------------------------

LLAMA_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' "
    "+ message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

_GEMMA_TOK = {
    "head": ["<pad>", "<eos>", "<bos>", "<unk>"],
    "tail": ["<start_of_turn>", "<end_of_turn>"],
    "bos": "<bos>",
    "eos": "<eos>",
    "pad": "<pad>",
    "unk": "<unk>",
    "stop": ["<eos>", "<end_of_turn>"],
    "template": GEMMA_TEMPLATE,
}
TOKENIZERS: dict[str, dict] = {
    "llama": {
        "head": [],
        "tail": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": None,
        "unk": None,
        "stop": ["<|end_of_text|>", "<|eot_id|>"],
        "template": LLAMA_TEMPLATE,
    },
    "qwen2": {
        "head": [],
        "tail": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "unk": None,
        "stop": ["<|im_end|>", "<|endoftext|>"],
        "template": CHATML_TEMPLATE,
    },
    "mistral": {
        "head": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "tail": [],
        "bos": "<s>",
        "eos": "</s>",
        "pad": None,
        "unk": "<unk>",
        "stop": ["</s>"],
        "template": MISTRAL_TEMPLATE,
    },
    "gemma2": _GEMMA_TOK,
    "gemma3": _GEMMA_TOK,
    "phi3": {
        "head": ["<unk>", "<s>", "</s>"],
        "tail": ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
        "bos": "<s>",
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "unk": "<unk>",
        "stop": ["<|endoftext|>", "<|assistant|>", "<|end|>"],
        "template": PHI3_TEMPLATE,
    },
}

SPLIT_REGEX = {
    "llama": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TOKENIZER_CLASS = {"llama": "PreTrainedTokenizerFast", "qwen2": "Qwen2Tokenizer"}

# --- hub-style configs (token ids are filled in from the tokenizer) -----------------------------

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "use_cache": True,
    "vocab_size": VOCAB,
}
CONFIGS: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": SLIDING_WINDOW,
        "tie_word_embeddings": False,
    },
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "attention_bias": False,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "head_dim": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": SLIDING_WINDOW,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "attention_bias": False,
        "embd_pdrop": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "original_max_position_embeddings": 4096,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}

# --- public API ---------------------------------------------------------------------------------


def zoo_home() -> Path:
    home = Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh"))
    return home / "zoo"


def hf_model(arch: str, dtype: str = "float32") -> Path:
    """The HF directory of ``arch`` with weights stored in ``dtype``."""
    _check(arch, ARCHS)
    _check(dtype, HF_DTYPES)
    dst = zoo_home() / f"{arch}-{dtype}-r{RECIPE}"
    if dtype == "float32":
        return _atomic(dst, lambda tmp: _build_hf(arch, tmp))
    base = hf_model(arch)
    return _atomic(dst, lambda tmp: _cast_hf(base, tmp, dtype))


def mlx_model(arch: str, variant: str) -> Path:
    """``mlx_lm.convert`` of ``hf_model(arch)`` as ``variant`` (see ``convert_mlx``)."""
    _check(arch, ARCHS)
    return convert_mlx(hf_model(arch), zoo_home() / f"{arch}-mlx-{variant}-r{RECIPE}", variant)


def convert_mlx(src: Path, dst: Path, variant: str) -> Path:
    """Convert the HF directory ``src`` into an mlx-lm directory ``dst`` (idempotent, atomic)."""
    _check(variant, MLX_VARIANTS)
    return _atomic(Path(dst), lambda tmp: _convert(Path(src), tmp, variant))


def windowed(src: Path, window: int, layer_types: tuple[str, ...] | None = None) -> Path:
    """A copy of the model directory ``src`` (HF or mlx) whose ``sliding_window`` is
    ``window`` (and ``layer_types`` set, when given): the same weights under a small
    window, so prompts of several windows stay short. Cached beside ``src``."""
    tag = f"w{window}" + (f"-{''.join(t[0] for t in layer_types)}" if layer_types else "")
    dst = Path(src).parent / f"{Path(src).name}-{tag}"

    def build(tmp: Path) -> None:
        for f in Path(src).iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["sliding_window"] = window
        if layer_types is not None:
            cfg["layer_types"] = list(layer_types)
        cfg["_name_or_path"] = dst.name
        _write_json(tmp / "config.json", cfg)

    return _atomic(dst, build)


def prompt_tokens(path: Path, n: int, seed: int = 0) -> list[int]:
    """``n`` non-special token ids the tokenizer at ``path`` produces for generated text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        enc = tok.encode(_paragraph(rng), add_special_tokens=False)
        assert not special.intersection(enc.tokens)
        ids.extend(enc.ids)
    return ids[:n]


# --- caching ------------------------------------------------------------------------------------


def _check(value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {allowed}")


def _atomic(dst: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` once, under a lock, and move ``tmp`` to ``dst``."""
    if dst.is_dir():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst.parent / f".{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dst.is_dir():
            return dst
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
        try:
            build(tmp)
            os.replace(tmp, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


# --- text and tokenizer -------------------------------------------------------------------------


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randint(1, len(words)), str(rng.randint(0, 2048)))
    if rng.random() < 0.2:
        words[rng.randint(0, len(words) - 1)] += ","
    return words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice(".!?.")


def _paragraph(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "\n"


def _corpus() -> str:
    rng = random.Random(20240601)
    return "".join(_paragraph(rng) for _ in range(300))


def _learn_merges(pre_tokenizer, text: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE over byte-level pre-tokenized words; ties break lexicographically."""
    pieces = pre_tokenizer.pre_tokenize_str(text)
    words = {tuple(w): c for w, c in Counter(p for p, _ in pieces).items()}
    merges = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:], strict=False):
                pairs[pair] += c
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        words = {_merge_word(w, best): c for w, c in words.items()}
    return merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order (token id of byte b is b + #head specials)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _pre_tokenizer(arch: str):
    """Llama-3 and Qwen2 split with their own regexes (as their tokenizer.json files do)."""
    from tokenizers import Regex, pre_tokenizers

    if arch not in SPLIT_REGEX:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    split = pre_tokenizers.Split(Regex(SPLIT_REGEX[arch]), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([split, byte_level])


def _build_tokenizer(arch: str, out: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    fam = TOKENIZERS[arch]
    specials = fam["head"] + fam["tail"]
    merges = _learn_merges(_pre_tokenizer(arch), _corpus(), VOCAB - 256 - len(specials))
    tokens = fam["head"] + _byte_alphabet() + [a + b for a, b in merges] + fam["tail"]
    assert len(tokens) == len(set(tokens)) == VOCAB
    model = models.BPE({t: i for i, t in enumerate(tokens)}, merges)
    tok = Tokenizer(model)
    if arch == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(arch)
    tok.decoder = decoders.ByteLevel()
    bos = fam["bos"]
    if arch in BOS_FAMILIES:
        pair = f"{bos} $A:0 {bos}:1 $B:1"
        special_ids = [(bos, tokens.index(bos))]
        tok.post_processor = processors.TemplateProcessing(f"{bos} $A:0", pair, special_ids)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=fam["eos"],
        pad_token=fam["pad"],
        unk_token=fam["unk"],
        chat_template=fam["template"],
        clean_up_tokenization_spaces=False,
        model_max_length=CONFIGS[arch]["max_position_embeddings"],
    )
    fast.save_pretrained(out)
    if arch in TOKENIZER_CLASS:  # as on the hub; transformers 5 rebuilds Qwen2's pipeline anyway
        _write_json(
            out / "tokenizer_config.json",
            {
                **json.loads((out / "tokenizer_config.json").read_text()),
                "tokenizer_class": TOKENIZER_CLASS[arch],
            },
        )
    return {t: tokens.index(t) for t in specials}


# --- weights ------------------------------------------------------------------------------------


def _token_ids(arch: str, ids: dict[str, int]) -> dict:
    fam = TOKENIZERS[arch]
    stop = [ids[t] for t in fam["stop"]]
    out = {
        "bos_token_id": ids.get(fam["bos"] or "", ids[fam["stop"][-1]]),
        "eos_token_id": stop[0] if arch in ("mistral", "phi3") else stop,
    }
    if fam["pad"]:
        out["pad_token_id"] = ids[fam["pad"]]
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _seed(arch: str) -> int:
    return 1000 + ARCHS.index(arch)


def _fill_weights(arch: str, model) -> None:
    """Deterministic weights from a NumPy PCG64 stream, independent of transformers' init."""
    import torch

    rng = np.random.default_rng(_seed(arch))
    gemma_norm = arch.startswith("gemma")  # gemma scales by (1 + w)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = rng.standard_normal(tuple(p.shape), dtype=np.float32)
            if p.ndim == 1 and "norm" in name:
                values = noise * 0.1 + (GEMMA_NORM if gemma_norm else 1.0)
            elif p.ndim == 1:
                values = noise * 0.02
            elif gemma_norm and name.endswith("embed_tokens.weight"):
                values = noise * (
                    WEIGHT_STD / GEMMA_EMBED_DIV
                )  # gemma multiplies embeddings by sqrt(64)
            else:
                values = noise * WEIGHT_STD
            p.copy_(torch.from_numpy(values))


def _build_hf(arch: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = _build_tokenizer(arch, out)
    hub = {
        **_COMMON,
        **CONFIGS[arch],
        **_token_ids(arch, ids),
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    _write_json(out / "config.json", hub)
    cfg = AutoConfig.from_pretrained(out)
    torch.manual_seed(_seed(arch))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _fill_weights(arch, model)
    model.save_pretrained(out)
    _write_json(out / "config.json", hub)  # hub-style again: save_pretrained rewrote it
    gen = {**_GEN, **_token_ids(arch, ids)}
    gen["eos_token_id"] = [ids[t] for t in TOKENIZERS[arch]["stop"]]
    _write_json(out / "generation_config.json", gen)


def _cast_hf(src: Path, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy2(f, out / f.name)
    for f in src.glob("*.safetensors"):
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(f).items()}
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    _write_json(out / "config.json", cfg)


# --- mlx ----------------------------------------------------------------------------------------

_MLX_ARGS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "q4": {"dtype": "float16", "quantize": True, "q_bits": 4, "q_group_size": 64},
    "q8": {"dtype": "bfloat16", "quantize": True, "q_bits": 8, "q_group_size": 64},
}


def _convert(src: Path, tmp: Path, variant: str) -> None:
    from mlx_lm import convert

    out = tmp / "mlx"
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), str(out), **_MLX_ARGS[variant])
    for f in out.iterdir():
        os.replace(f, tmp / f.name)
    out.rmdir()
    cfg = json.loads((tmp / "config.json").read_text())  # mlx_lm keeps the source's dtype
    cfg["torch_dtype"] = cfg["dtype"] = _MLX_ARGS[variant]["dtype"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=4, sort_keys=True))
