"""The mlx-lm engine adapter (Metal on Apple silicon; ``mlx[cpu]`` on Linux).

Cache types:

- ``KVCache``: any prefix is exact. Export reads ``keys[..., a:b, :]``; import
  builds ``[1, kv_heads, n, head_dim]`` arrays and sets ``offset = n``.
- ``RotatingKVCache`` (sliding-window layers): a prefix is restorable exactly only
  while no position has been rotated out, i.e. ``n <= window``. Longer prefixes
  are neither exported nor imported (a miss, never an approximation).
- ``QuantizedKVCache``: not supported yet; a model asked to use it is refused.

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
from .base import Engine, Importer, KVState, Sampling, card_from_hf_dir

_NAMES = {"float32": np.float32, "float16": np.float16}


class _MLXImporter(Importer):
    def __init__(self, engine: MLXEngine, n_tokens: int) -> None:
        super().__init__(n_tokens)
        c = engine.card
        self.engine = engine
        np_dtype = _NAMES[c.kv_dtype]
        self.bufs = [
            np.empty((1, c.num_kv_heads, n_tokens, c.head_dim), np_dtype)
            for _ in range(2 * c.num_layers)
        ]
        self._np_dtype = np_dtype

    def _copy(self, block: Block) -> None:
        t, a = block.header.tokens, block.header.start
        for dst, (spec, view) in zip(self.bufs, block.tensors(), strict=False):
            dst[0, :, a : a + t] = np.frombuffer(view, self._np_dtype).reshape(spec.shape)

    def cache(self) -> Any:
        mx = self.engine.mx
        caches = self.engine.new_cache()
        for i, c in enumerate(caches):
            c.keys, c.values = mx.array(self.bufs[2 * i]), mx.array(self.bufs[2 * i + 1])
            c.offset = self.n_tokens
            if hasattr(c, "_idx"):  # RotatingKVCache, not yet rotated (n <= window)
                c._idx = self.n_tokens
        return caches


class MLXEngine(Engine):
    name = "mlx"

    def __init__(self, path: Path, block_tokens: int | None = None) -> None:
        import mlx.core as mx
        from mlx_lm import load

        self.mx = mx
        self.path = Path(path)
        self.model, self.tokenizer = load(str(self.path))
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
        )
        self.layout = Layout(self.card)
        windows = [w for w in self.card.sliding_windows if w]
        self.max_prefix = min(windows) if windows else None  # exact restore bound
        eos = self.tokenizer.eos_token_ids if hasattr(self.tokenizer, "eos_token_ids") else []
        self.eos_ids = frozenset(int(e) for e in eos)

    def new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    # -- text -----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return self.encode(text)

    def decode_text(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    # -- KV -------------------------------------------------------------------

    def importer(self, n_tokens: int) -> _MLXImporter:
        if self.max_prefix is not None and n_tokens > self.max_prefix:
            from ..errors import CacheMiss

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
        mx.eval(last, *[c.keys for c in cache], *[c.values for c in cache])
        return cache, last

    def _crop(self, cache: Any, n_tokens: int) -> Any:
        out = self.new_cache()
        for src, dst in zip(cache, out, strict=True):
            dst.keys, dst.values = src.keys[..., :n_tokens, :], src.values[..., :n_tokens, :]
            dst.offset = n_tokens
            if hasattr(dst, "_idx"):
                if src.offset > (self.max_prefix or src.offset):
                    raise ValueError("cannot crop a rotated sliding-window cache")
                dst._idx = n_tokens
        return out

    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        c = self.card
        per = c.num_kv_heads * (stop - start) * c.head_dim
        dst = np.frombuffer(out, _NAMES[c.kv_dtype])
        off = 0
        for layer in cache:
            for src in (layer.keys, layer.values):
                arr = np.asarray(src[0, :, start:stop, :])
                dst[off : off + per].reshape(arr.shape)[...] = arr
                off += per

    def export(
        self,
        state: KVState,
        keyer: BlockKeyer,
        keys: PrefixKeys | None = None,
        first_block: int = 0,
    ) -> list[Block]:
        if self.max_prefix is not None and state.cached > self.max_prefix:
            # positions may have rotated out: export only what is exactly restorable
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
