"""What a loaded model's cache holds (:class:`CacheGeometry`, read off a probe
forward, never guessed from config files: invariant 5) and the compatibility card
built from it and the model directory (:func:`card_from_hf_dir`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..compat import (
    CompatCard,
    LayerGeometry,
    dtype_size,
    rope_from_config,
    tokenizer_digest,
    weights_digest,
)

MAX_STATE_EVERY = 32  # blocks: the coarsest recurrent-state checkpoint grid


@dataclass(frozen=True)
class CacheGeometry:
    """What the loaded model's cache really holds, read off a probe forward
    (invariant 5: the card describes the real cache, never a config guess)."""

    kv_dtype: str
    layers: tuple[LayerGeometry, ...]

    @classmethod
    def attention(
        cls, kv_dtype: str, kv_heads: int, head_dim: int, windows: Sequence[int]
    ) -> CacheGeometry:
        """Every layer attention KV of one shape (``windows``: per layer, 0 = full)."""
        return cls(kv_dtype, tuple(LayerGeometry("kv", kv_heads, head_dim, w) for w in windows))

    @property
    def uniform(self) -> bool:
        """Every layer attention KV of one shape: the card's scalar fields say it all."""
        return all(g.kind == "kv" for g in self.layers) and (
            len({(g.kv_heads, g.head_dim) for g in self.layers}) == 1
        )

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.layers)

    def state_every(self, block_tokens: int) -> int:
        """Blocks between recurrent-state checkpoints: about as many bytes of state
        as of KV travel (a state can be MBs per layer), never coarser than
        :data:`MAX_STATE_EVERY`; 0 without recurrent layers."""
        state = sum(g.state_bytes for g in self.layers)
        if not state:
            return 0
        size = dtype_size(self.kv_dtype)
        kv_block = sum(2 * g.kv_heads * g.head_dim * size for g in self.layers) * block_tokens
        if not kv_block:
            return MAX_STATE_EVERY
        return max(1, min(MAX_STATE_EVERY, -(-state // kv_block)))

    def card_fields(self, block_tokens: int) -> dict[str, Any]:
        """The card's geometry fields."""
        if self.uniform:
            first = self.layers[0]
            heads, dim, per_layer = first.kv_heads, first.head_dim, tuple[str, ...]()
        else:
            heads, dim = 0, 0
            per_layer = tuple(g.encode() for g in self.layers)
        return {
            "kv_dtype": self.kv_dtype,
            "num_layers": len(self.layers),
            "num_kv_heads": heads,
            "head_dim": dim,
            "sliding_windows": self.sliding_windows,
            "layer_geometry": per_layer,
            "state_every": self.state_every(block_tokens),
        }


def card_from_hf_dir(
    path: Path,
    engine: str,
    geometry: CacheGeometry,
    quantization: str,
    block_tokens: int,
    kv_quant: str = "none",
    tokenizer_dir: Path | None = None,
    block_digest: str = "blake3",
) -> CompatCard:
    """A card for the model in ``path`` whose cache has ``geometry`` (probed); its
    tokenizer files are in ``tokenizer_dir`` when that differs from ``path``."""
    cfg = json.loads((path / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    return CompatCard(
        engine=engine,
        model_id=model_name(path, cfg),
        weights_digest=weights_digest(path),
        tokenizer_digest=tokenizer_digest(tokenizer_dir or path),
        quantization=quantization,
        rope=rope_from_config(text_cfg),
        vocab_size=int(text_cfg["vocab_size"]),
        block_tokens=block_tokens,
        kv_quant=kv_quant,
        block_digest=block_digest,
        **geometry.card_fields(block_tokens),
    )


def model_name(path: Path, cfg: dict[str, Any]) -> str:
    """The model's short name: the last part of ``_name_or_path`` or the directory
    name, never a local absolute path (cards are gossiped and shown publicly)."""
    raw = str(cfg.get("_name_or_path") or "").rstrip("/")
    return raw.rsplit("/", 1)[-1] or path.resolve().name
