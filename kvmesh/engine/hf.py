"""The transformers (PyTorch) engine.

A block holds per layer ``[kv_heads, tokens, head_dim]``, K then V (the cache's
layout less the batch axis); bfloat16 travels as its raw 16-bit words. The card is
read off the cache a one-token probe forward fills and checked against the
config's windows (:func:`_probe_layers`); a disagreement is a :class:`ConfigError`
at load. A continuation from imported KV is bitwise the producer's continuation.

Cache layers:

- ``DynamicLayer`` (full attention): any prefix is exact.
- ``DynamicSlidingWindowLayer`` (window ``W``): live, its last ``W - 1`` positions
  as transformers keeps them; every position also in a *record* (:func:`_settle`
  after each forward), so any prefix is exported, cropped and restored as
  transformers holds it after computing it. The record costs what a full layer
  holds (``card.kv_bytes_per_token`` per position), which the head's KV budget
  reserves for every sequence and session.
- ``DummyLayer`` (Gemma 3n/4's KV-shared layers; layers without attention):
  ``shared`` / ``none`` in the card, nothing shipped.
- ``LinearAttentionLayer`` (Gated DeltaNet, Mamba2, short conv): its states cannot
  be cut back, so forwards stop every ``state_every`` blocks to keep a copy there
  (a checkpoint) and keep one at a prompt's end and after its last two whole
  blocks (those carry it: the next chat turn imports up to there); an import or
  crop ends on one (:meth:`TransformersEngine.restorable`).
- Anything else, or keys and values of different shapes (latent attention), turns
  reuse off: served, never exported or imported.

On the CPU every forward's linear layers take the kernel chosen for its row count
(:mod:`.kernels`): decode steps, lone or batched, and prefill chunks alike
(deterministic mode: prefill takes ``F.linear``, decode its row-invariant
kernel; :mod:`.deterministic`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import threading
import types
import warnings
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..blocks import (
    DEFAULT_BLOCK_TOKENS,
    MEDIA_BASE,
    last_block_stops,
    split_at,
    stale_states,
)
from ..codec import Block, Layout
from ..compat import LayerGeometry, kv_quant_params
from ..errors import CacheMiss, CannotRestore, ConfigError
from . import attention, lora, packed
from . import deterministic as det
from . import rows as seqs
from .attention import continuing
from .base import EngineBase
from .decode import Sampling
from .geometry import CacheGeometry, card_from_hf_dir

# KERNELS, MAX_ROWS_FIRST, MORE_ROWS, _BUCKETS, _calibrate: tests and bench import them from here
from .kernels import (  # noqa: F401
    _BUCKETS,
    KERNELS,
    MAX_ROWS_FIRST,
    MORE_ROWS,
    _agrees,
    _calibrate,
    _choose_kernels,
    _rows_first_linear,
    batched,
    pack_weights,
    packs,
)
from .mlp import fuse_gated_mlps
from .protocol import Scorer
from .sampling import distribution, greedy, safe_temperature
from .state import Importer, KVState
from .vision import Vision, sees_images

log = logging.getLogger("kvmesh.engine")

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}
_RECORD = "kvmesh_record"  # a sliding layer's K/V of every position [lo, cumulative_length)
_LO = "kvmesh_lo"  # a sliding layer's first recorded position (0 unless a trimmed import's)
# transformers >= 5.20's cache layers of KV-shared / recurrent layers; the 5.19 that
# vLLM 0.32 pins has neither (its models of those kinds then load with reuse off)
DummyLayer: Any = getattr(cache_utils, "DummyLayer", None)
LinearAttentionLayer: Any = getattr(cache_utils, "LinearAttentionLayer", None)
_STATES = "kvmesh_states"  # on a cache: {position: per layer, its state tensors then}
_POS = "kvmesh_pos"  # on a cache with recurrent layers: the positions it holds


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view sharing memory (bfloat16 as its raw 16-bit pattern)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()


def _frombuffer(view: memoryview, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # blobs are read-only bytes; we never write through this
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype)


# -- cache layers -------------------------------------------------------------


def _sliding(layer: Any) -> bool:
    return type(layer) is DynamicSlidingWindowLayer  # subclasses keep other state


def _holds_kv(layer: Any) -> bool:
    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def _recurrent(layer: Any) -> bool:
    return type(layer) is LinearAttentionLayer


def _layer_window(layer: Any) -> int:
    """The window a cache layer really applies (0 = full attention, or no KV)."""
    if type(layer) in (DynamicLayer, DummyLayer, LinearAttentionLayer):
        return 0
    if _sliding(layer) and int(layer.sliding_window) >= 2:
        return int(layer.sliding_window)
    raise CannotRestore(f"cache layer {layer!r} is not supported by the transformers adapter")


def _state_slots(layer: Any) -> list[tuple[str, int]]:
    """Which tensors a recurrent layer's state is, in wire order: per state index,
    its conv state then its recurrent state (either may be absent: LFM2 has no
    recurrent state)."""
    slots = []
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            slots.append(("conv", i))
        if layer.is_recurrent_states_initialized[i]:
            slots.append(("rec", i))
    return slots


def _state_parts(layer: Any, slots: Sequence[tuple[str, int]]) -> tuple[torch.Tensor, ...]:
    return tuple(
        (layer.conv_states if kind == "conv" else layer.recurrent_states)[i] for kind, i in slots
    )


def _set_state(layer: Any, slots: Sequence[tuple[str, int]], parts: Sequence[torch.Tensor]) -> None:
    """Make a recurrent layer hold ``parts`` (its own copies: the model updates a
    recurrent state in place), as after a forward that ended there."""
    for (kind, i), t in zip(slots, parts, strict=True):
        t = t.clone()
        if kind == "conv":
            layer.conv_states[i], layer.conv_kernel_size[i] = t, int(t.shape[-1])
            layer.is_conv_states_initialized[i] = True
        else:
            layer.recurrent_states[i] = t
            layer.is_recurrent_states_initialized[i] = True
        layer.has_previous_state[i] = True
        layer.dtype, layer.device = t.dtype, t.device


def _record_past(layer: Any) -> None:
    """Make ``layer`` keep what a forward gives it until :func:`_settle` has seen it.
    transformers >= 5.25 can also keep per-token recurrent states
    (``recurrent_states_to_keep``, ``None`` by default, which its models cannot
    read): kvmesh checkpoints states itself, so it asks for none."""
    layer.activate_past_recording()
    if _recurrent(layer):
        layer.recurrent_states_to_keep = 0


def _drop_state_history(layer: Any) -> None:
    """transformers >= 5.25 appends a copy of a recording layer's recurrent state to
    its history on every forward (for a later ``crop``, which kvmesh never asks
    for): dropped after each forward, so a long decode holds one state, not one
    per step."""
    for past in (getattr(layer, "recurrent_states_history", None) or {}).values():
        past.clear()


def _set_length(layer: Any, n: int) -> None:
    """transformers >= 5.25 counts a recurrent layer's positions itself: a model
    whose first layer is recurrent takes its past length (so the positions of the
    next tokens) from that count."""
    length = getattr(layer, "cumulative_length_linear", None)
    if length is not None:
        length.fill_(n)


def _trim_conv(layer: Any) -> None:
    """A recording conv state keeps every column it was given: cut it to the
    kernel's width, zeros on the left when fewer came, exactly what transformers
    keeps without recording (the next forward concatenates: nothing is written
    in place, so a checkpoint's tensors stay what they were)."""
    for i, k in layer.conv_kernel_size.items():
        t = layer.conv_states[i]
        if t is None or k is None:
            continue
        w = t.shape[-1]
        layer.conv_states[i] = (
            t[..., -k:] if w >= k else torch.nn.functional.pad(t, (k - w, 0), value=0)
        )


def _config_windows(config: Any) -> tuple[int, ...]:
    """Per-layer windows as the loaded config object states them (0 = full)."""
    text = config.get_text_config(decoder=True)
    window = int(getattr(text, "sliding_window", None) or 0)
    types = getattr(text, "layer_types", None)
    if types is None:  # transformers then makes every layer sliding iff sliding_window is set
        if getattr(text, "attention_chunk_size", None):
            raise ConfigError("chunked attention is not supported by the transformers adapter")
        return (window,) * int(text.num_hidden_layers)
    if "chunked_attention" in types:  # cached as sliding, masked otherwise
        raise ConfigError("chunked attention is not supported by the transformers adapter")
    # any other type (full, linear, conv, mlp, ...) holds no window: the probe checks
    # that the cache layers transformers built are ones this adapter restores
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _probe_layers(
    cache: Any, config: Any, dtype: torch.dtype
) -> tuple[CacheGeometry, dict[int, list[tuple[str, int]]]]:
    """The geometry of ``cache`` after a one-token forward, checked against the loaded
    ``config`` (per layer its attention KV, its recurrent state, or nothing of its
    own), and each recurrent layer's state slots. A layer it cannot describe is
    :class:`CannotRestore`; a disagreement with the config, a :class:`ConfigError`."""
    dtypes: set[str] = set()
    layers = []
    slots: dict[int, list[tuple[str, int]]] = {}
    shared_from = _first_shared_layer(config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DummyLayer:
            layers.append(LayerGeometry("shared" if i >= shared_from else "none"))
        elif _recurrent(layer):
            slots[i] = _state_slots(layer)
            layers.append(_state_geometry(i, _state_parts(layer, slots[i])))
        elif _holds_kv(layer):
            layers.append(_kv_geometry(i, layer, dtypes))
        else:
            raise CannotRestore(f"cache layer {i} ({type(layer).__name__}) is not supported")
    # a layer without KV of its own keeps no window (a KV-shared one attends
    # through its producer's)
    windows = tuple(g.window for g in layers)
    stated = tuple(
        w if g.has_kv else 0 for w, g in zip(_config_windows(config), layers, strict=True)
    )
    if windows != stated:
        raise ConfigError(f"the cache applies windows {windows}, the config states {stated}")
    if len(dtypes) > 1:
        raise ConfigError(f"cache layers differ in KV dtype: {sorted(dtypes)}")
    kv_dtype = dtypes.pop() if dtypes else _DTYPES[dtype]
    return CacheGeometry(kv_dtype, tuple(layers)), slots


def _state_geometry(i: int, parts: Sequence[torch.Tensor]) -> LayerGeometry:
    if not parts or any(t.dtype not in _DTYPES for t in parts):
        raise CannotRestore(f"cache layer {i}: a recurrent state kvmesh cannot ship")
    spec = tuple((_DTYPES[t.dtype], tuple(int(d) for d in t.shape)) for t in parts)
    return LayerGeometry("state", state=spec)


def _kv_geometry(i: int, layer: Any, dtypes: set[str]) -> LayerGeometry:
    """An attention layer's geometry; its KV dtype is added to ``dtypes``."""
    k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.ndim != 4:
        raise CannotRestore(f"cache layer {i} holds no KV after a forward")
    if (k.dtype, k.shape) != (v.dtype, v.shape) or k.dtype not in _DTYPES:
        raise CannotRestore(
            f"cache layer {i}: keys {k.dtype} {tuple(k.shape)} and values {v.dtype} "
            f"{tuple(v.shape)} are not one K/V geometry (latent attention?)"
        )
    dtypes.add(_DTYPES[k.dtype])
    return LayerGeometry("kv", int(k.shape[1]), int(k.shape[3]), _layer_window(layer))


def _first_shared_layer(config: Any) -> int:
    """The first layer that attends to another's KV (Gemma 3n/4's
    ``num_kv_shared_layers``); layers past the count."""
    text = config.get_text_config(decoder=True)
    shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    return int(text.num_hidden_layers) - shared if shared else 1 << 30


def _record(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    return getattr(layer, _RECORD, None)


def _lo(layer: Any) -> int:
    """A layer's first recorded position: above 0 only for a sliding layer of a
    trimmed import (and caches cut or continued from it)."""
    return int(getattr(layer, _LO, 0))


def _span(layer: Any, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of positions [start, stop) of one layer: a full layer's own tensors, a
    sliding layer's record (every position it was given or computed from its
    :func:`_lo` on: a trimmed import never had the earlier ones)."""
    if _sliding(layer):
        rec, lo = _record(layer), _lo(layer)
        if rec is None or start < lo or stop > lo + rec[0].shape[-2]:
            raise CacheMiss(f"positions [{start}, {stop}) were not recorded")
        k, v = rec
        start, stop = start - lo, stop - lo
    else:
        k, v = layer.keys, layer.values
        if stop > k.shape[-2]:
            raise CacheMiss(f"positions [{start}, {stop}) are not in the cache")
    return k[:, :, start:stop], v[:, :, start:stop]


def _restore(layer: Any, k: torch.Tensor, v: torch.Tensor, n: int, lo: int = 0) -> None:
    """Make ``layer`` hold positions [0, n), given as (K, V) of [lo, n), in the state
    transformers leaves after computing them (device, dtype, length, trimmed window):
    a sliding layer keeps its last ``W - 1`` positions live (views of ``k``, ``v``:
    attention sees the very values the producer's did) and the given ones as its
    record. ``lo`` > 0 only for a sliding layer whose live window lies within
    [lo, n): :class:`CacheMiss` otherwise, before the layer is touched."""
    if lo and (not _sliding(layer) or n - lo < layer.sliding_window - 1):
        raise CacheMiss(f"positions [0, {lo}) of a layer are not held: cannot restore {n}")
    layer.lazy_initialization(k, v)  # device, is_initialized, the window tensor's device
    if _sliding(layer):
        keep = layer.sliding_window - 1
        layer.cumulative_length = n
        setattr(layer, _RECORD, (k, v))
        setattr(layer, _LO, lo)
        if n > keep:  # transformers keeps only the last W - 1 positions
            k, v = k[:, :, -keep:], v[:, :, -keep:]
    layer.keys, layer.values = k, v


def _lowest(cache: Any) -> int:
    """The first position every layer of ``cache`` holds."""
    return max((_lo(ly) for ly in cache.layers), default=0)


def _floor(cache: Any) -> int:
    """The fewest positions ``cache`` can be cut back to other than none: a trimmed
    sliding layer's live window (its last ``W - 1``) must lie past its low bound."""
    return max(
        (_lo(ly) + ly.sliding_window - 1 for ly in cache.layers if _sliding(ly) and _lo(ly)),
        default=0,
    )


def _settle(cache: Any, new: int) -> None:
    """After a forward of ``new`` tokens: append their K/V to each sliding layer's
    record, then trim the layer to its last W - 1 positions exactly as transformers
    does without ``record_past`` (the same view of the same tensor); cut each
    recurrent layer's conv state to its kernel."""
    for layer in cache.layers:
        if _recurrent(layer):
            _trim_conv(layer)
            _drop_state_history(layer)
        if not _sliding(layer):
            continue
        rec = _record(layer)
        if rec is not None:  # one copy per forward, as a full layer's own cache grows
            k, v = layer.keys[:, :, -new:], layer.values[:, :, -new:]
            setattr(layer, _RECORD, (torch.cat([rec[0], k], -2), torch.cat([rec[1], v], -2)))
        elif layer.keys.shape[-2] == layer.cumulative_length:  # a first forward: all of it
            setattr(layer, _RECORD, (layer.keys, layer.values))  # shared with the live view
        keep = layer.sliding_window - 1
        if layer.keys.shape[-2] > keep:
            layer.keys = layer.keys[:, :, -keep:, :]
            layer.values = layer.values[:, :, -keep:, :]


class _TorchImporter(Importer):
    """Layers' K and V live in buffers ``[2 * layers, heads, n, head_dim]`` (K0, V0,
    K1, ...): one for all layers of a full-attention model of one geometry, one per
    layer otherwise (a sliding layer's record then pins only its own positions, as
    the layer's own cache would; layers of other head dims cannot share one). A
    block's KV payload is those tensors back to back, in that order, so it is
    imported with one strided copy per buffer (NumPy releases the GIL for it). Each
    layer's K and V are views of its buffer (see :meth:`TransformersEngine.detach`).
    A block that carries recurrent state leaves a copy of it: the cache restores
    from the last of them and keeps the others as checkpoints.

    The buffers are allocated when the first block arrives, on the thread that
    copies it (a fetch's hasher: see :meth:`kvmesh.mesh.client.MeshClient.warm`).
    In a head every thread shares one pre-faulted heap (:func:`kvmesh.memory.one_heap`);
    in a process that could not set that up first, the hashers' heaps are the
    ones warmed, not the request thread's that opened the importer.

    With ``keep_from`` each layer has a buffer of its own holding positions
    ``[keep_from[i], n)`` (a trimmed sliding layer's earlier ones never arrive);
    :meth:`cache` marks the layer's record with that low bound (``kvmesh_lo``)."""

    def __init__(
        self, engine: TransformersEngine, n_tokens: int, keep_from: Sequence[int] | None = None
    ) -> None:
        super().__init__(n_tokens, engine.layout, keep_from)
        c = engine.card
        if kv_quant_params(c.kv_quant) is not None:
            raise ValueError("the torch engine keeps an unquantized KV cache")
        self.engine = engine
        self._dtype = _BY_NAME[c.kv_dtype]  # the card's (probed) dtype: the cache's
        self._np_dtype = _NP[self._dtype]
        kv = [i for i, g in enumerate(c.geometry) if g.has_kv]
        one = c.uniform and not any(c.sliding_windows) and keep_from is None
        self._groups = [kv] if one else [[i] for i in kv]  # layers per buffer
        self._geometry = c.geometry
        self._lo = _low_bounds(engine, n_tokens, self.keep_from)
        self._alloc = threading.Lock()
        self._kv: list[torch.Tensor] | None = None
        self._states: dict[int, tuple[tuple[torch.Tensor, ...], ...]] = {}

    def _shape(self, group: Sequence[int], tokens: int) -> tuple[int, int, int, int]:
        g = self._geometry[group[0]]
        return (2 * len(group), g.kv_heads, tokens, g.head_dim)

    def _buffers(self) -> list[torch.Tensor]:
        with self._alloc:
            if self._kv is None:
                n = self.n_tokens
                self._kv = [
                    torch.empty(self._shape(g, n - self._lo[g[0]]), dtype=self._dtype)
                    for g in self._groups
                ]
            return self._kv

    def _copy(self, block: Block) -> None:
        if self.keep_from is not None:
            self._copy_layers(block)
        else:
            self._copy_whole(block)
        if block.header.states:
            self._keep_state(block)

    def _copy_whole(self, block: Block) -> None:
        t, a = block.header.tokens, block.header.start
        # add() checked the block against the card: its payload starts with exactly
        # these K/V tensors, in the buffers' order
        payload, off = block.payload(), 0
        for g, buf in zip(self._groups, self._buffers(), strict=True):
            shape = self._shape(g, t)
            count = shape[0] * shape[1] * t * shape[3]
            src = np.frombuffer(payload, self._np_dtype, count=count, offset=off)
            _np(buf)[:, :, a : a + t] = src.reshape(shape)
            off += count * src.itemsize

    def _copy_layers(self, block: Block) -> None:
        """A (possibly trimmed) block's wanted layers, each into its own buffer at
        its offset (a layer's positions before its low bound are dropped)."""
        t = block.header.tokens
        bufs = dict(zip((g[0] for g in self._groups), self._buffers(), strict=True))
        for i, parts, skip, at in self._spans(block, self._lo):
            dst = _np(bufs[i])[:, :, at : at + t - skip]
            for j, (spec, view) in enumerate(parts):  # K then V
                src = np.frombuffer(view, self._np_dtype).reshape(spec.shape)
                dst[j] = src[:, skip:]

    def _keep_state(self, block: Block) -> None:
        per: list[list[torch.Tensor]] = [[] for _ in self._geometry]
        for i, spec, view in block.state_tensors():  # copies: a view would keep the block
            t = _frombuffer(view, _BY_NAME[spec.dtype]).view(spec.shape).clone()
            per[i].append(t)
        end = block.header.start + block.header.tokens
        with self._alloc:
            self._states[end] = tuple(tuple(p) for p in per)

    def cache(self) -> Any:
        """The cache of the imported positions; with recurrent layers, of those up
        to the last block that carried their state (an import ends on one)."""
        eng, n = self.engine, self.n_tokens
        cache = eng._new_cache()
        if eng.card.state_every:
            n = max((p for p in self._states if p <= n), default=0)
            if not n:
                return None
        dev, lows = eng.device, self._lo
        views = {
            layer: (buf[2 * j : 2 * j + 1], buf[2 * j + 1 : 2 * j + 2])
            for group, buf in zip(self._groups, self._buffers(), strict=True)
            for j, layer in enumerate(group)
        }
        for i, layer in enumerate(cache.layers):
            if i in views:
                k, v = (t[:, :, : n - lows[i]] for t in views[i])
                _restore(layer, k.to(dev), v.to(dev), n, lows[i])
        if eng.card.state_every:
            eng._restore_states(cache, n, self._states[n], dict(self._states))
        return det.mark(cache, n) if eng.grid else cache


def _low_bounds(
    engine: TransformersEngine, n: int, keep_from: Sequence[int] | None
) -> tuple[int, ...]:
    """Per layer, the first position an import holds (all 0 without ``keep_from``),
    checked so that the import restores: 0 for a full-attention layer; a sliding
    layer's live window (its last ``W - 1`` of ``n``) within what it holds."""
    c = engine.card
    if keep_from is None:
        return (0,) * c.num_layers
    if c.state_every or engine.grid:  # imports end on positions only a checkpoint knows
        raise ValueError("this card's imports are never trimmed")
    for i, (lo, g) in enumerate(zip(keep_from, c.geometry, strict=True)):
        if not g.has_kv:
            continue
        if not 0 <= lo <= n or (lo and (not g.window or n - lo < g.window - 1)):
            raise ValueError(f"layer {i} (window {g.window}) cannot be imported from {lo} of {n}")
    return tuple(lo if g.has_kv else 0 for lo, g in zip(keep_from, c.geometry, strict=True))


GROW = 32  # positions a batch cache holds beyond its width: a copy every GROW steps
MAX_BATCHES = 4  # live batch caches kept per engine (one per group of similar lengths)


def _write_in_place(
    layer: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DynamicLayer.update`` for a batch cache: the new positions are written into
    the layer's buffers (``kvmesh_buf``) after those it holds, instead of copying all
    of them into a new tensor; a full buffer is first copied into one ``GROW``
    positions longer. Rows handed out as views never see the write: it lies past them."""
    bk, bv = layer.kvmesh_buf
    w, q = layer.keys.shape[-2], key_states.shape[-2]
    if w + q > bk.shape[-2]:
        shape = (*bk.shape[:2], w + q + GROW, bk.shape[-1])
        nk, nv = bk.new_empty(shape), bv.new_empty(shape)
        nk[:, :, :w], nv[:, :, :w] = bk[:, :, :w], bv[:, :, :w]
        bk, bv = layer.kvmesh_buf = (nk, nv)
    bk[:, :, w : w + q], bv[:, :, w : w + q] = key_states, value_states
    layer.keys, layer.values = bk[:, :, : w + q], bv[:, :, : w + q]
    return layer.keys, layer.values


@dataclass(eq=False)
class _Batch:
    """A batch cache that persists between steps of the same states: row ``i`` holds
    ``states[i]``'s ``lens[i]`` positions right-aligned at ``width``, zeros before;
    ``caches`` are the row caches last handed to the states (if a state's cache or
    length changed since, the batch is stale and rebuilt)."""

    cache: Any
    states: list[KVState]
    caches: list[Any]
    lens: list[int]
    mask: torch.Tensor  # [rows, width]: 1 where a row holds a position

    @classmethod
    def build(cls, engine: TransformersEngine, states: Sequence[KVState]) -> _Batch:
        lens = [s.cached for s in states]
        width = max(lens)
        cache = engine._new_cache()
        for i, layer in enumerate(cache.layers):
            k0 = states[0].cache.layers[i].keys
            shape = (len(states), k0.shape[1], width + GROW, k0.shape[3])
            ks, vs = k0.new_zeros(shape), k0.new_zeros(shape)
            for row, (s, n) in enumerate(zip(states, lens, strict=True)):
                ks[row, :, width - n : width] = s.cache.layers[i].keys[0, :, :n]
                vs[row, :, width - n : width] = s.cache.layers[i].values[0, :, :n]
            _restore(layer, ks[:, :, :width], vs[:, :, :width], width)
            layer.kvmesh_buf = (ks, vs)
            layer.update = types.MethodType(_write_in_place, layer)
        mask = torch.ones((len(states), width), dtype=torch.long, device=engine.device)
        for row, n in enumerate(lens):
            mask[row, : width - n] = 0
        return cls(cache, list(states), [s.cache for s in states], lens, mask)

    def current(self, states: Sequence[KVState]) -> bool:
        return all(
            a is s and s.cache is c and s.cached == n
            for a, s, c, n in zip(self.states, states, self.caches, self.lens, strict=True)
        )

    def grow_mask(self) -> torch.Tensor:
        """The mask with one column more: every row's new token."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.lens), 1))], 1)
        return self.mask

    def advanced(self, engine: TransformersEngine, states: Sequence[KVState], logits: Any) -> None:
        """After the forward: each state gets its row (views) and logits."""
        width = self.mask.shape[1]
        self.lens = [n + 1 for n in self.lens]
        self.caches = []
        for row, (s, n) in enumerate(zip(states, self.lens, strict=True)):
            own = engine._new_cache()
            for src, dst in zip(self.cache.layers, own.layers, strict=True):
                span = slice(width - n, None)
                _restore(
                    dst, src.keys[row : row + 1, :, span], src.values[row : row + 1, :, span], n
                )
            if engine.grid:  # a decode step: canonical as far as before it
                det.cropped(s.cache, own, n)
            s.cache, s.logits, s.cached = own, logits[row, -1].float(), n
            self.caches.append(own)


@torch.inference_mode()
def _prefill_rows(
    engine: TransformersEngine, states: Sequence[KVState], chunks: Sequence[int]
) -> None:
    """:meth:`TransformersEngine.prefill_batch` of two or more states in one forward."""
    pasts = [s.cached for s in states]
    for s, q in zip(states, chunks, strict=True):
        if q < 1 or s.cached + q > len(s.tokens):
            raise ValueError(f"chunk of {q} tokens at {s.cached} of {len(s.tokens)}")
    width, q_max, rows = max(pasts), max(chunks), len(states)
    cache = engine._new_cache()
    if width:
        _pad_pasts(cache, states, width)
    ids = torch.zeros((rows, q_max), dtype=torch.long, device=engine.device)
    mask = torch.zeros((rows, width + q_max), dtype=torch.long, device=engine.device)
    for row, (s, n, q) in enumerate(zip(states, pasts, chunks, strict=True)):
        ids[row, :q] = torch.tensor(s.tokens[n : n + q], device=engine.device)
        mask[row, width - n : width + q] = 1
    last = sorted({q - 1 for q in chunks})  # the positions whose logits are kept
    keep = torch.tensor(last, dtype=torch.long, device=engine.device)
    kw = {engine._cache_kw: cache}
    with batched(engine._prefill_kernels()), _rows(states):
        out = engine.model(
            **_inputs(engine, ids, width),
            attention_mask=mask,
            position_ids=_positions(engine, pasts, q_max),
            use_cache=True,
            logits_to_keep=keep,
            **kw,
        )
    for row, (s, n, q) in enumerate(zip(states, pasts, chunks, strict=True)):
        own = engine._new_cache()
        span = slice(width - n, width + q)
        for src, dst in zip(cache.layers, own.layers, strict=True):
            k = src.keys[row : row + 1, :, span].clone()
            v = src.values[row : row + 1, :, span].clone()
            _restore(dst, k, v, n + q)
        s.cache, s.logits, s.cached = own, out.logits[row, last.index(q - 1)].float(), n + q


def _pad_pasts(cache: Any, states: Sequence[KVState], width: int) -> None:
    """Fill ``cache`` with every state's cached positions right-aligned at
    ``width``, zeros before (a state with none: a row of zeros)."""
    ref = next(s.cache for s in states if s.cached)
    for i, layer in enumerate(cache.layers):
        k0 = ref.layers[i].keys
        shape = (len(states), k0.shape[1], width, k0.shape[3])
        ks, vs = k0.new_zeros(shape), k0.new_zeros(shape)
        for row, s in enumerate(states):
            n = s.cached
            if n:
                ks[row, :, width - n :] = s.cache.layers[i].keys[0, :, :n]
                vs[row, :, width - n :] = s.cache.layers[i].values[0, :, :n]
        _restore(layer, ks, vs, width)


def _own_storage(cache: Any) -> None:
    """Clone each layer's K/V whose storage is larger than what the cache's layers
    view of it between them."""
    layers = [ly for ly in cache.layers if isinstance(getattr(ly, "keys", None), torch.Tensor)]
    held: dict[int, int] = {}  # storage -> bytes of it the cache's layers view
    for layer in layers:
        for t in (layer.keys, layer.values):
            ptr = t.untyped_storage().data_ptr()
            held[ptr] = held.get(ptr, 0) + t.nbytes
    for layer in layers:
        k = layer.keys
        storage = k.untyped_storage()
        if storage.nbytes() > held[storage.data_ptr()]:
            layer.keys, layer.values = k.clone(), layer.values.clone()


def _sample(
    logits: torch.Tensor,
    sampling: Sampling,
    rng: torch.Generator,
    counts: Mapping[int, int] | None,
    allowed: np.ndarray | None,
) -> int:
    """:meth:`TransformersEngine.sample`: greedy is one argmax on the logits' device,
    anything else samples on the CPU from :func:`distribution`."""
    if allowed is not None:  # a grammar's mask: the others never sampled (a copy)
        if logits.device.type == "cpu":  # NumPy: one thread, never a torch pool's stall
            x = logits.detach().float().numpy()
            logits = torch.from_numpy(np.where(allowed, x, np.float32(-np.inf)))
        else:
            keep = torch.from_numpy(allowed).to(logits.device)
            logits = torch.where(keep, logits, float("-inf"))
    if counts and sampling.penalized:  # OpenAI: -= count * frequency + presence
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        n = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.clone()
        logits[ids] -= n * sampling.frequency_penalty + sampling.presence_penalty
    if not safe_temperature(sampling.temperature):  # greedy: one argmax on the device
        i = int(torch.argmax(logits).item())
        if not torch.isnan(logits[i]):
            return i
    x = logits.detach().float().cpu().numpy()
    p = distribution(x, sampling.temperature, sampling.top_p)
    if p is None:
        return greedy(x)  # NaN logits: never chosen
    return int(torch.multinomial(torch.from_numpy(p), 1, generator=rng).item())


def _scorer(engine: TransformersEngine, adapter: str | None) -> Scorer:
    """:meth:`TransformersEngine.prompt_scorer`: every position's logits of a chunk,
    on a plain cache (nothing recorded: it is never exported), with ``adapter``."""
    model = engine.model
    kw = {engine._cache_kw: cache_utils.DynamicCache(config=model.config)}

    @torch.inference_mode()
    def score(ids: Sequence[int], targets: Sequence[int], top: int) -> Any:
        x = torch.tensor([list(ids)], dtype=torch.long, device=engine.device)
        with lora.rows([adapter]):
            logits = model(input_ids=x, use_cache=True, logits_to_keep=0, **kw).logits[0]
        lp = torch.log_softmax(logits.float(), dim=-1)
        want = torch.tensor(list(targets), device=lp.device)
        token_lp = lp.gather(1, want[:, None])[:, 0].cpu().numpy()
        if top <= 0:
            return token_lp, np.zeros((len(ids), 0)), np.zeros((len(ids), 0))
        vals, idx = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        return token_lp, idx.cpu().numpy(), vals.cpu().numpy()

    return score


def _load_adapter(engine: TransformersEngine, name: str, path: str) -> bytes:
    """:meth:`TransformersEngine.load_adapter` (:mod:`.lora`); not in deterministic
    mode, whose kernels are row-invariant without a delta only."""
    if engine.grid:
        raise ConfigError("--lora is not served in deterministic mode")
    adapter = lora.load(engine.model, name, path, engine.dtype, engine.device)
    if engine.device.type != "cpu":  # on the CPU every linear layer is routed already
        _rows_first_linear(engine.model)
    lora.attach(engine.model, adapter, engine.adapters)
    return adapter.digest


def _load_model(
    path: Path, cfg: dict[str, Any], device: torch.device, dtype: str | None
) -> tuple[Any, torch.dtype]:
    """The model in ``path`` (config ``cfg``) on ``device`` for inference, and its
    dtype: ``dtype``, else the saved one (float32 on CPU: half-precision matmuls are
    slow there). A vision-language model is loaded whole, its tower included."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    saved = str(cfg.get("dtype") or cfg.get("torch_dtype"))  # transformers 5 writes "dtype"
    want = _BY_NAME[dtype] if dtype else _BY_NAME.get(saved, torch.float32)
    if device.type == "cpu" and want != torch.float32 and dtype is None:
        want = torch.float32
    auto = AutoModelForImageTextToText if sees_images(path, cfg) else AutoModelForCausalLM
    model = auto.from_pretrained(str(path), dtype=want, local_files_only=True)
    model.to(device)  # type: ignore[arg-type]  # (transformers types .to oddly)
    return model.eval(), want


def _go_deterministic(engine: TransformersEngine, grid: int) -> None:
    """Deterministic mode: the grid, the decode kernels, and a card that says so."""
    det.check("torch", grid, engine.block_tokens)
    c = engine.card
    if c.state_every or engine.reuse_off is not None or engine.device.type != "cpu":
        raise ConfigError(
            "--deterministic runs on the CPU, for models whose cache kvmesh restores "
            "exactly without recurrent state (this one: "
            f"{'recurrent state' if c.state_every else engine.reuse_off or engine.device})"
        )
    if engine.whole_pictures:  # its grid would stop forwards inside pictures
        raise ConfigError(
            "--deterministic cannot serve a model that attends both ways within a "
            "picture (use_bidirectional_attention: vision)"
        )
    # row-invariant batched decode: the compiled kernel (float32) at every row
    # count, SDPA row by row; otherwise each sequence decodes alone
    rows = (
        engine.dtype == torch.float32
        and engine.attn_implementation == "sdpa"
        and engine.batches
        and _agrees(
            "streamed", [m for m in engine.model.modules() if type(m) is torch.nn.Linear][:1], 1
        )
    )
    if rows:
        det.install_rowwise_sdpa()
        engine.kernels = {det.ANY_ROWS: "streamed"}
    engine.grid, engine._rowwise = grid, rows
    decode = "rows" if rows else "alone"
    engine.card = dataclasses.replace(
        c,
        engine=f"{c.engine}/deterministic:{det.kernel_family()}:decode={decode}",
        prefill_grid=grid,
    )


def _packable(engine: TransformersEngine) -> bool:
    """Plain full attention through the split implementation, nothing whose rows
    need more than their positions (pictures, a prefill grid, recurrent states)."""
    return (
        engine.attn_implementation == attention.NAME
        and engine.batches
        and not engine.grid
        and engine.vision is None
        and not engine.card.state_every
        and engine.reuse_off is None
    )


def _rides_checked(engine: TransformersEngine) -> bool:
    """:func:`_packable`, and a packed forward of a short prompt beside a decode
    step gives the logits their own forwards give (an architecture whose forward
    does anything else with its rows is left unpacked)."""
    if not _packable(engine):
        return False
    engine._rides = True
    try:
        with torch.inference_mode():
            rider = engine.prefill([1, 2, 3, 4, 5])
            rider.tokens.append(6)
            alone = engine.fork(rider)
            engine.decode_batch([alone])
            prompt = engine.begin_prefill([7, 8, 9])
            engine.prefill_riding(prompt, 3, [rider])
            lone = engine.prefill([7, 8, 9])
        return all(
            torch.allclose(a.logits, b.logits, rtol=1e-3, atol=1e-3 * float(b.logits.abs().max()))
            for a, b in ((rider, alone), (prompt, lone))
        )
    except Exception as e:
        log.info("decode steps do not ride prefill forwards on this model: %r", e)
        return False


@torch.inference_mode()
def _ride(engine: TransformersEngine, state: KVState, n: int, riders: Sequence[KVState]) -> None:
    """:meth:`TransformersEngine.prefill_riding`'s packed forward; on failure every
    cache is rolled back."""
    engine._drop(riders)  # a live batch holding a rider is stale from now on
    cache = state.cache if state.cache is not None else engine._new_cache()
    rows = packed.PackedRows(
        [cache, *(s.cache for s in riders)],
        [state.cached, *(s.cached for s in riders)],
        [n, *(1 for _ in riders)],
    )
    ids = state.tokens[state.cached : state.cached + n] + [s.tokens[s.cached] for s in riders]
    device = engine.device
    try:
        with batched(engine._prefill_kernels()), attention.packed(rows):
            out = engine.model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=rows.positions().to(device),
                attention_mask=rows.mask().to(device),
                use_cache=True,
                logits_to_keep=rows.last_rows().to(device),
                **{engine._cache_kw: rows},
            )
    except BaseException:
        rows.rollback()
        raise
    logits = out.logits[0].float()
    state.cache, state.cached, state.logits = cache, state.cached + n, logits[0]
    for i, s in enumerate(riders, 1):
        s.cached, s.logits = s.cached + 1, logits[i]


def _rows(states: Sequence[KVState]) -> Any:
    """Within it, the rows of a forward are ``states`` (:func:`kvmesh.engine.rows.forward_rows`)."""
    return seqs.forward_rows([s.adapter for s in states], [s.tokens for s in states])


def _positions(engine: TransformersEngine, starts: Sequence[int], width: int) -> torch.Tensor:
    """Row ``i``'s positions ``starts[i] + [0, width)`` as a forward takes them:
    [rows, width]; under M-RoPE [4, rows, width], those (the attention mask's) above
    each row's 3-D positions, counted over its whole sequence (the forward's
    :func:`kvmesh.engine.rows.sequences`)."""
    at = torch.tensor(list(starts), dtype=torch.long)[:, None]
    pos = (torch.arange(width, dtype=torch.long) + at).to(engine.device)
    if engine.vision is None or not engine.vision.mrope:
        return pos
    whole = seqs.sequences()
    if whole is None or len(whole) != len(starts):
        raise RuntimeError("an M-RoPE forward outside forward_rows() naming its sequences")
    turned = [engine.vision.positions(s, a, width) for s, a in zip(whole, starts, strict=True)]
    return torch.cat([pos[None], torch.stack(turned, dim=1).to(engine.device)])


def _inputs(engine: TransformersEngine, ids: torch.Tensor, past: int) -> dict[str, Any]:
    """A forward's inputs: ``ids`` (after ``past`` cached positions), or with media
    ids among them their images'."""
    if engine.vision is None or int(ids.max()) < MEDIA_BASE:
        return {"input_ids": ids}
    return engine.vision.inputs(ids, past)


class TransformersEngine(EngineBase):
    name = "torch"

    def __init__(
        self,
        path: Path,
        block_tokens: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        threads: int | None = None,
        block_digest: str = "blake3",
        deterministic_grid: int = 0,
        pack: bool = True,
    ) -> None:
        """``deterministic_grid`` > 0: deterministic mode on a prefill grid of that
        many tokens (:mod:`kvmesh.engine.deterministic`). ``pack=False`` keeps the
        plain weights whatever the kernel choice (``kernels.pack_weights``): for
        whoever swaps the kernel table, as the kernel tests do."""
        from transformers import AutoTokenizer, DynamicCache

        if threads:
            torch.set_num_threads(threads)
        self.path = Path(path)
        self.device = torch.device(device)
        cfg = json.loads((self.path / "config.json").read_text())
        self.model, want = _load_model(self.path, cfg, self.device, dtype)
        fuse_gated_mlps(self.model)  # the same numbers, in place
        self.vision = Vision(self.model, self.path) if sees_images(self.path, cfg) else None
        self.whole_pictures = self.vision is not None and self.vision.bidirectional
        self.kernels: dict[int, str] = {}  # batch size -> the kernel its linear layers take
        self._batches: dict[tuple[int, ...], _Batch] = {}  # live batch caches, oldest first
        self.grid, self._rowwise = 0, False  # deterministic mode (:func:`_go_deterministic`)
        self.adapters: dict[str, lora.Adapter] = {}  # LoRA adapters by name (load_adapter)
        if self.device.type == "cpu":
            _rows_first_linear(self.model)
            with torch.inference_mode():
                self.kernels = _choose_kernels(self.model)
        # transformers >= 5.20 names the cache argument ``cache``; earlier 5.x (which
        # vLLM 0.32 pins) still call it ``past_key_values``
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self._cache_cls = DynamicCache
        self.dtype = want
        # fixed per model by transformers (e.g. eager for Gemma-2's softcapping); shown, not guessed
        self.attn_implementation = str(getattr(self.model.config, "_attn_implementation", ""))
        if self._split_attention(deterministic_grid):
            self.model.set_attn_implementation(attention.implementations(self.model.config))
            self.attn_implementation = attention.NAME
        quant = cfg.get("quantization_config")
        self.block_tokens = block_tokens or DEFAULT_BLOCK_TOKENS
        self._state_every = 0  # the probe runs before the card says how often
        self.card = card_from_hf_dir(
            self.path,
            # attention kernels compute different numbers: part of the namespace
            engine=f"transformers/{self.attn_implementation or 'default'}",
            geometry=self._probe_or_off(),
            quantization=json.dumps(quant, sort_keys=True) if quant else "none",
            block_tokens=self.block_tokens,
            block_digest=block_digest,
        )
        self._state_every = self.card.state_every
        if deterministic_grid:
            _go_deterministic(self, deterministic_grid)
        elif pack and packs(self.kernels):  # deterministic prefills on F.linear: plain
            pack_weights(self.model)
        self.layout = Layout(self.card)
        self._rides = _rides_checked(self)
        eos = self.model.generation_config.eos_token_id
        eos_list = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.tokenizer.eos_token_id is not None:
            eos_list.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(int(e) for e in eos_list)

    def _split_attention(self, deterministic_grid: int) -> bool:
        """Whether a continuing prefill attends mask-free (:mod:`.attention`): SDPA
        on the CPU, outside deterministic mode (its card and numbers stay SDPA's)."""
        return (
            self.device.type == "cpu"
            and self.attn_implementation == "sdpa"
            and not deterministic_grid
            and attention.install()
        )

    def _probe(self) -> CacheGeometry:
        """The geometry of the cache a real forward fills (:func:`_probe_layers`)."""
        self._slots: dict[int, list[tuple[str, int]]] = {}
        with seqs.forward_rows([None], [[0]]):
            cache, _ = self._forward(None, [0], 0)
        geometry, self._slots = _probe_layers(cache, self.model.config, self.dtype)
        return geometry

    def _probe_or_off(self) -> CacheGeometry:
        """:meth:`_probe`; a cache it cannot describe exactly turns reuse off (the
        model is still served: every prompt computed, nothing exported)."""
        try:
            return self._probe()
        except CannotRestore as e:
            self.reuse_off = str(e)
            layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
            none = tuple(LayerGeometry("none") for _ in range(int(layers)))
            return CacheGeometry(_DTYPES.get(self.dtype, "float32"), none)

    # -- KV -------------------------------------------------------------------

    def _new_cache(self) -> Any:
        cache: Any = self._cache_cls(config=self.model.config)
        for layer in cache.layers:
            # keep whole states until _settle has recorded them; a recording
            # recurrent layer concatenates its conv state instead of writing in place
            if _sliding(layer) or _recurrent(layer):
                _record_past(layer)
        if self._state_every:
            setattr(cache, _STATES, {})
            setattr(cache, _POS, 0)
        return cache

    def importer(self, n_tokens: int, keep_from: Sequence[int] | None = None) -> _TorchImporter:
        if self.reuse_off is not None:
            raise CacheMiss(f"reuse is off for this model: {self.reuse_off}")
        return _TorchImporter(self, n_tokens, keep_from)

    @torch.inference_mode()
    def _forward(
        self,
        cache: Any,
        tokens: Sequence[int],
        start: int,
        checkpoint_end: bool = True,
        kernels: Mapping[int, str] | None = None,
    ) -> tuple[Any, Any]:
        """With recurrent layers, the forward stops at every state checkpoint
        (a multiple of ``state_every`` blocks) to keep the state there; a prompt's
        forward (``checkpoint_end``) keeps the state at its end too (its tail is
        exported from it while decoding goes on) and after its last whole blocks
        (:func:`~kvmesh.blocks.last_block_stops`). The linear layers take
        ``kernels`` (default: the prefill's, :meth:`_prefill_kernels`)."""
        if cache is None:
            cache = self._new_cache()
        every = self._state_every * self.block_tokens or self.grid
        end = start + len(tokens)
        stops = (
            last_block_stops(start, end, self.block_tokens, every)
            if self._state_every and checkpoint_end
            else []
        )
        pieces = split_at(list(tokens), start, every, stops) if every else [list(tokens)]
        if self.grid:
            det.advance(cache, start, [len(p) for p in pieces], self.grid)
        pos = start
        for piece in pieces:
            ids = torch.tensor([piece], dtype=torch.long, device=self.device)
            kw = {self._cache_kw: cache}
            if self.vision is not None and self.vision.mrope:
                kw["position_ids"] = _positions(self, [pos], len(piece))
            with batched(self._prefill_kernels() if kernels is None else kernels), continuing():
                out = self.model(**_inputs(self, ids, pos), use_cache=True, logits_to_keep=1, **kw)
            _settle(cache, len(piece))  # the cache was extended in place
            pos += len(piece)
            if self._state_every:
                setattr(cache, _POS, pos)
                if pos % every == 0 or pos in stops or (checkpoint_end and pos == end):
                    self._checkpoint(cache, pos, every, replace=checkpoint_end)
        return cache, out.logits[0, -1].float()

    def _advance(self, state: KVState) -> None:
        pending = state.tokens[state.cached :]
        # a lone step: its row count's kernel (deterministic: as a batch's row, or F.linear)
        kernels = self.kernels if self._rowwise or not self.grid else {}
        with _rows([state]):
            state.cache, state.logits = self._forward(
                state.cache, pending, state.cached, False, kernels
            )
        state.cached = len(state.tokens)

    def _prefill_kernels(self) -> Mapping[int, str]:
        """The kernel table a prefill forward takes: the chosen one, except in
        deterministic mode (a prefill's numbers must not depend on a measurement)."""
        return {} if self.grid else self.kernels

    # -- recurrent state ----------------------------------------------------------

    def _checkpoint(self, cache: Any, pos: int, every: int, replace: bool = True) -> None:
        """Keep every recurrent layer's state at ``pos`` (copies: the model updates
        them in place). A prompt's states off the checkpoint grid ``replace`` those
        before them (:func:`~kvmesh.blocks.stale_states`; decoding past a grid point
        keeps the prompt's: the next chat turn resumes there)."""
        states = getattr(cache, _STATES)
        for p in stale_states(states, pos, every, self.block_tokens) if replace else ():
            del states[p]
        states[pos] = tuple(
            tuple(t.clone() for t in _state_parts(layer, self._slots[i]))
            if i in self._slots
            else ()
            for i, layer in enumerate(cache.layers)
        )

    def _kept_state(self, cache: Any, pos: int) -> bool:
        return pos in getattr(cache, _STATES, {})

    def _states_at(self, cache: Any, pos: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        states = getattr(cache, _STATES, {})
        if pos in states:
            return states[pos]
        if getattr(cache, _POS, -1) == pos:  # decoded to here: the live state
            return tuple(
                _state_parts(layer, self._slots[i]) if i in self._slots else ()
                for i, layer in enumerate(cache.layers)
            )
        raise CacheMiss(f"no recurrent state was kept at position {pos}")

    def _restore_states(
        self,
        cache: Any,
        n: int,
        at_n: Sequence[Sequence[torch.Tensor]],
        states: Mapping[int, Any],
    ) -> None:
        """Give ``cache``'s recurrent layers the state at ``n`` and the checkpoints
        up to it."""
        dev = self.device
        for i, layer in enumerate(cache.layers):
            if i in self._slots:
                _set_state(layer, self._slots[i], [t.to(dev) for t in at_n[i]])
                _set_length(layer, n)
        setattr(cache, _STATES, {p: s for p, s in states.items() if p <= n})
        setattr(cache, _POS, n)

    def _positions(self, cache: Any) -> int | None:
        return getattr(cache, _POS, None) if self._state_every else None

    def exportable_from(self, state: KVState) -> int:
        return _lowest(state.cache) if state.cache is not None else 0

    def exportable(self, state: KVState) -> int:
        # deterministic: only what a cold run computes the same way (whole grid cells)
        if self.grid:
            return self.restorable(state.cache, state.cached)
        return super().exportable(state)

    def restorable(self, cache: Any, n: int) -> int:
        if self.grid and cache is not None:
            return det.restorable(cache, super().restorable(cache, n), self.grid)
        if not self._state_every or cache is None:
            m = super().restorable(cache, n)
            # a trimmed import: a cut whose window reaches below what it holds computes
            return m if cache is None or m >= _floor(cache) else 0
        held = getattr(cache, _POS)
        kept = [p for p in getattr(cache, _STATES) if p <= n]
        return max(kept + ([held] if held <= n else []), default=0)

    # -- batched decode ---------------------------------------------------------

    @property
    def batches(self) -> bool:
        # full attention of one geometry: padding is exact to mask (a recurrent
        # state would run over the padding)
        c = self.card
        plain = c.uniform and not any(c.sliding_windows)
        return plain and (not self.grid or self._rowwise)

    @property
    def rides(self) -> bool:
        return self._rides

    @torch.inference_mode()
    def prefill_riding(self, state: KVState, n: int, riders: Sequence[KVState]) -> None:
        """One forward: ``state``'s next ``n`` prompt tokens and each rider's pending
        token, packed end to end (:mod:`.packed`), each against its own cache; the
        linear layers take the kernel of the forward's row count."""
        if not (self._rides and riders) or any(s.adapter for s in (state, *riders)):
            super().prefill_riding(state, n, riders)
        else:
            _ride(self, state, n, riders)

    @torch.inference_mode()
    def decode_batch(self, states: Sequence[KVState]) -> None:
        """One forward for every state's pending token: the states' KV right-aligned
        in one batch cache (left padding hidden by the attention mask), each row at
        its own position; then each state gets its rows back as views. The batch
        cache persists (:class:`_Batch`): while the same states step together it is
        extended in place, so a step copies no KV (a rebuild copies each row once
        when the group changes, and every :data:`GROW` steps)."""
        key = tuple(id(s) for s in states)
        batch = self._batches.pop(key, None)
        if batch is None or not batch.current(states):
            # any batch holding one of these states is stale from now on: its buffer goes
            self._drop(states)
            if len(states) < 2 or not self.batches:
                super().decode_batch(states)
                return
            batch = _Batch.build(self, states)
        ids = torch.tensor([[s.tokens[s.cached]] for s in states], device=self.device)
        mask = batch.grow_mask()
        kw = {self._cache_kw: batch.cache}
        rows = det.rowwise([n + 1 for n in batch.lens]) if self._rowwise else nullcontext()
        # a failed forward leaves the batch half written: it is not kept
        with batched(self.kernels), rows, _rows(states):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=_positions(self, batch.lens, 1),
                use_cache=True,
                logits_to_keep=1,
                **kw,
            )
        batch.advanced(self, states, out.logits)
        self._batches[key] = batch
        while len(self._batches) > MAX_BATCHES:  # the least recently stepped goes
            self._batches.pop(next(iter(self._batches)))

    # -- batched prefill ----------------------------------------------------------

    def prefill_batch(self, states: Sequence[KVState], chunks: Sequence[int]) -> None:
        """One forward for the next ``chunks[i]`` prompt tokens of every state: each
        row's cached positions right-aligned at the longest (zeros before, hidden by
        the attention mask), its chunk after them, right-padded to the longest chunk
        (a pad query comes after its row's real tokens, so it attends to them and
        never to nothing); each row at its own positions. Each state then owns a
        copy of its row (the padded batch is freed at once) and the logits of its
        last computed position. One state alone is the single-sequence forward."""
        if self.grid:  # each prompt alone, its chunk stretched to end on the grid
            ends = [
                det.chunk_end(s.cached, q, len(s.tokens), self.grid)
                for s, q in zip(states, chunks, strict=True)
            ]
            super().prefill_batch(states, [e - s.cached for s, e in zip(states, ends, strict=True)])
            return
        if len(states) < 2 or not self.batches:
            super().prefill_batch(states, chunks)
            return
        _prefill_rows(self, states, chunks)

    def _drop(self, states: Sequence[KVState]) -> None:
        """Forget the live batches holding any of ``states``: so live batches never
        share a state, and their buffers are at most one copy of each state's KV."""
        ids = {id(s) for s in states}
        for key in [k for k in self._batches if ids.intersection(k)]:
            del self._batches[key]

    def detach(self, state: KVState) -> None:
        """Give ``state``'s layers storage of their own where they are views of a
        larger buffer they do not fill between them (a batch's rows, a crop), so
        that keeping the state does not keep the rest of that buffer alive. An
        import's buffer, which the state's layers fill exactly, is kept as is."""
        self._drop([state])  # a batch holding it would keep the whole buffer alive
        if state.cache is not None:
            _own_storage(state.cache)

    def _crop(self, cache: Any, n_tokens: int) -> Any:
        """A new cache holding the first ``n_tokens`` positions; ``cache`` is untouched
        (a session or a background export may still be reading it). With recurrent
        layers ``n_tokens`` must be :meth:`restorable`."""
        out = self._new_cache()
        for src, dst in zip(cache.layers, out.layers, strict=True):
            if _holds_kv(src):
                lo = _lo(src)  # a trimmed import's sliding layer: from its low bound
                k, v = _span(src, lo, n_tokens)  # a sliding layer's from its record
                _restore(dst, k, v, n_tokens, lo)
        if self._state_every:
            at = self._states_at(cache, n_tokens)
            self._restore_states(out, n_tokens, at, getattr(cache, _STATES))
        return det.cropped(cache, out, n_tokens) if self.grid else out

    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        c = self.card
        kv = _BY_NAME[c.kv_dtype]
        dst = np.frombuffer(out, _NP[kv])
        off = 0
        for layer in cache.layers:
            if not _holds_kv(layer):
                continue
            for src in _span(layer, start, stop):
                if src.dtype != kv:  # never reinterpret: the card must describe these bytes
                    raise ConfigError(f"cache holds {src.dtype}, the card says {c.kv_dtype}")
                src_np = _np(src[0])
                dst[off : off + src_np.size].reshape(src_np.shape)[...] = src_np
                off += src_np.size

    def _write_state(self, cache: Any, pos: int, out: memoryview) -> None:
        off = 0
        for layer_states, specs in zip(
            self._states_at(cache, pos), self.layout.states, strict=True
        ):
            for t, spec in zip(layer_states, specs, strict=True):
                if (_DTYPES.get(t.dtype), tuple(t.shape)) != (spec.dtype, spec.shape):
                    raise ConfigError(f"state {t.dtype} {tuple(t.shape)}, the card says {spec}")
                src = _np(t.contiguous())
                view = np.frombuffer(out[off : off + src.nbytes], src.dtype)
                view.reshape(src.shape)[...] = src
                off += src.nbytes

    def _write_logits(self, logits: Any, out: memoryview) -> None:
        _frombuffer(out, torch.float32).copy_(logits.detach().to("cpu", torch.float32))

    def _read_logits(self, view: memoryview) -> Any:
        return _frombuffer(view, torch.float32).to(self.device)

    # -- sampling -------------------------------------------------------------

    def new_rng(self, seed: int | None) -> Any:
        g = torch.Generator(device="cpu")
        if seed is not None:
            g.manual_seed(seed)
        else:
            g.seed()
        return g

    def sample(
        self,
        logits: Any,
        sampling: Sampling,
        rng: Any,
        counts: Mapping[int, int] | None = None,
        allowed: np.ndarray | None = None,
    ) -> int:
        return _sample(logits, sampling, rng, counts, allowed)

    def _log_softmax(self, logits: Any) -> np.ndarray:
        return torch.log_softmax(logits.float(), dim=-1).cpu().numpy()

    def prompt_scorer(self, adapter: str | None = None) -> Scorer:
        return _scorer(self, adapter)

    def load_adapter(self, name: str, path: str) -> bytes:
        return _load_adapter(self, name, path)
