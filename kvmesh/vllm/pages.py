"""vLLM pages as kvmesh blocks: the card of a vLLM cache, and page copies in and out.

A kvmesh block here is one vLLM page (``block_size`` tokens) over all attention
layers, keyed with kvmesh's chained keys over the page's tokens. vLLM's page is
opaque to kvmesh: on CPU (and FlashAttention-style backends) a layer's cache is
one tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` whose page
holds, per head, all keys then all values. The codec's per-layer "K then V"
specs, each ``[num_kv_heads, block_size, head_dim]``, cover exactly the bytes of
one layer's page, so a page travels as the first and second half of its bytes and
the codec's checks (namespace, key, sizes, digest) apply unchanged. Backends
that keep K and V apart (``[2, num_blocks, ...]``) map K to the first spec and V
to the second. Which layout a card's bytes are in is part of the card's engine
string, so two layouts never share a namespace. vLLM's FP8 pages are uint8
tensors whose bytes travel as stored, under a card whose KV dtype names the FP8
format (:data:`FP8`). A recurrent layer's page (vLLM's ``MambaSpec``: Gated
DeltaNet, Mamba) is one raw byte page holding its state tensors back to back,
which is exactly the codec's state of that layer; such a card leaves the state
to the producer (``STATE_WHERE_SAVED``): a page carries it when vLLM kept a
checkpoint at the page's end, and an import ends on a page that carries it
(:class:`StateCut`, the one place that rule is kept).
Pages on the CPU are copied through NumPy, never torch: the connector loads pages
on threads of its own, and a torch copy that large builds an OpenMP team on its
thread for the thread's life, which slows every forward of vLLM's own team (see
:mod:`kvmesh.runtime.ready`).
No vLLM import here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..blocks import BlockKeyer, Media, PrefixKeys, media_bytes
from ..codec import PREFIX, Block, Layout, new_blob
from ..compat import STATE_WHERE_SAVED, CompatCard, LayerGeometry
from ..errors import ConfigError, MalformedPayload
from ..mesh.hits import PeerHit

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# vLLM's FP8 KV cache (--kv-cache-dtype): the card's dtype; its pages are uint8 tensors
FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def storage_dtype(kv_dtype: str) -> str:
    """The dtype of vLLM's cache tensors for a card's KV dtype."""
    return "uint8" if kv_dtype in FP8.values() else kv_dtype


PAGED = "paged"  # [num_blocks, *page]: one contiguous page per block and layer
SPLIT_KV = "split_kv"  # [2, num_blocks, *half]: K pages and V pages apart


@dataclass(frozen=True)
class CacheSpec:
    """What vLLM says its cache is (from ``kv_cache_config``), before it is checked
    against the tensors it allocated."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str
    windows: tuple[int, ...] = ()  # per layer, the sliding window attention reads (0: all)
    # per layer, (KV heads, head dim) of its page; (0, 0): it holds none (it reads
    # another layer's KV, or holds recurrent state). () : every layer the scalars'
    kv: tuple[tuple[int, int], ...] = ()
    # per layer, a recurrent layer's state tensors (dtype, shape) in vLLM's page order;
    # () for an attention layer
    states: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...] = ()

    def layer_windows(self) -> tuple[int, ...]:
        return self.windows or (0,) * self.num_layers

    def layer_states(self) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
        return self.states or ((),) * self.num_layers

    def layer_kv(self) -> tuple[tuple[int, int], ...]:
        return self.kv or ((self.num_kv_heads, self.head_dim),) * self.num_layers

    def layer_geometry(self) -> tuple[LayerGeometry, ...]:
        """Each layer in the card: its recurrent state, its KV page, or ``shared``."""
        out = []
        for window, state, (heads, dim) in zip(
            self.layer_windows(), self.layer_states(), self.layer_kv(), strict=True
        ):
            if state:
                out.append(LayerGeometry("state", state=state))
            elif heads:
                out.append(LayerGeometry("kv", heads, dim, window))
            else:
                out.append(LayerGeometry("shared"))
        return tuple(out)


def model_card(
    model_dir: Path,
    tokenizer_dir: Path,
    cache: CacheSpec,
    *,
    engine: str,
    quantization: str = "none",
) -> CompatCard:
    """The card of ``model_dir`` served by vLLM with ``cache``. ``engine`` names vLLM's
    version, platform, attention backend, page layout, model dtype and execution
    mode (everything the numbers depend on that the other fields do not say)."""
    from ..engine.base import CacheGeometry, card_from_hf_dir

    card = card_from_hf_dir(
        model_dir,
        engine,
        CacheGeometry(cache.kv_dtype, cache.layer_geometry()),
        quantization,
        cache.block_size,
        tokenizer_dir=tokenizer_dir,
    )
    if any(cache.layer_states()):  # vLLM keeps a state where a prefill chunk ended
        card = dataclasses.replace(card, state_every=STATE_WHERE_SAVED)
    return card


def page_layout(tensors: Sequence[torch.Tensor], card: CompatCard) -> str:
    """:data:`PAGED` or :data:`SPLIT_KV` for vLLM's per-layer cache tensors, after
    checking each against the card (dtype, page size, contiguity): a disagreement
    is an error at start, never a silent re-reading."""
    if len(tensors) != card.num_layers:
        raise ConfigError(
            f"vLLM registered {len(tensors)} cache layers, the card says {card.num_layers}"
        )
    kinds = set()
    for i, t in enumerate(tensors):
        g = card.geometry[i]
        if g.state:
            _check_state_page(i, t, g)
        if not g.has_kv:  # a state page, or a layer reading another's KV: no KV page
            continue
        half = g.kv_heads * card.block_tokens * g.head_dim
        if _name(t.dtype) != storage_dtype(card.kv_dtype):
            raise ConfigError(f"cache layer {i} is {t.dtype}, the card says {card.kv_dtype}")
        if t.ndim >= 2 and t.shape[0] == 2 and _elements(t[0, 0]) == half:
            kind, page = SPLIT_KV, t[0, 0]
        elif _elements(t[0]) == 2 * half:
            kind, page = PAGED, t[0]
        else:
            raise ConfigError(
                f"cache layer {i} of shape {tuple(t.shape)} does not hold {card.summary()} pages"
            )
        if not page.is_contiguous():
            raise ConfigError(f"cache layer {i}: a page is not contiguous (strides {t.stride()})")
        kinds.add(kind)
    if len(kinds) != 1:
        raise ConfigError(f"cache layers mix page layouts: {sorted(kinds)}")
    return kinds.pop()


def _check_state_page(i: int, t: torch.Tensor, g: LayerGeometry) -> None:
    """A recurrent layer's cache: raw byte pages ``[num_blocks, ...]`` each holding
    at least the layer's state tensors back to back."""
    if not g.state or t.dtype not in (torch.int8, torch.uint8) or t.ndim < 2:
        raise ConfigError(f"cache layer {i} ({t.dtype}, {tuple(t.shape)}) is not a state page")
    if _elements(t[0]) < g.state_bytes or not t[0].is_contiguous():
        raise ConfigError(
            f"cache layer {i}: a page of {_elements(t[0])} bytes does not hold its "
            f"{g.state_bytes}-byte state contiguously"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _elements(t: torch.Tensor) -> int:
    return int(t.numel())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1) if t.ndim else t.reshape(1).view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Byte view ``src`` into byte view ``dst``: on the CPU through NumPy (no OpenMP
    team on the calling thread; the GIL released), elsewhere ``copy_``."""
    if dst.is_cpu and src.is_cpu:
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


#: One page's vLLM block ids: an int for a cache of one group, else one per KV cache
#: group (vLLM's hybrid manager), None where the group holds no page there (a
#: sliding window's blocks behind it).
PageIds = int | Sequence[int | None]


class Pages:
    """Copies whole pages between vLLM's cache tensors and kvmesh blocks. Layer
    ``i`` of the card is ``tensors[i]``, paged by KV cache group ``groups[i]``."""

    def __init__(
        self,
        card: CompatCard,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[int] | None = None,
    ) -> None:
        self.card = card
        self.layout = Layout(card)
        self.kind = page_layout(tensors, card)
        self.tensors = list(tensors)
        self.groups = list(groups) if groups is not None else [0] * len(self.tensors)
        if len(self.groups) != len(self.tensors):
            raise ConfigError(f"{len(self.groups)} group indices for {len(self.tensors)} layers")
        geometry = card.geometry[: card.num_layers]
        self._kv = [i for i, g in enumerate(geometry) if g.has_kv]
        self._state = [(i, g.state_bytes) for i, g in enumerate(geometry) if g.state]
        self._sizes = [p.numel() for p in self._parts(0) if p is not None]  # per part, bytes
        self.state_bytes = sum(n for _, n in self._state)
        self.page_bytes = sum(self._sizes) + self.state_bytes  # at most, with the state

    def _layer_ids(self, ids: PageIds) -> list[int | None]:
        if isinstance(ids, int):
            return [ids] * len(self.tensors)
        return [ids[g] for g in self.groups]

    def _parts(self, ids: PageIds) -> list[torch.Tensor | None]:
        """Byte views of one page, per attention layer K then V (a paged layer as its
        two halves); None, None for a layer whose group holds no page here."""
        out: list[torch.Tensor | None] = []
        layer_ids = self._layer_ids(ids)
        for i in self._kv:
            t, block_id = self.tensors[i], layer_ids[i]
            if block_id is None:
                out += [None, None]
            elif self.kind == SPLIT_KV:
                out += [_bytes(t[0, block_id]), _bytes(t[1, block_id])]
            else:
                page = _bytes(t[block_id])
                n = page.numel() // 2
                out += [page[:n], page[n:]]
        return out

    def _state_parts(self, ids: PageIds) -> list[torch.Tensor | None]:
        """Byte views of each recurrent layer's state in one page (None where its
        group holds no page here: no checkpoint)."""
        layer_ids = self._layer_ids(ids)
        out: list[torch.Tensor | None] = []
        for i, n in self._state:
            block_id = layer_ids[i]
            out.append(None if block_id is None else _bytes(self.tensors[i][block_id])[:n])
        return out

    def holds_kv(self, ids: PageIds) -> bool:
        """Whether vLLM holds every attention layer's page here (not behind a window)."""
        return None not in self._parts(ids)

    def holds_state(self, ids: PageIds) -> bool:
        """Whether vLLM holds every recurrent layer's state for this page."""
        return bool(self._state) and None not in self._state_parts(ids)

    def copy_out(
        self, keyer: BlockKeyer, keys: PrefixKeys, index: int, ids: PageIds, state: bool = False
    ) -> tuple[bytearray, object]:
        """One page's bytes in a new blob (header written), for :meth:`seal` off the
        model's path, with the recurrent state at its end when ``state``. The only
        work on the path is this one copy."""
        b = self.card.block_tokens
        header = self.layout.header(
            "block", keys.blocks[index], keyer.parent_of(keys, index), index * b, b, state
        )
        parts = self._parts(ids) + (self._state_parts(ids) if state else [])
        blob, view = new_blob(header)
        off = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns on buffers torch cannot own
            for part in parts:
                if part is None:
                    raise MalformedPayload(f"page {index} is not held by every cache group")
                n = part.numel()
                _copy(torch.frombuffer(view[off : off + n], dtype=torch.uint8), part)
                off += n
        if off != len(view):
            raise MalformedPayload("page bytes do not fill the block")
        return blob, header

    def seal(self, blob: bytearray, header: object) -> Block:
        return self.layout.seal(header, blob)  # type: ignore[arg-type]

    def copy_in(self, block: Block, ids: PageIds) -> None:
        """Copy a verified block's bytes into vLLM's pages ``ids`` (a group that holds
        no page there, a sliding window's below it, takes nothing; a recurrent
        layer's state only where the block carries one)."""
        specs = [spec for layer in block.header.layers for spec in layer]
        expected = [s for layer in self.layout.layers(self.card.block_tokens) for s in layer]
        if block.header.kind != "block" or specs != expected:
            raise MalformedPayload("block does not hold one page under this card")
        view = block.payload()
        off = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only source: copied from, never written
            for part, n in zip(self._parts(ids), self._sizes, strict=True):
                if part is not None:
                    _copy(part, torch.frombuffer(view[off : off + n], dtype=torch.uint8))
                off += n
            if not block.header.states:
                return
            for part, (_, n) in zip(self._state_parts(ids), self._state, strict=True):
                if part is not None:
                    _copy(part, torch.frombuffer(view[off : off + n], dtype=torch.uint8))
                off += n


class StateCut:
    """Where an import of a chain of pages can end: the one owner of the rule of a
    card that leaves the recurrent state to its producer (``STATE_WHERE_SAVED``: a
    hybrid model, whose state vLLM keeps only where a prefill chunk ended). On such
    a card a peer's hit, the stored chain and the pages loaded are all cut to the
    last page that carries a state; on any other card nothing is cut."""

    def __init__(self, layout: Layout) -> None:
        card = layout.card
        self.applies = card.state_optional
        self.block_tokens = card.block_tokens
        # the least announced size of a page that carries the state: a stateless
        # page's by more than half the state (for a peer that sets no flag)
        bare = layout.header("block", bytes(32), bytes(32), 0, card.block_tokens)
        self._least = PREFIX.size + len(bare.encode()) + bare.payload_bytes + card.state_bytes // 2

    def end(self, carries: Sequence[bool]) -> int:
        """How many of a chain's first pages an import can take, ``carries[i]`` saying
        whether page ``i`` carries the recurrent state: the rule itself."""
        if not self.applies:
            return len(carries)
        return max((i + 1 for i, c in enumerate(carries) if c), default=0)

    def blocks(self, blocks: Sequence[Block]) -> int:
        """How many of ``blocks`` (their headers say which carry a state) an import
        can take."""
        return self.end([bool(b.header.states) for b in blocks]) if self.applies else len(blocks)

    def hit(self, hit: PeerHit) -> PeerHit:
        """``hit`` cut to where an import can end, by what its lookup answer claims of
        each page: its ``states`` flag, or from a peer that sets none, its announced
        size. Either is a claim: the fetched block is checked again."""
        if not self.applies:
            return hit
        n = self.end([self._announced(b) for b in hit.blocks])
        return dataclasses.replace(hit, blocks=hit.blocks[:n], tokens=n * self.block_tokens)

    def _announced(self, info: Any) -> bool:
        return bool(info.states) if info.HasField("states") else info.nbytes >= self._least


def page_keys(
    keyer: BlockKeyer,
    tokens: Sequence[int],
    known: PrefixKeys | None = None,
    media: Sequence[Media] = (),
) -> PrefixKeys:
    """Keys of at least ``tokens``' whole pages (a prompt's first pages), hashing only
    those past ``known`` (keys of the same prompt's first pages, from its ask or its
    last save step, under the same ``keyer`` and ``media``): each page of a prompt is
    hashed once, not once a step."""
    if known is None or not known.blocks:
        return keyer.keys(tokens, media)
    b = keyer.block_tokens
    n = len(tokens) // b
    if len(known.blocks) >= n:
        return known
    chain = list(known.blocks)
    parent = chain[-1]  # the chain goes on from it (the root is hashed into page 0 only)
    for i in range(len(chain), n):
        extra = media_bytes(media, i * b, (i + 1) * b)
        parent = keyer.block_key(parent, tokens[i * b : (i + 1) * b], extra)
        chain.append(parent)
    tail = keyer.tail_key(parent, tokens[n * b :], media_bytes(media, n * b, len(tokens)))
    return PrefixKeys(b, len(tokens), tuple(chain), tail)


def check_position(block: Block, keyer: BlockKeyer, keys: PrefixKeys, index: int) -> None:
    """A block is used only at the position whose key it carries, under its parent."""
    h = block.header
    b = keyer.block_tokens
    if (
        h.key != keys.blocks[index]
        or h.parent != keyer.parent_of(keys, index)
        or h.start != index * b
        or h.tokens != b
    ):
        raise MalformedPayload(f"block {index} does not continue the chain")
