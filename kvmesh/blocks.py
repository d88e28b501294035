"""Cutting token ids into blocks and chaining their keys.

Block ``i`` covers tokens ``[i*B, (i+1)*B)`` and its key is
``H(key_{i-1} || "B" || tokens_i)`` with ``key_{-1} = namespace``. ``H`` is
SHA-256, or HMAC-SHA256 under the fleet key so that a key seen on the wire cannot
be matched to a prompt by anyone outside the fleet.

The *tail* of a published sequence of ``n`` tokens is the ``n mod B`` tokens after
its last full block (possibly none). Its key is ``H(parent || "T" || tokens)``;
a tail entry carries those tokens' KV plus the next-token logits of position
``n-1``, so an exact repeat needs no forward pass before its first sampled token.

Namespaces within a namespace: a request's chain may start from a *chain root*
other than the namespace (:func:`chain_root`), derived from a server-side tenant
root (:func:`tenant_root`, a secret the client never sees or names) and an
optional ``cache_salt`` (vLLM's request field). Only block 0's key depends on the
root, and every later key on block 0's, so two roots share no key. Headers still
name the namespace as block 0's parent (the structural root of every tree), so a
block on the wire or on disk does not say which root — which tenant — it has.
A LoRA adapter's weights digest (:func:`adapter_digest`) roots a chain the same
way: an adapter's KV is found only under its own weights.

Prompts that carry images (or other media) hash more than token ids: a block (or
tail) whose positions overlap an item's placeholder span also hashes that span's
:class:`Media` (its offset, length and content digest), so a block at or after an
image is a hit only for the same image at the same place; blocks wholly before
the first item keep their text-only keys and are shared with text prompts.

Inside one process a prompt's media positions hold *media token ids*
(:data:`MEDIA_IDS`): ids at or above :data:`MEDIA_BASE` that stand for "position
``i`` of media item (digest, placeholder id, length)", one id per distinct item and
position, never reused. Token lists then compare equal exactly when their text and
their images agree, so every in-memory prefix match (sessions, shared prefills) is
exact with no media bookkeeping, and :meth:`BlockKeyer.keys` turns them back into
the placeholder ids plus :class:`Media` spans that the keys hash.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Below 32 tokens per-block overhead dominates encode and import; above it, the
# reuse lost at a divergence point (B/2 tokens on average) outweighs the gain (bench/codec.py).
DEFAULT_BLOCK_TOKENS = 32

KEY_BYTES = 32
_BLOCK_TAG = b"B"
_TAIL_TAG = b"T"
_CALLER_TAG = b"C"  # a caller's own tail: b"TC" + 32-byte caller digest
_TENANT_DOMAIN = b"kvmesh/tenant-root/v1\x00"
_ROOT_DOMAIN = b"kvmesh/chain-root/v1\x00"
_ADAPTER_TAG = b"kvmesh/adapter/v1\x00"  # appended to a chain root's input by an adapter
_ADAPTER_DOMAIN = b"kvmesh/adapter-digest/v1\x00"
_MEDIA_TAG = b"M"  # per media span a block overlaps: b"M" + offset, length + digest
MAX_CACHE_SALT_CHARS = 1024  # vLLM sets none; ours keeps a salt a small hash input


def check_cache_salt(salt: object) -> str:
    """``salt`` if it is a valid ``cache_salt``: a non-empty string of at most
    ``MAX_CACHE_SALT_CHARS`` characters of valid Unicode. Else ValueError naming
    what is wrong (the API turns it into a 400 on ``cache_salt``)."""
    if not isinstance(salt, str):
        raise ValueError("cache_salt must be a string")
    if not salt:
        raise ValueError("cache_salt must not be empty")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("cache_salt must be valid Unicode (no lone surrogates)") from None
    return salt


def tenant_root(secret: bytes, tenant: str) -> bytes:
    """A tenant's root: HMAC-SHA256 of its name under a server-side ``secret`` (the
    head's tenant secret, never the fleet key). Only the server computes it; a client that
    knows (or sends) another tenant's name or salt cannot reproduce it."""
    if not secret:
        raise ValueError("a tenant root needs a non-empty secret")
    return hmac.new(secret, _TENANT_DOMAIN + tenant.encode("utf-8"), hashlib.sha256).digest()


def chain_root(
    namespace: bytes,
    tenant: bytes | None = None,
    cache_salt: str | None = None,
    adapter: bytes | None = None,
) -> bytes:
    """The root a request's key chain starts from: the namespace itself when there
    is no tenant root, salt or adapter (the one shared cache),
    else SHA-256 of the namespace, the tenant root (``tenant``, from
    :func:`tenant_root`; absent: the shared namespace) and the salt, each
    length-prefixed, then the adapter's weights digest (:func:`adapter_digest`)
    where there is one. The salt separates requests *within* what ``tenant``
    already separates: it is never a way into another tenant's cache."""
    if len(namespace) != KEY_BYTES:
        raise ValueError("namespace must be 32 bytes")
    if tenant is None and cache_salt is None and adapter is None:
        return namespace
    if tenant is not None and len(tenant) != KEY_BYTES:
        raise ValueError("a tenant root is 32 bytes")
    if adapter is not None and len(adapter) != KEY_BYTES:
        raise ValueError("an adapter digest is 32 bytes")
    salt = b"" if cache_salt is None else check_cache_salt(cache_salt).encode("utf-8")
    t = tenant or b""
    msg = _ROOT_DOMAIN + namespace + bytes([len(t)]) + t + len(salt).to_bytes(4, "little")
    return hashlib.sha256(msg + salt + (_ADAPTER_TAG + adapter if adapter else b"")).digest()


def request_root(
    namespace: bytes,
    tenant: bytes | None = None,
    cache_salt: str | None = None,
    adapter: bytes | None = None,
) -> bytes | None:
    """The root a request's keyer is rooted at (:meth:`BlockKeyer.rooted`), from its
    tenant root (None: the shared cache), ``cache_salt`` and LoRA adapter digest:
    None, the namespace itself, when there is none of them; else :func:`chain_root`.
    ValueError on a bad salt. The one derivation the head's API, its tenants and
    the vLLM connector share."""
    if tenant is None and cache_salt is None and adapter is None:
        return None
    return chain_root(namespace, tenant, cache_salt, adapter)


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
MAX_ADAPTER_BYTES = 8 << 30  # read whole to hash: a bound on what a path may make us read


def adapter_digest(directory: str | Path) -> bytes:
    """SHA-256 of a PEFT LoRA adapter directory's config and weights (each file
    name- and length-prefixed), the identity its KV is keyed by: two adapters
    with the same weights and config share KV whatever they are called, and any
    change to either shares none. ValueError when ``directory`` holds no
    ``adapter_config.json`` or no weights, or more than :data:`MAX_ADAPTER_BYTES`."""
    return adapter_files_digest(read_adapter(directory))


def read_adapter(directory: str | Path) -> dict[str, bytes]:
    """The bytes of a PEFT LoRA adapter directory's files (:data:`ADAPTER_FILES`
    that exist), by name, read once: what its digest and its weights both come
    from, so the two never disagree. ValueError as :func:`adapter_digest`."""
    root = Path(directory)
    files = [root / name for name in ADAPTER_FILES if (root / name).is_file()]
    if not files or files[0].name != ADAPTER_FILES[0] or len(files) < 2:
        raise ValueError(f"{root} is not a LoRA adapter (adapter_config.json and weights)")
    if sum(f.stat().st_size for f in files) > MAX_ADAPTER_BYTES:
        raise ValueError(f"{root}: adapter files larger than {MAX_ADAPTER_BYTES} bytes")
    return {f.name: f.read_bytes() for f in files}


def adapter_files_digest(files: dict[str, bytes]) -> bytes:
    """:func:`adapter_digest` of files :func:`read_adapter` read (in its order)."""
    h = hashlib.sha256(_ADAPTER_DOMAIN)
    for name, data in files.items():
        h.update(name.encode() + b"\x00" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


@dataclass(frozen=True)
class Media:
    """One image (or other media item) in a prompt: its placeholder positions
    ``[offset, offset + length)`` and a 32-byte digest of its content."""

    offset: int
    length: int
    digest: bytes

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0 or len(self.digest) != KEY_BYTES:
            raise ValueError("a media span has offset >= 0, length > 0 and a 32-byte digest")

    def overlaps(self, start: int, stop: int) -> bool:
        return self.offset < stop and start < self.offset + self.length


def media_bytes(media: Sequence[Media], start: int, stop: int) -> bytes:
    """What positions ``[start, stop)`` hash besides their token ids: each media
    span they overlap, in prompt order (nothing where they overlap none)."""
    return b"".join(
        _MEDIA_TAG + struct.pack("<II", m.offset, m.length) + m.digest
        for m in media
        if m.overlaps(start, stop)
    )


_MEDIA_SPAN_BYTES = len(_MEDIA_TAG) + 8 + KEY_BYTES


def media_spans(extra: bytes) -> list[Media]:
    """The spans :func:`media_bytes` wrote, in order (ValueError on other bytes)."""
    if len(extra) % _MEDIA_SPAN_BYTES:
        raise ValueError("not media bytes")
    out = []
    for at in range(0, len(extra), _MEDIA_SPAN_BYTES):
        if extra[at : at + 1] != _MEDIA_TAG:
            raise ValueError("not media bytes")
        offset, length = struct.unpack_from("<II", extra, at + 1)
        out.append(Media(offset, length, extra[at + 9 : at + _MEDIA_SPAN_BYTES]))
    return out


#: media token ids start here: far above any vocabulary, within int64 (torch's ids)
MEDIA_BASE = 1 << 40
MEDIA_MAX_LENGTH = 1 << 20  # positions one item may have (the low bits of its ids)
_GONE_DOMAIN = b"kvmesh/media-gone/v1\x00"


@dataclass(frozen=True)
class MediaItem:
    """What a run of media token ids stands for: an item's content digest, the
    placeholder token id the model sees at its positions and its length."""

    digest: bytes
    placeholder: int
    length: int


class MediaIds:
    """The process's media token ids (see the module). At most ``capacity`` items are
    remembered, least recently named first forgotten; ids of a forgotten item are
    never given again and key as an item that matches nothing (a miss, never a
    wrong hit)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._items: OrderedDict[int, MediaItem] = OrderedDict()  # slot -> item
        self._slots: dict[MediaItem, int] = {}
        self._next = 0
        self._lock = threading.Lock()

    def ids(self, item: MediaItem) -> list[int]:
        """The ids of ``item``'s positions (the same list each time it is named)."""
        if len(item.digest) != KEY_BYTES or not 0 < item.length <= MEDIA_MAX_LENGTH:
            raise ValueError("a media item has a 32-byte digest and 1..2**20 positions")
        if not 0 <= item.placeholder < MEDIA_BASE:
            raise ValueError("a media item's placeholder is a token id")
        with self._lock:
            slot = self._slots.get(item)
            if slot is None:
                slot, self._next = self._next, self._next + 1
                self._slots[item] = slot
                if len(self._items) >= self.capacity:
                    _, old = self._items.popitem(last=False)
                    del self._slots[old]
            self._items[slot] = item
            self._items.move_to_end(slot)
        first = MEDIA_BASE + slot * MEDIA_MAX_LENGTH
        return list(range(first, first + item.length))

    def item(self, token: int) -> tuple[MediaItem, int]:
        """The item media id ``token`` stands for and its position in it; a forgotten
        item's stand-in (a digest of its slot, placeholder 0)."""
        slot, index = divmod(token - MEDIA_BASE, MEDIA_MAX_LENGTH)
        with self._lock:
            found = self._items.get(slot)
        if found is None:
            gone = hashlib.sha256(_GONE_DOMAIN + slot.to_bytes(8, "little")).digest()
            return MediaItem(gone, 0, MEDIA_MAX_LENGTH), index
        return found, index

    def split(self, tokens: Sequence[int]) -> tuple[list[int], list[Media]]:
        """``tokens`` as the model's ids (each media id its item's placeholder) and
        the media spans it holds, each whole even where ``tokens`` cuts it."""
        if not tokens or max(tokens) < MEDIA_BASE:
            return list(tokens), []
        ids, spans = list(tokens), []
        for at, token in enumerate(tokens):
            if token < MEDIA_BASE:
                continue
            item, index = self.item(token)
            ids[at] = item.placeholder
            if index == 0 or at == 0 or tokens[at - 1] != token - 1:
                spans.append(Media(at - index, item.length, item.digest))
        return ids, spans

    def cut(self, tokens: Sequence[int], stop: int) -> tuple[int, int] | None:
        """The span ``[start, end)`` of the media item that ending a forward before
        ``tokens[stop]`` would split (one of its positions on each side), or None."""
        if not 0 < stop < len(tokens) or tokens[stop] < MEDIA_BASE:
            return None
        if tokens[stop - 1] != tokens[stop] - 1:
            return None  # the item starts at ``stop``: nothing is split
        item, index = self.item(tokens[stop])
        return stop - index, stop - index + item.length

    def model_ids(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` with each media id as its placeholder (what a tokenizer knows)."""
        return self.split(tokens)[0]


#: the process's media token ids
MEDIA_IDS = MediaIds()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


@dataclass(frozen=True)
class PrefixKeys:
    """The keys of one token sequence: full blocks, then its exact tail."""

    block_tokens: int
    n_tokens: int
    blocks: tuple[bytes, ...]
    tail: bytes  # key of tokens[len(blocks)*B : n] under the last full block

    @property
    def tail_tokens(self) -> int:
        return self.n_tokens - len(self.blocks) * self.block_tokens


class BlockKeyer:
    """Computes chained block keys for one namespace, from ``root`` (default: the
    namespace; see :func:`chain_root`)."""

    def __init__(
        self,
        namespace: bytes,
        block_tokens: int,
        fleet_key: bytes | None = None,
        root: bytes | None = None,
        caller: bytes | None = None,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if len(namespace) != KEY_BYTES:
            raise ValueError("namespace must be 32 bytes")
        if root is not None and len(root) != KEY_BYTES:
            raise ValueError("root must be 32 bytes")
        if caller is not None and len(caller) != KEY_BYTES:
            raise ValueError("caller must be 32 bytes")
        self.namespace = namespace
        self.root = namespace if root is None else root
        self.caller = caller  # hashed into tail keys only: see tail_key
        self.block_tokens = block_tokens
        self._fleet_key = fleet_key

    def rooted(self, root: bytes, caller: bytes | None = None) -> BlockKeyer:
        """This keyer (same namespace, block size and fleet key) from ``root``, its
        tails ``caller``'s own (see :meth:`tail_key`)."""
        return BlockKeyer(self.namespace, self.block_tokens, self._fleet_key, root, caller)

    def _h(self, parent: bytes, tag: bytes, tokens: Sequence[int], media: bytes = b"") -> bytes:
        # media after the length-prefixed tokens: where the tokens end says where it starts
        msg = parent + tag + len(tokens).to_bytes(4, "little") + _token_bytes(tokens) + media
        if self._fleet_key is not None:
            return hmac.new(self._fleet_key, msg, hashlib.sha256).digest()
        return hashlib.sha256(msg).digest()

    def block_key(self, parent: bytes, tokens: Sequence[int], media: bytes = b"") -> bytes:
        """``media``: what the block's positions hash besides tokens (:func:`media_bytes`)."""
        if len(tokens) != self.block_tokens:
            raise ValueError(f"a block has {self.block_tokens} tokens, got {len(tokens)}")
        return self._h(parent, _BLOCK_TAG, tokens, media)

    def tail_key(self, parent: bytes, tokens: Sequence[int], media: bytes = b"") -> bytes:
        """A tail is matched token-exactly, so a hit on it says "exactly this prompt
        was sent". With ``caller`` (whose conversation this is) the key is that
        caller's own: another caller under the same root reuses whole blocks only."""
        if len(tokens) >= self.block_tokens:
            raise ValueError("a tail is shorter than a block")
        tag = _TAIL_TAG if self.caller is None else _TAIL_TAG + _CALLER_TAG + self.caller
        return self._h(parent, tag, tokens, media)

    def keys(self, tokens: Sequence[int], media: Sequence[Media] = ()) -> PrefixKeys:
        """The chain of ``tokens``; ``media``: the prompt's media spans (see the module),
        found from its media token ids when not given."""
        if not media:
            tokens, media = MEDIA_IDS.split(tokens)
        b = self.block_tokens
        n_full = len(tokens) // b
        chain: list[bytes] = []
        parent = self.root  # hashed in; headers name the namespace (see parent_of)
        for i in range(n_full):
            extra = media_bytes(media, i * b, (i + 1) * b) if media else b""
            parent = self.block_key(parent, tokens[i * b : (i + 1) * b], extra)
            chain.append(parent)
        extra = media_bytes(media, n_full * b, len(tokens)) if media else b""
        tail = self.tail_key(parent, tokens[n_full * b :], extra)
        return PrefixKeys(b, len(tokens), tuple(chain), tail)

    def parent_of(self, keys: PrefixKeys, index: int) -> bytes:
        """Parent key of full block ``index`` as headers name it: the namespace for
        block 0 whatever the root (the root is hashed into block 0's key, never
        written out), so a stored or sent block does not reveal its root."""
        return self.namespace if index == 0 else keys.blocks[index - 1]


def split_at(
    tokens: list[int], start: int, every: int, also: Sequence[int] = ()
) -> list[list[int]]:
    """``tokens`` (positions ``start...``) cut at every multiple of ``every`` and at
    the positions ``also``: the pieces a forward runs to stop on each recurrent-state
    checkpoint."""
    out, at = [], 0
    while at < len(tokens):
        stop = min(len(tokens), (start + at) // every * every + every - start)
        stop = min([stop, *(p - start for p in also if start + at < p < start + stop)])
        out.append(tokens[at:stop])
        at = stop
    return out


#: whole blocks at a prompt's end after which its forward keeps the recurrent state:
#: the next turn of a chat re-renders the last few tokens (the generation prompt
#: becomes the answer's header), so the block before the last is where it may part
KEPT_LAST_BLOCKS = 2


def last_block_stops(start: int, end: int, block_tokens: int, every: int) -> list[int]:
    """The boundaries of a prompt's last :data:`KEPT_LAST_BLOCKS` whole blocks that its
    forward over ``[start, end)`` passes, off the ``every`` grid: the states kept
    there let the next turn, whose prompt continues this one, import (nearly) every
    whole block of it."""
    last = end // block_tokens * block_tokens
    ends = (last - i * block_tokens for i in range(KEPT_LAST_BLOCKS))
    return sorted(p for p in ends if start < p < end and p % every)


def stale_states(held: Iterable[int], pos: int, every: int, block_tokens: int) -> list[int]:
    """The kept states a prompt's state at ``pos`` replaces: those off the ``every``
    grid before it, except those after the prompt's last whole blocks
    (:data:`KEPT_LAST_BLOCKS`, counting ``pos`` itself when it ends one)."""
    lowest = (pos // block_tokens - KEPT_LAST_BLOCKS + 1) * block_tokens
    return [
        p for p in held if p % every and p < pos and not (p % block_tokens == 0 and p >= lowest)
    ]
