"""A lookup's cost stays flat with fleet size: beyond ASK_ALL_BELOW cache peers it
asks the rendezvous owners of the prompt's root (where publishes go), one more for
each owner skipped or failing, and still finds what an owner holds. Real nodes
(gRPC and bulk servers) on loopback, in this process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvmesh.blocks import BlockKeyer
from kvmesh.mesh.client import ASK_ALL_BELOW
from kvmesh.mesh.node import MeshNode, NodeConfig

from .helpers import small_card, synthetic_chain

CARD = small_card()
TOKENS = list(range(30))


# which peers a lookup asks is the point here, not how fast they answer: under load the
# default 0.25 s deadline can fail a live owner (12 nodes on one event loop)
DEADLINE = 10.0


async def _fleet(n: int) -> tuple[list[MeshNode], MeshNode]:
    nodes = [
        MeshNode(NodeConfig(alias=f"c{i}", ttl=60, gossip_interval=60, lookup_deadline=DEADLINE))
        for i in range(n)
    ]
    head = MeshNode(
        NodeConfig(
            alias="head", roles=("head",), ttl=60, gossip_interval=60, lookup_deadline=DEADLINE
        )
    )
    for node in [*nodes, head]:
        await node.start()
    for node in nodes:
        await head.client.exchange(node.address, node.node_id)
    return nodes, head


async def _landed(done: Callable[[], bool]) -> None:
    """Wait until ``done()`` (a background call reached its peer), at most DEADLINE."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE
    while not done() and loop.time() < end:
        await asyncio.sleep(0.02)


def _asked(nodes: list[MeshNode]) -> int:
    return sum(n.cache.counters["lookups"] for n in nodes)


def test_a_large_fleet_asks_the_owners_and_the_next_one_when_one_is_out():
    async def run() -> None:
        nodes, head = await _fleet(ASK_ALL_BELOW + 3)
        try:
            by_id = {n.node_id: n for n in nodes}
            chain = synthetic_chain(CARD, TOKENS)
            keys = BlockKeyer(CARD.namespace, CARD.block_tokens).keys(TOKENS)
            owners = head.client.publish_targets(chain[0].key)
            assert len(owners) == len(nodes)
            await head.client.publish(owners[1], CARD, chain)  # as if owner 0 had been down

            before = _asked(nodes)
            hits, errors = await head.client.lookup(CARD, keys)
            assert _asked(nodes) - before == head.client.replicas + 1 == 2
            assert [h.node_id for h in hits] == [owners[1].node_id] and not errors
            assert hits[0].tokens == len(TOKENS)

            # owner 1 backed off by the caller: owner 2 is asked in its place (and owner 1
            # probed in the background); the hit it holds is then out of reach, no error
            before = _asked(nodes)
            hits, errors = await head.client.lookup(
                CARD, keys, skip=lambda n: n == owners[1].node_id
            )
            await _landed(lambda: _asked(nodes) - before >= 3)  # the background probe
            assert _asked(nodes) - before == 3 and not hits and not errors

            # owner 0 crashes (no goodbye): its failure costs one more peer, and owner
            # 1's hit is found
            await by_id[owners[0].node_id]._server.stop(0)
            before = _asked(nodes)
            hits, errors = await head.client.lookup(CARD, keys)
            assert [h.node_id for h in hits] == [owners[1].node_id]
            assert errors == ["peer_unreachable"] and _asked(nodes) - before == 2
        finally:
            for n in [*nodes, head]:
                await n.stop(0)

    asyncio.run(run())


def test_a_small_fleet_is_asked_in_full():
    async def run() -> None:
        nodes, head = await _fleet(3)
        try:
            chain = synthetic_chain(CARD, TOKENS)
            await head.client.publish(nodes[2].membership.outgoing()[0], CARD, chain)
            keys = BlockKeyer(CARD.namespace, CARD.block_tokens).keys(TOKENS)
            hits, _ = await head.client.lookup(CARD, keys)
            assert _asked(nodes) == 3 and [h.node_id for h in hits] == [nodes[2].node_id]
        finally:
            for n in [*nodes, head]:
                await n.stop(0)

    asyncio.run(run())
