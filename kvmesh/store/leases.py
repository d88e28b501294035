"""Leases on stored blocks: a leased block is not evicted while a transfer reads
it. A lease names the store's epoch (random at start), so a restart voids every
old lease; an expired lease frees its blocks.

Every method runs under the store lock.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import LeaseExpired, StaleEpoch
from .index import Index

DEFAULT_LEASE_TTL = 30.0


@dataclass(frozen=True)
class Lease:
    id: str
    epoch: str
    keys: tuple[bytes, ...]
    expires: float


class Leases:
    """The live leases of one store, counted on its index's entries."""

    def __init__(self, index: Index, epoch: str, clock: Callable[[], float]) -> None:
        self.index = index
        self.epoch = epoch
        self.clock = clock
        self.live: dict[str, Lease] = {}

    def take(self, keys: Sequence[bytes], ttl: float) -> Lease:
        entries = self.index.entries
        missing = [k for k in keys if k not in entries]
        if missing:
            raise LeaseExpired(f"{len(missing)} block(s) no longer stored")
        lease = Lease(secrets.token_hex(8), self.epoch, tuple(keys), self.clock() + ttl)
        for k in keys:
            entries[k].leases += 1
        self.live[lease.id] = lease
        self.index.stats.leases = len(self.live)
        return lease

    def check(self, lease_id: str, epoch: str) -> Lease:
        if epoch != self.epoch:
            raise StaleEpoch(f"lease from epoch {epoch[:8]}, store is {self.epoch[:8]}")
        self.expire()
        lease = self.live.get(lease_id)
        if lease is None:
            raise LeaseExpired(f"lease {lease_id} expired or unknown")
        return lease

    def release(self, lease_id: str) -> None:
        lease = self.live.pop(lease_id, None)
        if lease is not None:
            self._drop(lease)

    def expire(self) -> None:
        now = self.clock()
        for lease in [lease for lease in self.live.values() if lease.expires <= now]:
            del self.live[lease.id]
            self._drop(lease)

    def _drop(self, lease: Lease) -> None:
        for k in lease.keys:
            e = self.index.entries.get(k)
            if e is not None:
                e.leases -= 1
        self.index.stats.leases = len(self.live)
