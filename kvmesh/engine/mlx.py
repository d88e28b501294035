"""The mlx-lm engine adapter (Metal on Apple silicon; ``mlx[cpu]`` on Linux).

Cache types:

- ``KVCache``: any prefix is exact. Export reads ``keys[..., a:b, :]``; import
  builds ``[1, kv_heads, n, head_dim]`` arrays and sets ``offset = n``.
- ``RotatingKVCache`` (sliding-window layers): a prefix is restorable exactly only
  while no position has been rotated out, i.e. ``n <= window``. Longer prefixes
  are neither exported nor imported (a miss, never an approximation).
- ``QuantizedKVCache`` (``kv_bits``): each of K and V travels as mlx's
  (packed uint32, scales, biases) triple; bits and group size join the card.

The numerics of mlx and torch differ, so an mlx card is a different namespace
from a torch card for the same weights (the card's ``engine`` field).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..blocks import DEFAULT_BLOCK_TOKENS, BlockKeyer, PrefixKeys
from ..codec import Block, Layout
from ..compat import kv_quant_name
from ..errors import CacheMiss
from .base import Engine, Importer, KVState, Sampling, card_from_hf_dir


class _MLXImporter(Importer):
    def __init__(self, engine: MLXEngine, n_tokens: int) -> None:
        super().__init__(n_tokens)
        self.engine = engine
        self.specs = [spec for layer in engine.layout.layers(n_tokens) for spec in layer]
        self.bufs = [np.empty((1, *s.shape), np.dtype(s.dtype)) for s in self.specs]

    def _copy(self, block: Block) -> None:
        t, a = block.header.tokens, block.header.start
        for dst, (spec, view) in zip(self.bufs, block.tensors(), strict=False):
            dst[0, :, a : a + t] = np.frombuffer(view, np.dtype(spec.dtype)).reshape(spec.shape)

    def cache(self) -> Any:
        mx = self.engine.mx
        caches = self.engine.new_cache()
        per = len(self.bufs) // len(caches)  # 2 (K, V) or 6 (quantized K, V triples)
        for i, c in enumerate(caches):
            parts = [mx.array(b) for b in self.bufs[i * per : (i + 1) * per]]
            if per == 2:
                c.keys, c.values = parts
            else:
                c.keys, c.values = tuple(parts[:3]), tuple(parts[3:])
            c.offset = self.n_tokens
            if hasattr(c, "_idx"):  # RotatingKVCache, not yet rotated (n <= window)
                c._idx = self.n_tokens
        return caches


def _rotated(layer: Any) -> bool:
    """A RotatingKVCache that trimmed or wrapped: positions 0.. no longer sit at 0.."""
    return hasattr(layer, "_idx") and layer._idx != layer.offset


def _parts(layer: Any) -> tuple[Any, ...]:
    """A layer cache's arrays: (K, V), or the quantized (K triple, V triple)."""
    if isinstance(layer.keys, tuple):
        return (*layer.keys, *layer.values)
    return layer.keys, layer.values


class MLXEngine(Engine):
    name = "mlx"

    def __init__(
        self,
        path: Path,
        block_tokens: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ) -> None:
        import mlx.core as mx
        from mlx_lm import load

        self.mx = mx
        self.path = Path(path)
        self.model, self.tokenizer = load(str(self.path))[:2]
        cfg = json.loads((self.path / "config.json").read_text())
        quant = cfg.get("quantization") or cfg.get("quantization_config")
        params = dict(_leaves(self.model.parameters()))
        emb = next(v for k, v in params.items() if "embed" in k)
        kv_dtype = {mx.float32: "float32", mx.float16: "float16"}.get(emb.dtype)
        if kv_dtype is None:
            kv_dtype = "float32"  # quantized or bfloat16 weights compute KV in float32 here
        self.card = card_from_hf_dir(
            self.path,
            engine="mlx",
            kv_dtype=kv_dtype,
            quantization=json.dumps(quant, sort_keys=True) if quant else "none",
            block_tokens=block_tokens or DEFAULT_BLOCK_TOKENS,
            kv_quant=kv_quant_name(kv_bits, kv_group_size) if kv_bits else "none",
        )
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.layout = Layout(self.card)
        windows = [w for w in self.card.sliding_windows if w]
        self.max_prefix = min(windows) if windows else None  # exact restore bound
        if kv_bits and windows:
            raise NotImplementedError("quantized KV with sliding-window layers is not supported")
        eos = self.tokenizer.eos_token_ids if hasattr(self.tokenizer, "eos_token_ids") else []
        self.eos_ids = frozenset(int(e) for e in eos)

    def new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        caches = make_prompt_cache(self.model)
        if self.kv_bits:
            return [QuantizedKVCache(self.kv_group_size, self.kv_bits) for _ in caches]
        return caches

    # -- KV -------------------------------------------------------------------

    def importer(self, n_tokens: int) -> _MLXImporter:
        if self.max_prefix is not None and n_tokens > self.max_prefix:
            raise CacheMiss(
                f"a {n_tokens}-token prefix is not restorable past the {self.max_prefix}-token window"
            )
        return _MLXImporter(self, n_tokens)

    def _forward(self, cache: Any, tokens: Sequence[int], start: int) -> tuple[Any, Any]:
        mx = self.mx
        if cache is None:
            cache = self.new_cache()
        logits = self.model(mx.array([list(tokens)]), cache=cache)
        last = logits[0, -1].astype(mx.float32)
        mx.eval(last, *[p for c in cache for p in _parts(c)])
        return cache, last

    def _crop(self, cache: Any, n_tokens: int) -> Any:
        out = self.new_cache()
        for src, dst in zip(cache, out, strict=True):
            cut = [p[..., :n_tokens, :] for p in _parts(src)]
            if len(cut) == 2:
                dst.keys, dst.values = cut
            else:
                dst.keys, dst.values = tuple(cut[:3]), tuple(cut[3:])
            dst.offset = n_tokens
            if hasattr(dst, "_idx"):
                if _rotated(src):
                    raise CacheMiss("a trimmed sliding-window cache cannot be cropped exactly")
                dst._idx = n_tokens
        return out

    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        off = 0
        for layer in cache:
            for src in _parts(layer):
                arr = np.asarray(src[0, :, start:stop, :])
                np.frombuffer(out[off : off + arr.nbytes], arr.dtype).reshape(arr.shape)[...] = arr
                off += arr.nbytes

    def export(
        self,
        state: KVState,
        keyer: BlockKeyer,
        keys: PrefixKeys | None = None,
        first_block: int = 0,
    ) -> list[Block]:
        if self.max_prefix is not None:
            if any(_rotated(c) for c in state.cache):
                return []  # a sliding layer trimmed or wrapped: its early positions are gone
            if state.cached > self.max_prefix:  # export only what is exactly restorable
                n = (self.max_prefix // self.card.block_tokens) * self.card.block_tokens
                state = KVState(state.tokens[:n], state.cache, None, n)
        return super().export(state, keyer, keys, first_block)

    def _write_logits(self, logits: Any, out: memoryview) -> None:
        np.frombuffer(out, np.float32)[:] = np.asarray(logits, dtype=np.float32)

    def _read_logits(self, view: memoryview) -> Any:
        return self.mx.array(np.frombuffer(view, np.float32))

    # -- sampling -------------------------------------------------------------

    def new_rng(self, seed: int | None) -> Any:
        return np.random.default_rng(seed)

    def sample(self, logits: Any, sampling: Sampling, rng: Any) -> int:
        x = np.asarray(logits, dtype=np.float64)
        if sampling.temperature <= 0:
            return int(np.argmax(x))
        p = np.exp((x - x.max()) / sampling.temperature)
        p /= p.sum()
        if sampling.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < sampling.top_p
            mask = np.zeros_like(p)
            mask[order[keep]] = p[order[keep]]
            p = mask / mask.sum()
        return int(rng.choice(len(p), p=p))


def _leaves(tree: Any, prefix: str = "") -> Any:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), tree
