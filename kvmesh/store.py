"""The block store: immutable, byte-bounded, LRU, with leases and an epoch.

Blocks form prefix trees (each block names its parent). The store only accepts a
block whose parent it holds (or whose parent is the namespace), and only evicts
leaves, least recently used first, so every stored byte stays reachable from a
root (invariant 9). Leased blocks are never evicted; a lease is tied to the
store's epoch, a random id made at start, so a restart voids every old lease.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .blocks import PrefixKeys
from .codec import Block
from .errors import ImmutableConflict, LeaseExpired, OrphanBlock, StaleEpoch, StoreFull

DEFAULT_LEASE_TTL = 30.0


@dataclass
class _Entry:
    block: Block
    children: int = 0
    leases: int = 0


@dataclass(frozen=True)
class Lease:
    id: str
    epoch: str
    keys: tuple[bytes, ...]
    expires: float


@dataclass(frozen=True)
class Match:
    """The longest stored prefix of one lookup."""

    blocks: tuple[Block, ...]
    tail: Block | None

    @property
    def tokens(self) -> int:
        n = sum(b.header.tokens for b in self.blocks)
        return n + (self.tail.header.tokens if self.tail else 0)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.all())

    def all(self) -> tuple[Block, ...]:
        return self.blocks + ((self.tail,) if self.tail else ())


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


class BlockStore:
    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget must be positive")
        self.epoch = secrets.token_hex(8)
        self._clock = clock
        self._lock = threading.RLock()
        self._entries: dict[bytes, _Entry] = {}
        self._leaves: OrderedDict[bytes, None] = OrderedDict()  # LRU order, oldest first
        self._leases: dict[str, Lease] = {}
        self.stats = StoreStats(budget_bytes)

    # -- writes -------------------------------------------------------------

    def put(self, block: Block) -> bool:
        """Store ``block``. True if stored, False if already held (identical)."""
        key, parent = block.header.key, block.header.parent
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None:
                if existing.block.digest != block.digest:
                    self._reject(ImmutableConflict.reason)
                    raise ImmutableConflict(
                        f"block {key.hex()[:12]} already stored with other bytes"
                    )
                self._touch(key)
                return False
            is_root = block.header.start == 0 and parent == block.header.namespace
            if not is_root and parent not in self._entries:
                self._reject(OrphanBlock.reason)
                raise OrphanBlock(f"parent of {key.hex()[:12]} is not stored")
            self._make_room(block.nbytes, keep=parent)
            self._entries[key] = _Entry(block)
            self._leaves[key] = None
            if not is_root:
                p = self._entries[parent]
                p.children += 1
                self._leaves.pop(parent, None)
            self.stats.used_bytes += block.nbytes
            self.stats.entries += 1
            self.stats.inserts += 1
            return True

    def _reject(self, reason: str) -> None:
        self.stats.rejects[reason] = self.stats.rejects.get(reason, 0) + 1

    def _make_room(self, nbytes: int, keep: bytes) -> None:
        budget = self.stats.budget_bytes
        if nbytes > budget:
            self._reject(StoreFull.reason)
            raise StoreFull(f"block of {nbytes} bytes exceeds the budget of {budget}")
        self._expire_leases()
        while self.stats.used_bytes + nbytes > budget:
            victim = next(
                (k for k in self._leaves if k != keep and self._entries[k].leases == 0), None
            )
            if victim is None:
                self._reject(StoreFull.reason)
                raise StoreFull("budget held by leased blocks")
            self._evict(victim)

    def _evict(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        del self._leaves[key]
        self.stats.used_bytes -= entry.block.nbytes
        self.stats.entries -= 1
        self.stats.evictions += 1
        parent = self._entries.get(entry.block.header.parent)
        if parent is not None:
            parent.children -= 1
            if parent.children == 0:
                # A parent was last used no later than its child: oldest end.
                self._leaves[entry.block.header.parent] = None
                self._leaves.move_to_end(entry.block.header.parent, last=False)

    def _touch(self, key: bytes) -> None:
        if key in self._leaves:
            self._leaves.move_to_end(key)

    # -- reads --------------------------------------------------------------

    def get(self, key: bytes) -> Block | None:
        with self._lock:
            e = self._entries.get(key)
            return e.block if e else None

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def longest_prefix(
        self, keys: PrefixKeys | Sequence[bytes], tail: bytes | None = None
    ) -> Match:
        """Longest run of stored blocks from the root; never crosses a hole.
        The tail counts only when every full block before it matched."""
        if isinstance(keys, PrefixKeys):
            chain, tail = keys.blocks, keys.tail
        else:
            chain = tuple(keys)
        with self._lock:
            found: list[Block] = []
            for k in chain:
                e = self._entries.get(k)
                if e is None:
                    break
                found.append(e.block)
                self._touch(k)
            t = None
            if len(found) == len(chain) and tail is not None:
                e = self._entries.get(tail)
                if e is not None:
                    t = e.block
                    self._touch(tail)
            if found or t:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
            return Match(tuple(found), t)

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

    def reachable_bytes(self) -> int:
        """Bytes of blocks whose whole parent chain is stored (test hook for invariant 9)."""
        with self._lock:
            total = 0
            for e in self._entries.values():
                h = e.block.header
                while not (h.start == 0 and h.parent == h.namespace):
                    p = self._entries.get(h.parent)
                    if p is None:
                        break
                    h = p.block.header
                else:
                    total += e.block.nbytes
            return total

    def namespaces(self) -> set[bytes]:
        with self._lock:
            return {e.block.header.namespace for e in self._entries.values()}
