"""The block store's disk tier: blocks written behind by one thread
(:class:`~kvmesh.store.files.Writer`), a parent-closed set of files (a block is written
only after its parent, so a restart rebuilds whole chains), its own byte budget
and leaf-first LRU, the index rebuilt from file headers at start.

A disk leaf has no child on (or bound for) disk, and no child at all unless the
block is also in RAM. A file is read and verified outside the store lock; a bad
one is deleted, counted as corrupt, and its subtree dropped. Methods other than
the writer's callbacks, :meth:`DiskTier.open`, ``flush`` and ``close`` run under
the store lock.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from ..codec import Block, Layout, check_header
from ..errors import MalformedPayload
from .files import DiskConfig, DiskFiles, Writer, unlink
from .index import DISK, Entry, Index, canonical, is_root
from .leases import Leases

log = logging.getLogger("kvmesh.store")


class DiskTier:
    def __init__(
        self,
        config: DiskConfig,
        index: Index,
        leases: Leases,
        lock: AbstractContextManager[Any],
        layouts: Mapping[bytes, Layout],
    ) -> None:
        self.config = config
        self.index = index
        self.leases = leases
        self.lock = lock
        self.files = DiskFiles(config.path)
        index.files = self.files
        self.backlog = False  # a write was refused for a full queue
        self.load(layouts)
        self.writer = Writer(self._write_one, self._drained, config.queue_bytes)

    # -- writes ---------------------------------------------------------------

    def admissible(self, e: Entry) -> bool:
        return self.config.admit == "evicted" or e.hits > 0

    def admit(self, key: bytes) -> None:
        """Queue ``key`` for the writer when its parent is on (or bound for) disk."""
        ix = self.index
        e = ix.entries[key]
        if e.queued or e.on_disk or e.block is None:
            return
        parent = ix.entries.get(e.header.parent)
        closed = is_root(e.header) or (parent is not None and (parent.on_disk or parent.queued))
        if not closed or e.nbytes > ix.disk_stats.budget_bytes:
            return
        if not self.writer.submit(key, e.nbytes):
            ix.disk_stats.dropped += 1
            self.backlog = True  # retried when the writer drains (see _drained)
            return
        e.queued = True
        if parent is not None:
            parent.disk_kids += 1
            ix.sync(e.header.parent)

    def _write_one(self, key: bytes) -> None:
        """Writer thread: make room on disk, write outside the lock, then record."""
        ix = self.index
        with self.lock:
            e = ix.entries.get(key)
            if e is None or not e.queued or e.block is None:
                return
            parent = ix.entries.get(e.header.parent)
            if not (is_root(e.header) or (parent is not None and parent.on_disk)):
                return self._write_failed(key)  # the parent's write failed: keep disk closed
            if not (self._own_room(e) and self.make_room(e.nbytes)):
                return self._write_failed(key)
            ix.disk_stats.used_bytes += e.nbytes  # reserved before the file exists
            ix.own(e, DISK, e.nbytes)
            block = e.block
        try:
            self.files.write(block)
        except OSError:
            with self.lock:
                self._unreserve(e)
                if ix.entries.get(key) is e:
                    self._write_failed(key)
            return
        with self.lock:
            if ix.entries.get(key) is not e:  # dropped while being written
                self.files.remove(e.digest)
                self._unreserve(e)
                return
            e.queued, e.on_disk = False, True
            if not e.in_ram:
                e.block = None
            ix.disk_stats.entries += 1
            ix.disk_stats.admissions += 1
            ix.tell("stored", "disk", e)
            ix.sync(key)

    def _unreserve(self, e: Entry) -> None:
        self.index.disk_stats.used_bytes -= e.nbytes
        self.index.own(e, DISK, -e.nbytes)

    def _drained(self) -> None:
        """Writer thread, queue empty: make renames durable, then queue the blocks
        a full queue refused (parents first: entries keep insertion order)."""
        self.files.sync_dir()
        with self.lock:
            if not self.backlog:
                return
            self.backlog = False
            for k, e in list(self.index.entries.items()):
                if e.in_ram and not (e.queued or e.on_disk) and self.admissible(e):
                    self.admit(k)
                    if self.backlog:
                        return

    def _write_failed(self, key: bytes) -> None:
        ix = self.index
        e = ix.entries[key]
        e.queued = False
        ix.disk_stats.dropped += 1
        parent = ix.entries.get(e.header.parent)
        if parent is not None:
            parent.disk_kids -= 1
            ix.sync(e.header.parent, old=True)
        if e.in_ram:
            ix.sync(key)
        else:
            ix.drop_subtree(key)  # its only copy was the one being written

    # -- room -----------------------------------------------------------------

    def _own_room(self, e: Entry) -> bool:
        """Room on disk for ``e`` within its owner's budget, made from the owner's
        own disk leaves only; False when there is none."""
        ix = self.index
        if e.owner is None or ix.tenant_budget is None:
            return True
        budget = ix.tenant_budget[DISK]
        self.leases.expire()
        while ix.owned.get(e.owner, [0, 0])[DISK] + e.nbytes > budget:
            victim = next((k for k in ix.disk_leaves if self._evictable(k, e.owner)), None)
            if victim is None:
                return False
            self.evict(victim)
        return True

    def make_room(self, nbytes: int) -> bool:
        """Room for ``nbytes`` more within the disk budget; False when there is none."""
        ix = self.index
        budget = ix.disk_stats.budget_bytes
        if nbytes > budget:
            return False
        self.leases.expire()
        while ix.disk_stats.used_bytes + nbytes > budget:
            victim = next((k for k in ix.disk_leaves if self._evictable(k)), None)
            if victim is None:
                return False
            self.evict(victim)
        return True

    def _evictable(self, key: bytes, owner: str | None = None) -> bool:
        """A disk leaf may go when its bytes stay in RAM or no lease holds it."""
        e = self.index.entries[key]
        return (owner is None or e.owner == owner) and (e.in_ram or e.leases == 0)

    def evict(self, key: bytes) -> None:
        ix = self.index
        e = ix.entries[key]
        ix.disk_stats.evictions += 1
        if not e.in_ram:
            return ix.remove(key)  # a disk leaf out of RAM has no children
        ix.unlink(e)
        parent = ix.entries.get(e.header.parent)
        if parent is not None:
            parent.disk_kids -= 1
            ix.sync(e.header.parent, old=True)
        ix.sync(key)

    # -- reads ----------------------------------------------------------------

    def open(self, e: Entry) -> Block | None:
        """Outside the lock: read and verify ``e``'s file; None when it is bad."""
        try:
            return self.files.open(e.header, e.digest, e.nbytes)
        except (MalformedPayload, OSError):
            return None

    def usable(self, key: bytes, e: Entry, block: Block | None) -> bool:
        """After :meth:`open`: whether ``block`` may be used. A bad file still
        indexed is counted, deleted and its subtree dropped; False also when the
        entry left the index meanwhile."""
        ix = self.index
        if ix.entries.get(key) is not e:
            return False  # evicted or dropped while being read: not a corrupt file
        if block is None:
            if e.block is not None or not e.on_disk:
                return False  # promoted or unlinked meanwhile; the next read decides
            ix.disk_stats.corrupt += 1
            log.warning("disk tier: deleting %s (bad on read)", e.digest.hex()[:12])
            ix.drop_subtree(key)
            return False
        return True

    # -- start and stop -------------------------------------------------------

    def load(self, layouts: Mapping[bytes, Layout]) -> None:
        """Rebuild the index from the files' headers, parents first; delete torn,
        bad, duplicate and orphaned files; then fit the budget (oldest leaves first)."""
        ix, files, ds = self.index, self.files, self.index.disk_stats
        ds.torn = files.clear_torn()

        def bad(path: str, why: str) -> None:
            ds.corrupt += 1
            log.warning("disk tier: deleting %s (%s)", path, why)
            unlink(path)

        records = sorted(files.scan(bad), key=lambda r: r.header.start)
        mtimes: dict[bytes, float] = {}
        for r in records:
            h = r.header
            if h.key in ix.entries:
                bad(str(files.path(r.digest)), "a second file for one key")
                continue
            layout = layouts.get(h.namespace)
            if layout is not None:
                try:
                    check_header(h, layout)
                except MalformedPayload as why:
                    bad(str(files.path(r.digest)), f"disagrees with its card: {why}")
                    continue
                h = canonical(h, layout)
            parent = ix.entries.get(h.parent)
            if not is_root(h) and parent is None:
                ds.orphans += 1
                files.remove(r.digest)
                continue
            ix.entries[h.key] = Entry(h, r.digest, r.nbytes, None, in_ram=False, on_disk=True)
            if parent is not None:
                parent.kids.add(h.key)
                parent.disk_kids += 1
            mtimes[h.key] = r.mtime
            ds.used_bytes += r.nbytes
            ds.entries += 1
        leaves = [k for k, e in ix.entries.items() if not e.kids]
        for k in sorted(leaves, key=mtimes.__getitem__):
            ix.disk_leaves[k] = None
        self.make_room(0)

    @property
    def queued_bytes(self) -> int:
        return self.writer.queued_bytes

    def flush(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.writer.close(timeout)
