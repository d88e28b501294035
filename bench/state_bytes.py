"""What recurrent-state checkpoints cost on the wire, for real hybrid models.

    python bench/state_bytes.py --json bench/results/state_bytes.json
    python bench/state_bytes.py --smoke --json /tmp/state_bytes.json   # CI: a few seconds

A block carries attention KV for its positions; every ``state_every``-th block
(and every tail) also carries each recurrent layer's state after its last token,
and a hit is rounded down to the last checkpoint. For published configs (numbers
below, each with where it was read) this builds the per-layer geometry the way
transformers 5's cache holds it, lets kvmesh's own rule pick ``state_every``
(:meth:`CacheGeometry.state_every`) and kvmesh's own card and codec count the
bytes (:attr:`CompatCard.kv_bytes_per_token`, :meth:`Layout.header`): KV per token
and per block, state per checkpoint, bytes shipped per token on average, and the
tokens a hit may recompute (up to ``state_every * block - 1``), beside
full-attention models of similar size.

State tensors as transformers 5.24 keeps them (batch 1), for a bfloat16 model:

- Gated DeltaNet (``qwen3_next``, ``qwen3_5``): conv state ``[1, conv_dim, kernel]``
  in the model dtype, ``conv_dim = 2 * key_heads * key_dim + value_heads * value_dim``;
  recurrent state ``[1, value_heads, key_dim, value_dim]`` in **float32** (the
  chunked and recurrent delta rules compute in float32 and the cache keeps it).
- Mamba2 (``nemotron_h``): conv state ``[1, heads * head_dim + 2 * groups * state, kernel]``
  in the model dtype; SSM state ``[1, heads, head_dim, state]`` in **float32**.
- LFM2 short conv: conv state ``[1, hidden, conv_L_cache]`` in the model dtype only.

The formula is checked against real caches: the tiny zoo models' configs go through
the same code and must give exactly the card a :class:`TransformersEngine` probes
(layer geometry, state bytes, ``state_every``), in float32 and in bfloat16; Nemotron-H,
which the torch engine serves with reuse off today, against the cache transformers
fills for it. Logits (4 bytes x vocabulary, in every tail) are not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.zoo: the tiny models of the cross-check

from _common import run_main  # noqa: E402

from kvmesh.blocks import DEFAULT_BLOCK_TOKENS  # noqa: E402
from kvmesh.codec import Layout  # noqa: E402
from kvmesh.compat import CompatCard, LayerGeometry, dtype_size  # noqa: E402
from kvmesh.engine.base import MAX_STATE_EVERY, CacheGeometry  # noqa: E402

PROMPT_TOKENS = 8192  # one export of this many tokens: its blocks and its tail
_FULL, _LINEAR, _SLIDING = "full_attention", "linear_attention", "sliding_attention"


# --- geometry from a config, as transformers 5.24's cache holds it -------------------------


def _every(interval: int, n: int) -> list[str]:
    """transformers' ``layer_types`` from ``full_attention_interval``."""
    return [_LINEAR if (i + 1) % interval else _FULL for i in range(n)]


def geometry(model_type: str, cfg: dict[str, Any], dtype: str = "bfloat16") -> CacheGeometry:
    """The cache geometry of a model of ``model_type`` with (text) config ``cfg``,
    weights and activations in ``dtype``."""
    n = int(cfg["num_hidden_layers"])
    kv_heads = int(cfg.get("num_key_value_heads") or 0)
    head_dim = int(
        cfg.get("head_dim")
        or cfg.get("attention_head_dim")  # Nemotron-H's name for it
        or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    )
    layers: list[LayerGeometry] = []
    if model_type in ("qwen3_next", "qwen3_5", "qwen3_5_text"):
        types = cfg.get("layer_types") or _every(int(cfg["full_attention_interval"]), n)
        kh, kd = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
        vh, vd = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
        conv = (dtype, (1, 2 * kh * kd + vh * vd, int(cfg["linear_conv_kernel_dim"])))
        delta = LayerGeometry("state", state=(conv, ("float32", (1, vh, kd, vd))))
        for t in types:
            layers.append(LayerGeometry("kv", kv_heads, head_dim) if t == _FULL else delta)
    elif model_type == "nemotron_h":
        pattern = cfg["hybrid_override_pattern"]
        assert len(pattern) == n, "one pattern character a layer"
        h, hd = int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"])
        st, g = int(cfg["ssm_state_size"]), int(cfg["n_groups"])
        conv = (dtype, (1, h * hd + 2 * g * st, int(cfg["conv_kernel"])))
        mamba = LayerGeometry("state", state=(conv, ("float32", (1, h, hd, st))))
        kinds = {"M": mamba, "*": LayerGeometry("kv", kv_heads, head_dim)}
        layers = [kinds.get(c, LayerGeometry("none")) for c in pattern]  # -: MLP, E: MoE
    elif model_type == "lfm2":
        types = cfg.get("layer_types") or [
            _FULL if i in cfg["full_attn_idxs"] else "conv" for i in range(n)
        ]
        conv = LayerGeometry(
            "state", state=((dtype, (1, int(cfg["hidden_size"]), int(cfg["conv_L_cache"]))),)
        )
        layers = [LayerGeometry("kv", kv_heads, head_dim) if t == _FULL else conv for t in types]
    elif model_type in ("gemma4", "gemma4_text"):
        first_shared = n - int(cfg.get("num_kv_shared_layers") or 0)
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        global_heads = (k_eq_v and cfg.get("num_global_key_value_heads")) or kv_heads
        for i, t in enumerate(cfg["layer_types"]):
            if i >= first_shared:
                layers.append(LayerGeometry("shared"))
            elif t == _SLIDING:
                layers.append(LayerGeometry("kv", kv_heads, head_dim, int(cfg["sliding_window"])))
            else:
                layers.append(
                    LayerGeometry("kv", int(global_heads), int(cfg.get("global_head_dim") or 512))
                )
    else:  # one attention geometry in every layer (llama, qwen3, qwen3_moe)
        layers = [LayerGeometry("kv", kv_heads, head_dim) for _ in range(n)]
    return CacheGeometry(dtype, tuple(layers))


def card_of(geom: CacheGeometry, name: str, block_tokens: int) -> CompatCard:
    """A card for ``geom`` (digests and vocabulary are placeholders: they enter no figure)."""
    return CompatCard(
        engine="torch",
        model_id=name,
        weights_digest="0" * 64,
        tokenizer_digest="0" * 64,
        quantization="none",
        rope="{}",
        vocab_size=1,
        block_tokens=block_tokens,
        **geom.card_fields(block_tokens),
    )


def attention_bytes_per_token(geom: CacheGeometry) -> int:
    size = dtype_size(geom.kv_dtype)
    return sum(2 * g.kv_heads * g.head_dim * size for g in geom.layers if g.has_kv)


def export_bytes(card: CompatCard, tokens: int) -> tuple[int, int]:
    """KV and state bytes of one export of ``tokens`` tokens (full blocks, then the
    tail), each header made by the codec as for a real export."""
    layout, b, key = Layout(card), card.block_tokens, bytes(32)
    heads = [layout.header("block", key, key, i * b, b) for i in range(tokens // b)]
    heads.append(layout.header("tail", key, key, tokens // b * b, tokens % b))
    return sum(h.kv_bytes for h in heads), sum(h.state_bytes for h in heads)


# --- the published models ---------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    name: str
    model_type: str
    source: str
    config: dict[str, Any]  # only values that were found (see ``source``)
    compare: str = ""  # the full-attention model of similar size
    derived: dict[str, str] = field(default_factory=dict)  # what was not in the config


QWEN3_NEXT = Model(
    "Qwen3-Next-80B-A3B-Instruct",
    "qwen3_next",
    "Qwen/Qwen3-Next-80B-A3B-Instruct config.json as quoted in a public model study (whose copy "
    "had num_hidden_layers cut to 1); the 48 layers and the layout 12 x (3 Gated DeltaNet + 1 "
    "Gated Attention) from the model card (as on lmstudio.ai/models/qwen3-next); Qwen3-Coder-Next "
    "config.json mirrors (the same qwen3_next architecture) also say num_hidden_layers 48",
    {
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
    },
    compare="Qwen3-30B-A3B",
)
QWEN3_5_9B = Model(
    "Qwen3.5-9B",
    "qwen3_5_text",
    "Qwen/Qwen3.5-9B config.json text_config, as checked in verbatim as a test fixture ('the "
    "real Qwen3.5-9B config') and as in khtsly/Mini-Coder's config.json (model_name "
    "Qwen/Qwen3.5-9B); mamba_ssm_dtype float32 there",
    {
        "num_hidden_layers": 32,
        "layer_types": ([_LINEAR] * 3 + [_FULL]) * 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
    },
    compare="Qwen3-8B",
)
NEMOTRON_H_8B = Model(
    "Nemotron-H-8B-Base-8K",
    "nemotron_h",
    "nvidia/Nemotron-H-8B-Base-8K config.json as quoted in full by Megatron-Bridge's NemotronH "
    "bridge test fixture (and, trimmed, by other parsers naming it); Megatron-Bridge docs: 52 "
    "layers, 128 Mamba heads of 64, state 128, 8 KV groups of 128",
    {
        "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_key_value_heads": 8,
        "attention_head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
    },
    compare="Llama-3.1-8B",
)
LFM2_1_2B = Model(
    "LFM2-1.2B",
    "lfm2",
    "LiquidAI/LFM2-1.2B config.json (huggingface.co/LiquidAI/LFM2-1.2B/resolve/main/config.json) "
    "as quoted by a public test that cites it",
    {
        "num_hidden_layers": 16,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14],
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "conv_L_cache": 3,
    },
    derived={"head_dim": "hidden_size / num_attention_heads = 64 (no head_dim in the config)"},
)
GEMMA4_E4B = Model(
    "gemma-4-E4B-it",
    "gemma4_text",
    "google/gemma-4-E4B-it config.json text_config as quoted by several public parsers' "
    "fixtures; NVIDIA Megatron-Bridge docs (google/gemma-4-E4B-it): 42 layers, 2 KV heads, "
    "global head_dim 512, KV shared across the last 18 layers",
    {
        "num_hidden_layers": 42,
        "layer_types": (["sliding_attention"] * 5 + [_FULL]) * 7,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 18,
        "sliding_window": 512,
    },
)
QWEN3_8B = Model(
    "Qwen3-8B",
    "qwen3",
    "Qwen/Qwen3-8B config.json (a verbatim copy on huggingface.co, 'Copy config.json from "
    "Qwen/Qwen3-8B')",
    {"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128},
)
LLAMA31_8B = Model(
    "Llama-3.1-8B",
    "llama",
    "meta-llama/Llama-3.1-8B config as printed in vLLM's examples and quoted by parsers' fixtures",
    {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128},
)
QWEN3_30B_A3B = Model(
    "Qwen3-30B-A3B",
    "qwen3_moe",
    "Qwen3-30B-A3B: 48 layers, 4 query groups, kv_channels 128 (Ascend MindSpeed-RL "
    "qwen3_30b_a3b.yaml); the same in Qwen3-Coder-30B-A3B's config.json",
    {"num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128},
)
HYBRIDS = (QWEN3_NEXT, QWEN3_5_9B, NEMOTRON_H_8B, LFM2_1_2B, GEMMA4_E4B)
ATTENTION = (QWEN3_30B_A3B, QWEN3_8B, LLAMA31_8B)
NOT_FOUND = [
    "Qwen/Qwen3-Next-80B-A3B-Instruct's own config.json page (only the model card and a copy "
    "with num_hidden_layers cut to 1: the layer count is the card's)",
    "Qwen3.5-27B and Qwen3.5-35B-A3B linear-attention head counts from a Qwen source (only "
    "third-party fixtures): left out",
    "LFM2-1.2B head_dim (not in its config; transformers derives 2048 / 32 = 64)",
    "Nemotron-H-8B's head_dim key (the config says attention_head_dim 128; transformers 5.24 "
    "reads head_dim, default 128: the same)",
    "a ~1B full-attention model's config to set beside LFM2-1.2B",
]


def report(m: Model, block_tokens: int) -> dict[str, Any]:
    geom = geometry(m.model_type, m.config)
    card = card_of(geom, m.name, block_tokens)
    kv_tok = attention_bytes_per_token(geom)
    state = card.state_bytes
    every = card.state_every
    kinds = [g.kind for g in geom.layers]
    kv, st = export_bytes(card, PROMPT_TOKENS)
    out: dict[str, Any] = {
        "name": m.name,
        "model_type": m.model_type,
        "source": m.source,
        "config": m.config,
        "derived": m.derived,
        "layers": {k: kinds.count(k) for k in dict.fromkeys(kinds)},
        "kv_dtype": geom.kv_dtype,
        "kv_bytes_per_token": kv_tok,
        "kv_bytes_per_block": kv_tok * block_tokens,
        "state_bytes_per_checkpoint": state,
        "state_tensors": sorted({g.encode() for g in geom.layers if g.state}),
        "state_every": every,
        "state_every_unclamped": -(-state // (kv_tok * block_tokens)) if state else 0,
        "shipped_bytes_per_token": card.kv_bytes_per_token,  # KV + state amortized (the card's)
        "shipped_over_kv": round(card.kv_bytes_per_token / kv_tok, 3),
        "recompute_tokens_max": every * block_tokens - 1 if every else 0,
        "recompute_tokens_mean": (every * block_tokens - 1) / 2 if every else 0,
        "prompt": {
            "tokens": PROMPT_TOKENS,
            "kv_bytes": kv,
            "state_bytes": st,
            "checkpoints": st // state if state else 0,
            "bytes_per_token": round((kv + st) / PROMPT_TOKENS, 1),
        },
    }
    if m.compare:
        out["compare_with"] = m.compare
    if every:  # the rule, checked against its own definition
        assert every == max(1, min(MAX_STATE_EVERY, out["state_every_unclamped"]))
        for p in (every * block_tokens - 1, 3 * every * block_tokens + 5):
            imported = card.importable_blocks(p // block_tokens) * block_tokens
            assert p - imported <= out["recompute_tokens_max"]
    return out


# --- the cross-check against real caches ------------------------------------------------


def _zoo(arch: str) -> Path:
    """The tiny zoo model ``arch`` (built on first use), else /tmp/m/qwen35 for qwen3_5."""
    try:
        from tests.zoo import TODAY, hf_model

        if arch in TODAY:
            return hf_model(arch)
    except ImportError:
        pass
    fallback = Path("/tmp/m/qwen35")
    if arch == "qwen3_5" and (fallback / "config.json").exists():
        return fallback
    raise SystemExit(f"no tiny {arch} model: tests/zoo.py has no {arch!r} and no {fallback}")


def _text_config(path: Path) -> dict[str, Any]:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("text_config", cfg)


def check_engine(arch: str, dtype: str) -> dict[str, Any]:
    """This formula on the zoo model's config against the card a TransformersEngine
    probes from a real forward."""
    from kvmesh.engine.hf import TransformersEngine

    path = _zoo(arch)
    cfg = _text_config(path)
    geom = geometry(cfg["model_type"], cfg, dtype)
    eng = TransformersEngine(path, dtype=dtype, threads=1)
    card, b = eng.card, eng.card.block_tokens
    mine = card_of(geom, "check", b)
    row = {
        "arch": arch,
        "dtype": dtype,
        "against": "TransformersEngine card (probe forward)",
        "layer_geometry": [g.encode() for g in geom.layers],
        "state_bytes": mine.state_bytes,
        "probed_state_bytes": card.state_bytes,
        "state_every": mine.state_every,
        "card_state_every": card.state_every,
        "reuse_off": eng.reuse_off,
    }
    row["ok"] = (
        eng.reuse_off is None
        and mine.state_bytes == card.state_bytes
        and mine.state_every == card.state_every
        and mine.geometry == card.geometry
        and mine.kv_dtype == card.kv_dtype
    )
    assert row["ok"], f"formula and probe differ for {arch} {dtype}: {row} vs {card.geometry}"
    return row


def check_raw_cache(arch: str, dtype: str) -> dict[str, Any]:
    """This formula against the cache transformers itself fills (for a model the
    torch engine serves with reuse off)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    path = _zoo(arch)
    cfg = _text_config(path)
    geom = geometry(cfg["model_type"], cfg, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), local_files_only=True
    ).eval()
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    seen = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        parts = []
        for i in range(getattr(layer, "number_of_states", 0)):
            if layer.is_conv_states_initialized[i]:
                parts.append(layer.conv_states[i])
            if layer.is_recurrent_states_initialized[i]:
                parts.append(layer.recurrent_states[i])
        if parts:
            spec = tuple((names[t.dtype], tuple(t.shape)) for t in parts)
            seen.append(LayerGeometry("state", state=spec))
        elif isinstance(keys, torch.Tensor):
            seen.append(LayerGeometry("kv", int(keys.shape[1]), int(keys.shape[3])))
        else:
            seen.append(LayerGeometry("none"))
    row = {
        "arch": arch,
        "dtype": dtype,
        "against": "transformers' own cache after a forward (the torch engine has reuse off)",
        "layer_geometry": [g.encode() for g in geom.layers],
        "state_bytes": sum(g.state_bytes for g in geom.layers),
        "probed_state_bytes": sum(g.state_bytes for g in seen),
        "ok": tuple(seen) == geom.layers,
    }
    assert row["ok"], f"formula and cache differ for {arch} {dtype}: {geom.layers} vs {seen}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/state_bytes.json")
    ap.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    ap.add_argument(
        "--smoke", action="store_true", help="CI: the qwen3_5 cross-check and one real model"
    )
    args = ap.parse_args()
    b = args.block_tokens

    checks = [check_engine("qwen3_5", d) for d in ("float32", "bfloat16")]
    if not args.smoke:
        checks += [check_engine(a, d) for a in ("lfm2", "gemma4") for d in ("float32", "bfloat16")]
        checks += [check_raw_cache("nemotron_h", d) for d in ("float32", "bfloat16")]
    hybrids = (QWEN3_5_9B,) if args.smoke else HYBRIDS
    rows = [report(m, b) for m in hybrids]
    attention = {m.name: report(m, b) for m in ATTENTION if not args.smoke}

    mib = 2**20
    print(f"block {b} tokens, bfloat16, state_every <= {MAX_STATE_EVERY}")
    for r in rows + list(attention.values()):
        print(
            f"{r['name']:28s} KV {r['kv_bytes_per_token'] / 1024:6.1f} KiB/tok "
            f"{r['kv_bytes_per_block'] / mib:6.2f} MiB/blk  "
            f"state {r['state_bytes_per_checkpoint'] / mib:6.2f} MiB  "
            f"every {r['state_every']:2d} (rule {r['state_every_unclamped']:3d})  "
            f"shipped {r['shipped_bytes_per_token'] / 1024:6.1f} KiB/tok  "
            f"recompute <= {r['recompute_tokens_max']}"
        )
    for c in checks:
        print(f"cross-check {c['arch']} {c['dtype']}: {c['state_bytes']} B state, ok")
    out = {
        "block_tokens": b,
        "dtype": "bfloat16",
        "max_state_every": MAX_STATE_EVERY,
        "transformers_cache": "transformers 5.24 (state shapes and dtypes as its cache holds them)",
        "models": rows,
        "attention_models": attention,
        "not_found": NOT_FOUND,
        "cross_check": checks,
        "command": "python bench/state_bytes.py" + (" --smoke" if args.smoke else ""),
    }
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    run_main(main)
