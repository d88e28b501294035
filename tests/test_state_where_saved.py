"""Blocks that carry the recurrent state where their producer kept one: every block of
a ``STATE_WHERE_SAVED`` card (vLLM's align mode), and off the grid of a card that
checkpoints every ``state_every`` blocks (a prompt's last whole blocks). A block with
the state or without it is valid there, a wrong state never is, a grid block must
carry it, and a card without recurrent layers takes none."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.codec import Layout, check_header, decode_block, new_blob
from kvmesh.compat import STATE_WHERE_SAVED, CompatCard
from kvmesh.errors import MalformedPayload

from .helpers import small_card

BLOCK = 4
STATE = "state:bfloat16[3,8];float32[2,4,4]"


def _card(state_every: int) -> CompatCard:
    return small_card(
        num_kv_heads=0,
        head_dim=0,
        layer_geometry=(STATE, "kv:1x8"),
        state_every=state_every,
    )


def _block(layout: Layout, start: int, state: bool):
    header = layout.header("block", bytes(range(32)), bytes(32), start, BLOCK, state)
    blob, view = new_blob(header)
    view[:] = bytes(len(view))
    return layout.seal(header, blob)


def test_a_block_with_or_without_the_state_is_valid_where_saved():
    layout = Layout(_card(STATE_WHERE_SAVED))
    assert layout.card.state_optional and not layout.card.carries_state("block", 0)
    with_state, without = _block(layout, 0, True), _block(layout, 0, False)
    assert with_state.header.states == layout.states and not without.header.states
    assert with_state.nbytes - without.nbytes > layout.card.state_bytes
    for blk in (with_state, without):
        check_header(blk.header, layout)
        assert decode_block(bytes(blk.blob), layout, blk.digest).header == blk.header
    assert layout.card.importable_blocks(3) == 3  # the caller ends on a block with state


def test_a_grid_card_takes_a_state_off_its_grid_and_requires_one_on_it():
    every_two = Layout(_card(2))
    off_grid = _block(every_two, 0, True)
    assert off_grid.header.states == every_two.states
    check_header(off_grid.header, every_two)
    check_header(_block(every_two, 0, False).header, every_two)  # or without it
    on_grid = _block(every_two, BLOCK, False).header
    assert on_grid.states == every_two.states  # the grid's blocks carry it, asked or not
    with pytest.raises(MalformedPayload, match="recurrent state"):  # and must
        check_header(dataclasses.replace(on_grid, states=()), every_two)
    # an import ends after the last block that carries it, the grid's or a flagged one
    assert every_two.card.importable_blocks(3) == 2
    assert every_two.card.importable_blocks(3, [True, False, True]) == 3
    assert every_two.card.importable_blocks(3, [True, False, False]) == 2
    saved = Layout(_card(STATE_WHERE_SAVED))
    wrong = dataclasses.replace(_block(saved, 0, True).header, states=every_two.states[:1])
    with pytest.raises(MalformedPayload, match="recurrent state"):
        check_header(wrong, saved)
    plain = Layout(small_card())
    assert not plain.card.may_carry_state
    stateful = dataclasses.replace(
        plain.header("block", bytes(32), bytes(32), 0, BLOCK), states=every_two.states
    )
    with pytest.raises(MalformedPayload, match="recurrent state"):
        check_header(stateful, plain)
    with pytest.raises(ValueError, match="state_every"):
        _card(-2)


def test_a_lookup_answer_says_which_blocks_carry_the_state():
    """Real nodes on loopback (gRPC): a peer holding a where-saved chain whose second
    block carries the state answers a lookup flagging that block alone, read from
    the stored headers; a flag on a card without state is refused as malformed."""
    import asyncio

    from kvmesh.blocks import BlockKeyer
    from kvmesh.mesh.hits import PeerHit, validated
    from kvmesh.mesh.node import MeshNode, NodeConfig
    from kvmesh.mesh.proto import kvmesh_pb2 as pb

    card = _card(STATE_WHERE_SAVED)
    layout = Layout(card)
    keyer = BlockKeyer(card.namespace, BLOCK)
    tokens = list(range(3 * BLOCK))
    keys = keyer.keys(tokens)
    chain = []
    for i, key in enumerate(keys.blocks):
        header = layout.header("block", key, keyer.parent_of(keys, i), i * BLOCK, BLOCK, i == 1)
        blob, view = new_blob(header)
        view[:] = bytes(len(view))
        chain.append(layout.seal(header, blob))

    async def run() -> list[PeerHit]:
        peer = MeshNode(NodeConfig(alias="cache", ttl=60, gossip_interval=60))
        head = MeshNode(NodeConfig(alias="head", roles=("head",), ttl=60, gossip_interval=60))
        for node in (peer, head):
            await node.start()
        try:
            await head.client.exchange(peer.address, peer.node_id)
            (target,) = head.client.publish_targets(chain[0].key)
            await head.client.publish(target, card, chain)
            hits, errors = await head.client.lookup(card, keys)
            assert not errors
            return hits
        finally:
            for node in (peer, head):
                await node.stop(0)

    (hit,) = asyncio.run(run())
    assert [b.HasField("states") for b in hit.blocks] == [True] * 3
    assert [b.states for b in hit.blocks] == [False, True, False]
    plain = Layout(small_card())  # no recurrent layer: a flag there is a lie
    info = pb.BlockInfo(key=b"k" * 32, nbytes=10, digest=b"d" * 32, tokens=BLOCK, states=True)
    claim = PeerHit("n", "p", "a", "ethernet", "e", (info,), None, BLOCK)
    with pytest.raises(MalformedPayload, match="recurrent state"):
        validated(claim, plain, 0)
    assert validated(claim, layout, 0) is claim
