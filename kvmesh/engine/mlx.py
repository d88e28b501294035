"""The mlx-lm engine adapter (Metal on Apple silicon; ``mlx[cpu]`` on Linux).

The card describes the cache this model really produces: at load a one-token
probe forward fills a fresh cache, and the KV dtype, kv heads and head dim are
read off its arrays (for ``QuantizedKVCache``, off its scales), the sliding
windows off its layer classes. A 4-bit model with float16 scales computes its
cache in float16, a bfloat16 model in bfloat16: whatever the weights look like,
the card says what the cache holds. A probe that disagrees with the config
(a rotating layer whose window is not ``sliding_window``) or a cache class this
adapter cannot restore exactly is a :class:`ConfigError` at load.

Cache types:

- ``KVCache``: any prefix is exact. Export reads ``keys[..., a:b, :]``; import
  builds ``[1, kv_heads, n, head_dim]`` arrays and sets ``offset = n``.
- ``RotatingKVCache`` (sliding-window layers, window ``W``, ``keep`` sink
  positions): mlx-lm trims and rotates its buffer, so after a while it no longer
  holds positions 0.. at 0... Each rotating layer therefore keeps a *record*, its
  K/V of every position in order, appended after every forward (the last ``q`` of
  a ``q``-token update, or the slot a one-token update wrote). Export and crops
  read the record; a prefix of ``n > W`` tokens is restored as mlx-lm holds it
  after computing ``n`` tokens in one pass, reduced to what its next update keeps:
  the ``keep`` first and the last ``W - keep`` positions in order, ``offset = n``,
  ``_idx = W`` (the next update, in place or concatenating, trims, rotates, masks
  and attends exactly as it would after that pass). The record costs what a
  plain ``KVCache`` layer holds (``card.kv_bytes_per_token`` per position over
  all layers), which the head's KV budget already reserves per sequence.
  mlx-lm 0.32 builds rotating caches for Gemma-3 (and Llama-style configs with
  ``layer_types``); its Gemma-2 and Mistral models attend fully on every layer:
  their caches are ``KVCache`` and their cards say so (window 0).
- ``QuantizedKVCache`` (``kv_bits``): each of K and V travels as mlx's
  (packed uint32, scales, biases) triple; bits and group size join the card.

bfloat16 arrays travel as their raw 16-bit words (no PEP 3118 format needed).
The numerics of mlx and torch differ, so an mlx card is a different namespace
from a torch card for the same weights (the card's ``engine`` field).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..blocks import DEFAULT_BLOCK_TOKENS
from ..codec import Block, Layout
from ..compat import kv_quant_name
from ..errors import CacheMiss, ConfigError
from .base import CacheGeometry, Engine, Importer, KVState, Sampling, card_from_hf_dir
from .sampling import distribution, greedy

# wire dtype name -> NumPy buffer dtype (bfloat16 as raw 16-bit words)
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32}


def _dtype_name(arr: Any) -> str:
    """The wire name of an mlx array's dtype (``mlx.core.float16`` -> ``float16``)."""
    return str(arr.dtype).rsplit(".", 1)[-1]


def _to_numpy(arr: Any) -> np.ndarray:
    """A NumPy copy of an mlx array; bfloat16 as its raw 16-bit words."""
    import mlx.core as mx

    return np.asarray(arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr)


def _from_numpy(buf: np.ndarray, dtype: str) -> Any:
    import mlx.core as mx

    arr = mx.array(buf)
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr


class _MLXImporter(Importer):
    def __init__(self, engine: MLXEngine, n_tokens: int) -> None:
        super().__init__(n_tokens, engine.layout)
        self.engine = engine
        self.specs = [spec for layer in engine.layout.layers(n_tokens) for spec in layer]
        self.bufs = [np.empty((1, *s.shape), _NP[s.dtype]) for s in self.specs]

    def _copy(self, block: Block) -> None:
        t, a = block.header.tokens, block.header.start
        # add() checked the block against the card: K/V match the buffers one to one
        for dst, (spec, view) in zip(self.bufs, block.kv_tensors(), strict=True):
            dst[0, :, a : a + t] = np.frombuffer(view, _NP[spec.dtype]).reshape(spec.shape)

    def cache(self) -> Any:
        caches = self.engine.new_cache()
        per = len(self.bufs) // len(caches)  # 2 (K, V) or 6 (quantized K, V triples)
        parts = [_from_numpy(b, s.dtype) for b, s in zip(self.bufs, self.specs, strict=True)]
        for i, c in enumerate(caches):
            _set_parts(c, parts[i * per : (i + 1) * per], self.n_tokens)
        return caches


_RECORD = "kvmesh_record"  # a rotating layer's K/V of every position [0, offset)


def _rotating(layer: Any) -> bool:
    """A RotatingKVCache (mlx-lm's sliding-window layer)."""
    return hasattr(layer, "max_size") and hasattr(layer, "_idx")


def _parts(layer: Any) -> tuple[Any, ...]:
    """A layer cache's arrays: (K, V), or the quantized (K triple, V triple)."""
    if isinstance(layer.keys, tuple):
        return (*layer.keys, *layer.values)
    return layer.keys, layer.values


def _positions(layer: Any, n: int) -> tuple[Any, ...]:
    """A layer's arrays holding positions [0, n) at indices 0..n-1: a plain cache's
    own, a rotating layer's record. CacheMiss when they are not all there."""
    if _rotating(layer):
        rec = getattr(layer, _RECORD, None)
        if rec is None or rec[0].shape[2] < n:
            raise CacheMiss(f"positions [0, {n}) were not recorded")
        return rec
    parts = _parts(layer)
    if layer.offset < n:
        raise CacheMiss(f"positions [0, {n}) are not in the cache")
    return parts


def _record(cache: Sequence[Any], new: int) -> None:
    """After a forward of ``new`` tokens, append their K/V to each rotating layer's
    record: the last ``new`` of a multi-token update (mlx-lm concatenates), the
    slot just written by a one-token update (mlx-lm writes in place, rotating)."""
    import mlx.core as mx

    for layer in cache:
        if not _rotating(layer):
            continue
        if new > 1:
            k, v = layer.keys[..., -new:, :], layer.values[..., -new:, :]
        else:
            i = layer._idx
            k, v = layer.keys[..., i - 1 : i, :], layer.values[..., i - 1 : i, :]
        rec = getattr(layer, _RECORD, None)
        if rec is not None and rec[0].shape[2] == layer.offset - new:
            k, v = mx.concatenate([rec[0], k], axis=2), mx.concatenate([rec[1], v], axis=2)
        elif layer.offset != new:  # no record from position 0: nothing to extend
            k = v = None
        setattr(layer, _RECORD, None if k is None else (k, v))


def _set_parts(layer: Any, parts: Sequence[Any], n_tokens: int) -> None:
    """Make ``layer`` hold exactly ``parts`` for positions [0, n_tokens), in the
    state mlx-lm leaves after computing them in one pass. A rotating layer past
    its window ``W`` holds its ``keep`` first and last ``W - keep`` positions in
    order (its next update trims, rotates and attends exactly as after that pass)
    and records all of them."""
    import mlx.core as mx

    if _rotating(layer):
        k, v = parts
        setattr(layer, _RECORD, (k, v))
        w, keep = layer.max_size, layer.keep
        if n_tokens > w:
            cut = [slice(0, keep), slice(n_tokens - w + keep, n_tokens)]
            k, v = (mx.concatenate([a[..., c, :] for c in cut], axis=2) for a in (k, v))
        layer.keys, layer.values = k, v
        layer._idx = min(n_tokens, w)
    elif len(parts) == 2:
        layer.keys, layer.values = parts
    else:
        layer.keys, layer.values = tuple(parts[:3]), tuple(parts[3:])
    layer.offset = n_tokens


def _layer_geometry(layer: Any) -> tuple[str, int, int]:
    """(dtype, kv_heads, head_dim) of one probed layer cache."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    if type(layer) is QuantizedKVCache:
        packed, scales = _parts(layer)[:2]  # via Any: mlx-lm types keys as None
        dim = scales.shape[-1] * layer.group_size
        if packed.shape[-1] * 32 != dim * layer.bits:
            raise ConfigError(f"quantized KV packs {packed.shape[-1]} words for head dim {dim}")
        return _dtype_name(scales), int(scales.shape[1]), int(dim)
    if type(layer) not in (KVCache, RotatingKVCache):
        raise ConfigError(f"mlx-lm cache {type(layer).__name__} cannot be restored exactly")
    k, v = layer.keys, layer.values
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ConfigError(f"keys {k.shape} {k.dtype} and values {v.shape} {v.dtype} differ")
    return _dtype_name(k), int(k.shape[1]), int(k.shape[-1])


def _windows(caches: Sequence[Any], config: dict[str, Any]) -> list[int]:
    """Per-layer sliding windows of mlx-lm's caches (0 = full attention), checked
    against the config's ``sliding_window`` where it declares one (mlx-lm has
    defaults for configs that do not): a disagreement is a ConfigError."""
    from mlx_lm.models.cache import RotatingKVCache

    text_cfg = config.get("text_config", config)
    declared = text_cfg.get("sliding_window")
    windows = []
    for c in caches:
        w = c.max_size if type(c) is RotatingKVCache else 0
        if w and declared is not None and w != declared:
            raise ConfigError(f"mlx-lm built a {w}-token window; config says {declared}")
        if w and not 0 <= c.keep < w:
            raise ConfigError(f"a rotating cache keeps {c.keep} of a {w}-token window")
        windows.append(int(w))
    return windows


class MLXEngine(Engine):
    name = "mlx"

    def __init__(
        self,
        path: Path,
        block_tokens: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        block_digest: str = "blake3",
    ) -> None:
        import mlx.core as mx
        from mlx_lm import load

        self.mx = mx
        self.path = Path(path)
        self.model, self.tokenizer = load(str(self.path))[:2]
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        cfg = json.loads((self.path / "config.json").read_text())
        quant = cfg.get("quantization") or cfg.get("quantization_config")
        self.card = card_from_hf_dir(
            self.path,
            engine="mlx",
            geometry=self._probe(cfg),
            quantization=json.dumps(quant, sort_keys=True) if quant else "none",
            block_tokens=block_tokens or DEFAULT_BLOCK_TOKENS,
            kv_quant=kv_quant_name(kv_bits, kv_group_size) if kv_bits else "none",
            block_digest=block_digest,
        )
        self.layout = Layout(self.card)
        eos = self.tokenizer.eos_token_ids if hasattr(self.tokenizer, "eos_token_ids") else []
        self.eos_ids = frozenset(int(e) for e in eos)

    def _probe(self, cfg: dict[str, Any]) -> CacheGeometry:
        """The real cache's geometry: a one-token forward into a fresh cache."""
        from mlx_lm.models.cache import make_prompt_cache

        windows = _windows(make_prompt_cache(self.model), cfg)
        if self.kv_bits and any(windows):  # mlx-lm: "RotatingKVCache Quantization NYI"
            raise ConfigError("quantized KV (kv_bits) is not supported with sliding windows")
        try:
            cache, _ = self._forward(None, [0], 0)
        except ValueError as e:  # e.g. a KV group size mlx cannot quantize with
            raise ConfigError(f"mlx-lm cannot build this cache: {e}") from e
        return CacheGeometry.from_layers([_layer_geometry(c) for c in cache], windows)

    def new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        caches = make_prompt_cache(self.model)
        if self.kv_bits:
            return [QuantizedKVCache(self.kv_group_size, self.kv_bits) for _ in caches]
        return caches

    # -- KV -------------------------------------------------------------------

    def importer(self, n_tokens: int) -> _MLXImporter:
        return _MLXImporter(self, n_tokens)

    def _forward(self, cache: Any, tokens: Sequence[int], start: int) -> tuple[Any, Any]:
        mx = self.mx
        if cache is None:
            cache = self.new_cache()
        logits = self.model(mx.array([list(tokens)]), cache=cache)
        last = logits[0, -1].astype(mx.float32)
        _record(cache, len(tokens))
        recs = [r for c in cache for r in getattr(c, _RECORD, None) or ()]
        mx.eval(last, *[p for c in cache for p in _parts(c)], *recs)
        return cache, last

    # -- batched decode ---------------------------------------------------------

    @property
    def batches(self) -> bool:
        # mlx-lm's BatchKVCache: plain KV caches only (no window, no quantized KV)
        return not any(self.card.sliding_windows) and not self.kv_bits

    def decode_batch(self, states: Sequence[KVState]) -> None:
        """One forward for every state's pending token through mlx-lm's own batch
        cache (left padding, per-row offsets); each state gets its rows back."""
        if len(states) < 2 or not self.batches:
            super().decode_batch(states)
            return
        from mlx_lm.models.cache import BatchKVCache

        mx = self.mx
        layers = len(states[0].cache)
        batch = [BatchKVCache.merge([s.cache[i] for s in states]) for i in range(layers)]
        ids = mx.array([[s.tokens[s.cached]] for s in states])
        logits = self.model(ids, cache=batch)[:, -1].astype(mx.float32)
        rows = [[c.extract(r) for c in batch] for r in range(len(states))]
        mx.eval(logits, *[p for row in rows for c in row for p in _parts(c)])
        for r, s in enumerate(states):
            s.cache, s.logits, s.cached = rows[r], logits[r], s.cached + 1

    def _crop(self, cache: Any, n_tokens: int) -> Any:
        out = self.new_cache()
        for src, dst in zip(cache, out, strict=True):
            _set_parts(dst, [p[..., :n_tokens, :] for p in _positions(src, n_tokens)], n_tokens)
        return out

    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        specs = [s for layer in self.layout.layers(stop - start) for s in layer]
        parts = [p for layer in cache for p in _positions(layer, stop)]
        off = 0
        for spec, src in zip(specs, parts, strict=True):
            if _dtype_name(src) != spec.dtype:  # never write one dtype's bytes as another's
                raise ConfigError(f"cache holds {_dtype_name(src)}, the card says {spec.dtype}")
            arr = _to_numpy(src[0, :, start:stop, :])
            np.frombuffer(out[off : off + arr.nbytes], arr.dtype).reshape(arr.shape)[...] = arr
            off += arr.nbytes

    def _write_logits(self, logits: Any, out: memoryview) -> None:
        np.frombuffer(out, np.float32)[:] = np.asarray(logits, dtype=np.float32)

    def _read_logits(self, view: memoryview) -> Any:
        return self.mx.array(np.frombuffer(view, np.float32))

    # -- sampling -------------------------------------------------------------

    def new_rng(self, seed: int | None) -> Any:
        return np.random.default_rng(seed)

    def sample(
        self, logits: Any, sampling: Sampling, rng: Any, counts: Mapping[int, int] | None = None
    ) -> int:
        x = np.asarray(logits, dtype=np.float64)
        if counts and sampling.penalized:  # OpenAI: -= count * frequency + presence
            ids = np.fromiter(counts, np.int64, len(counts))
            n = np.fromiter(counts.values(), np.float64, len(counts))
            x[ids] -= n * sampling.frequency_penalty + sampling.presence_penalty
        p = distribution(x, sampling.temperature, sampling.top_p)
        if p is None:
            return greedy(x)
        return int(rng.choice(len(p), p=p))

    def _log_softmax(self, logits: Any) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float64)
        m = x.max()
        return (x - (m + np.log(np.exp(x - m).sum()))).astype(np.float32)
