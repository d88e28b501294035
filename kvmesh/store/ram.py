"""The block store's RAM tier: room within the byte budget (the whole tier's and
each owner's), made by evicting leaves, least recently used first, never a
leased block; an evicted block is left on (or queued for) the disk tier when it
has one, else dropped. Hot disk blocks are promoted back into RAM when they fit.

Every method runs under the store lock.
"""

from __future__ import annotations

import dataclasses

from ..codec import Block
from ..errors import StoreFull
from .disk import DiskTier
from .index import RAM, Index
from .leases import Leases


class RamTier:
    def __init__(self, index: Index, leases: Leases, disk: DiskTier | None) -> None:
        self.index = index
        self.leases = leases
        self.disk = disk
        self.no_room = False  # a promotion of this lookup found no room
        self.lookup_keys: frozenset[bytes] = frozenset()  # blocks a promotion must not evict

    def own_room(self, owner: str | None, nbytes: int, keep: bytes) -> None:
        """Room for ``nbytes`` more of ``owner``'s within its RAM budget, made from
        its own LRU leaves only."""
        ix = self.index
        if owner is None or ix.tenant_budget is None:
            return
        budget = ix.tenant_budget[RAM]
        self.leases.expire()
        while ix.owned.get(owner, [0, 0])[RAM] + nbytes > budget:
            victim = next((k for k in ix.leaves if k != keep and self._mine(k, owner)), None)
            if victim is None:
                ix.reject(StoreFull.reason)
                raise StoreFull(f"tenant budget of {budget} bytes is full")
            self.evict(victim)

    def _mine(self, key: bytes, owner: str) -> bool:
        e = self.index.entries[key]
        return e.owner == owner and e.leases == 0

    def make_room(
        self,
        nbytes: int,
        keep: bytes,
        count: bool = True,
        spill: bool = True,
        protect: frozenset[bytes] = frozenset(),
    ) -> None:
        """Room for ``nbytes`` more within the RAM budget, never evicting ``keep``
        or ``protect``; ``count``: a refusal is counted as a reject."""
        ix = self.index
        budget = ix.stats.budget_bytes
        if nbytes > budget:
            if count:
                ix.reject(StoreFull.reason)
            raise StoreFull(f"block of {nbytes} bytes exceeds the budget of {budget}")
        self.leases.expire()
        while ix.stats.used_bytes + nbytes > budget:
            victim = self._victim(keep, spill, protect)
            if victim is None:
                if count:
                    ix.reject(StoreFull.reason)
                raise StoreFull("budget held by leased blocks")
            self.evict(victim)

    def _victim(self, keep: bytes, spill: bool, protect: frozenset[bytes]) -> bytes | None:
        """The LRU RAM leaf; with a disk tier and ``spill``, else any block already
        on (or bound for) disk: its children stay reachable through the disk copy."""
        entries = self.index.entries
        leaf = next(
            (
                k
                for k in self.index.leaves
                if k != keep and k not in protect and entries[k].leases == 0
            ),
            None,
        )
        if leaf is not None or self.disk is None or not spill:
            return leaf
        return next(
            (
                k
                for k, e in entries.items()
                if e.in_ram and (e.on_disk or e.queued) and e.leases == 0 and k not in protect
            ),
            None,
        )

    def evict(self, key: bytes) -> None:
        """Take a RAM leaf out of RAM: left on (or bound for) disk, else dropped."""
        ix = self.index
        e = ix.entries[key]
        ix.stats.evictions += 1
        ix.drop_ram(e)
        parent = ix.entries.get(e.header.parent)
        if parent is not None:
            parent.ram_kids -= 1
            ix.sync(e.header.parent, old=True)  # a parent was used no later than its child
        if self.disk is not None and not (e.on_disk or e.queued) and self.disk.admissible(e):
            self.disk.admit(key)
        if e.queued:
            ix.sync(key)  # the writer holds the bytes until they are on disk
        elif e.on_disk:
            e.block = None
            ix.sync(key)
        else:
            ix.drop_subtree(key)

    def promote(self, key: bytes, block: Block) -> None:
        """Copy a hot disk block into RAM when it fits (its file stays). A lookup
        promotes a prefix of its chain: after one refusal it stops (``no_room``)."""
        if self.no_room:
            return
        ix = self.index
        e = ix.entries[key]
        try:
            # never spill parents or this lookup's own blocks: that would churn
            self.make_room(
                e.nbytes, keep=e.header.parent, count=False, spill=False, protect=self.lookup_keys
            )
        except StoreFull:
            self.no_room = True
            return
        if not isinstance(block.blob, bytes):  # an mmap view: RAM wants its own bytes
            block = dataclasses.replace(block, blob=bytes(block.blob))
        e.block = block
        ix.add_ram(e)
        ix.disk_stats.promotions += 1
        ix.tell("stored", "ram", e)
        parent = ix.entries.get(e.header.parent)
        if parent is not None:
            parent.ram_kids += 1
            ix.sync(e.header.parent)
        ix.sync(key)
