"""Block payloads: a small typed header plus raw tensor bytes. No pickle.

Wire form of one block::

    b"KVB1" | u32 header_len (LE) | header (UTF-8 JSON) | payload

The payload is, for each layer that holds attention KV, K then V, each a
C-contiguous ``[kv_heads, tokens, head_dim]`` array of that layer's own geometry
(the card's :class:`~kvmesh.compat.LayerGeometry`; a KV-shared layer ships
nothing); then, in a block that carries one (every tail, every ``state_every``-th
block), each recurrent layer's state after the block's last token (the header's
``states``); then the optional float32 logits of a tail. Every attention layer,
sliding-window layers included, holds all of the block's positions (an importer
keeps of a sliding layer only what its window needs): nothing is approximated.

A block's *parts* are, in payload order, each layer's K/V bytes (empty for a layer
without KV), the states, the logits. Its *digest* is a root over its header and
its parts' digests (:func:`root_digest`) under the card's ``block_digest``
algorithm (BLAKE3 by default, or SHA-256, part of the card, hence of the
namespace). So a block *trimmed* to the parts an import of ``[0, P)`` needs
(:meth:`Layout.keep_from`, :meth:`Layout.want`, :func:`trim`: a sliding layer's
positions before its window) is still verified against the producer's digest:
its blob holds the prefix, the header and the present parts back to back, and
``Block.present`` says which. Only whole blocks are stored or published.

Decoding validates magic, lengths and every header field against a
:class:`Layout` derived from the expected card *before* any payload-sized buffer
is allocated (invariant 7), and raises :class:`~kvmesh.errors.MalformedPayload`
(or a subclass) on anything unexpected.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import blake3

from . import squeeze
from .compat import BLOCK_DIGESTS, CompatCard, dtype_size, kv_quant_params
from .errors import ChecksumMismatch, IncompatibleCard, MalformedPayload, OversizePayload

MAGIC = b"KVB1"
PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 64 * 1024
CHUNK_BYTES = 1 << 20  # 1 MiB wire chunks; bench/transfer.py measures the choice
MAX_CHUNK_BYTES = 4 << 20
KINDS = ("block", "tail")
ALL = -1  # a part mask (Block.present, Layout.want): every part
DIGEST_DOMAIN = b"kvmesh/block/v5\0"
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...
    def digest(self) -> bytes: ...


def hasher(algo: str) -> Hasher:
    """A fresh incremental hasher for a card's ``block_digest`` (both drop the GIL
    while hashing, so verification runs beside the receiving thread)."""
    if algo == "blake3":
        return blake3.blake3()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown block digest {algo!r}; one of {', '.join(BLOCK_DIGESTS)}")


def digest_of(data: Any, algo: str) -> bytes:
    h = hasher(algo)
    h.update(data)
    return h.digest()


def root_digest(header_json: Any, parts: Sequence[bytes], algo: str) -> bytes:
    """A block's digest: its header's bytes and its parts' digests, framed."""
    h = hasher(algo)
    h.update(DIGEST_DOMAIN + U32.pack(len(header_json)))
    h.update(header_json)
    h.update(U16.pack(len(parts)) + b"".join(parts))
    return h.digest()


def part_digests(
    payload: memoryview, sizes: Sequence[int], present: int, algo: str
) -> tuple[bytes, ...]:
    """The digest of each present part of ``payload`` (present parts back to back)."""
    out, off = [], 0
    for i, n in enumerate(sizes):
        if has(present, i):
            out.append(digest_of(payload[off : off + n], algo))
            off += n
    return tuple(out)


def block_digest(
    blob: Any, payload_offset: int, header: BlockHeader, algo: str
) -> tuple[bytes, tuple[bytes, ...]]:
    """(digest, part digests) of a whole block's ``blob``."""
    view = memoryview(blob)
    parts = part_digests(view[payload_offset:], header.part_sizes, ALL, algo)
    return root_digest(view[PREFIX.size : payload_offset], parts, algo), parts


def has(mask: int, part: int) -> bool:
    return bool(mask >> part & 1)


def mask_of(parts: Iterable[int], count: int) -> int:
    """The mask of ``parts`` out of ``count`` (:data:`ALL` when that is all of them)."""
    m = 0
    for i in parts:
        m |= 1 << i
    return ALL if m == (1 << count) - 1 else m


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = dtype_size(self.dtype)
        for d in self.shape:
            n *= d
        return n


_KV_BYTES: dict[int, tuple[Any, int]] = {}  # id(layers) -> (layers, their bytes)


def _kv_bytes(layers: tuple[tuple[TensorSpec, ...], ...]) -> int:
    """The bytes of ``layers``' tensors. Decoded headers share the card's layers
    tuple (:func:`read_header`), so the sum (48 specs for a 24-layer model, ~30 µs)
    is done once per tuple, not once per block received."""
    hit = _KV_BYTES.get(id(layers))
    if hit is not None and hit[0] is layers:
        return hit[1]
    n = sum(spec.nbytes for layer in layers for spec in layer)
    if len(_KV_BYTES) >= 1024:  # headers from nowhere (a peer's lies) cannot grow it
        _KV_BYTES.clear()
    _KV_BYTES[id(layers)] = (layers, n)
    return n


@dataclass(frozen=True)
class BlockHeader:
    namespace: bytes
    key: bytes
    parent: bytes
    kind: str  # "block" (exactly B tokens) or "tail" (0..B-1 tokens + logits)
    start: int  # position of the first token
    tokens: int
    layers: tuple[tuple[TensorSpec, ...], ...]  # per layer: K part(s) then V part(s)
    logits: TensorSpec | None = None
    states: tuple[tuple[TensorSpec, ...], ...] = ()  # per layer, when the block carries state

    @functools.cached_property
    def payload_bytes(self) -> int:  # checked on every import: summed once per header
        return self.kv_bytes + self.state_bytes + (self.logits.nbytes if self.logits else 0)

    @property
    def kv_bytes(self) -> int:
        return _kv_bytes(self.layers)

    @functools.cached_property
    def part_sizes(self) -> tuple[int, ...]:
        """Bytes of each part: every layer's K/V, the states, the logits."""
        layers = [sum(t.nbytes for t in layer) for layer in self.layers]
        return (*layers, self.state_bytes, self.logits.nbytes if self.logits else 0)

    def present_bytes(self, mask: int) -> int:
        """Payload bytes of the parts in ``mask``."""
        if mask == ALL:
            return self.payload_bytes
        return sum(n for i, n in enumerate(self.part_sizes) if has(mask, i))

    @property
    def state_bytes(self) -> int:
        return _kv_bytes(self.states) if self.states else 0

    def encode(self) -> bytes:
        doc = {
            "ns": self.namespace.hex(),
            "key": self.key.hex(),
            "parent": self.parent.hex(),
            "kind": self.kind,
            "start": self.start,
            "tokens": self.tokens,
            "layers": [[[t.dtype, list(t.shape)] for t in layer] for layer in self.layers],
            "logits": [self.logits.dtype, list(self.logits.shape)] if self.logits else None,
        }
        if self.states:
            doc["states"] = [[[t.dtype, list(t.shape)] for t in layer] for layer in self.states]
        return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Layout:
    """What a block under one card must look like."""

    card: CompatCard

    @functools.lru_cache(maxsize=256)  # noqa: B019  (layouts are few and live long)
    def layers(self, tokens: int) -> tuple[tuple[TensorSpec, ...], ...]:
        """Per layer, K then V; each one array, or (packed, scales, biases) when
        the KV cache is quantized (mlx-lm's QuantizedKVCache layout); nothing for
        a layer without KV of its own."""
        c = self.card
        q = kv_quant_params(c.kv_quant)
        out: list[tuple[TensorSpec, ...]] = []
        for g in c.geometry:
            if not g.has_kv:
                out.append(())
                continue

            def spec(dtype: str, last: int, heads: int = g.kv_heads) -> TensorSpec:
                return TensorSpec(dtype, (heads, tokens, last))

            if q is None:
                one: tuple[TensorSpec, ...] = (spec(c.kv_dtype, g.head_dim),)
            else:
                bits, group = q
                side = spec(c.kv_dtype, g.head_dim // group)
                one = (spec("uint32", g.head_dim * bits // 32), side, side)
            out.append(one + one)
        return tuple(out)

    @functools.cached_property
    def states(self) -> tuple[tuple[TensorSpec, ...], ...]:
        """Per layer, its recurrent state's tensors (none for an attention layer)."""
        return tuple(tuple(TensorSpec(d, s) for d, s in g.state) for g in self.card.geometry)

    def logits(self) -> TensorSpec:
        return TensorSpec("float32", (self.card.vocab_size,))

    def header(
        self, kind: str, key: bytes, parent: bytes, start: int, tokens: int, state: bool = False
    ) -> BlockHeader:
        """A block's header; ``state``: it carries the recurrent state where the card
        does not say it must (:meth:`~kvmesh.compat.CompatCard.may_carry_state`)."""
        c = self.card
        carries = c.carries_state(kind, start) or (state and c.may_carry_state)
        return BlockHeader(
            namespace=self.card.namespace,
            key=key,
            parent=parent,
            kind=kind,
            start=start,
            tokens=tokens,
            layers=self.layers(tokens),
            logits=self.logits() if kind == "tail" else None,
            states=self.states if carries else (),
        )

    @functools.lru_cache(maxsize=1024)  # noqa: B019  (a few prompt lengths at a time)
    def keep_from(self, n: int) -> tuple[int, ...] | None:
        """Per layer, the first position an import of ``[0, n)`` needs, rounded down
        to a block boundary (parts are whole (layer, block) pieces): 0 for a full
        layer; for a sliding layer of window ``W`` the block holding position
        ``n - 1 - W`` (the import may be cut back to ``n - 1``, whose window starts
        at ``n - W``; mlx keeps ``W`` positions, transformers ``W - 1``); ``n`` for a
        layer without KV. None when nothing is saved, or the card's imports may end
        before ``n`` on positions only its producer knows (recurrent state, a
        prefill grid): those are fetched whole."""
        c = self.card
        if c.state_every or c.prefill_grid or not n:
            return None
        b = c.block_tokens
        out = tuple(
            (n if not g.has_kv else b * (max(0, n - 1 - g.window) // b) if g.window else 0)
            for g in c.geometry
        )
        return (
            out if any(lo >= b for lo, g in zip(out, c.geometry, strict=True) if g.has_kv) else None
        )

    def want(self, header: BlockHeader, keep_from: Sequence[int] | None) -> int:
        """The parts of a block an import with ``keep_from`` needs: the layers that
        hold a position at or after their first needed one, the states, the logits,
        and every empty part (:data:`ALL` when that is all)."""
        return want_mask(header, keep_from)

    def seal(self, header: BlockHeader, blob: bytes | bytearray) -> Block:
        """``blob`` (filled under ``header``) frozen and digested as the card says."""
        return seal(header, blob, self.card.block_digest)

    @property
    def max_block_bytes(self) -> int:
        b = self.card.block_tokens
        return (
            PREFIX.size
            + MAX_HEADER_BYTES
            + self.card.kv_bytes_per_token * b
            + self.card.state_bytes
            + 4 * self.card.vocab_size
        )


@dataclass(frozen=True)
class Block:
    """One sealed, immutable block: its header, its wire blob and its digest;
    ``parts`` the digests of its present parts, ``present`` which parts its blob
    holds (:data:`ALL`, or a trimmed block's: :func:`trim`)."""

    header: BlockHeader
    blob: bytes  # immutable: served as is, without a copy per fetch
    digest: bytes
    payload_offset: int
    parts: tuple[bytes, ...] = ()
    present: int = ALL

    @property
    def key(self) -> bytes:
        return self.header.key

    @property
    def whole(self) -> bool:
        return self.present == ALL

    def _offset(self, part: int) -> int:
        """Where present part ``part`` starts in the payload."""
        if not has(self.present, part):
            raise ValueError(f"part {part} is not in this trimmed block")
        sizes = self.header.part_sizes
        return sum(n for i, n in enumerate(sizes[:part]) if has(self.present, i))

    def kv_layers(self) -> Iterator[tuple[int, tuple[tuple[TensorSpec, memoryview], ...]]]:
        """(layer, its K/V parts as (spec, bytes)) of each present layer with KV."""
        view, off = self.payload(), 0
        for i, layer in enumerate(self.header.layers):
            if not has(self.present, i):
                continue
            out = []
            for spec in layer:
                out.append((spec, view[off : off + spec.nbytes]))
                off += spec.nbytes
            if out:
                yield i, tuple(out)

    @property
    def nbytes(self) -> int:
        return len(self.blob)

    def payload(self) -> memoryview:
        return memoryview(self.blob)[self.payload_offset :]

    def kv_tensors(self) -> Iterator[tuple[TensorSpec, memoryview]]:
        """(spec, bytes) for K0, V0, K1, V1, ... (a quantized layer's K and V as
        their parts; none for a layer without KV): exactly one per destination
        buffer of an import. A whole block's only (see :meth:`kv_layers`)."""
        if not self.whole:
            raise ValueError("a trimmed block's tensors are per layer: kv_layers()")
        view = self.payload()
        off = 0
        for layer in self.header.layers:
            for spec in layer:
                yield spec, view[off : off + spec.nbytes]
                off += spec.nbytes

    def state_tensors(self) -> Iterator[tuple[int, TensorSpec, memoryview]]:
        """(layer, spec, bytes) of each recurrent state tensor the block carries."""
        if not self.header.states:
            return
        view = self.payload()
        off = self._offset(len(self.header.layers))
        for i, layer in enumerate(self.header.states):
            for spec in layer:
                yield i, spec, view[off : off + spec.nbytes]
                off += spec.nbytes

    def tensors(self) -> Iterator[tuple[TensorSpec, memoryview]]:
        """:meth:`kv_tensors`, the states, then the logits if present."""
        yield from self.kv_tensors()
        for _, spec, view in self.state_tensors():
            yield spec, view
        if self.header.logits is not None:
            yield self.header.logits, self.logits_bytes()

    def logits_bytes(self) -> memoryview:
        """A tail's float32 logits (the last part)."""
        assert self.header.logits is not None
        n = self.header.logits.nbytes
        return self.payload()[len(self.blob) - self.payload_offset - n :]


def new_blob(header: BlockHeader) -> tuple[bytearray, memoryview]:
    """Allocate a blob with the header written; the engine fills the payload view."""
    hdr = header.encode()
    if len(hdr) > MAX_HEADER_BYTES:
        raise OversizePayload("header too large")
    blob = bytearray(PREFIX.size + len(hdr) + header.payload_bytes)
    PREFIX.pack_into(blob, 0, MAGIC, len(hdr))
    blob[PREFIX.size : PREFIX.size + len(hdr)] = hdr
    return blob, memoryview(blob)[PREFIX.size + len(hdr) :]


def seal(header: BlockHeader, blob: bytes | bytearray, algo: str) -> Block:
    """Freeze a filled blob (one copy, at export, so that serving it never copies),
    digested under ``algo`` (the card's ``block_digest``)."""
    frozen = bytes(blob)
    start = len(frozen) - header.payload_bytes
    digest, parts = block_digest(frozen, start, header, algo)
    return Block(header, frozen, digest, start, parts)


def trim(block: Block, mask: int) -> Block:
    """``block`` with only the parts in ``mask`` (a subset of its own): the blob a
    receiver of those parts holds, verified by the same digest."""
    if mask == block.present:
        return block
    if mask == ALL or (not block.whole and mask & ~block.present):
        raise ValueError("a trimmed block cannot grow parts")
    view, sizes = block.payload(), block.header.part_sizes
    pieces, off = [memoryview(block.blob)[: block.payload_offset]], 0
    for i, n in enumerate(sizes):
        if has(block.present, i):
            if has(mask, i):
                pieces.append(view[off : off + n])
            off += n
    digests = [d for i, d in _present(block) if has(mask, i)]
    blob = b"".join(pieces)
    return Block(block.header, blob, block.digest, block.payload_offset, tuple(digests), mask)


def _present(block: Block) -> Iterator[tuple[int, bytes]]:
    """(part, digest) of each present part."""
    present = (i for i in range(len(block.header.part_sizes)) if has(block.present, i))
    return zip(present, block.parts, strict=True)


# -- decoding ---------------------------------------------------------------


def _spec(raw: Any) -> TensorSpec:
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or not isinstance(raw[0], str)
        or not isinstance(raw[1], list)
        or not all(type(d) is int and d >= 0 for d in raw[1])
    ):
        raise MalformedPayload("bad tensor spec")
    try:
        dtype_size(raw[0])
    except ValueError:
        raise MalformedPayload(f"unknown dtype {raw[0][:16]!r}") from None
    return TensorSpec(raw[0], tuple(raw[1]))


def _hex32(doc: dict[str, Any], name: str) -> bytes:
    v = doc.get(name)
    if not isinstance(v, str) or len(v) != 64:
        raise MalformedPayload(f"bad {name}")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise MalformedPayload(f"bad {name}") from None


def _count(doc: dict[str, Any], name: str) -> int:
    v = doc.get(name)
    if type(v) is not int or v < 0:
        raise MalformedPayload(f"bad {name}")
    return v


def _same(value: Any) -> Any:
    return value


def parse_prefix(head: bytes | bytearray | memoryview) -> int:
    """Validate the fixed prefix; return the header length."""
    if len(head) < PREFIX.size:
        raise MalformedPayload("truncated prefix")
    magic, hlen = PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise MalformedPayload("bad magic")
    if hlen > MAX_HEADER_BYTES:
        raise OversizePayload(f"header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
    return int(hlen)


def read_header(
    raw: bytes | memoryview,
    layout: Layout | None = None,
    intern: Callable[[Any], Any] = _same,
) -> BlockHeader:
    """A header's *structure*, checked against no card: a JSON object, hex ids,
    non-negative counts, well-formed specs of known dtypes. Whether it is what a
    card expects is :func:`check_header`'s job. With ``layout``, layers equal to
    the card's reuse its parsed specs (parsing every spec costs more than
    verifying the block's digest: bench/transfer.py). ``intern`` lets the disk
    index keep one copy of the specs that many headers share."""
    try:
        doc = json.loads(bytes(raw))
    except (UnicodeDecodeError, ValueError):
        raise MalformedPayload("header is not JSON") from None
    if not isinstance(doc, dict):
        raise MalformedPayload("header is not an object")
    kind = doc.get("kind")
    if kind not in KINDS:
        raise MalformedPayload("bad kind")
    tokens = _count(doc, "tokens")
    layers = intern(_layers(doc.get("layers"), layout, tokens))
    logits = None if doc.get("logits") is None else intern(_spec(doc["logits"]))
    states = intern(_states(doc["states"], layout)) if "states" in doc else ()
    return BlockHeader(
        intern(_hex32(doc, "ns")),
        _hex32(doc, "key"),
        _hex32(doc, "parent"),
        kind,
        _count(doc, "start"),
        tokens,
        layers,
        logits,
        states,
    )


def _states(raw: Any, layout: Layout | None) -> tuple[tuple[TensorSpec, ...], ...]:
    if layout is not None and layout.states and raw == _states_doc(layout):
        return layout.states
    if not isinstance(raw, list) or not raw or not all(isinstance(x, list) for x in raw):
        raise MalformedPayload("bad states")
    return tuple(tuple(_spec(t) for t in layer) for layer in raw)


@functools.lru_cache(maxsize=64)
def _states_doc(layout: Layout) -> list[list[list[Any]]]:
    return [[[t.dtype, list(t.shape)] for t in layer] for layer in layout.states]


def _layers(raw: Any, layout: Layout | None, tokens: int) -> tuple[tuple[TensorSpec, ...], ...]:
    # the token bound keeps a lying header from filling the layout's spec cache;
    # the card's layers are then recognised in one comparison, in C
    if (
        layout is not None
        and tokens <= layout.card.block_tokens
        and raw == _layers_doc(layout, tokens)
    ):
        return layout.layers(tokens)
    if not isinstance(raw, list) or not raw or not all(isinstance(x, list) for x in raw):
        raise MalformedPayload("bad layers")  # (a layer without KV is an empty list)
    return tuple(tuple(_spec(t) for t in layer) for layer in raw)


@functools.lru_cache(maxsize=256)
def _layers_doc(layout: Layout, tokens: int) -> list[list[list[Any]]]:
    """The card's tensor specs for ``tokens`` as a header's JSON decodes them."""
    return [[[t.dtype, list(t.shape)] for t in layer] for layer in layout.layers(tokens)]


def check_header(header: BlockHeader, layout: Layout) -> None:
    """Raise unless ``header`` is exactly what a block under ``layout``'s card
    is: its namespace, a kind whose token count fits the block size, a start on
    a block boundary, the card's layer count and per-layer K/V dtypes and
    shapes for that token count, and float32 logits over the vocabulary for a
    tail (none for a block). The one check every tier's blocks go through:
    decoding (peers), the store (RAM and disk, once it knows the card) and
    every import (:func:`kvmesh.engine.base.check_chain`, ``Importer.add``)."""
    c = layout.card
    if header.namespace != c.namespace:
        raise IncompatibleCard("block belongs to another namespace")
    b, kind, tokens = c.block_tokens, header.kind, header.tokens
    if (kind == "block" and tokens != b) or (kind == "tail" and not 0 <= tokens < b):
        raise MalformedPayload(f"{kind} with {tokens} tokens")
    if kind not in KINDS or header.start < 0 or header.start % b:
        raise MalformedPayload(f"bad kind or start ({kind!r} at {header.start})")
    if len(header.layers) != c.num_layers:
        raise MalformedPayload(
            f"wrong layer count: {len(header.layers)}, the card says {c.num_layers}"
        )
    # identity makes this cheap for headers built from the layout (export, decode)
    if header.layers != layout.layers(tokens):
        raise MalformedPayload("tensor dtype or shape does not match the card")
    if header.logits != (layout.logits() if kind == "tail" else None):
        raise MalformedPayload("bad logits spec")
    if header.states != (layout.states if c.carries_state(kind, header.start) else ()) and not (
        c.may_carry_state and header.states == layout.states
    ):
        raise MalformedPayload("recurrent state does not match the card")


def check_form(header: BlockHeader) -> None:
    """What holds for a block under *any* card, for a reader that has none (the
    disk tier at start serves many namespaces): every KV spec is
    ``[kv_heads, tokens, ...]`` over the header's tokens, a layer is nothing or
    its K part(s) then V part(s) alike, some layer holds KV or state, a block has
    tokens and starts on a multiple of them, a tail carries 1-D float32 logits
    and a block none. A header that passes still has to pass :func:`check_header`."""
    for layer in header.layers:
        half = len(layer) // 2
        if len(layer) % 2 or layer[:half] != layer[half:]:
            raise MalformedPayload("layers are not K then V alike in every layer")
        if any(len(t.shape) != 3 or t.shape[1] != header.tokens for t in layer):
            raise MalformedPayload("a tensor spec disagrees with the header's token count")
    if not any(header.layers) and not header.states:
        raise MalformedPayload("layers are not K then V alike in every layer")
    if header.kind == "block" and (not header.tokens or header.start % header.tokens):
        raise MalformedPayload("bad block extent")
    logits = header.logits
    if header.kind == "block" and logits is not None:
        raise MalformedPayload("a block carries logits")
    if header.kind == "tail" and (
        logits is None or logits.dtype != "float32" or len(logits.shape) != 1
    ):
        raise MalformedPayload("a tail without float32 logits")


def check_block(block: Block, layout: Layout) -> None:
    """:func:`check_header`, and the blob holds exactly the payload it announces
    (of a trimmed block: its present parts)."""
    check_header(block.header, layout)
    if block.payload_offset < PREFIX.size or len(
        block.blob
    ) != block.payload_offset + block.header.present_bytes(block.present):
        raise MalformedPayload("block bytes disagree with its header")


def parse_header(raw: bytes | memoryview, layout: Layout) -> BlockHeader:
    """Parse header JSON and check every field against ``layout``."""
    header = read_header(raw, layout)
    check_header(header, layout)
    return header


def decode_block(blob: bytes, layout: Layout, digest: bytes | None = None) -> Block:
    """Validate a complete blob. With ``digest``, verify it too (the card's algorithm)."""
    if len(blob) > layout.max_block_bytes:
        raise OversizePayload("block larger than the card allows")
    hlen = parse_prefix(blob)
    end = PREFIX.size + hlen
    if len(blob) < end:
        raise MalformedPayload("truncated header")
    header = parse_header(memoryview(blob)[PREFIX.size : end], layout)
    if len(blob) != end + header.payload_bytes:
        raise MalformedPayload(
            f"payload is {len(blob) - end} bytes, header says {header.payload_bytes}"
        )
    actual, parts = block_digest(blob, end, header, layout.card.block_digest)
    if digest is not None and actual != digest:
        raise ChecksumMismatch(f"block {header.key.hex()[:12]} digest mismatch")
    return Block(header, blob, actual, end, parts)


def digest_blob(blob: Any, algo: str) -> bytes:
    """The digest of a whole block's bytes read under no card (a tool naming a file
    by its digest); raises :class:`MalformedPayload` when they are no block."""
    end = PREFIX.size + parse_prefix(blob)
    header = read_header(memoryview(blob)[PREFIX.size : end])
    if len(blob) != end + header.payload_bytes:
        raise MalformedPayload("block bytes disagree with its header")
    return block_digest(blob, end, header, algo)[0]


def chunks(blob: bytes, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    if not 0 < size <= MAX_CHUNK_BYTES:
        raise ValueError("chunk size out of range")
    view = memoryview(blob)
    for off in range(0, len(view), size):
        yield view[off : off + size]


class Assembler:
    """Reassembles one block from chunks, validating the header before anything
    payload-sized is kept, and its digest once whole. A block that arrives as one
    chunk becomes the block's blob as is (no copy)."""

    def __init__(self, layout: Layout, total: int, digest: bytes | None = None) -> None:
        if not 0 < total <= layout.max_block_bytes:
            raise OversizePayload(f"announced block size {total} exceeds the card's cap")
        self.layout = layout
        self.total = total
        self.digest = digest
        self._parts: list[bytes] = []
        self.filled = 0
        self.header: BlockHeader | None = None
        self._head = b""

    def feed(self, chunk: bytes) -> None:
        if len(chunk) > MAX_CHUNK_BYTES:
            raise OversizePayload("chunk too large")
        if self.filled + len(chunk) > self.total:
            raise MalformedPayload("more bytes than announced")
        if self.header is None:
            self._head += chunk[: MAX_HEADER_BYTES + PREFIX.size]
            if len(self._head) >= PREFIX.size:
                end = PREFIX.size + parse_prefix(self._head)
                if len(self._head) >= end:
                    self.header = parse_header(
                        memoryview(self._head)[PREFIX.size : end], self.layout
                    )
                    if end + self.header.payload_bytes != self.total:
                        raise MalformedPayload("announced size disagrees with header")
                    self._head = b""
        self._parts.append(chunk)
        self.filled += len(chunk)

    @property
    def complete(self) -> bool:
        return self.filled == self.total

    def finish(self) -> Block:
        if self.header is None or self.filled != self.total:
            raise MalformedPayload(f"truncated block: {self.filled} of {self.total} bytes")
        blob = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts = []
        start = self.total - self.header.payload_bytes
        actual, parts = block_digest(blob, start, self.header, self.layout.card.block_digest)
        if self.digest is not None and actual != self.digest:
            raise ChecksumMismatch(f"block {self.header.key.hex()[:12]} digest mismatch")
        return Block(self.header, blob, actual, start, parts)


# -- trimmed blocks on the wire ----------------------------------------------

PARTS_MAGIC = b"KVP1"
PART_ENTRY = struct.Struct("<HBQ")  # part, codec id, wire bytes
DIGEST_BYTES = 32


def want_mask(header: BlockHeader, keep_from: Sequence[int] | None) -> int:
    """:meth:`Layout.want` for a reader that checked ``header`` already."""
    if keep_from is None:
        return ALL
    sizes, end = header.part_sizes, header.start + header.tokens
    if len(keep_from) != len(sizes) - 2:
        raise MalformedPayload(
            f"keep_from names {len(keep_from)} layers, the block has {len(sizes) - 2}"
        )
    needed = (i for i, n in enumerate(sizes) if i >= len(keep_from) or not n or end > keep_from[i])
    return mask_of(needed, len(sizes))


def part_itemsize(header: BlockHeader, part: int) -> int:
    """The element size a part's bytes are made of (what byte planes split by)."""
    if part < len(header.layers):
        sizes = {dtype_size(t.dtype) for t in header.layers[part]}
    elif part == len(header.layers):
        sizes = {dtype_size(t.dtype) for layer in header.states for t in layer}
    else:
        sizes = {4}
    return sizes.pop() if len(sizes) == 1 else 1


Encoder = Callable[[memoryview, int], tuple[int, Any]]  # (raw, itemsize) -> (codec id, bytes)


def parts_frame(block: Block, mask: int, encode: Encoder | None = None) -> list[Any]:
    """The pieces of a PARTS frame sending ``block``'s (whole) parts in ``mask``::

        b"KVP1" | u32 hlen | header | u16 nparts | nparts x 32-byte part digests
        | u16 nsent | nsent x (u16 part, u8 codec, u64 wire bytes) | sent parts

    Raw parts are views of the block's own buffer (never copied); ``encode`` may
    compress a part (it answers the codec id it used; 0 is raw)."""
    if not block.whole:
        raise ValueError("only a whole block is sent in parts")
    view, off = block.payload(), 0
    table, sent = [], []
    for i, n in enumerate(block.header.part_sizes):
        if has(mask, i):
            raw = view[off : off + n]
            cid, wire = (
                (0, raw) if encode is None or not n else encode(raw, part_itemsize(block.header, i))
            )
            table.append(PART_ENTRY.pack(i, cid, len(wire)))
            sent.append(wire)
        off += n
    hjson = memoryview(block.blob)[PREFIX.size : block.payload_offset]
    head = b"".join(
        [
            PARTS_MAGIC,
            U32.pack(len(hjson)),
            hjson,
            U16.pack(len(block.parts)),
            *block.parts,
            U16.pack(len(table)),
            *table,
        ]
    )
    return [head, *sent]


@dataclass
class PartsPlan:
    """A PARTS frame's head, checked (:func:`read_parts_head`): what to receive
    where. ``blob`` is the trimmed block's buffer, prefix and header written; raw
    parts are received straight into their ``slots``."""

    header: BlockHeader
    digest: bytes
    parts: tuple[bytes, ...]  # every part's digest, as the producer's root names them
    entries: list[tuple[int, int, int]]  # (part, codec id, wire bytes), in order
    mask: int
    blob: bytearray
    payload_offset: int

    def slots(self) -> Iterator[tuple[int, int, int, memoryview]]:
        """(part, codec id, wire bytes, its raw bytes' place in ``blob``)."""
        view, off = memoryview(self.blob)[self.payload_offset :], 0
        for part, cid, wire in self.entries:
            n = self.header.part_sizes[part]
            yield part, cid, wire, view[off : off + n]
            off += n


def read_parts_head(
    read: Callable[[int], bytes],
    frame_bytes: int,
    layout: Layout,
    key: bytes,
    digest: bytes,
    keep_from: Sequence[int] | None,
    codecs: Sequence[int] = (0,),
    alloc: Callable[[int], bytearray] = bytearray,
) -> PartsPlan:
    """Read and check a PARTS frame's head (``read(n)`` gives the next ``n`` bytes of
    a frame of ``frame_bytes``) before anything payload-sized is allocated: its
    header against the card and ``key``; its part digests against ``digest`` (the
    lookup's: the producer's root); the parts it sends are exactly those an import
    with ``keep_from`` needs; each in a codec of ``codecs`` and no longer than its
    raw bytes (raw: exactly); the frame's length adds up."""
    magic, hlen = PREFIX.unpack(read(PREFIX.size))
    if magic != PARTS_MAGIC or hlen > MAX_HEADER_BYTES or PREFIX.size + hlen > frame_bytes:
        raise MalformedPayload("bad parts frame")
    hjson = read(hlen)
    header = parse_header(hjson, layout)
    if header.key != key:
        raise ChecksumMismatch("peer sent a block other than the one asked for")
    (nparts,) = U16.unpack(read(U16.size))
    if nparts != len(header.part_sizes):
        raise MalformedPayload(f"{nparts} part digests for {len(header.part_sizes)} parts")
    raw_digests = read(nparts * DIGEST_BYTES)
    parts = tuple(
        raw_digests[i : i + DIGEST_BYTES] for i in range(0, len(raw_digests), DIGEST_BYTES)
    )
    if root_digest(hjson, parts, layout.card.block_digest) != digest:
        raise ChecksumMismatch(f"block {key.hex()[:12]} part digests do not make its digest")
    (nsent,) = U16.unpack(read(U16.size))
    if nsent > nparts:
        raise MalformedPayload("more parts sent than the block has")
    table = read(nsent * PART_ENTRY.size)
    entries = [PART_ENTRY.unpack_from(table, i * PART_ENTRY.size) for i in range(nsent)]
    _check_entries(header, entries, want_mask(header, keep_from), codecs)
    fixed = PREFIX.size + hlen + 2 * U16.size + nparts * DIGEST_BYTES + nsent * PART_ENTRY.size
    if fixed + sum(e[2] for e in entries) != frame_bytes:
        raise MalformedPayload("parts frame length disagrees with its table")
    mask = mask_of((e[0] for e in entries), nparts)
    blob = alloc(PREFIX.size + hlen + header.present_bytes(mask))
    PREFIX.pack_into(blob, 0, MAGIC, hlen)
    blob[PREFIX.size : PREFIX.size + hlen] = hjson
    return PartsPlan(header, digest, parts, entries, mask, blob, PREFIX.size + hlen)


def _check_entries(
    header: BlockHeader, entries: Sequence[tuple[int, int, int]], want: int, codecs: Sequence[int]
) -> None:
    sizes = header.part_sizes
    order = [e[0] for e in entries]
    if order != sorted(set(order)) or any(p >= len(sizes) for p in order):
        raise MalformedPayload("parts out of order, repeated or unknown")
    if mask_of(order, len(sizes)) != want:
        raise MalformedPayload("the parts sent are not the ones the import needs")
    for part, cid, wire in entries:
        if cid not in codecs and cid != 0:
            raise MalformedPayload(f"part {part} in codec {cid}, which was not asked for")
        if wire > sizes[part] or (cid == 0 and wire != sizes[part]):
            raise MalformedPayload(f"part {part} is {wire} bytes on the wire, {sizes[part]} raw")


def finish_parts(plan: PartsPlan, wires: dict[int, Any], algo: str) -> Block:
    """The trimmed block of a received PARTS frame: compressed parts (``wires``, by
    part) decoded into their slots, every part checked against its digest."""
    got = []
    for part, cid, _, slot in plan.slots():
        if cid:
            itemsize = part_itemsize(plan.header, part)
            squeeze.decode_into(squeeze.codec_name(cid), wires[part], slot, itemsize)
        d = digest_of(slot, algo)
        if d != plan.parts[part]:
            raise ChecksumMismatch(
                f"block {plan.header.key.hex()[:12]} part {part} digest mismatch"
            )
        got.append(d)
    blob: Any = plan.blob  # never written again: a Block holds it as its bytes
    return Block(plan.header, blob, plan.digest, plan.payload_offset, tuple(got), plan.mask)
