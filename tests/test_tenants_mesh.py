"""Through the mesh, a tenant's blocks carry its salted keys only: a peer holds
none of the unsalted chain's keys, and nothing it holds names the tenant or its
root (in process: a real head runtime and a real peer node over loopback)."""

from __future__ import annotations

from kvmesh.blocks import chain_root, tenant_root
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.head import CacheScope, Generation

from .test_mesh import SAMPLING, close, make_head, prompt, wait_for


def test_a_peer_holds_salted_keys_only_and_never_the_tenant(tiny_engine):
    ns = tiny_engine.card.namespace
    troot = tenant_root(b"fleet-secret", "acme-corp")
    root = chain_root(ns, troot, "conversation-7")
    toks = prompt(tiny_engine, 200, salt="mesh-tenant")
    peer = NodeThread(NodeConfig(listen="127.0.0.1:0", alias="t-peer", gossip_interval=0.3, ttl=2))
    head = make_head(tiny_engine, [peer.node.address], alias="t-head")
    try:
        wait_for(lambda: len(head.fleet.members()) >= 1, what="gossip")
        for _ in head.generate(
            toks, SAMPLING, Generation(), client="key:acme", scope=CacheScope(root, "acme-corp")
        ):
            pass
        head.flush()
        store = peer.node.store
        wait_for(lambda: store.stats.entries >= len(toks) // 32, what="publish")
        salted = head.keyer_for(root, "key:acme").keys(toks)
        plain = head.keyer.keys(toks)
        held = set(store._entries)
        assert set(salted.blocks) <= held and salted.tail in held  # the salted chain, all of it
        assert not held & {*plain.blocks, plain.tail}  # none of the unsalted chain
        headers = [e.header for e in store._entries.values()]
        assert all(h.parent == ns for h in headers if h.start == 0)  # the root is not written
        for h in headers:  # what a header says on the wire and on disk
            wire = h.encode()
            assert b"acme" not in wire and troot not in wire and root not in wire
            assert troot.hex().encode() not in wire and root.hex().encode() not in wire
        # the head's own copy counts against the tenant; the peer's against no one
        assert head.fleet.store.owned_bytes("acme-corp") > 0
        assert store.owners() == {}
    finally:
        close(head)
        peer.close()
