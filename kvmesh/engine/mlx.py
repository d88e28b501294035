"""The mlx-lm engine (Metal on Apple silicon; ``mlx[cpu]`` on Linux).

The card is read off the cache a one-token probe forward fills: per layer the KV
dtype, KV heads and head dim (``QuantizedKVCache``: off its scales), the window
(off the layer class), a recurrent layer's state arrays. A disagreement with the
config is a :class:`ConfigError` at load; a cache this adapter cannot restore
exactly (an unknown class, latent attention, a state it cannot ship) is
:class:`CannotRestore`: reuse off. ``make_prompt_cache`` may build fewer caches
than layers: Gemma 4's KV-shared layers are ``shared``, NemotronH's MLP and MoE
blocks ``none``; any other mismatch is a ConfigError.

Cache types:

- ``KVCache``: any prefix is exact (both of Gemma 4's ``attention_k_eq_v`` arrays
  travel).
- ``RotatingKVCache`` (window ``W``, ``keep`` sink positions): each layer keeps a
  *record*, its K/V of every position in order, appended after every forward;
  export and crops read it. A prefix of ``n > W`` is restored as mlx-lm holds it
  after computing ``n`` tokens in one pass: the ``keep`` first and the last
  ``W - keep`` positions in order, ``offset = n``, ``_idx = W``. The record costs
  ``card.kv_bytes_per_token`` per position, which the head's KV budget reserves.
- ``QuantizedKVCache`` (``kv_bits``): K and V each travel as mlx's (packed uint32,
  scales, biases); bits and group size join the card.
- ``ArraysCache`` (recurrent layers): mlx-lm replaces its arrays on every forward,
  so a state is kept by reference. A multi-token forward stops every
  ``state_every`` blocks to keep the state there; a prompt's keeps it where the
  prompt ends and after its last two whole blocks (those carry it: the next chat
  turn imports up to there); an import or crop ends on a kept position
  (:meth:`MLXEngine.restorable`).

mlx's CPU build runs mixture-of-experts layers only in float32 or quantized: a
bfloat16 MoE is a ConfigError at load there. bfloat16 arrays travel as raw 16-bit
words. mlx and torch compute different numbers: their cards differ (``engine``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..blocks import DEFAULT_BLOCK_TOKENS, last_block_stops, split_at, stale_states
from ..codec import Block, Layout
from ..compat import LayerGeometry, kv_quant_name
from ..errors import CacheMiss, CannotRestore, ConfigError
from .base import EngineBase
from .decode import Sampling
from .geometry import CacheGeometry, card_from_hf_dir
from .protocol import Scorer
from .sampling import distribution, greedy
from .state import Importer, KVState

# wire dtype name -> NumPy buffer dtype (bfloat16 as raw 16-bit words)
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32}
_NP_NAME = {np.dtype(v): k for k, v in _NP.items()}  # (a raw uint16 buffer is bfloat16)
_STATE_DTYPES = ("float32", "float16", "bfloat16")

# a state: per cache, its recurrent arrays (mlx arrays, or raw NumPy copies of a
# block's bytes until a cache restores them); () for an attention cache
States = tuple[tuple[Any, ...], ...]


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


def _raw(arr: Any) -> bool:
    """An imported state's raw NumPy copy of a block's bytes (not yet an mlx array)."""
    return isinstance(arr, np.ndarray)


def _own(arr: Any) -> Any:
    """A copy of an (evaluated) mlx array in a buffer of its own: a slice keeps
    its whole source buffer alive, a kept state should not."""
    return _from_numpy(_to_numpy(arr), _dtype_name(arr))


class _Cache(list):  # type: ignore[type-arg]
    """mlx-lm's caches (one per cache, not per layer) as the model takes them,
    and, for a model with recurrent layers, the states kept along the way:
    ``states`` {position: :data:`States`} and ``pos``, the position it holds."""

    states: dict[int, States]
    pos: int


def _is_state(layer: Any) -> bool:
    """An ArraysCache (a recurrent layer's state)."""
    from mlx_lm.models.cache import ArraysCache

    return type(layer) is ArraysCache


class _MLXImporter(Importer):
    """One ``[1, kv_heads, n - lo, head_dim]`` buffer per K or V array (per
    quantized part) of each layer with a cache of its own, holding positions
    ``[lo, n)`` (``lo``: the layer's ``keep_from``, 0 without); the states blocks
    carry are kept (NumPy copies) and :meth:`cache` restores the last, keeping the
    others as the cache's checkpoints. A trimmed rotating layer's record is marked
    with its low bound (``kvmesh_lo``)."""

    def __init__(
        self, engine: MLXEngine, n_tokens: int, keep_from: Sequence[int] | None = None
    ) -> None:
        super().__init__(n_tokens, engine.layout, keep_from)
        self.engine = engine
        self.lows = _low_bounds(engine, n_tokens, self.keep_from)
        per_layer = engine.layout.layers(n_tokens)
        self.specs = [(i, s) for i, layer in enumerate(per_layer) for s in layer]
        self.bufs = [
            np.empty((1, s.shape[0], n_tokens - self.lows[i], s.shape[2]), _NP[s.dtype])
            for i, s in self.specs
        ]
        self._first: dict[int, int] = {}  # layer -> the index of its first buffer
        for j, (i, _) in enumerate(self.specs):
            self._first.setdefault(i, j)
        self._states: dict[int, States] = {}
        self._lock = threading.Lock()

    def _copy(self, block: Block) -> None:
        t, a = block.header.tokens, block.header.start
        # add() checked the block against the card: a layer's parts match its buffers
        for i, parts, skip, at in self._spans(block, self.lows):
            for j, (spec, view) in enumerate(parts, self._first[i]):
                src = np.frombuffer(view, _NP[spec.dtype]).reshape(spec.shape)
                self.bufs[j][0, :, at : at + t - skip] = src[:, skip:]
        if block.header.states:
            eng = self.engine
            per: list[list[Any]] = [[] for _ in range(eng.n_caches)]
            for i, spec, view in block.state_tensors():
                c = eng.cache_of[i]
                assert c is not None  # a state layer has a cache of its own (probed)
                # a copy: a view would pin the whole block (its K/V too) for the cache's life
                per[c].append(np.frombuffer(view, _NP[spec.dtype]).reshape(spec.shape).copy())
            with self._lock:
                self._states[a + t] = tuple(tuple(p) for p in per)

    def cache(self) -> Any:
        """The cache of the imported positions; with recurrent layers, of those up
        to the last block that carried their state (an import ends on one)."""
        eng, n = self.engine, self.n_tokens
        if eng.card.state_every:
            n = max((p for p in self._states if p <= n), default=0)
            if not n:
                return None
        caches = eng.new_cache()
        parts: dict[int, list[Any]] = {}
        for (i, spec), buf in zip(self.specs, self.bufs, strict=True):
            held = buf[..., : n - self.lows[i], :]
            parts.setdefault(i, []).append(_from_numpy(held, spec.dtype))
        for i, layer_parts in parts.items():
            c = eng.cache_of[i]
            assert c is not None  # a KV layer has a cache of its own (probed)
            _set_parts(caches[c], layer_parts, n, self.lows[i])
        if eng.card.state_every:
            eng._restore_states(caches, n, self._states[n], self._states)
        return caches


def _low_bounds(engine: MLXEngine, n: int, keep_from: Sequence[int] | None) -> tuple[int, ...]:
    """Per layer, the first position an import holds (all 0 without ``keep_from``),
    checked so that the import restores: 0 for a full-attention layer; a rotating
    layer's live window (its last ``W`` of ``n``) within what it holds."""
    c = engine.card
    if keep_from is None:
        return (0,) * c.num_layers
    if c.state_every:  # imports end on positions only a checkpoint knows
        raise ValueError("this card's imports are never trimmed")
    for i, (lo, g) in enumerate(zip(keep_from, c.geometry, strict=True)):
        if not g.has_kv:
            continue
        if not 0 <= lo <= n or (lo and (not g.window or n - lo < g.window)):
            raise ValueError(f"layer {i} (window {g.window}) cannot be imported from {lo} of {n}")
    return tuple(lo if g.has_kv else 0 for lo, g in zip(keep_from, c.geometry, strict=True))


_RECORD = "kvmesh_record"  # a rotating layer's K/V of every position [lo, offset)
_LO = "kvmesh_lo"  # a rotating layer's first recorded position (0 unless a trimmed import's)


def _lo(layer: Any) -> int:
    return int(getattr(layer, _LO, 0))


def _rotating(layer: Any) -> bool:
    """A RotatingKVCache (mlx-lm's sliding-window layer)."""
    return hasattr(layer, "max_size") and hasattr(layer, "_idx")


def _parts(layer: Any) -> tuple[Any, ...]:
    """A layer cache's arrays: (K, V), or the quantized (K triple, V triple)."""
    if isinstance(layer.keys, tuple):
        return (*layer.keys, *layer.values)
    return layer.keys, layer.values


def _arrays(layer: Any) -> tuple[Any, ...]:
    """Every array a cache holds now (to evaluate after a forward)."""
    if _is_state(layer):
        return tuple(a for a in layer.cache if a is not None)
    if getattr(layer, "keys", None) is None:
        return ()
    return (*_parts(layer), *(getattr(layer, _RECORD, None) or ()))


def _span(layer: Any, start: int, stop: int) -> tuple[Any, ...]:
    """A layer's arrays of positions [start, stop): a plain cache's own, a rotating
    layer's record (from its :func:`_lo` on: a trimmed import never had the earlier
    ones). CacheMiss when they are not all there."""
    if _rotating(layer):
        rec, lo = getattr(layer, _RECORD, None), _lo(layer)
        if rec is None or start < lo or lo + rec[0].shape[2] < stop:
            raise CacheMiss(f"positions [{start}, {stop}) were not recorded")
        return tuple(a[..., start - lo : stop - lo, :] for a in rec)
    if layer.offset < stop:
        raise CacheMiss(f"positions [{start}, {stop}) are not in the cache")
    return tuple(a[..., start:stop, :] for a in _parts(layer))


def _floor(cache: Sequence[Any]) -> int:
    """The fewest positions ``cache`` can be cut back to other than none: a trimmed
    rotating layer's window (its last ``W``) must lie past its low bound."""
    return max((_lo(c) + c.max_size for c in cache if _rotating(c) and _lo(c)), default=0)


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
        rec, lo = getattr(layer, _RECORD, None), _lo(layer)
        if rec is not None and lo + rec[0].shape[2] == layer.offset - new:
            k, v = mx.concatenate([rec[0], k], axis=2), mx.concatenate([rec[1], v], axis=2)
        elif layer.offset != new:  # no record up to this forward: nothing to extend
            k = v = None
        if k is None or layer.offset == new:  # none, or a first forward's: from position 0
            lo = 0
        setattr(layer, _RECORD, None if k is None else (k, v))
        setattr(layer, _LO, lo)


def _set_parts(layer: Any, parts: Sequence[Any], n_tokens: int, lo: int = 0) -> None:
    """Make ``layer`` hold exactly ``parts`` for positions [0, n_tokens) (given from
    ``lo`` on), in the state mlx-lm leaves after computing them in one pass. A
    rotating layer past its window ``W`` holds its ``keep`` first and last
    ``W - keep`` positions in order (its next update trims, rotates and attends
    exactly as after that pass) and records all it is given. ``lo`` > 0 only for a
    rotating layer without sink positions whose window lies within [lo, n_tokens):
    :class:`CacheMiss` otherwise, before the layer is touched."""
    import mlx.core as mx

    if lo and (not _rotating(layer) or layer.keep or n_tokens - lo < layer.max_size):
        raise CacheMiss(f"positions [0, {lo}) of a layer are not held: cannot restore {n_tokens}")
    if _rotating(layer):
        k, v = parts
        setattr(layer, _RECORD, (k, v))
        setattr(layer, _LO, lo)
        w, keep = layer.max_size, layer.keep
        if n_tokens > w:
            cut = [slice(0, keep), slice(n_tokens - lo - w + keep, n_tokens - lo)]
            k, v = (mx.concatenate([a[..., c, :] for c in cut], axis=2) for a in (k, v))
        layer.keys, layer.values = k, v
        layer._idx = min(n_tokens, w)
    elif len(parts) == 2:
        layer.keys, layer.values = parts
    else:
        layer.keys, layer.values = tuple(parts[:3]), tuple(parts[3:])
    layer.offset = n_tokens


def _layer_geometry(layer: Any) -> tuple[str, int, int]:
    """(dtype, kv_heads, head_dim) of one probed attention cache."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    if type(layer) is QuantizedKVCache:
        packed, scales = _parts(layer)[:2]  # via Any: mlx-lm types keys as None
        dim = scales.shape[-1] * layer.group_size
        if packed.shape[-1] * 32 != dim * layer.bits:
            raise CannotRestore(f"quantized KV packs {packed.shape[-1]} words for head dim {dim}")
        return _dtype_name(scales), int(scales.shape[1]), int(dim)
    if type(layer) not in (KVCache, RotatingKVCache):
        raise CannotRestore(f"mlx-lm cache {type(layer).__name__} cannot be restored exactly")
    k, v = layer.keys, layer.values
    if k is None or v is None:
        raise CannotRestore(f"mlx-lm cache {type(layer).__name__} holds no K/V after a forward")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise CannotRestore(
            f"keys {k.shape} {k.dtype} and values {v.shape} {v.dtype} are not one K/V "
            "geometry (latent attention?)"
        )
    return _dtype_name(k), int(k.shape[1]), int(k.shape[-1])


def _state_geometry(layer: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dtype, shape) of each array of one probed recurrent cache."""
    if layer.lengths is not None or layer.left_padding is not None:
        raise CannotRestore("a recurrent cache holds batch padding after a one-row forward")
    if not layer.cache or any(a is None for a in layer.cache):
        raise CannotRestore("a recurrent cache holds no state after a forward")
    spec = tuple((_dtype_name(a), tuple(int(d) for d in a.shape)) for a in layer.cache)
    if bad := sorted({d for d, _ in spec} - set(_STATE_DTYPES)):
        raise CannotRestore(f"a recurrent state in {bad}, which kvmesh cannot ship")
    return spec


def _windows(caches: Sequence[Any], config: dict[str, Any]) -> list[int]:
    """Per-cache sliding windows of mlx-lm's caches (0 = full attention or none),
    checked against the config's ``sliding_window`` where it declares one (mlx-lm
    has defaults for configs that do not): a disagreement is a ConfigError."""
    from mlx_lm.models.cache import RotatingKVCache

    text_cfg = config.get("text_config", config)
    declared = text_cfg.get("sliding_window")
    windows = []
    for c in caches:
        w = c.max_size if type(c) is RotatingKVCache else 0
        if w and declared is not None and w != declared:
            raise ConfigError(f"mlx-lm built a {w}-token window; config says {declared}")
        if w and not 0 <= c.keep < w:
            raise CannotRestore(f"a rotating cache keeps {c.keep} of a {w}-token window")
        windows.append(int(w))
    return windows


def _owners(model: Any, n_caches: int) -> list[int | str]:
    """Per model layer, the index of its cache in ``make_prompt_cache``'s list, or
    why it has none: ``shared`` (Gemma 4's KV-shared layers, which attend to an
    earlier layer's K/V: the model appends None caches for them) or ``none``
    (NemotronH's MLP and MoE blocks; the model hands caches to its Mamba2 and
    attention blocks in order). Any other mismatch is a ConfigError."""
    layers = list(getattr(model, "layers", None) or ())
    if not layers:
        raise CannotRestore("mlx-lm model lists no layers: kvmesh cannot map its caches")
    if n_caches == len(layers):
        return list(range(n_caches))
    kinds = [getattr(layer, "block_type", None) for layer in layers]
    if all(isinstance(k, str) and len(k) == 1 for k in kinds):  # NemotronH's pattern
        owners: list[int | str] = []
        for k in kinds:
            mixer = k in ("M", "*")  # Mamba2 and attention blocks hold a cache
            owners.append(sum(isinstance(o, int) for o in owners) if mixer else "none")
        if sum(isinstance(o, int) for o in owners) == n_caches:
            return owners
    for inner in _submodules(model):
        prev = getattr(inner, "previous_kvs", None)  # Gemma 4: layer -> whose K/V it uses
        if isinstance(prev, list) and len(prev) == len(layers):
            own = [j for j, p in enumerate(prev) if p == j]
            if own == list(range(n_caches)) and all(p < n_caches for p in prev):
                return [j if p == j else "shared" for j, p in enumerate(prev)]
    raise CannotRestore(
        f"mlx-lm built {n_caches} caches for {len(layers)} layers; kvmesh cannot tell "
        "which layer each belongs to"
    )


def _submodules(model: Any) -> list[Any]:
    """Where a text model's own module may sit: the model, ``.model``, and a
    multimodal wrapper's ``.language_model`` (and its ``.model``)."""
    out = [model, getattr(model, "model", None)]
    lm = getattr(model, "language_model", None)
    out += [lm, getattr(lm, "model", None)]
    return [m for m in out if m is not None]


def _scorer(engine: MLXEngine) -> Scorer:
    """:meth:`MLXEngine.prompt_scorer`: every position's logits of a chunk, on a
    plain prompt cache (nothing recorded: it is never exported)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(engine.model)

    def score(ids: Sequence[int], targets: Sequence[int], top: int) -> Any:
        logits = engine.model(mx.array([list(ids)]), cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        want = mx.array(list(targets))
        token_lp = mx.take_along_axis(lp, want[:, None], axis=-1)[:, 0]
        if top <= 0:
            mx.eval(token_lp)
            return np.asarray(token_lp), np.zeros((len(ids), 0)), np.zeros((len(ids), 0))
        k = min(top, lp.shape[-1])
        idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        mx.eval(token_lp, idx, vals)
        order = np.argsort(-np.asarray(vals), axis=-1, kind="stable")
        top_ids = np.take_along_axis(np.asarray(idx), order, axis=-1)
        top_lp = np.take_along_axis(np.asarray(vals), order, axis=-1)
        return np.asarray(token_lp), top_ids, top_lp

    return score


class MLXEngine(EngineBase):
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
        self._every = 0  # positions between state checkpoints: the probe runs before the card
        self.card = card_from_hf_dir(
            self.path,
            engine="mlx",
            geometry=self._probe_or_off(cfg),
            quantization=json.dumps(quant, sort_keys=True) if quant else "none",
            block_tokens=block_tokens or DEFAULT_BLOCK_TOKENS,
            kv_quant=kv_quant_name(kv_bits, kv_group_size) if kv_bits else "none",
            block_digest=block_digest,
        )
        self._every = self.card.state_every * self.card.block_tokens
        self.layout = Layout(self.card)
        eos = self.tokenizer.eos_token_ids if hasattr(self.tokenizer, "eos_token_ids") else []
        self.eos_ids = frozenset(int(e) for e in eos)

    def _probe_or_off(self, cfg: dict[str, Any]) -> CacheGeometry:
        """:meth:`_probe`; a cache it cannot restore exactly turns reuse off (the
        model is still served: every prompt computed, nothing exported). Any other
        disagreement (a window, the KV options) stays an error at load."""
        try:
            return self._probe(cfg)
        except CannotRestore as e:
            self.reuse_off = str(e)
            text = cfg.get("text_config", cfg)
            layers = int(text.get("num_hidden_layers") or len(getattr(self.model, "layers", ())))
            self.n_caches, self.cache_of = 0, list[int | None]()
            return CacheGeometry("float32", tuple(LayerGeometry("none") for _ in range(layers)))

    def _probe(self, cfg: dict[str, Any]) -> CacheGeometry:
        """The real cache's geometry: a one-token forward into a fresh cache, each
        layer read off the cache it owns."""
        from mlx_lm.models.cache import make_prompt_cache

        built = make_prompt_cache(self.model)
        owners = _owners(self.model, len(built))
        windows = _windows(built, cfg)
        if self.kv_bits and any(windows):  # mlx-lm: "RotatingKVCache Quantization NYI"
            raise ConfigError("quantized KV (kv_bits) is not supported with sliding windows")
        self.n_caches = len(built)
        self.cache_of = [o if isinstance(o, int) else None for o in owners]
        try:
            cache, _ = self._forward(None, [0], 0)
        except ValueError as e:  # e.g. a KV group size mlx cannot quantize with
            raise ConfigError(f"mlx-lm cannot build this cache: {e}") from e
        except RuntimeError as e:  # e.g. gather_mm (MoE) in bfloat16 on the CPU
            hint = (
                " (mlx's CPU backend runs mixture-of-experts layers only in float32 or "
                "quantized: convert the model with mlx_lm.convert -q or --dtype float32)"
                if "GatherMM" in str(e) or "gather_mm" in str(e)
                else ""
            )
            raise ConfigError(f"mlx cannot run this model here: {e}{hint}") from e
        per_cache: list[LayerGeometry] = []
        dtypes: set[str] = set()
        for c, w in zip(cache, windows, strict=True):
            if _is_state(c):
                per_cache.append(LayerGeometry("state", state=_state_geometry(c)))
            else:
                dtype, heads, dim = _layer_geometry(c)
                dtypes.add(dtype)
                per_cache.append(LayerGeometry("kv", heads, dim, w))
        if len(dtypes) > 1:
            raise CannotRestore(f"cache layers differ in KV dtype: {sorted(dtypes)}")
        first_state = next((g.state[0][0] for g in per_cache if g.state), "float32")
        kv_dtype = dtypes.pop() if dtypes else first_state
        layers = tuple(per_cache[o] if isinstance(o, int) else LayerGeometry(o) for o in owners)
        return CacheGeometry(kv_dtype, layers)

    def new_cache(self) -> _Cache:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

        caches = make_prompt_cache(self.model)
        if self.kv_bits:
            caches = [
                QuantizedKVCache(self.kv_group_size, self.kv_bits) if type(c) is KVCache else c
                for c in caches
            ]
        out = _Cache(caches)
        out.states, out.pos = {}, 0
        return out

    # -- KV -------------------------------------------------------------------

    def importer(self, n_tokens: int, keep_from: Sequence[int] | None = None) -> _MLXImporter:
        if self.reuse_off is not None:
            raise CacheMiss(f"reuse is off for this model: {self.reuse_off}")
        return _MLXImporter(self, n_tokens, keep_from)

    def _forward(
        self, cache: Any, tokens: Sequence[int], start: int, checkpoint_end: bool = True
    ) -> tuple[Any, Any]:
        """With recurrent layers, the forward stops at every state checkpoint (a
        multiple of ``state_every`` blocks) to keep the state there; a prompt's
        forward (``checkpoint_end``) keeps the state at its end too (its tail is
        exported from it while decoding goes on) and after its last whole blocks
        (:func:`~kvmesh.blocks.last_block_stops`)."""
        mx = self.mx
        if cache is None:
            cache = self.new_cache()
        every, end = self._every, start + len(tokens)
        b = self.card.block_tokens if every else 0
        stops = last_block_stops(start, end, b, every) if every and checkpoint_end else []
        pieces = split_at(list(tokens), start, every, stops) if every else [list(tokens)]
        pos = start
        for piece in pieces:
            logits = self.model(mx.array([piece]), cache=cache)
            _record(cache, len(piece))
            pos += len(piece)
            last = piece is pieces[-1]
            out = logits[0, -1].astype(mx.float32) if last else None
            mx.eval(*([out] if last else []), *[a for c in cache for a in _arrays(c)])
            if every:
                cache.pos = pos
                if pos % every == 0 or pos in stops or (checkpoint_end and last):
                    self._checkpoint(cache, pos, every, replace=checkpoint_end)
        return cache, out

    def _advance(self, state: KVState) -> None:
        pending = state.tokens[state.cached :]
        state.cache, state.logits = self._forward(state.cache, pending, state.cached, False)
        state.cached = len(state.tokens)

    # -- recurrent state ------------------------------------------------------------

    def _live_states(self, cache: Sequence[Any]) -> States:
        return tuple(tuple(c.cache) if _is_state(c) else () for c in cache)

    def _checkpoint(self, cache: _Cache, pos: int, every: int, replace: bool = True) -> None:
        """Keep every recurrent cache's state at ``pos`` (copies of their own). A
        prompt's states off the checkpoint grid ``replace`` those before them
        (:func:`~kvmesh.blocks.stale_states`; decoding past a grid point keeps the
        prompt's: the next chat turn resumes there)."""
        b = self.card.block_tokens
        for p in stale_states(cache.states, pos, every, b) if replace else ():
            del cache.states[p]
        cache.states[pos] = tuple(tuple(_own(a) for a in s) for s in self._live_states(cache))

    def _kept_state(self, cache: Any, pos: int) -> bool:
        return pos in getattr(cache, "states", {})

    def _states_at(self, cache: Any, pos: int) -> States:
        states = getattr(cache, "states", {})
        if pos in states:
            return states[pos]  # type: ignore[no-any-return]
        if getattr(cache, "pos", -1) == pos:  # decoded to here: the live state
            return self._live_states(cache)
        raise CacheMiss(f"no recurrent state was kept at position {pos}")

    def _restore_states(
        self, cache: _Cache, n: int, at_n: States, states: Mapping[int, States]
    ) -> None:
        """Give ``cache``'s recurrent caches the state at ``n`` and the checkpoints
        up to it."""
        for c, parts in zip(cache, at_n, strict=True):
            if _is_state(c):
                c.cache = [_from_numpy(a, _NP_NAME[a.dtype]) if _raw(a) else a for a in parts]
        cache.states = {p: s for p, s in states.items() if p <= n}
        cache.pos = n

    def _positions(self, cache: Any) -> int | None:
        return cache.pos if self._every and cache is not None else None

    def exportable_from(self, state: KVState) -> int:
        return max((_lo(c) for c in state.cache), default=0) if state.cache is not None else 0

    def restorable(self, cache: Any, n: int) -> int:
        if not self._every or cache is None or self.reuse_off is not None:
            m = super().restorable(cache, n)
            # a trimmed import: a cut whose window reaches below what it holds computes
            return m if cache is None or m >= _floor(cache) else 0
        kept = [p for p in cache.states if p <= n]
        return max(kept + ([cache.pos] if cache.pos <= n else []), default=0)

    # -- batched decode ---------------------------------------------------------

    @property
    def batches(self) -> bool:
        # mlx-lm's BatchKVCache: plain KV caches of every layer only (no window,
        # no quantized KV, no shared layer, no recurrent state)
        return self.card.uniform and not any(self.card.sliding_windows) and not self.kv_bits

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
        """A new cache holding the first ``n_tokens`` positions; ``cache`` is
        untouched. With recurrent layers ``n_tokens`` must be :meth:`restorable`."""
        out = self.new_cache()
        for src, dst in zip(cache, out, strict=True):
            if not _is_state(src):
                lo = _lo(src)  # a trimmed import's rotating layer: from its low bound
                _set_parts(dst, _span(src, lo, n_tokens), n_tokens, lo)
        if self._every:
            at = self._states_at(cache, n_tokens)
            self._restore_states(out, n_tokens, at, cache.states)
        return out

    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        off = 0
        for i, specs in enumerate(self.layout.layers(stop - start)):
            if not specs:  # no K/V of its own (shared, recurrent, none)
                continue
            c = self.cache_of[i]
            assert c is not None  # a KV layer has a cache of its own (probed)
            for spec, src in zip(specs, _span(cache[c], start, stop), strict=True):
                if _dtype_name(src) != spec.dtype:  # never write one dtype's bytes as another's
                    raise ConfigError(f"cache holds {_dtype_name(src)}, the card says {spec.dtype}")
                arr = _to_numpy(src[0])
                np.frombuffer(out[off : off + arr.nbytes], arr.dtype).reshape(arr.shape)[...] = arr
                off += arr.nbytes

    def _write_state(self, cache: Any, pos: int, out: memoryview) -> None:
        at = self._states_at(cache, pos)
        off = 0
        for i, specs in enumerate(self.layout.states):
            if not specs:
                continue
            c = self.cache_of[i]
            assert c is not None  # a state layer has a cache of its own (probed)
            for spec, src in zip(specs, at[c], strict=True):
                arr = src if _raw(src) else _to_numpy(src)
                name = _NP_NAME[arr.dtype] if _raw(src) else _dtype_name(src)
                if (name, tuple(arr.shape)) != (spec.dtype, spec.shape):
                    raise ConfigError(f"state {name} {tuple(arr.shape)}, the card says {spec}")
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
        self,
        logits: Any,
        sampling: Sampling,
        rng: Any,
        counts: Mapping[int, int] | None = None,
        allowed: np.ndarray | None = None,
    ) -> int:
        x = np.asarray(logits, dtype=np.float64)
        if allowed is not None:  # a grammar's mask: the others never sampled
            x = np.where(allowed, x, -np.inf)
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

    def prompt_scorer(self, adapter: str | None = None) -> Scorer:
        if adapter is not None:
            raise ConfigError("the mlx engine serves no LoRA adapters")
        return _scorer(self)
