"""The block store: immutable, byte-bounded, LRU, with leases and an epoch.

Blocks form prefix trees (each block names its parent). A block is accepted only
when its parent is stored (or is the namespace); only leaves are evicted, least
recently used first, so every stored byte stays reachable from a root (invariant
9). Leased blocks are never evicted; a restart makes a new epoch, voiding every
old lease. A second put of a key keeps the first bytes.

With a :class:`DiskConfig` a disk tier sits under RAM
(:mod:`kvmesh.store.disk`): lookups and fetches see both tiers, each with its own
budget. :meth:`BlockStore.lookup` and :meth:`BlockStore.peek` answer from the
index alone (no file read); :meth:`BlockStore.get` and
:meth:`BlockStore.longest_prefix` read and verify disk files outside the store
lock, promote hot ones to RAM, and drop a bad one (its fetch fails: the caller
falls back). A namespace whose card the store knows (:meth:`BlockStore.expect`,
or ``layouts``) has every block checked against it
(:func:`~kvmesh.codec.check_header`): disagreeing files are deleted as corrupt,
disagreeing puts refused.

Tenant budgets (:meth:`BlockStore.set_tenant_budget`): a put may name its
``owner`` (known to the head only: never stored in a file or sent). An owner at
its budget in a tier makes room from its own leaves only; only an owner under
its budget may push out other blocks.

A ``listener`` hears every change of a tier as ``(change, tier, header)``
("stored" | "removed", "ram" | "disk") under the store lock: it must only note
the change and return. A disk tier rebuilt at start is announced once its index
is whole, parents first.

This package's one public face is this module (its ``__all__``); callers outside
``kvmesh/store/`` import nothing else. The parts: :mod:`.index` (entries, leaves,
byte counts), :mod:`.ram` and :mod:`.disk` (each tier's room and eviction),
:mod:`.files` (the disk tier's files: one verified block per file, crash-safe),
:mod:`.leases`; :class:`BlockStore` is the one door.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..blocks import PrefixKeys
from ..codec import Block, BlockHeader, Layout, check_block, check_header
from ..errors import MalformedPayload, OrphanBlock
from .disk import DiskTier
from .files import ADMIT, DiskConfig, DiskFiles, DiskRecord, DiskStats, unlink
from .index import (
    Entry,
    Index,
    Listener,
    StoreStats,
    canonical,
    is_root,
)
from .leases import DEFAULT_LEASE_TTL, Lease, Leases
from .ram import RamTier

log = logging.getLogger("kvmesh.store")


@dataclass(frozen=True)
class Match:
    """The longest stored prefix of one lookup, its blocks read (and verified)."""

    blocks: tuple[Block, ...]
    tail: Block | None
    disk_blocks: int = 0  # of these, read from the disk tier

    @property
    def tokens(self) -> int:
        n = sum(b.header.tokens for b in self.blocks)
        return n + (self.tail.header.tokens if self.tail else 0)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.all())

    @property
    def from_disk(self) -> bool:
        return self.disk_blocks > 0

    def all(self) -> tuple[Block, ...]:
        return self.blocks + ((self.tail,) if self.tail else ())


@dataclass(frozen=True)
class BlockRef:
    """What the index knows of a stored block without reading it."""

    header: BlockHeader
    digest: bytes
    nbytes: int

    @property
    def key(self) -> bytes:
        return self.header.key


@dataclass(frozen=True)
class Found:
    """The longest stored prefix as the index knows it: keys, sizes and digests
    (from headers), no payload read. A disk file found bad later fails its fetch."""

    blocks: tuple[BlockRef, ...]
    tail: BlockRef | None
    disk_blocks: int = 0

    @property
    def tokens(self) -> int:
        n = sum(b.header.tokens for b in self.blocks)
        return n + (self.tail.header.tokens if self.tail else 0)


@dataclass(frozen=True)
class Peek:
    """A prefix's stored length, from the index alone (:meth:`BlockStore.peek`)."""

    ram_tokens: int  # from the root, every block's bytes in memory (no file to read)
    tokens: int  # from the root, in either tier
    whole: bool  # ``tokens`` covers the prompt with its tail (stored logits)


@dataclass(frozen=True)
class TierStats:
    """One tier's figures, for metrics and the dashboard."""

    tier: str  # "ram" | "disk"
    budget_bytes: int
    used_bytes: int
    entries: int
    hits: int  # lookups answered (in part) from this tier
    admissions: int  # blocks that entered the tier (RAM: puts and promotions; disk: files written)
    evictions: int  # blocks that left it for the budget
    corrupt: int = 0  # bad files found and deleted (disk)
    promotions: int = 0  # disk blocks copied back into RAM
    dropped: int = 0  # disk writes refused (queue full, no room, I/O error)
    queued_bytes: int = 0  # bytes waiting for the disk writer


class BlockStore:
    """Blocks in RAM and, with ``disk``, on a second tier under it: the facade
    over the index, the tiers and the leases (see the module docstring).

    Every entry is in RAM, queued for the disk writer, on disk, or several of
    these. RAM evicts its leaves (no child in RAM), dropping them or leaving them
    on disk; a block whose parent is gone from both tiers is never kept."""

    def __init__(
        self,
        budget_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        disk: DiskConfig | None = None,
        layouts: Sequence[Layout] = (),
        listener: Listener | None = None,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget must be positive")
        self.epoch = secrets.token_hex(8)
        self._layouts = {lay.card.namespace: lay for lay in layouts}  # see expect()
        self._lock = threading.RLock()
        self.stats = StoreStats(budget_bytes)
        self.disk = disk
        self.disk_stats = DiskStats(disk.budget_bytes if disk else 0)
        self._index = Index(self.stats, self.disk_stats)  # quiet while the disk is rebuilt
        self._entries = self._index.entries
        self._leases = Leases(self._index, self.epoch, clock)
        self._disk: DiskTier | None = None
        if disk is not None:
            self._disk = DiskTier(disk, self._index, self._leases, self._lock, self._layouts)
        self._ram = RamTier(self._index, self._leases, self._disk)
        self._index.listener = listener
        for e in list(self._entries.values()):  # rebuilt from disk, parents first
            self._index.tell("stored", "disk", e)

    @property
    def listener(self) -> Listener | None:
        return self._index.listener

    @listener.setter
    def listener(self, listener: Listener | None) -> None:
        self._index.listener = listener

    @property
    def _files(self) -> DiskFiles | None:
        return self._disk.files if self._disk is not None else None

    # -- tenants ------------------------------------------------------------

    def set_tenant_budget(self, ram_bytes: int, disk_bytes: int | None = None) -> None:
        """Cap what each owner (tenant) holds: ``ram_bytes`` in RAM and
        ``disk_bytes`` (default: the same) on the disk tier."""
        if ram_bytes <= 0 or (disk_bytes is not None and disk_bytes <= 0):
            raise ValueError("a tenant budget must be positive")
        with self._lock:
            disk = ram_bytes if disk_bytes is None else disk_bytes
            self._index.tenant_budget = (ram_bytes, disk)

    @property
    def tenant_budget(self) -> tuple[int, int] | None:
        """(RAM, disk) bytes each owner may hold; None: no cap."""
        return self._index.tenant_budget

    def owned_bytes(self, owner: str, tier: str = "ram") -> int:
        with self._lock:
            return self._index.owned.get(owner, [0, 0])[tier != "ram"]

    def owners(self) -> dict[str, tuple[int, int]]:
        """Each owner holding blocks: (RAM bytes, disk bytes)."""
        with self._lock:
            return {o: (ram, disk) for o, (ram, disk) in self._index.owned.items()}

    # -- writes -------------------------------------------------------------

    def put(self, block: Block, owner: str | None = None) -> bool:
        """Store ``block``. True if stored, False if its key is already held. A key
        held with other bytes keeps the first: two producers may compute the same
        tokens to different bytes (kernels that depend on the pass's length, e.g.
        bfloat16 on AMX), which is counted as a variant, never as an attack.
        ``owner``: the tenant it is counted against (see :meth:`set_tenant_budget`)."""
        key, parent = block.header.key, block.header.parent
        ix = self._index
        with self._lock:
            self._check_put(block)
            existing = self._entries.get(key)
            if existing is not None:
                if existing.digest != block.digest:
                    self.stats.variants += 1
                ix.touch(key)
                return False
            root = is_root(block.header)
            if not root and parent not in self._entries:
                ix.reject(OrphanBlock.reason)
                raise OrphanBlock(f"parent of {key.hex()[:12]} is not stored")
            self._ram.own_room(owner, block.nbytes, keep=parent)
            self._ram.make_room(block.nbytes, keep=parent)
            e = Entry(block.header, block.digest, block.nbytes, block, owner=owner)
            self._entries[key] = e
            ix.add_ram(e)
            if not root:
                p = self._entries[parent]
                p.kids.add(key)
                p.ram_kids += 1
                ix.sync(parent)
            ix.sync(key)
            self.stats.inserts += 1
            ix.tell("stored", "ram", e)
            if self._disk is not None and self._disk.config.admit == "evicted":
                self._disk.admit(key)
            return True

    def _check_put(self, block: Block) -> None:
        """Under the lock: a block of a namespace whose card the store knows must
        match it (the same check as decoding and import: :func:`check_block`);
        a trimmed block (a fetch's, for one import) is never stored."""
        if not block.whole:
            self._index.reject(MalformedPayload.reason)
            raise MalformedPayload("a trimmed block is never stored")
        layout = self._layouts.get(block.header.namespace)
        if layout is None:
            return
        try:
            check_block(block, layout)
        except MalformedPayload as e:
            self._index.reject(e.reason)
            raise

    def expect(self, layout: Layout) -> int:
        """From now on hold ``layout``'s namespace to its card: every indexed block
        of it is checked now (:func:`check_header`; a disagreeing disk file is
        deleted and counted as corrupt, its subtree dropped, so the disk tier never
        serves it), later puts are refused unless they match. Returns how many
        blocks were found bad. A store serves many namespaces and learns their
        cards from their users (a head knows its own), hence a call, not a scan."""
        ns = layout.card.namespace
        with self._lock:
            self._layouts[ns] = layout
            bad = []
            for k, e in self._entries.items():
                if e.header.namespace != ns:
                    continue
                try:
                    check_header(e.header, layout)
                except MalformedPayload:
                    bad.append(k)
                    continue
                e.header = canonical(e.header, layout)
            for k in bad:
                self._drop_bad(k)
            return len(bad)

    def _drop_bad(self, key: bytes) -> None:
        """Under the lock: forget a block found to disagree with its card."""
        e = self._entries.get(key)
        if e is None:
            return  # below another bad block: already dropped with it
        if e.on_disk or e.queued:
            self.disk_stats.corrupt += 1
            log.warning("disk tier: deleting %s (disagrees with its card)", e.digest.hex()[:12])
        else:
            self._index.reject(MalformedPayload.reason)
        self._index.drop_subtree(key)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued disk writes (tests, benches, a clean shutdown)."""
        return self._disk.flush(timeout) if self._disk else True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the disk writer after the writes already queued."""
        if self._disk is not None:
            self._disk.close(timeout)

    # -- reads --------------------------------------------------------------

    def get(self, key: bytes) -> Block | None:
        """The block under ``key``, or None (a disk file found bad is deleted and
        counted). A disk block is read and verified outside the store lock, and
        promoted to RAM when lookups made it hot (a fetch follows a lookup)."""
        with self._lock:
            e = self._hit(key, hit=False)
            if e is None:
                return None
            if e.block is not None:
                return e.block
        block = self._read(e)  # an entry without bytes in memory is on disk
        with self._lock:
            self._ram.no_room, self._ram.lookup_keys = False, frozenset()
            return block if self._opened(key, e, block, promote=e.hits > 0) else None

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def _hit(self, key: bytes, hit: bool) -> Entry | None:
        """Under the lock: the entry under ``key``, touched (and counted as hit)."""
        e = self._entries.get(key)
        if e is None:
            return None
        if hit:
            e.hits += 1
        self._index.touch(key)
        disk = self._disk
        if e.block is not None and hit and disk is not None and disk.config.admit == "hit":
            disk.admit(key)
        return e

    def _opened(self, key: bytes, e: Entry, block: Block | None, promote: bool) -> bool:
        """Under the lock, after a disk read: False when the block must not be used
        (bad, or dropped from the index meanwhile); a good hot one is promoted."""
        assert self._disk is not None
        if not self._disk.usable(key, e, block):
            return False
        assert block is not None
        hot = e.hits >= self._disk.config.promote_hits
        if promote and hot and e.block is None:
            self._ram.promote(key, block)
        return True

    def _chain(
        self, keys: PrefixKeys | Sequence[bytes], tail: bytes | None
    ) -> tuple[list[tuple[bytes, Entry]], tuple[bytes, Entry] | None]:
        """Under the lock: the stored entries of the longest prefix, each hit once;
        counts the lookup (store hits/misses; a disk hit when a block is on disk only)."""
        if isinstance(keys, PrefixKeys):
            chain, tail = keys.blocks, keys.tail
        else:
            chain = tuple(keys)
        found: list[tuple[bytes, Entry]] = []
        for k in chain:
            e = self._hit(k, hit=True)
            if e is None:
                break
            found.append((k, e))
        t = None
        if len(found) == len(chain) and tail is not None:
            te = self._hit(tail, hit=True)
            t = (tail, te) if te is not None else None
        if found or t:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        if any(e.block is None for _, e in found + ([t] if t else [])):
            self.disk_stats.hits += 1
        return found, t

    def peek(self, keys: PrefixKeys) -> Peek:
        """The longest stored prefix of ``keys`` in RAM alone and across both tiers,
        from the index: nothing is touched, counted or read (a router's question
        is not a use of the cache)."""
        with self._lock:
            chain = [self._entries.get(k) for k in keys.blocks]
            tail = self._entries.get(keys.tail)
        ram = both = 0
        for i, e in enumerate(chain + [tail]):
            if e is None:
                break
            n = e.header.tokens if i < len(chain) else keys.tail_tokens
            both += n
            ram += n if e.block is not None and ram == both - n else 0  # no file read
        return Peek(ram, both, both == keys.n_tokens and tail is not None)

    def lookup(self, keys: PrefixKeys | Sequence[bytes], tail: bytes | None = None) -> Found:
        """Longest run of stored blocks from the root, across tiers, from the index
        alone (no file is read: a lookup costs no I/O and holds the lock briefly)."""
        with self._lock:
            found, t = self._chain(keys, tail)
            refs = [(BlockRef(e.header, e.digest, e.nbytes), e.block is None) for _, e in found]
            tref = (
                (BlockRef(t[1].header, t[1].digest, t[1].nbytes), t[1].block is None) if t else None
            )
        disk = sum(d for _, d in refs) + (tref[1] if tref else 0)
        return Found(tuple(r for r, _ in refs), tref[0] if tref else None, disk)

    def longest_prefix(
        self, keys: PrefixKeys | Sequence[bytes], tail: bytes | None = None
    ) -> Match:
        """Longest run of stored blocks from the root, across tiers, read; never
        crosses a hole. The tail counts only when every full block before it
        matched. Disk blocks are read and verified outside the store lock; the run
        stops at the first bad file (deleted, counted), and hot ones are promoted."""
        with self._lock:
            found, t = self._chain(keys, tail)
            want = found + ([t] if t else [])
            blocks = [e.block for _, e in want]
        read: list[Block | None] = []
        for (_, e), b in zip(want, blocks, strict=True):
            read.append(b if b is not None else self._read(e))
            if read[-1] is None:
                break
        disk = 0
        out: list[Block] = []
        with self._lock:
            self._ram.no_room = False
            self._ram.lookup_keys = frozenset(k for k, _ in want)
            for (k, e), b, got in zip(want, blocks, read, strict=False):
                if b is None:
                    if not self._opened(k, e, got, promote=True):
                        break
                    disk += 1
                assert got is not None
                out.append(got)
            self._ram.lookup_keys = frozenset()
        n = len(found)
        tail_block = out[n] if t is not None and len(out) > n else None
        return Match(tuple(out[:n]), tail_block, disk)

    def _read(self, e: Entry) -> Block | None:
        """Outside the lock: ``e``'s disk file, verified; None when it is bad."""
        assert self._disk is not None
        return self._disk.open(e)

    # -- leases -------------------------------------------------------------

    def lease(self, keys: Sequence[bytes], ttl: float = DEFAULT_LEASE_TTL) -> Lease:
        with self._lock:
            return self._leases.take(keys, ttl)

    def check_lease(self, lease_id: str, epoch: str) -> Lease:
        with self._lock:
            return self._leases.check(lease_id, epoch)

    def release(self, lease_id: str) -> None:
        with self._lock:
            self._leases.release(lease_id)

    # -- introspection ------------------------------------------------------

    def reachable_bytes(self, tier: str = "ram") -> int:
        """Bytes in ``tier`` ("ram" or "disk") of blocks whose whole parent chain
        is stored (test hook for invariant 9; on disk the chain must be on disk)."""
        with self._lock:
            return self._index.reachable_bytes(tier)

    def namespaces(self) -> set[bytes]:
        with self._lock:
            return {e.header.namespace for e in self._entries.values()}

    def tier_stats(self) -> tuple[TierStats, ...]:
        """RAM, then the disk tier when there is one."""
        with self._lock:
            queued = self._disk.queued_bytes if self._disk is not None else None
            return tier_stats(self.stats, self.disk_stats, queued)


def tier_stats(s: StoreStats, d: DiskStats, queued_bytes: int | None) -> tuple[TierStats, ...]:
    """Each tier's figures: RAM, then disk unless ``queued_bytes`` is None (no tier)."""
    ram = TierStats(
        "ram",
        s.budget_bytes,
        s.used_bytes,
        s.entries,
        s.hits,
        s.inserts + d.promotions,
        s.evictions,
    )
    if queued_bytes is None:
        return (ram,)
    disk = TierStats(
        "disk",
        d.budget_bytes,
        d.used_bytes,
        d.entries,
        d.hits,
        d.admissions,
        d.evictions,
        corrupt=d.corrupt,
        promotions=d.promotions,
        dropped=d.dropped,
        queued_bytes=queued_bytes,
    )
    return (ram, disk)


__all__ = [
    "ADMIT",
    "DEFAULT_LEASE_TTL",
    "BlockRef",
    "BlockStore",
    "DiskConfig",
    "DiskFiles",
    "DiskRecord",
    "DiskStats",
    "Found",
    "Lease",
    "Listener",
    "Match",
    "Peek",
    "StoreStats",
    "TierStats",
    "unlink",
]
