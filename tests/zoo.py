"""A zoo of tiny random-weight models of real architectures, built offline and deterministically.

Contract (other tests rely on it, keep it stable):

- ``ARCHS``: ``llama``, ``qwen2``, ``mistral``, ``gemma2``, ``gemma3``, ``phi3``; ``TODAY``
  (below): ``gemma4``, ``gemma4_hub``, ``qwen3_5``, ``qwen3_5_hub``, ``gpt_oss``, ``lfm2``,
  ``nemotron_h``.
- ``hf_model(arch, dtype="float32") -> Path``: an ordinary Hugging Face model directory
  (hub-style ``config.json``, ``model.safetensors``, ``generation_config.json``, a real
  byte-level BPE ``tokenizer.json`` with the family's special tokens, BOS convention and chat
  template). ``dtype`` is ``float32``, ``bfloat16`` or ``float16``: the same seeded weights cast.
- ``mlx_model(arch, variant) -> Path``: ``mlx_lm.convert`` of ``hf_model(arch)``; ``variant``
  in ``MLX_VARIANTS``: ``float32``, ``bfloat16``, ``q4`` (4-bit, group 64, float16 scales and
  non-quantized params, like mlx-community models) and ``q8`` (8-bit, group 64, bfloat16).
- ``convert_mlx(src, dst, variant) -> Path``: the same conversion for any HF directory.
- ``reshaped(arch, **config) -> Path``: a TODAY text arch with ``config`` changed (other
  shapes, other seeded weights), e.g. ``reshaped("gpt_oss", head_dim=32)`` for vLLM's CPU build.
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

Today's architectures (``TODAY``, kept apart from ``ARCHS`` so that tests parametrized over
``ARCHS`` keep their set; ``hf_model``, ``mlx_model`` and ``windowed`` take both):

- ``gemma4``: ``Gemma4ForCausalLM`` (``gemma4_text``), 6 layers sliding, sliding, full, sliding,
  sliding, full; sliding layers head dim 32 with 2 KV heads, full layers ``global_head_dim`` 64
  with ``num_global_key_value_heads`` 1 and ``attention_k_eq_v`` (no ``v_proj``); the last
  ``num_kv_shared_layers`` 2 reuse the K/V of layers 3 and 2 (no cache of their own; their MLP
  is double wide); MoE beside the MLP (4 experts, top 2); per-layer input embeddings (16);
  proportional partial RoPE on full layers; final logit softcap 30.
- ``gemma4_hub``: the same as the hub ships it, ``Gemma4ForConditionalGeneration``
  (``gemma4`` with ``text_config``) with tiny seeded vision and audio towers; its language
  model has ``gemma4``'s very weights (``HUB_TEXT``), so both give the same logits.
- ``qwen3_5``: ``Qwen3_5ForCausalLM`` (``qwen3_5_text``), 3 Gated-DeltaNet
  ``linear_attention`` layers then 1 ``full_attention`` layer (gated output, head dim 32, 2 KV
  heads, ``partial_rotary_factor`` 0.25); linear heads: 2 key and 4 value heads of dim 16,
  conv kernel 4.
- ``qwen3_5_hub``: ``Qwen3_5ForConditionalGeneration`` (``qwen3_5`` with ``text_config``, a
  tiny vision tower), language model weights = ``qwen3_5``'s. ``AutoModelForCausalLM`` loads it
  as ``Qwen3_5ForCausalLM`` (text only, the tower dropped); mlx-lm loads it as ``qwen3_5``.
- ``gpt_oss``: 4 layers alternating sliding / full, attention sinks, biases, MoE (4 experts,
  top 2), YaRN (factor 32, ``truncate`` false) as the hub config.
- ``lfm2``: 6 layers conv, conv, full_attention, conv, full_attention, conv (short conv, L 3).
- ``nemotron_h``: ``hybrid_override_pattern`` ``M*M-`` (Mamba2 with 8 heads of 16, state 16,
  2 groups, conv 4; attention; Mamba2; a cacheless relu2 MLP layer).

Tokenizers as the families': Gemma 4's ``<|turn>role ... <turn|>`` (BOS added; ``model`` for the
assistant; ``enable_thinking`` puts ``<|think|>`` in the system turn); Qwen3.5's ChatML whose
generation prompt is ``<think>\n`` or, with ``enable_thinking=False``, ``<think>\n\n</think>\n\n``
(``<think>``/``</think>`` are added, non-special tokens); gpt-oss's harmony format (fixed
system message without the date, ``<|start|>assistant`` as the generation prompt); LFM2's ChatML
after ``<|startoftext|>`` (BOS added); Nemotron-H plain ChatML (no BOS). ``MODEL_KINDS[arch]``
names the cache features each exercises.

``mlx_model`` for TODAY (``MLX_SUPPORT``; any other pair raises ``ValueError``):

- ``gemma4``, ``gemma4_hub``, ``gpt_oss``: ``float32``, ``q4``, ``q8``. Refused: ``bfloat16``,
  since mlx CPU's GatherMM (unquantized MoE experts) is float32-only.
- ``qwen3_5_hub``, ``lfm2``, ``nemotron_h``: all of ``MLX_VARIANTS``.
- ``qwen3_5``: refused, mlx-lm has no ``qwen3_5_text`` (use ``qwen3_5_hub``).

mlx-lm 0.32 reads ``gpt_oss`` experts only as the hub's MXFP4 blocks, so the conversion hands it
them split into its own layout. Known engine differences: mlx-lm's YaRN ignores ``truncate:
false``, so ``gpt_oss`` logits differ from transformers' (all others agree to about 1e-4, Nemotron-H
to 3e-2); transformers' sliding layers keep ``window - 1`` tokens, mlx-lm's ``RotatingKVCache``
keeps ``window``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import random
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RECIPE = 1
ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "phi3")
TODAY_RECIPE = 1  # bump to rebuild the TODAY archs only
TODAY = ("gemma4", "gemma4_hub", "qwen3_5", "qwen3_5_hub", "gpt_oss", "lfm2", "nemotron_h")
HUB_TEXT = {"gemma4_hub": "gemma4", "qwen3_5_hub": "qwen3_5"}  # hub layout -> its text twin
MLX_VARIANTS = ("float32", "bfloat16", "q4", "q8")
HF_DTYPES = ("float32", "bfloat16", "float16")
VOCAB = 512
SLIDING_WINDOW = 96
WEIGHT_STD = 0.2
GEMMA_EMBED_DIV = 4.0
GEMMA_NORM = 1.0
BOS_FAMILIES = ("llama", "mistral", "gemma2", "gemma3", "phi3", "gemma4", "gemma4_hub", "lfm2")
NFC_FAMILIES = ("qwen2", "qwen3_5", "qwen3_5_hub")  # tokenizers with an NFC normalizer

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

# Gemma 4: <|turn>role ... <turn|>, "model" for the assistant, thinking switched on by <|think|> at
# the head of the system turn (the real template also renders tools and strips thoughts).
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{%- set think = enable_thinking is defined and enable_thinking %}"
    "{%- if messages[0]['role'] in ('system', 'developer') %}"
    "{{ '<|turn>system\\n' + ('<|think|>' if think else '') + messages[0]['content'] | trim"
    " + '<turn|>\\n' }}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- if think %}{{ '<|turn>system\\n<|think|><turn|>\\n' }}{%- endif %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|turn>model\\n' }}{%- endif %}"
)
# Qwen3.5: ChatML; thinking is on unless enable_thinking=False, which pre-fills an empty
# <think></think>; earlier assistant turns are rendered without their reasoning.
QWEN3_5_TEMPLATE = (
    "{%- for message in messages %}{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
# gpt-oss harmony: a fixed system message (the real one also prints today's date, left out here
# so that renders are deterministic), system/developer content as a developer message, earlier
# assistant turns on the final channel, and "<|start|>assistant" as the generation prompt.
GPT_OSS_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: ' + (reasoning_effort | default('medium')) + '\\n\\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "<|end|>' }}{%- for message in messages %}"
    "{%- if message['role'] in ('system', 'developer') %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message['content'] + '<|end|>' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
LFM2_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
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
_GEMMA4_TOK = {
    "head": ["<pad>", "<eos>", "<bos>", "<unk>"],
    "tail": [
        "<|turn>",
        "<turn|>",
        "<|think|>",
        "<|channel>",
        "<channel|>",
        "<|tool_response>",
        "<|image>",
        "<image|>",
        "<|image|>",
        "<|audio>",
        "<audio|>",
        "<|audio|>",
        "<|video|>",
    ],
    "bos": "<bos>",
    "eos": "<eos>",
    "pad": "<pad>",
    "unk": "<unk>",
    "stop": ["<eos>", "<turn|>", "<|tool_response>"],
    "template": GEMMA4_TEMPLATE,
}
_QWEN3_5_TOK = {
    "head": [],
    "tail": [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
    "plain": ["<think>", "</think>"],  # added tokens, not special (decoded with the text)
    "bos": None,
    "eos": "<|im_end|>",
    "pad": "<|endoftext|>",
    "unk": None,
    "stop": ["<|im_end|>", "<|endoftext|>"],
    "template": QWEN3_5_TEMPLATE,
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
    "gemma4": _GEMMA4_TOK,
    "gemma4_hub": _GEMMA4_TOK,
    "qwen3_5": _QWEN3_5_TOK,
    "qwen3_5_hub": _QWEN3_5_TOK,
    "gpt_oss": {
        "head": [],
        "tail": [
            "<|startoftext|>",
            "<|endoftext|>",
            "<|return|>",
            "<|constrain|>",
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|call|>",
        ],
        "bos": "<|startoftext|>",
        "eos": "<|return|>",
        "pad": "<|endoftext|>",
        "unk": None,
        "stop": ["<|return|>", "<|endoftext|>", "<|call|>"],
        "template": GPT_OSS_TEMPLATE,
    },
    "lfm2": {
        "head": ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "tail": [],
        "bos": "<|startoftext|>",
        "eos": "<|im_end|>",
        "pad": "<|pad|>",
        "unk": None,
        "stop": ["<|im_end|>"],
        "template": LFM2_TEMPLATE,
    },
    "nemotron_h": {
        "head": ["<unk>", "<s>", "</s>"],
        "tail": ["<|im_start|>", "<|im_end|>"],
        "plain": ["<think>", "</think>"],
        "bos": "<s>",
        "eos": "<|im_end|>",
        "pad": None,
        "unk": "<unk>",
        "stop": ["<|im_end|>", "</s>"],
        "template": CHATML_TEMPLATE,
    },
}

SPLIT_REGEX = {
    "llama": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen3_5": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt_oss": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPLIT_REGEX["qwen3_5_hub"] = SPLIT_REGEX["qwen3_5"]
TOKENIZER_CLASS = {
    "llama": "PreTrainedTokenizerFast",
    "qwen2": "Qwen2Tokenizer",
    "qwen3_5": "Qwen3_5Tokenizer",
    "qwen3_5_hub": "Qwen2Tokenizer",  # as on the hub; transformers 5 loads it as Qwen3_5Tokenizer
}

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

# --- today's architectures (hub-style too: what both transformers 5.24 and mlx-lm 0.32 read) ----

_S, _F = "sliding_attention", "full_attention"
_GEMMA4_TEXT = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_k_eq_v": True,  # full layers: no v_proj, values = v_norm(k_proj(x))
    "enable_moe_block": True,
    "final_logit_softcapping": 30.0,
    "global_head_dim": 64,  # full layers: head dim 64, 1 KV head; sliding: 32, 2 KV heads
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "hidden_size_per_layer_input": 16,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": [_S, _S, _F, _S, _S, _F],
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_experts": 4,
    "num_global_key_value_heads": 1,
    "num_hidden_layers": 6,
    "num_key_value_heads": 2,
    "num_kv_shared_layers": 2,  # layers 4 (sliding) and 5 (full) reuse layers 3 and 2
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": SLIDING_WINDOW,
    "tie_word_embeddings": True,
    "top_k_experts": 2,
    "use_bidirectional_attention": None,
    "use_cache": True,
    "use_double_wide_mlp": True,  # kv-shared layers have a 2x wide MLP
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
}
_QWEN3_5_TEXT = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "full_attention_interval": 4,  # what mlx-lm reads (transformers reads layer_types)
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 16,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [2, 1, 1],
        "partial_rotary_factor": 0.25,  # 8 of the 32 dims rotate
        "rope_theta": 10000000.0,
        "rope_type": "default",
    },
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": VOCAB,
}
TODAY_CONFIGS: dict[str, dict] = {
    "gemma4": _GEMMA4_TEXT,
    "gemma4_hub": {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "audio_config": {
            "model_type": "gemma4_audio",
            "attention_chunk_size": 4,
            "attention_context_left": 5,
            "attention_context_right": 0,
            "conv_kernel_size": 3,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "output_proj_dims": 32,
            "subsampling_conv_channels": [8, 4],
            "use_clipped_linears": False,
        },
        "initializer_range": 0.02,
        "text_config": {k: v for k, v in _GEMMA4_TEXT.items() if k != "architectures"},
        "tie_word_embeddings": True,
        "vision_config": {
            "model_type": "gemma4_vision",
            "head_dim": 16,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "num_key_value_heads": 2,
            "patch_size": 4,
            "pooling_kernel_size": 2,
            "position_embedding_size": 64,
        },
        "vocab_size": VOCAB,  # mlx-lm's gemma4 overrides text_config's vocab_size with this
    },
    "qwen3_5": _QWEN3_5_TEXT,
    "qwen3_5_hub": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {k: v for k, v in _QWEN3_5_TEXT.items() if k != "architectures"},
        "tie_word_embeddings": False,
        "vision_config": {
            "model_type": "qwen3_5",  # sic: the hub's, transformers corrects it
            "deepstack_visual_indexes": [],
            "depth": 1,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 32,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 16,
            "out_hidden_size": 64,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "experts_per_token": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_types": [_S, _F, _S, _F],
        "max_position_embeddings": 131072,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": SLIDING_WINDOW,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "lfm2": {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "block_auto_adjust_ff_dim": True,  # MLP width: 64 * ceil(2/3 * 192 / 64) = 128
        "block_dim": 64,
        "block_ff_dim": 192,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 64,
        "block_norm_eps": 1e-5,
        "conv_L_cache": 3,
        "conv_bias": False,
        "conv_dim": 64,
        "conv_dim_out": 64,
        "full_attn_idxs": [2, 4],
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 192,
        "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
        "max_position_embeddings": 128000,
        "norm_eps": 1e-5,
        "num_attention_heads": 4,
        "num_heads": 4,
        "num_hidden_layers": 6,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "tie_embedding": True,
        "use_cache": True,
        "use_pos_enc": True,
        "vocab_size": VOCAB,
    },
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "chunk_size": 128,
        "conv_kernel": 4,
        "expand": 2,
        "head_dim": 16,
        "hidden_dropout": 0.0,
        "hidden_size": 64,
        "hybrid_override_pattern": "M*M-",  # mamba2, attention, mamba2, MLP
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_norm_epsilon": 1e-5,
        "mamba_head_dim": 16,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": 8,
        "mamba_proj_bias": False,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "n_groups": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_logits_to_keep": 1,
        "rescale_prenorm_residual": True,
        "residual_in_fp32": False,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "ssm_state_size": 16,
        "tie_word_embeddings": False,
        "time_step_floor": 1e-4,
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mamba_kernels": True,
        "vocab_size": VOCAB,
    },
}
# the hub configs' multimodal token ids, by the tokenizer's token
_HUB_TOKEN_IDS = {
    "gemma4_hub": {
        "audio_token_id": "<|audio|>",
        "boa_token_id": "<|audio>",
        "boi_token_id": "<|image>",
        "eoa_token_index": "<audio|>",
        "eoi_token_id": "<image|>",
        "image_token_id": "<|image|>",
        "video_token_id": "<|video|>",
    },
    "qwen3_5_hub": {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_end_token_id": "<|vision_end|>",
        "vision_start_token_id": "<|vision_start|>",
    },
}

# What each TODAY arch exercises in a prefix cache.
MODEL_KINDS: dict[str, tuple[str, ...]] = {
    "gemma4": (
        "sliding",  # 4 of 6 layers, window SLIDING_WINDOW
        "per-layer head dims",  # sliding 32, full 64
        "per-layer kv heads",  # sliding 2, full 1
        "k=v",  # full layers: values from the key projection (cached apart all the same)
        "kv-shared",  # the last 2 layers reuse earlier layers' K/V and have no cache of their own
        "moe",
        "per-layer inputs",
    ),
    "qwen3_5": ("gated-deltanet", "conv-state", "recurrent-state", "partial-rope", "gated-attn"),
    "gpt_oss": ("sliding", "attention-sinks", "moe", "yarn-rope"),
    "lfm2": ("short-conv", "conv-state"),
    "nemotron_h": ("mamba2", "conv-state", "recurrent-state", "cacheless-layers"),
}
MODEL_KINDS["gemma4_hub"] = MODEL_KINDS["gemma4"] + ("multimodal-layout",)
MODEL_KINDS["qwen3_5_hub"] = MODEL_KINDS["qwen3_5"] + ("multimodal-layout",)

# The (arch, variant) pairs mlx_model builds for TODAY, and why the others are refused.
MLX_SUPPORT: dict[str, tuple[str, ...]] = {
    "gemma4": ("float32", "q4", "q8"),
    "gemma4_hub": ("float32", "q4", "q8"),
    "qwen3_5_hub": MLX_VARIANTS,
    "gpt_oss": ("float32", "q4", "q8"),
    "lfm2": MLX_VARIANTS,
    "nemotron_h": MLX_VARIANTS,
}
_NO_BF16_MOE = "mlx CPU's GatherMM (unquantized MoE experts) is float32-only; use float32 or q4/q8"
MLX_REFUSED: dict[tuple[str, str], str] = {
    ("gemma4", "bfloat16"): _NO_BF16_MOE,
    ("gemma4_hub", "bfloat16"): _NO_BF16_MOE,
    ("gpt_oss", "bfloat16"): _NO_BF16_MOE,
    ("qwen3_5", "*"): "mlx-lm has no qwen3_5_text model; use qwen3_5_hub (model_type qwen3_5)",
}

# --- public API ---------------------------------------------------------------------------------


def zoo_home() -> Path:
    home = Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh"))
    return home / "zoo"


def hf_model(arch: str, dtype: str = "float32") -> Path:
    """The HF directory of ``arch`` with weights stored in ``dtype``."""
    _check(arch, ARCHS + TODAY)
    _check(dtype, HF_DTYPES)
    dst = zoo_home() / f"{arch}-{dtype}-r{_recipe(arch)}"
    if dtype == "float32":
        return _atomic(dst, lambda tmp: _build_hf(arch, tmp))
    base = hf_model(arch)
    return _atomic(dst, lambda tmp: _cast_hf(base, tmp, dtype))


def mlx_model(arch: str, variant: str) -> Path:
    """``mlx_lm.convert`` of ``hf_model(arch)`` as ``variant`` (see ``convert_mlx``)."""
    _check(arch, ARCHS + TODAY)
    _check(variant, MLX_VARIANTS)
    if arch in TODAY and variant not in MLX_SUPPORT.get(arch, ()):
        why = MLX_REFUSED.get((arch, variant)) or MLX_REFUSED.get((arch, "*"))
        raise ValueError(f"mlx_model({arch!r}, {variant!r}) is not supported: {why}")
    dst = zoo_home() / f"{arch}-mlx-{variant}-r{_recipe(arch)}"
    return convert_mlx(hf_model(arch), dst, variant)


def convert_mlx(src: Path, dst: Path, variant: str) -> Path:
    """Convert the HF directory ``src`` into an mlx-lm directory ``dst`` (idempotent, atomic)."""
    _check(variant, MLX_VARIANTS)
    return _atomic(Path(dst), lambda tmp: _convert(Path(src), tmp, variant))


def reshaped(arch: str, **config: Any) -> Path:
    """The TODAY arch ``arch`` built with ``config`` changed in its ``config.json`` (for
    example ``head_dim=32``: vLLM's CPU attention runs head dims of 32 and more), with
    seeded weights of the new shapes and the same tokenizer."""
    _check(arch, TODAY)
    if arch in HUB_TEXT or not config:
        raise ValueError(f"reshaped({arch!r}) takes a text arch and at least one change")
    tag = "-".join(f"{k}{v}" for k, v in sorted(config.items()))
    if len(tag) > 64 or not re.fullmatch(r"[\w.-]+", tag):  # a file name: short and plain
        tag = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    dst = zoo_home() / f"{arch}-{tag}-float32-r{_recipe(arch)}"
    return _atomic(dst, lambda tmp: _build_today(arch, tmp, config))


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
        text = cfg.get("text_config", cfg)  # hub layouts keep the geometry in text_config
        text["sliding_window"] = window
        if layer_types is not None:
            text["layer_types"] = list(layer_types)
        cfg["_name_or_path"] = dst.name
        _write_json(tmp / "config.json", cfg)

    return _atomic(dst, build)


LATENT_CONFIG = {  # DeepSeek-V3's multi-head latent attention: K and V of other shapes
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def latent_model(**config: Any) -> Path:
    """A tiny DeepSeek-V3 (multi-head latent attention, MoE) with the qwen2 family's
    tokenizer: a cache kvmesh's head cannot ship (its keys and values differ in
    shape). ``config`` changes its ``config.json`` (e.g. vLLM's CPU MLA kernel wants a
    latent of 512 + 64)."""
    tag = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    dst = zoo_home() / f"deepseek_v3{'-' + tag if config else ''}-float32-r{TODAY_RECIPE}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        src = hf_model("qwen2")
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        tokens = json.loads((src / "config.json").read_text())
        hub = {**LATENT_CONFIG, **config, "dtype": "float32", "torch_dtype": "float32"}
        hub.update({k: tokens[k] for k in ("bos_token_id", "eos_token_id") if k in tokens})
        _write_json(tmp / "config.json", hub)
        torch.manual_seed(3000)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp))
        rng = np.random.default_rng(3000)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                noise = rng.standard_normal(tuple(p.shape), dtype=np.float32)
                norm = p.ndim == 1 and "norm" in name
                p.copy_(torch.from_numpy(noise * 0.1 + 1.0 if norm else noise * WEIGHT_STD))
        model.save_pretrained(tmp)
        _write_json(tmp / "config.json", hub)

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


def _recipe(arch: str) -> int:
    return TODAY_RECIPE if arch in TODAY else RECIPE


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
    plain = fam.get("plain", [])  # added tokens that are not special (Qwen's <think>)
    n_merges = VOCAB - 256 - len(specials) - len(plain)
    merges = _learn_merges(_pre_tokenizer(arch), _corpus(), n_merges)
    tokens = fam["head"] + _byte_alphabet() + [a + b for a, b in merges] + fam["tail"] + plain
    assert len(tokens) == len(set(tokens)) == VOCAB
    model = models.BPE({t: i for i, t in enumerate(tokens)}, merges)
    tok = Tokenizer(model)
    if arch in NFC_FAMILIES:
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
    if plain:
        tok.add_tokens(plain)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=fam["eos"],
        pad_token=fam["pad"],
        unk_token=fam["unk"],
        chat_template=fam["template"],
        clean_up_tokenization_spaces=False,
        model_max_length=_max_positions(arch),
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
    return {t: tokens.index(t) for t in specials + plain}


def _max_positions(arch: str) -> int:
    if arch in TODAY:
        cfg = TODAY_CONFIGS[HUB_TEXT.get(arch, arch)]
        return cfg["max_position_embeddings"]
    return CONFIGS[arch]["max_position_embeddings"]


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
    if arch in TODAY:
        return 2000 + TODAY.index(arch)
    return 1000 + ARCHS.index(arch)


def _fill_weights(arch: str, model) -> None:
    """Deterministic weights from a NumPy PCG64 stream, independent of transformers' init."""
    import torch

    if arch in TODAY:
        return _fill_today(arch, model)

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

    if arch in TODAY:
        return _build_today(arch, out)
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


# --- today's architectures: configs, weights --------------------------------------------------


def _today_config(arch: str, ids: dict[str, int], changes: dict[str, Any] | None = None) -> dict:
    """The hub-style ``config.json`` of a TODAY arch (token ids from its tokenizer)."""
    hub = json.loads(json.dumps(TODAY_CONFIGS[arch]))  # a deep copy
    hub.update(changes or {})
    if arch in HUB_TEXT:
        hub["text_config"].update(_token_ids(arch, ids), dtype="float32")
        hub.update({k: ids[t] for k, t in _HUB_TOKEN_IDS[arch].items()})
    else:
        hub.update(_token_ids(arch, ids))
    hub["torch_dtype"] = hub["dtype"] = "float32"
    return hub


def _build_today(arch: str, out: Path, changes: dict[str, Any] | None = None) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = _build_tokenizer(arch, out)
    hub = _today_config(arch, ids, changes)
    _write_json(out / "config.json", hub)
    cfg = AutoConfig.from_pretrained(out)
    torch.manual_seed(_seed(arch))
    model = getattr(transformers, hub["architectures"][0])._from_config(cfg, dtype=torch.float32)
    _fill_today(arch, model)
    if arch in HUB_TEXT:  # the language model is the text twin's, weight for weight
        twin = AutoModelForCausalLM.from_pretrained(hf_model(HUB_TEXT[arch]), dtype=torch.float32)
        _copy_text_weights(model, dict(twin.named_parameters()))
    model.save_pretrained(out)
    _write_json(out / "config.json", hub)  # hub-style again: save_pretrained rewrote it
    gen = {**_GEN, **_token_ids(arch, ids)}
    gen["eos_token_id"] = [ids[t] for t in TOKENIZERS[arch]["stop"]]
    _write_json(out / "generation_config.json", gen)


def _copy_text_weights(model, text: dict) -> None:
    """Copy the text twin's weights (``model.X``, ``lm_head``) into the hub layout's
    language model (``model.language_model.X``, ``lm_head``)."""
    import torch

    copied = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = name.replace("model.language_model.", "model.", 1)
            if name.startswith("model.language_model.") or name == "lm_head.weight":
                p.copy_(text[src])
                copied.add(src)
    missing = {k for k in text if k not in copied and k != "lm_head.weight"}
    assert not missing, f"text weights not in the hub layout: {sorted(missing)}"


def _fill_today(arch: str, model) -> None:
    """Like ``_fill_weights``, with sane values for the parameters that are not plain weights:
    norms centred on their identity, SSM decays and time steps in their usual ranges, router
    scales near 1, small biases and attention sinks."""
    import torch

    rng = np.random.default_rng(_seed(arch))
    owners = {name: type(module).__name__ for name, module in model.named_modules()}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = rng.standard_normal(tuple(p.shape), dtype=np.float32)
            owner, _, leaf = name.rpartition(".")
            cls = owners.get(owner, "")
            if leaf == "A_log":  # decay rates A in about [1.5, 11]
                values = np.log(4.0) + 0.5 * noise
            elif leaf == "dt_bias":  # softplus^-1 of time steps in about [0.002, 0.05]
                dt = np.exp(np.log(0.01) + 0.8 * np.clip(noise, -2, 2))
                values = dt + np.log(-np.expm1(-dt))
            elif leaf == "D":
                values = 1.0 + 0.1 * noise
            elif leaf == "sinks":
                values = 0.5 * noise
            elif cls.endswith("Router") and leaf in ("scale", "per_expert_scale"):
                values = 1.0 + 0.1 * noise
            elif leaf == "bias" or leaf.endswith("_bias"):
                values = 0.02 * noise
            elif p.ndim == 1 and ("Norm" in cls or "norm" in name):
                centre = 0.0 if cls == "Qwen3_5RMSNorm" else 1.0  # Qwen3.5 scales by (1 + w)
                values = centre + 0.1 * noise
            elif p.ndim == 1:
                values = 0.02 * noise
            elif "embed_tokens" in name and arch.startswith("gemma"):
                values = noise * (WEIGHT_STD / GEMMA_EMBED_DIV)  # scaled up by sqrt(dim)
            else:
                values = noise * WEIGHT_STD
            p.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))


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
    if "dtype" in cfg.get("text_config", {}):
        cfg["text_config"]["dtype"] = dtype
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
    if json.loads((src / "config.json").read_text()).get("model_type") == "gpt_oss":
        src = _split_gpt_oss_experts(src, tmp / "split")
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), str(out), **_MLX_ARGS[variant])
    if src.parent == tmp:
        shutil.rmtree(src)
    for f in out.iterdir():
        os.replace(f, tmp / f.name)
    out.rmdir()
    cfg = json.loads((tmp / "config.json").read_text())  # mlx_lm keeps the source's dtype
    cfg["torch_dtype"] = cfg["dtype"] = _MLX_ARGS[variant]["dtype"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=4, sort_keys=True))


def _split_gpt_oss_experts(src: Path, dst: Path) -> Path:
    """mlx-lm 0.32's gpt_oss ``sanitize`` reads only the hub's MXFP4 experts
    (``gate_up_proj_blocks``/``_scales``) or already split ones, not transformers' dense
    ``gate_up_proj`` [E, hidden, 2I] (gate and up interleaved) and ``down_proj`` [E, I, hidden].
    Hand it the split, [E, out, in] layout it would have made from the blocks."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    for f in src.glob("*.safetensors"):
        out = {}
        for k, v in load_file(f).items():
            base = k.rpartition(".")[0]
            if k.endswith(".experts.gate_up_proj"):
                out[f"{base}.gate_proj.weight"] = v[..., ::2].transpose(1, 2).contiguous()
                out[f"{base}.up_proj.weight"] = v[..., 1::2].transpose(1, 2).contiguous()
            elif k.endswith(".experts.gate_up_proj_bias"):
                out[f"{base}.gate_proj.bias"] = v[..., ::2].contiguous()
                out[f"{base}.up_proj.bias"] = v[..., 1::2].contiguous()
            elif k.endswith(".experts.down_proj"):
                out[f"{base}.down_proj.weight"] = v.transpose(1, 2).contiguous()
            elif k.endswith(".experts.down_proj_bias"):
                out[f"{base}.down_proj.bias"] = v
            else:
                out[k] = v
        save_file({k: torch.as_tensor(v) for k, v in out.items()}, dst / f.name, {"format": "pt"})
    return dst


# --- tool calling (appended: a variant of an existing arch, nothing above changes) --------------

# Qwen2.5-Instruct's own template (tokenizer_config.json on the hub): tools in a system turn
# inside <tools></tools>, assistant tool calls as <tool_call>{"name", "arguments"}</tool_call>,
# consecutive tool results as <tool_response> blocks in one user turn.
QWEN2_5_TOOLS_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    '\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n'
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    '<|im_end|>\\n" }}\n'
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n"
    "{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


def tools_model(arch: str = "qwen2") -> Path:
    """``hf_model(arch)`` (same weights and tokenizer) with a chat template that renders
    tools and tool calls: Qwen2.5-Instruct's (hermes ``<tool_call>``) for qwen2."""
    templates = {"qwen2": QWEN2_5_TOOLS_TEMPLATE}
    _check(arch, tuple(templates))
    src = hf_model(arch)
    dst = zoo_home() / f"{arch}-tools-float32-r{_recipe(arch)}"

    def build(tmp: Path) -> None:
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        (tmp / "chat_template.jinja").write_text(templates[arch])
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["_name_or_path"] = dst.name
        _write_json(tmp / "config.json", cfg)

    return _atomic(dst, build)


# --- LoRA adapters -------------------------------------------------------------------------------


def lora_adapter(base: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``) on
    the attention projections q/k/v/o of ``base`` (a model of the Llama/Qwen layout:
    ``model.layers.N.self_attn``), seeded random A and B (PEFT starts B at zero, a
    no-op: these change every layer's K and V, so an adapter's KV is its own)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
    }
    digest = hashlib.sha256(f"{base.resolve()}|{seed}|{rank}".encode()).hexdigest()[:12]
    dst = zoo_home() / "lora" / f"{base.name}-s{seed}-r{rank}-{digest}"

    def build(tmp: Path) -> None:
        g = torch.Generator().manual_seed(seed)
        weights = {}
        for layer in range(cfg["num_hidden_layers"]):
            for name, (fan_in, fan_out) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
                weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
                weights[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
        save_file(weights, str(tmp / "adapter_model.safetensors"))
        _write_json(
            tmp / "adapter_config.json",
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base),
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": sorted(shapes),
                "bias": "none",
                "fan_in_fan_out": False,
            },
        )

    return _atomic(dst, build)


# --- vision-language models the head serves with images ------------------------------------------


def gemma4_vision_model(bidirectional: bool = False) -> Path:
    """``gemma4_hub`` (its tiny vision tower: patches of 4, pooled 2x2) with Gemma 4's
    PIL image processor at most 70 soft tokens a picture (its least), so the head serves it with
    images (``<|image>``, its soft tokens ``<|image|>``, ``<image|>``). ``bidirectional``:
    its sliding layers attend both ways within a picture, as Gemma 4's larger models do
    (``use_bidirectional_attention: "vision"``)."""
    src = hf_model("gemma4_hub")
    name = "gemma4_vl_bidir" if bidirectional else "gemma4_vl"
    dst = zoo_home() / f"{name}-float32-r{_recipe('gemma4_hub')}"

    def build(tmp: Path) -> None:
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            Gemma4ImageProcessorPil,
        )

        shutil.copytree(src, tmp, dirs_exist_ok=True)
        processor = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
        processor.save_pretrained(tmp)
        if bidirectional:
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["text_config"]["use_bidirectional_attention"] = "vision"
            _write_json(tmp / "config.json", cfg)

    return _atomic(dst, build)


GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def gemma3_vision_model() -> Path:
    """A tiny ``Gemma3ForConditionalGeneration``: ``hf_model("gemma3")``'s text config
    and tokenizer (plus Gemma 3's three image tokens), a 1-layer SigLIP tower of width
    32 on 32x32 pictures in patches of 8 (16 soft tokens a picture), seeded weights, and
    Gemma 3's PIL image processor. Its attention within a picture goes both ways."""
    src = hf_model("gemma3")
    dst = zoo_home() / f"gemma3_vl-float32-r{_recipe('gemma3')}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        tok = AutoTokenizer.from_pretrained(str(src))
        tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_IMAGE_TOKENS)})
        boi, eoi, image = tok.convert_tokens_to_ids(list(GEMMA3_IMAGE_TOKENS))
        text = json.loads((src / "config.json").read_text())
        text |= {"vocab_size": len(tok), "architectures": None}
        vision = {"model_type": "siglip_vision_model", "hidden_size": 32}
        vision |= {"intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
        vision |= {"image_size": 32, "patch_size": 8}
        config = Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=16,
            boi_token_index=boi,
            eoi_token_index=eoi,
            image_token_index=image,
        )
        torch.manual_seed(3)
        model = Gemma3ForConditionalGeneration(config).eval()
        with torch.no_grad():  # transformers starts the projection at zero: pictures unseen
            proj = model.model.multi_modal_projector.mm_input_projection_weight
            proj.normal_(0.0, 0.2)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(tmp)
        for f in ("chat_template.jinja",):  # the text model's template
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)

    return _atomic(dst, build)


QWEN_VL_IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's PIL image processor as the zoo's Qwen VLMs take it: patches of 4 merged 2x2,
# 16x16 to 64x64 pixels (4 to 64 positions a picture, its grid following its shape)
_QWEN_PIXELS = {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}
_QWEN_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
_QWEN_VISION |= {"patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}


def _qwen_processor(tmp: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, size=_QWEN_PIXELS).save_pretrained(tmp)


def _qwen_vl(name: str, seed: int, make: Callable[[Any, dict[str, int]], Any]) -> Path:
    """A tiny Qwen VLM ``name`` on ``hf_model("qwen2")``'s tokenizer plus Qwen's vision
    tokens: ``make(tokenizer, ids)`` (``ids``: the four tokens' ids by config field)
    gives the model, built with ``seed``; Qwen2-VL's image processor beside it."""
    src = hf_model("qwen2")
    dst = zoo_home() / f"{name}-float32-r{_recipe('qwen2')}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(src))
        tok.add_special_tokens({"additional_special_tokens": list(QWEN_VL_IMAGE_TOKENS)})
        fields = ("vision_start_token_id", "vision_end_token_id", "image_token_id")
        fields += ("video_token_id",)
        ids = dict(zip(fields, tok.convert_tokens_to_ids(list(QWEN_VL_IMAGE_TOKENS)), strict=True))
        torch.manual_seed(seed)
        make(tok, ids).eval().save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _qwen_processor(tmp)
        if (src / "chat_template.jinja").is_file():  # the text model's template
            shutil.copy2(src / "chat_template.jinja", tmp / "chat_template.jinja")

    return _atomic(dst, build)


def qwen2_5_vl_model() -> Path:
    """A tiny ``Qwen2_5_VLForConditionalGeneration``: ``hf_model("qwen2")``'s text
    model rotating by M-RoPE (sections 4/6/6 of its 16 frequencies), a 2-layer vision
    tower of width 32 (patches of 4, merged 2x2, one windowed layer and one full),
    seeded weights (:func:`_qwen_vl`)."""

    def make(tok: Any, ids: dict[str, int]) -> Any:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text = json.loads((hf_model("qwen2") / "config.json").read_text())
        text |= {"vocab_size": len(tok), "architectures": None, "model_type": "qwen2_5_vl_text"}
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 6, 6]}
        vision = _QWEN_VISION | {"window_size": 16, "fullatt_block_indexes": [1]}
        vision["out_hidden_size"] = text["hidden_size"]
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        return Qwen2_5_VLForConditionalGeneration(config)

    return _qwen_vl("qwen2_5_vl", 5, make)


def qwen3_vl_model() -> Path:
    """A tiny ``Qwen3VLForConditionalGeneration``: a 4-layer Qwen3 text model of width
    64 rotating by interleaved M-RoPE (sections 6/5/5 of its 16 frequencies), a
    2-layer vision tower of width 32 (patches of 4 merged 2x2, learned positions
    interpolated) whose first layer also feeds the text model's first layer at the
    picture's positions (deepstack), seeded weights (:func:`_qwen_vl`)."""

    def make(tok: Any, ids: dict[str, int]) -> Any:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        text = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128}
        text |= {"num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1}
        text |= {"head_dim": 32, "tie_word_embeddings": True}
        rope = {"rope_type": "default", "rope_theta": 1000000.0}
        text["rope_parameters"] = rope | {"mrope_section": [6, 5, 5], "mrope_interleaved": True}
        vision = _QWEN_VISION | {"num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
        vision["out_hidden_size"] = text["hidden_size"]
        config = Qwen3VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=True, **ids
        )
        return Qwen3VLForConditionalGeneration(config)

    return _qwen_vl("qwen3_vl", 6, make)


def qwen3_5_vision_model() -> Path:
    """``qwen3_5_hub`` (Qwen3.5: gated DeltaNet layers between attention layers, M-RoPE,
    its tiny vision tower: patches of 4 merged 2x2) with Qwen2-VL's PIL image
    processor taking 16x16 to 64x64 pixels, so the head serves it with images."""
    src = hf_model("qwen3_5_hub")
    dst = zoo_home() / f"qwen3_5_vl-float32-r{_recipe('qwen3_5_hub')}"

    def build(tmp: Path) -> None:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        _qwen_processor(tmp)

    return _atomic(dst, build)


# --- a vision-language model vLLM's CPU build runs ------------------------------------------------


def blip2_model() -> Path:
    """A tiny ``Blip2ForConditionalGeneration`` (a 1-layer 32-wide vision tower on 32x32
    images in patches of 8, a 1-layer Q-Former, 32 query tokens, a 4-layer OPT of hidden
    64 with 2 heads of 32), seeded, with ``hf_model("qwen2")``'s tokenizer plus
    ``<image>`` and a PIL image processor. Of vLLM 0.32's vision models it is one that
    runs without torchvision (which has no CPU build here); vLLM puts its 32 image
    tokens at the start of the prompt."""
    dst = zoo_home() / f"blip2-float32-r{_recipe('qwen2')}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import (
            AutoTokenizer,
            Blip2Config,
            Blip2ForConditionalGeneration,
            Blip2Processor,
        )
        from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

        tok = AutoTokenizer.from_pretrained(hf_model("qwen2"))
        image = BlipImageProcessorPil(size={"height": 32, "width": 32})
        processor = Blip2Processor(image_processor=image, tokenizer=tok, num_query_tokens=32)
        vocab = len(tok)  # with <image>
        text = {
            "model_type": "opt",
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "vocab_size": vocab,
            "word_embed_proj_dim": 64,
            "max_position_embeddings": 2048,
            "bos_token_id": tok.bos_token_id or 0,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id or 0,
        }
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
        vision |= {"num_attention_heads": 2, "image_size": 32, "patch_size": 8}
        qformer = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
        qformer |= {"intermediate_size": 64, "encoder_hidden_size": 32, "vocab_size": vocab}
        config = Blip2Config(
            vision_config=vision,
            qformer_config=qformer,
            text_config=text,
            num_query_tokens=32,
            image_token_index=tok.convert_tokens_to_ids("<image>"),
        )
        torch.manual_seed(0)
        Blip2ForConditionalGeneration(config).eval().save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return _atomic(dst, build)
