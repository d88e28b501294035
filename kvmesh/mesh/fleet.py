"""The fleet as a head sees it: the one door from a head (or a vLLM worker) to
its mesh node, a synchronous facade over a :class:`NodeThread`.

Request paths run on ordinary threads, the mesh on its own event loop: every
call that crosses has a deadline. Lookups return validated hits only (see
:meth:`MeshClient.lookup`) and report how each peer answered, so a circuit
breaker can blame and forgive; a failed lookup is no hit and a typed reason. A
fetch's deadline covers the wait for a local stream and the stream: a wait that
uses it up is ours (:class:`~kvmesh.errors.LocalBusy`), never the peer's. The
read-only views (members, transfers, tiers) serve the dashboard and metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..blocks import BlockKeyer, PrefixKeys
from ..codec import Block, Layout
from ..compat import CompatCard
from ..errors import KVMeshError, Reason
from ..store import BlockStore, Listener, Match, Peek, TierStats
from .hits import PeerHit, Transfer
from .node import NodeThread
from .proto import kvmesh_pb2 as pb
from .transport import StreamTimes, Want


class Fleet:
    def __init__(self, thread: NodeThread) -> None:
        self._thread = thread  # runs the mesh's coroutines on its loop, with a deadline
        self._mesh = thread.node
        self._client = self._mesh.client
        self._members = self._mesh.membership

    @property
    def store(self) -> BlockStore:
        """This node's own block store (a head is also a cache peer)."""
        return self._mesh.store

    @property
    def fetch_deadline(self) -> float:
        return self._client.fetch_deadline

    @property
    def window_trim(self) -> bool:
        """Whether fetches ask only for the parts an import needs (``--no-window-trim``: no)."""
        return self._mesh.config.window_trim

    def advertise(self, card: CompatCard) -> None:
        """Gossip that this node serves ``card``'s namespace and runs a head."""
        self.store.expect(Layout(card))  # its blocks, every tier, held to the card
        self._mesh.advertise_head(card.namespace_hex, card.summary())

    def hold_rows(self, card: CompatCard, hash_key: bytes | None = None) -> BlockKeyer:
        """The keyer of pictures' encoder rows under ``card`` (:attr:`CompatCard.rows`),
        whose blocks this node keeps and fetches but never announces as KV."""
        self._mesh.quiet(card.namespace)
        return BlockKeyer(card.namespace, card.block_tokens, hash_key)

    def announced(self) -> int:
        """Block changes this node's KV events have queued for routers (0: no events)."""
        events = self._mesh.events
        return events.source.changes if events is not None else 0

    def keyer(self, card: CompatCard, hash_key: bytes | None = None) -> BlockKeyer:
        """The keyer of ``card``'s chains; it records each block's tokens when this
        node publishes KV events with token ids."""
        return self._mesh.recording(BlockKeyer(card.namespace, card.block_tokens, hash_key))

    def show_links(self, links: Callable[[], list[dict[str, Any]]]) -> None:
        """Where this node's card, status and metrics read its measured links
        (the head's planner: :meth:`kvmesh.runtime.planner.Planner.links`)."""
        self._mesh.link_rates = links

    def hear_store(self, listener: Listener) -> None:
        """``listener`` hears every block stored in or removed from this node's store
        (set before the first block is stored)."""
        self.store.listener = listener

    def local_prefix(self, keys: PrefixKeys) -> Match:
        return self.store.longest_prefix(keys)

    def peek(self, keys: PrefixKeys) -> Peek:
        """How much of ``keys`` the local store holds, from its index, untouched."""
        return self.store.peek(keys)

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
            return self._thread.call(
                self._client.lookup(card, keys, skip, on_failure, on_success),
                timeout=self._client.lookup_deadline + 1,
            )
        except TimeoutError:
            return [], [Reason.TIMEOUT]
        except KVMeshError as e:
            return [], [e.reason]
        except Exception:  # the cache never decides correctness
            return [], [Reason.ERROR]

    def fetch(
        self,
        layout: Layout,
        hit: PeerHit,
        start: int,
        on_block: Callable[[Block], None],
        timeout: float,
        times: StreamTimes | None = None,
        want: Want | None = None,
    ) -> list[Block]:
        """Stream ``hit``'s blocks from index ``start``, verified, within ``timeout``
        seconds in all (the wait for a local stream included: one that uses it up
        is :class:`~kvmesh.errors.LocalBusy`). Raises a :class:`KVMeshError`
        (:class:`~kvmesh.errors.PeerBusy` and ``LocalBusy`` are no peer failure) or
        ``TimeoutError``. ``times`` hears when the stream reached each stage;
        ``want``: the parts an import needs (:class:`~.transport.Want`)."""
        fetch = self._client.fetch(
            layout, hit, start, on_block=on_block, deadline=timeout, times=times, want=want
        )
        return self._thread.call(fetch, timeout=timeout + 1)

    def warm(self, layout: Layout, sample: Block, nbytes: int, timeout: float = 10.0) -> None:
        """Pay the first-use costs of a fetch now (see :meth:`MeshClient.warm`)."""
        self._thread.call(self._client.warm(layout, sample, nbytes), timeout=timeout)

    def keep(self, blocks: Sequence[Block], owner: str | None = None) -> int:
        """Store ``blocks`` (a chain from the root) locally; stop at the first refusal
        (budget or orphan: a local copy is optional), or at the first trimmed block
        (fetched for one import: never stored). Returns how many were kept.
        ``owner``: the tenant whose budget they count against (see the store)."""
        for i, blk in enumerate(blocks):
            if not blk.whole:
                return i
            try:
                self.store.put(blk, owner=owner)
            except KVMeshError:
                return i
        return len(blocks)

    def publish(self, card: CompatCard, chain: list[Block]) -> None:
        """Queue ``chain`` for the cache peers (dropped, never blocking, when full)."""

        async def enqueue() -> None:
            self._client.enqueue_publish(card, chain)

        self._thread.call(enqueue(), timeout=10)

    def queued(self) -> int:
        return self._client.queued()

    def drain(self, timeout: float) -> None:
        self._thread.call(self._client.drain(), timeout=timeout)

    # -- read-only views (dashboard, metrics, pairing) -------------------------

    @property
    def alias(self) -> str:
        return self._mesh.alias

    @property
    def address(self) -> str:
        return self._mesh.address

    @property
    def epoch(self) -> str:
        return self.store.epoch

    @property
    def ttl(self) -> float:
        """Seconds a member's card lives without news."""
        return self._members.ttl

    def own_card(self) -> pb.CapabilityCard:
        return self._members.own_card()

    def members(self) -> list[pb.CapabilityCard]:
        """The live peers' cards."""
        return self._members.live()

    def aliases(self) -> dict[str, str]:
        """node id -> alias of every live peer."""
        return {m.node_id: m.alias for m in self.members()}

    def card_age(self, node_id: str) -> float:
        """Seconds since ``node_id``'s card was last refreshed (0.0: unknown)."""
        return self._members.age(node_id) or 0.0

    def rtt(self, node_id: str, address: str) -> float | None:
        return self._members.rtt(node_id, address)

    def compatible_peers(self, card: CompatCard) -> list[pb.CapabilityCard]:
        """The peers a lookup for ``card`` may ask."""
        return self._client.compatible_peers(card)

    def seeds(self) -> list[str]:
        """This node's own endpoint addresses (what a new node joins through)."""
        return [e.address for e in self._mesh.endpoints]

    def transfers(self) -> list[Transfer]:
        """The latest fetches, oldest first."""
        return list(self._client.transfers)

    def counter(self, name: str) -> int:
        """One of the mesh client's own counters."""
        return self._client.counters.get(name, 0)

    def counters(self) -> dict[str, int]:
        """All of the mesh client's own counters, as they stand now."""
        return dict(self._client.counters)

    def local_streams(self) -> int:
        """Bulk streams that went over a peer's Unix socket (a node on this host)."""
        return self._client.local_streams

    def tier_stats(self) -> tuple[TierStats, ...]:
        return self.store.tier_stats()

    def collector(self) -> Any:
        """A Prometheus collector of this node's store, serving and events."""
        from .metrics import NodeCollector

        return NodeCollector(lambda: self._mesh)
