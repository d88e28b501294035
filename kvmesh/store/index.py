"""The block store's index: every entry of both tiers, the parent/child links,
each tier's leaves in LRU order, the byte counts (per tier and per owner), and
the listener that hears each change.

Every method here runs under the store lock (:class:`~kvmesh.store.BlockStore`
holds it) and keeps the books consistent; the tiers decide what to evict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..codec import Block, BlockHeader, Layout
from .files import DiskFiles, DiskStats

Listener = Callable[[str, str, BlockHeader], None]

RAM, DISK = 0, 1  # an owner's byte counts: [RAM, disk]


@dataclass(eq=False)
class Entry:
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
    owner: str | None = None  # the tenant that put it (see BlockStore.set_tenant_budget)


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


def is_root(h: BlockHeader) -> bool:
    return h.start == 0 and h.parent == h.namespace


def canonical(header: BlockHeader, layout: Layout) -> BlockHeader:
    """``header`` (already checked) holding the layout's own spec objects, so later
    checks of it compare by identity (cheap) and the index shares one copy."""
    return replace(
        header,
        layers=layout.layers(header.tokens),
        logits=layout.logits() if header.logits else None,
    )


class Index:
    """The entries of both tiers and their books (see the module docstring)."""

    def __init__(self, stats: StoreStats, disk_stats: DiskStats) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.leaves: OrderedDict[bytes, None] = OrderedDict()  # RAM leaves, LRU first
        self.disk_leaves: OrderedDict[bytes, None] = OrderedDict()  # disk leaves, LRU first
        self.stats = stats
        self.disk_stats = disk_stats
        self.files: DiskFiles | None = None  # the disk tier's files, when there is one
        self.tenant_budget: tuple[int, int] | None = None  # (RAM, disk) bytes per owner
        self.owned: dict[str, list[int]] = {}  # owner -> [RAM bytes, disk bytes]
        self.listener: Listener | None = None

    def own(self, e: Entry, tier: int, n: int) -> None:
        """Count ``n`` more bytes of ``e``'s owner in ``tier`` (RAM or DISK)."""
        if e.owner is None:
            return
        held = self.owned.setdefault(e.owner, [0, 0])
        held[tier] += n
        if held == [0, 0]:
            del self.owned[e.owner]  # owners come and go (gateway tenants): keep only holders

    def tell(self, change: str, tier: str, e: Entry) -> None:
        if self.listener is not None:
            self.listener(change, tier, e.header)

    def reject(self, reason: str) -> None:
        self.stats.rejects[reason] = self.stats.rejects.get(reason, 0) + 1

    def add_ram(self, e: Entry) -> None:
        """Count ``e`` (its bytes now held) in the RAM tier."""
        e.in_ram = True
        self.own(e, RAM, e.nbytes)
        self.stats.used_bytes += e.nbytes
        self.stats.entries += 1

    def drop_ram(self, e: Entry) -> None:
        """Count ``e`` out of the RAM tier and tell the listener."""
        e.in_ram = False
        self.own(e, RAM, -e.nbytes)
        self.stats.used_bytes -= e.nbytes
        self.stats.entries -= 1
        self.tell("removed", "ram", e)

    def touch(self, key: bytes) -> None:
        if key in self.leaves:
            self.leaves.move_to_end(key)
        if key in self.disk_leaves:
            self.disk_leaves.move_to_end(key)

    def sync(self, key: bytes, old: bool = False) -> None:
        """Recompute whether ``key`` is a RAM leaf and a disk leaf; a new leaf goes
        to the newest end, or to the oldest with ``old``."""
        e = self.entries[key]
        _place(self.leaves, key, e.in_ram and e.ram_kids == 0, old)
        disk_leaf = e.on_disk and e.disk_kids == 0 and (e.in_ram or not e.kids)
        _place(self.disk_leaves, key, disk_leaf, old)

    def unlink(self, e: Entry) -> None:
        """Delete ``e``'s file and count it out of the disk tier."""
        assert self.files is not None
        self.files.remove(e.digest)
        self.own(e, DISK, -e.nbytes)
        e.on_disk = False
        self.disk_stats.used_bytes -= e.nbytes
        self.disk_stats.entries -= 1
        self.tell("removed", "disk", e)

    def remove(self, key: bytes) -> None:
        """Forget a childless entry in every tier."""
        e = self.entries.pop(key)
        self.leaves.pop(key, None)
        self.disk_leaves.pop(key, None)
        on_disk = e.on_disk or e.queued
        if e.in_ram:
            self.own(e, RAM, -e.nbytes)
            self.stats.used_bytes -= e.nbytes
            self.stats.entries -= 1
            self.tell("removed", "ram", e)
        if e.on_disk:
            self.unlink(e)
        parent = self.entries.get(e.header.parent)
        if parent is not None and key in parent.kids:
            parent.kids.discard(key)
            parent.ram_kids -= e.in_ram
            parent.disk_kids -= on_disk
            self.sync(e.header.parent, old=True)

    def drop_subtree(self, key: bytes) -> None:
        """Forget ``key`` and everything below it (their chain is broken)."""
        order, stack = [], [key]
        while stack:
            k = stack.pop()
            order.append(k)
            stack.extend(self.entries[k].kids)
        for k in reversed(order):  # children before parents
            self.remove(k)

    def reachable_bytes(self, tier: str) -> int:
        """Bytes in ``tier`` ("ram" or "disk") of blocks whose whole parent chain
        is stored (on disk, the chain must be on disk)."""
        total = 0
        for e in self.entries.values():
            if not (e.in_ram if tier == "ram" else e.on_disk):
                continue
            h = e.header
            while not is_root(h):
                p = self.entries.get(h.parent)
                if p is None or (tier == "disk" and not p.on_disk):
                    break
                h = p.header
            else:
                total += e.nbytes
        return total


def _place(order: OrderedDict[bytes, None], key: bytes, member: bool, old: bool) -> None:
    if not member:
        order.pop(key, None)
    elif key not in order:
        order[key] = None
        if old:
            order.move_to_end(key, last=False)
