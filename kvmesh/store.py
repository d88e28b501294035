"""The block store: immutable, byte-bounded, LRU, with leases and an epoch.

Blocks form prefix trees (each block names its parent). The store only accepts a
block whose parent it holds (or whose parent is the namespace), and only evicts
leaves, least recently used first, so every stored byte stays reachable from a
root (invariant 9). Leased blocks are never evicted; a lease is tied to the
store's epoch, a random id made at start, so a restart voids every old lease.

With a :class:`~kvmesh.disk.DiskConfig` the store has a second tier under RAM
(files in :mod:`kvmesh.disk`): blocks are written behind by one thread, lookups
and fetches see both tiers, each tier has its own budget and leaf-first LRU, and
a restart rebuilds the disk index from file headers under a new epoch.
:meth:`BlockStore.lookup` answers from the index alone (no file read);
:meth:`BlockStore.get` and :meth:`BlockStore.longest_prefix` read and verify disk
files outside the store lock, promote hot ones to RAM, and delete and count a bad
one (a fetch of it then fails: the caller falls back). A namespace whose card
the store is told (:meth:`BlockStore.expect`, or ``layouts`` at construction)
has every block checked against it (:func:`~kvmesh.codec.check_header`, the
codec's one check): indexed disk files that disagree are deleted and counted as
corrupt, puts that disagree are refused.

Tenant budgets (:meth:`BlockStore.set_tenant_budget`): a put may name its
``owner`` (a tenant label the head knows; it is never stored in a file or sent,
so a peer's blocks and blocks reloaded from disk have none). An owner at its
budget in a tier makes room by evicting only its own leaves there, LRU first; only
an owner under its budget may push out other blocks (the tier's LRU), so one
tenant's traffic never evicts more than its share of anyone else's.

A ``listener`` hears every change of a tier as ``(change, tier, header)`` with
``change`` "stored" or "removed" and ``tier`` "ram" or "disk" (a file written or
deleted), under the store lock: it must only note the change and return (the KV
events of :mod:`kvmesh.mesh.events`). A disk tier rebuilt at start is announced
once its index is whole, parents first.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .blocks import PrefixKeys
from .codec import Block, BlockHeader, Layout, check_block, check_header
from .disk import DiskConfig, DiskFiles, DiskStats, Writer, unlink
from .errors import (
    LeaseExpired,
    MalformedPayload,
    OrphanBlock,
    StaleEpoch,
    StoreFull,
)

log = logging.getLogger("kvmesh.store")

Listener = Callable[[str, str, BlockHeader], None]

DEFAULT_LEASE_TTL = 30.0


@dataclass(eq=False)
class _Entry:
    header: BlockHeader
    digest: bytes
    nbytes: int
    block: Block | None = None  # bytes in memory: the RAM tier, or waiting for the writer
    in_ram: bool = True  # counted in the RAM budget
    queued: bool = False  # waiting for the disk writer
    on_disk: bool = False  # a file holds it (verified again on every read)
    kids: set[bytes] = field(default_factory=set)
    ram_kids: int = 0  # kids in RAM
    disk_kids: int = 0  # kids queued for disk or on disk
    leases: int = 0
    hits: int = 0
    owner: str | None = None  # the tenant that put it (see set_tenant_budget)


def _is_root(h: BlockHeader) -> bool:
    return h.start == 0 and h.parent == h.namespace


@dataclass(frozen=True)
class Lease:
    id: str
    epoch: str
    keys: tuple[bytes, ...]
    expires: float


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


@dataclass
class StoreStats:
    budget_bytes: int
    used_bytes: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    leases: int = 0
    variants: int = 0  # puts of a held key with other bytes (the first bytes are kept)


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
    """Blocks in RAM and, with ``disk``, on a second tier under it.

    Every entry is in RAM, queued for the disk writer, on disk, or several of
    these. The disk holds a parent-closed set (a block is written only after its
    parent), so a restart rebuilds whole chains. RAM evicts its leaves (no child in
    RAM), dropping them or leaving them on disk; the disk evicts its leaves (no
    child on or bound for disk, and no child at all unless the block is in RAM).
    A block whose parent is gone from both tiers is never kept."""

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
        self._clock = clock
        self._lock = threading.RLock()
        self._entries: dict[bytes, _Entry] = {}
        self._leaves: OrderedDict[bytes, None] = OrderedDict()  # RAM leaves, LRU first
        self._disk_leaves: OrderedDict[bytes, None] = OrderedDict()  # disk leaves, LRU first
        self._leases: dict[str, Lease] = {}
        self.stats = StoreStats(budget_bytes)
        self.disk = disk
        self.disk_stats = DiskStats(disk.budget_bytes if disk else 0)
        self._files: DiskFiles | None = None
        self._backlog = False  # a write was refused for a full queue
        self._no_room = False  # a promotion of this lookup found no room
        self._lookup_keys: frozenset[bytes] = frozenset()  # blocks a promotion must not evict
        self._writer: Writer | None = None
        self.tenant_budget: tuple[int, int] | None = None  # (RAM, disk) bytes per owner
        self.owned: dict[str, list[int]] = {}  # owner -> [RAM bytes, disk bytes]
        self.listener: Listener | None = None  # quiet while the disk index is rebuilt
        if disk is not None:
            self._files = DiskFiles(disk.path)
            self._load_disk(self._files)
            self._writer = Writer(self._write_one, self._drained, disk.queue_bytes)
        self.listener = listener
        for e in list(self._entries.values()):  # rebuilt from disk, parents first
            self._tell("stored", "disk", e)

    # -- writes -------------------------------------------------------------

    def set_tenant_budget(self, ram_bytes: int, disk_bytes: int | None = None) -> None:
        """Cap what each owner (tenant) holds: ``ram_bytes`` in RAM and
        ``disk_bytes`` (default: the same) on the disk tier."""
        if ram_bytes <= 0 or (disk_bytes is not None and disk_bytes <= 0):
            raise ValueError("a tenant budget must be positive")
        with self._lock:
            self.tenant_budget = (ram_bytes, ram_bytes if disk_bytes is None else disk_bytes)

    def owned_bytes(self, owner: str, tier: str = "ram") -> int:
        with self._lock:
            return self.owned.get(owner, [0, 0])[tier != "ram"]

    def owners(self) -> dict[str, tuple[int, int]]:
        """Each owner holding blocks: (RAM bytes, disk bytes)."""
        with self._lock:
            return {o: (ram, disk) for o, (ram, disk) in self.owned.items()}

    def _own(self, e: _Entry, tier: int, n: int) -> None:
        if e.owner is None:
            return
        held = self.owned.setdefault(e.owner, [0, 0])
        held[tier] += n
        if held == [0, 0]:
            del self.owned[e.owner]  # owners come and go (gateway tenants): keep only holders

    def put(self, block: Block, owner: str | None = None) -> bool:
        """Store ``block``. True if stored, False if its key is already held. A key
        held with other bytes keeps the first: two producers may compute the same
        tokens to different bytes (kernels that depend on the pass's length, e.g.
        bfloat16 on AMX), which is counted as a variant, never as an attack.
        ``owner``: the tenant it is counted against (see :meth:`set_tenant_budget`)."""
        key, parent = block.header.key, block.header.parent
        with self._lock:
            self._check_put(block)
            existing = self._entries.get(key)
            if existing is not None:
                if existing.digest != block.digest:
                    self.stats.variants += 1
                self._touch(key)
                return False
            is_root = _is_root(block.header)
            if not is_root and parent not in self._entries:
                self._reject(OrphanBlock.reason)
                raise OrphanBlock(f"parent of {key.hex()[:12]} is not stored")
            self._own_room(owner, block.nbytes, keep=parent)
            self._make_room(block.nbytes, keep=parent)
            e = _Entry(block.header, block.digest, block.nbytes, block, owner=owner)
            self._entries[key] = e
            self._own(e, 0, block.nbytes)
            if not is_root:
                p = self._entries[parent]
                p.kids.add(key)
                p.ram_kids += 1
                self._sync(parent)
            self._sync(key)
            self.stats.used_bytes += block.nbytes
            self.stats.entries += 1
            self.stats.inserts += 1
            self._tell("stored", "ram", self._entries[key])
            if self.disk is not None and self.disk.admit == "evicted":
                self._admit(key)
            return True

    def _check_put(self, block: Block) -> None:
        """Under the lock: a block of a namespace whose card the store knows must
        match it (the same check as decoding and import: :func:`check_block`)."""
        layout = self._layouts.get(block.header.namespace)
        if layout is None:
            return
        try:
            check_block(block, layout)
        except MalformedPayload as e:
            self._reject(e.reason)
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
                e.header = _canonical(e.header, layout)
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
            self._reject(MalformedPayload.reason)
        self._drop_subtree(key)

    def _own_room(self, owner: str | None, nbytes: int, keep: bytes) -> None:
        """Under the lock: room for ``nbytes`` more of ``owner``'s in RAM within its
        budget, made from its own LRU leaves only."""
        if owner is None or self.tenant_budget is None:
            return
        budget = self.tenant_budget[0]
        self._expire_leases()
        while self.owned.get(owner, [0, 0])[0] + nbytes > budget:
            victim = next((k for k in self._leaves if k != keep and self._mine(k, owner)), None)
            if victim is None:
                self._reject(StoreFull.reason)
                raise StoreFull(f"tenant budget of {budget} bytes is full")
            self._evict(victim)

    def _mine(self, key: bytes, owner: str) -> bool:
        e = self._entries[key]
        return e.owner == owner and e.leases == 0

    def _tell(self, change: str, tier: str, e: _Entry) -> None:
        if self.listener is not None:
            self.listener(change, tier, e.header)

    def _reject(self, reason: str) -> None:
        self.stats.rejects[reason] = self.stats.rejects.get(reason, 0) + 1

    def _make_room(
        self,
        nbytes: int,
        keep: bytes,
        count: bool = True,
        spill: bool = True,
        protect: frozenset[bytes] = frozenset(),
    ) -> None:
        budget = self.stats.budget_bytes
        if nbytes > budget:
            if count:
                self._reject(StoreFull.reason)
            raise StoreFull(f"block of {nbytes} bytes exceeds the budget of {budget}")
        self._expire_leases()
        while self.stats.used_bytes + nbytes > budget:
            victim = self._ram_victim(keep, spill, protect)
            if victim is None:
                if count:
                    self._reject(StoreFull.reason)
                raise StoreFull("budget held by leased blocks")
            self._evict(victim)

    def _ram_victim(self, keep: bytes, spill: bool, protect: frozenset[bytes]) -> bytes | None:
        """The LRU RAM leaf; with a disk tier and ``spill``, else any block already
        on (or bound for) disk: its children stay reachable through the disk copy."""
        leaf = next(
            (
                k
                for k in self._leaves
                if k != keep and k not in protect and self._entries[k].leases == 0
            ),
            None,
        )
        if leaf is not None or self._writer is None or not spill:
            return leaf
        return next(
            (
                k
                for k, e in self._entries.items()
                if e.in_ram and (e.on_disk or e.queued) and e.leases == 0 and k not in protect
            ),
            None,
        )

    def _evict(self, key: bytes) -> None:
        """Take a RAM leaf out of RAM: left on (or bound for) disk, else dropped."""
        e = self._entries[key]
        e.in_ram = False
        self._own(e, 0, -e.nbytes)
        self.stats.used_bytes -= e.nbytes
        self.stats.entries -= 1
        self.stats.evictions += 1
        self._tell("removed", "ram", e)
        parent = self._entries.get(e.header.parent)
        if parent is not None:
            parent.ram_kids -= 1
            self._sync(e.header.parent, old=True)  # a parent was used no later than its child
        if not (e.on_disk or e.queued) and self._admissible(e):
            self._admit(key)
        if e.queued:
            self._sync(key)  # the writer holds the bytes until they are on disk
        elif e.on_disk:
            e.block = None
            self._sync(key)
        else:
            self._drop_subtree(key)

    def _touch(self, key: bytes) -> None:
        if key in self._leaves:
            self._leaves.move_to_end(key)
        if key in self._disk_leaves:
            self._disk_leaves.move_to_end(key)

    def _sync(self, key: bytes, old: bool = False) -> None:
        """Recompute whether ``key`` is a RAM leaf and a disk leaf; a new leaf goes
        to the newest end, or to the oldest with ``old``."""
        e = self._entries[key]
        _place(self._leaves, key, e.in_ram and e.ram_kids == 0, old)
        disk_leaf = e.on_disk and e.disk_kids == 0 and (e.in_ram or not e.kids)
        _place(self._disk_leaves, key, disk_leaf, old)

    def _remove(self, key: bytes) -> None:
        """Forget a childless entry in every tier."""
        e = self._entries.pop(key)
        self._leaves.pop(key, None)
        self._disk_leaves.pop(key, None)
        on_disk = e.on_disk or e.queued
        if e.in_ram:
            self._own(e, 0, -e.nbytes)
            self.stats.used_bytes -= e.nbytes
            self.stats.entries -= 1
            self._tell("removed", "ram", e)
        if e.on_disk:
            self._unlink(e)
        parent = self._entries.get(e.header.parent)
        if parent is not None and key in parent.kids:
            parent.kids.discard(key)
            parent.ram_kids -= e.in_ram
            parent.disk_kids -= on_disk
            self._sync(e.header.parent, old=True)

    def _drop_subtree(self, key: bytes) -> None:
        """Forget ``key`` and everything below it (their chain is broken)."""
        order, stack = [], [key]
        while stack:
            k = stack.pop()
            order.append(k)
            stack.extend(self._entries[k].kids)
        for k in reversed(order):  # children before parents
            self._remove(k)

    # -- the disk tier ------------------------------------------------------

    def _admissible(self, e: _Entry) -> bool:
        return self.disk is not None and (self.disk.admit == "evicted" or e.hits > 0)

    def _admit(self, key: bytes) -> None:
        """Queue ``key`` for the writer when its parent is on (or bound for) disk."""
        e = self._entries[key]
        if self._writer is None or e.queued or e.on_disk or e.block is None:
            return
        parent = self._entries.get(e.header.parent)
        closed = _is_root(e.header) or (parent is not None and (parent.on_disk or parent.queued))
        if not closed or e.nbytes > self.disk_stats.budget_bytes:
            return
        if not self._writer.submit(key, e.nbytes):
            self.disk_stats.dropped += 1
            self._backlog = True  # retried when the writer drains (see _readmit)
            return
        e.queued = True
        if parent is not None:
            parent.disk_kids += 1
            self._sync(e.header.parent)

    def _write_one(self, key: bytes) -> None:
        """Writer thread: make room on disk, write outside the lock, then record."""
        assert self._files is not None
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.queued or e.block is None:
                return
            parent = self._entries.get(e.header.parent)
            if not (_is_root(e.header) or (parent is not None and parent.on_disk)):
                return self._write_failed(key)  # the parent's write failed: keep disk closed
            if not (self._own_disk_room(e) and self._make_disk_room(e.nbytes)):
                return self._write_failed(key)
            self.disk_stats.used_bytes += e.nbytes  # reserved before the file exists
            self._own(e, 1, e.nbytes)
            block = e.block
        try:
            self._files.write(block)
        except OSError:
            with self._lock:
                self.disk_stats.used_bytes -= e.nbytes
                self._own(e, 1, -e.nbytes)
                if self._entries.get(key) is e:
                    self._write_failed(key)
            return
        with self._lock:
            if self._entries.get(key) is not e:  # dropped while being written
                self._files.remove(e.digest)
                self.disk_stats.used_bytes -= e.nbytes
                self._own(e, 1, -e.nbytes)
                return
            e.queued, e.on_disk = False, True
            if not e.in_ram:
                e.block = None
            self.disk_stats.entries += 1
            self.disk_stats.admissions += 1
            self._tell("stored", "disk", e)
            self._sync(key)

    def _drained(self) -> None:
        """Writer thread, queue empty: make renames durable, then queue the blocks
        a full queue refused (parents first: entries keep insertion order)."""
        assert self._files is not None
        self._files.sync_dir()
        with self._lock:
            if not self._backlog:
                return
            self._backlog = False
            for k, e in list(self._entries.items()):
                if e.in_ram and not (e.queued or e.on_disk) and self._admissible(e):
                    self._admit(k)
                    if self._backlog:
                        return

    def _write_failed(self, key: bytes) -> None:
        e = self._entries[key]
        e.queued = False
        self.disk_stats.dropped += 1
        parent = self._entries.get(e.header.parent)
        if parent is not None:
            parent.disk_kids -= 1
            self._sync(e.header.parent, old=True)
        if e.in_ram:
            self._sync(key)
        else:
            self._drop_subtree(key)  # its only copy was the one being written

    def _own_disk_room(self, e: _Entry) -> bool:
        """Under the lock: room on disk for ``e`` within its owner's budget, made
        from the owner's own disk leaves only; False when there is none."""
        if e.owner is None or self.tenant_budget is None:
            return True
        budget = self.tenant_budget[1]
        self._expire_leases()
        while self.owned.get(e.owner, [0, 0])[1] + e.nbytes > budget:
            victim = next(
                (
                    k
                    for k in self._disk_leaves
                    if self._entries[k].owner == e.owner
                    and (self._entries[k].in_ram or self._entries[k].leases == 0)
                ),
                None,
            )
            if victim is None:
                return False
            self._evict_disk(victim)
        return True

    def _make_disk_room(self, nbytes: int) -> bool:
        budget = self.disk_stats.budget_bytes
        if nbytes > budget:
            return False
        self._expire_leases()
        while self.disk_stats.used_bytes + nbytes > budget:
            victim = next(
                (
                    k
                    for k in self._disk_leaves
                    if self._entries[k].in_ram or self._entries[k].leases == 0
                ),
                None,
            )
            if victim is None:
                return False
            self._evict_disk(victim)
        return True

    def _evict_disk(self, key: bytes) -> None:
        e = self._entries[key]
        self.disk_stats.evictions += 1
        if not e.in_ram:
            return self._remove(key)  # a disk leaf out of RAM has no children
        self._unlink(e)
        parent = self._entries.get(e.header.parent)
        if parent is not None:
            parent.disk_kids -= 1
            self._sync(e.header.parent, old=True)
        self._sync(key)

    def _unlink(self, e: _Entry) -> None:
        assert self._files is not None
        self._files.remove(e.digest)
        self._own(e, 1, -e.nbytes)
        e.on_disk = False
        self.disk_stats.used_bytes -= e.nbytes
        self.disk_stats.entries -= 1
        self._tell("removed", "disk", e)

    def _hit(self, key: bytes, hit: bool) -> _Entry | None:
        """Under the lock: the entry under ``key``, touched (and counted as hit)."""
        e = self._entries.get(key)
        if e is None:
            return None
        if hit:
            e.hits += 1
        self._touch(key)
        if e.block is not None and hit and self.disk is not None and self.disk.admit == "hit":
            self._admit(key)
        return e

    def _open(self, e: _Entry) -> Block | None:
        """Outside the lock: read and verify ``e``'s file; None when it is bad."""
        assert self._files is not None
        try:
            return self._files.open(e.header, e.digest, e.nbytes)
        except (MalformedPayload, OSError):
            return None

    def _opened(self, key: bytes, e: _Entry, block: Block | None, promote: bool) -> bool:
        """Under the lock, after :meth:`_open`: a bad file still indexed is counted,
        deleted and its subtree dropped; a good hot one is promoted. False when the
        block must not be used (bad, or dropped from the index meanwhile)."""
        if self._entries.get(key) is not e:
            return False  # evicted or dropped while being read: not a corrupt file
        if block is None:
            if e.block is not None or not e.on_disk:
                return False  # promoted or unlinked meanwhile; the next read decides
            self.disk_stats.corrupt += 1
            log.warning("disk tier: deleting %s (bad on read)", e.digest.hex()[:12])
            self._drop_subtree(key)
            return False
        hot = self.disk is not None and e.hits >= self.disk.promote_hits
        if promote and hot and e.block is None and not self._no_room:
            self._promote(key, block)
        return True

    def _promote(self, key: bytes, block: Block) -> None:
        """Copy a hot disk block into RAM when it fits (its file stays). A lookup
        promotes a prefix of its chain: after one refusal it stops (``_no_room``)."""
        e = self._entries[key]
        protected = self._lookup_keys
        try:
            # never spill parents or this lookup's own blocks: that would churn
            self._make_room(
                e.nbytes, keep=e.header.parent, count=False, spill=False, protect=protected
            )
        except StoreFull:
            self._no_room = True
            return
        if not isinstance(block.blob, bytes):  # an mmap view: RAM wants its own bytes
            block = Block(block.header, bytes(block.blob), block.digest, block.payload_offset)
        e.block, e.in_ram = block, True
        self._own(e, 0, e.nbytes)
        self.stats.used_bytes += e.nbytes
        self.stats.entries += 1
        self.disk_stats.promotions += 1
        self._tell("stored", "ram", e)
        parent = self._entries.get(e.header.parent)
        if parent is not None:
            parent.ram_kids += 1
            self._sync(e.header.parent)
        self._sync(key)

    def _load_disk(self, files: DiskFiles) -> None:
        """Rebuild the index from the files' headers, parents first; delete torn,
        bad, duplicate and orphaned files; then fit the budget (oldest leaves first)."""
        ds = self.disk_stats
        ds.torn = files.clear_torn()

        def bad(path: str, why: str) -> None:
            ds.corrupt += 1
            log.warning("disk tier: deleting %s (%s)", path, why)
            unlink(path)

        records = sorted(files.scan(bad), key=lambda r: r.header.start)
        mtimes: dict[bytes, float] = {}
        for r in records:
            h = r.header
            if h.key in self._entries:
                bad(str(files.path(r.digest)), "a second file for one key")
                continue
            layout = self._layouts.get(h.namespace)
            if layout is not None:
                try:
                    check_header(h, layout)
                except MalformedPayload as why:
                    bad(str(files.path(r.digest)), f"disagrees with its card: {why}")
                    continue
                h = _canonical(h, layout)
            parent = self._entries.get(h.parent)
            if not _is_root(h) and parent is None:
                ds.orphans += 1
                files.remove(r.digest)
                continue
            e = _Entry(h, r.digest, r.nbytes, None, in_ram=False, on_disk=True)
            self._entries[h.key] = e
            if parent is not None:
                parent.kids.add(h.key)
                parent.disk_kids += 1
            mtimes[h.key] = r.mtime
            ds.used_bytes += r.nbytes
            ds.entries += 1
        leaves = [k for k, e in self._entries.items() if not e.kids]
        for k in sorted(leaves, key=mtimes.__getitem__):
            self._disk_leaves[k] = None
        self._make_disk_room(0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued disk writes (tests, benches, a clean shutdown)."""
        return self._writer.flush(timeout) if self._writer else True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the disk writer after the writes already queued."""
        if self._writer is not None:
            self._writer.close(timeout)

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
        block = self._open(e)
        with self._lock:
            self._no_room, self._lookup_keys = False, frozenset()
            return block if self._opened(key, e, block, promote=e.hits > 0) else None

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def _chain(
        self, keys: PrefixKeys | Sequence[bytes], tail: bytes | None
    ) -> tuple[list[tuple[bytes, _Entry]], tuple[bytes, _Entry] | None]:
        """Under the lock: the stored entries of the longest prefix, each hit once;
        counts the lookup (store hits/misses; a disk hit when a block is on disk only)."""
        if isinstance(keys, PrefixKeys):
            chain, tail = keys.blocks, keys.tail
        else:
            chain = tuple(keys)
        found: list[tuple[bytes, _Entry]] = []
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
            read.append(b if b is not None else self._open(e))
            if read[-1] is None:
                break
        disk = 0
        out: list[Block] = []
        with self._lock:
            self._no_room = False
            self._lookup_keys = frozenset(k for k, _ in want)
            for (k, e), b, got in zip(want, blocks, read, strict=False):
                if b is None:
                    if not self._opened(k, e, got, promote=True):
                        break
                    disk += 1
                assert got is not None
                out.append(got)
            self._lookup_keys = frozenset()
        n = len(found)
        tail_block = out[n] if t is not None and len(out) > n else None
        return Match(tuple(out[:n]), tail_block, disk)

    # -- leases -------------------------------------------------------------

    def lease(self, keys: Sequence[bytes], ttl: float = DEFAULT_LEASE_TTL) -> Lease:
        with self._lock:
            missing = [k for k in keys if k not in self._entries]
            if missing:
                raise LeaseExpired(f"{len(missing)} block(s) no longer stored")
            lease = Lease(secrets.token_hex(8), self.epoch, tuple(keys), self._clock() + ttl)
            for k in keys:
                self._entries[k].leases += 1
            self._leases[lease.id] = lease
            self.stats.leases = len(self._leases)
            return lease

    def check_lease(self, lease_id: str, epoch: str) -> Lease:
        with self._lock:
            if epoch != self.epoch:
                raise StaleEpoch(f"lease from epoch {epoch[:8]}, store is {self.epoch[:8]}")
            self._expire_leases()
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseExpired(f"lease {lease_id} expired or unknown")
            return lease

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._drop(lease)

    def _drop(self, lease: Lease) -> None:
        for k in lease.keys:
            e = self._entries.get(k)
            if e is not None:
                e.leases -= 1
        self.stats.leases = len(self._leases)

    def _expire_leases(self) -> None:
        now = self._clock()
        for lease in [lease for lease in self._leases.values() if lease.expires <= now]:
            del self._leases[lease.id]
            self._drop(lease)

    # -- introspection ------------------------------------------------------

    def reachable_bytes(self, tier: str = "ram") -> int:
        """Bytes in ``tier`` ("ram" or "disk") of blocks whose whole parent chain
        is stored (test hook for invariant 9; on disk the chain must be on disk)."""
        with self._lock:
            total = 0
            for e in self._entries.values():
                if not (e.in_ram if tier == "ram" else e.on_disk):
                    continue
                h = e.header
                while not _is_root(h):
                    p = self._entries.get(h.parent)
                    if p is None or (tier == "disk" and not p.on_disk):
                        break
                    h = p.header
                else:
                    total += e.nbytes
            return total

    def namespaces(self) -> set[bytes]:
        with self._lock:
            return {e.header.namespace for e in self._entries.values()}

    def tier_stats(self) -> tuple[TierStats, ...]:
        """RAM, then the disk tier when there is one."""
        with self._lock:
            s, d = self.stats, self.disk_stats
            out = [
                TierStats(
                    "ram",
                    s.budget_bytes,
                    s.used_bytes,
                    s.entries,
                    s.hits,
                    s.inserts + d.promotions,
                    s.evictions,
                )
            ]
            if self._writer is not None:
                out.append(
                    TierStats(
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
                        queued_bytes=self._writer.queued_bytes,
                    )
                )
            return tuple(out)


def _canonical(header: BlockHeader, layout: Layout) -> BlockHeader:
    """``header`` (already checked) holding the layout's own spec objects, so later
    checks of it compare by identity (cheap) and the index shares one copy."""
    return replace(
        header,
        layers=layout.layers(header.tokens),
        logits=layout.logits() if header.logits else None,
    )


def _place(order: OrderedDict[bytes, None], key: bytes, member: bool, old: bool) -> None:
    if not member:
        order.pop(key, None)
    elif key not in order:
        order[key] = None
        if old:
            order.move_to_end(key, last=False)
