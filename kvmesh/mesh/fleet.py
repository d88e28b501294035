"""The fleet as a head sees it: a small synchronous facade over a :class:`NodeThread`.

A head's request path runs on ordinary threads; the mesh runs on its own event
loop. ``Fleet`` is the one place that crosses between them: every call has a
deadline, and the head never reaches through the node's insides. Lookups return
validated hits only (a peer's claim is checked against the keys asked; see
:meth:`MeshClient.lookup`) and tell the caller how each peer answered, so its
circuit breaker can blame and forgive. A fetch's deadline covers the wait for a
local stream and the stream: a wait that uses it up is our failure
(:class:`~kvmesh.errors.LocalBusy`), never the peer's; the stream gets the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..blocks import PrefixKeys
from ..codec import Block, Layout
from ..compat import CompatCard
from ..errors import KVMeshError
from ..store import BlockStore, Match
from .bulk import StreamTimes
from .hits import PeerHit
from .node import NodeThread


class Fleet:
    def __init__(self, node: NodeThread) -> None:
        self._node = node
        self._client = node.node.client

    @property
    def store(self) -> BlockStore:
        """This node's own block store (a head is also a cache peer)."""
        return self._node.node.store

    @property
    def fetch_deadline(self) -> float:
        return self._client.fetch_deadline

    def advertise(self, card: CompatCard) -> None:
        """Gossip that this node serves ``card``'s namespace and runs a head."""
        node = self._node.node
        self.store.expect(Layout(card))  # its blocks, every tier, held to the card
        node.extra_namespaces[card.namespace_hex] = card.summary()
        node.config.roles = tuple(sorted({"head", *node.config.roles}))

    def local_prefix(self, keys: PrefixKeys) -> Match:
        return self.store.longest_prefix(keys)

    def lookup(
        self,
        card: CompatCard,
        keys: PrefixKeys,
        skip: Callable[[str], bool] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        on_success: Callable[[str], None] | None = None,
    ) -> tuple[list[PeerHit], list[str]]:
        """Validated hits (longest first) and the failure reasons of peers that did
        not answer. Peers for which ``skip(node_id)`` is true are not waited for;
        ``on_failure(node_id, reason)`` hears of each peer that failed and
        ``on_success(node_id)`` of each that answered, background probes included
        (all run on the mesh thread). Never raises: a failed lookup is a miss."""
        try:
            return self._node.call(
                self._client.lookup(card, keys, skip, on_failure, on_success),
                timeout=self._client.lookup_deadline + 1,
            )
        except TimeoutError:
            return [], ["timeout"]
        except Exception:  # the cache never decides correctness
            return [], ["error"]

    def fetch(
        self,
        layout: Layout,
        hit: PeerHit,
        start: int,
        on_block: Callable[[Block], None],
        timeout: float,
        times: StreamTimes | None = None,
    ) -> list[Block]:
        """Stream ``hit``'s blocks from index ``start``, verified, within ``timeout``
        seconds in all (the wait for a local stream included: one that uses it up
        is :class:`~kvmesh.errors.LocalBusy`). Raises a :class:`KVMeshError`
        (:class:`~kvmesh.errors.PeerBusy` and ``LocalBusy`` are no peer failure) or
        ``TimeoutError``. ``times`` hears when the stream reached each stage."""
        fetch = self._client.fetch(
            layout, hit, start, on_block=on_block, deadline=timeout, times=times
        )
        return self._node.call(fetch, timeout=timeout + 1)

    def warm(self, layout: Layout, sample: Block, nbytes: int, timeout: float = 10.0) -> None:
        """Pay the first-use costs of a fetch now (see :meth:`MeshClient.warm`)."""
        self._node.call(self._client.warm(layout, sample, nbytes), timeout=timeout)

    def keep(self, blocks: Sequence[Block], owner: str | None = None) -> int:
        """Store ``blocks`` (a chain from the root) locally; stop at the first refusal
        (budget or orphan: a local copy is optional). Returns how many were kept.
        ``owner``: the tenant whose budget they count against (see the store)."""
        for i, blk in enumerate(blocks):
            try:
                self.store.put(blk, owner=owner)
            except KVMeshError:
                return i
        return len(blocks)

    def publish(self, card: CompatCard, chain: list[Block]) -> None:
        """Queue ``chain`` for the cache peers (dropped, never blocking, when full)."""

        async def enqueue() -> None:
            self._client.enqueue_publish(card, chain)

        self._node.call(enqueue(), timeout=10)

    def queued(self) -> int:
        return self._client.queued()

    def drain(self, timeout: float) -> None:
        self._node.call(self._client.drain(), timeout=timeout)
