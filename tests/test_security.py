"""Fleet key, TLS / mutual TLS, forged cards, bad publishes, bad announcements."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.engine import Sampling
from kvmesh.errors import OversizePayload, Unauthenticated
from kvmesh.mesh.client import PeerHit
from kvmesh.mesh.membership import Membership, card_bytes
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.mesh.proto import kvmesh_pb2_grpc as pbg
from kvmesh.mesh.security import MAX_SKEW_S, FleetAuth, Security, TLSConfig, body_digest
from kvmesh.mesh.status import fetch_cards
from kvmesh.runtime.head import HeadRuntime

from .hostile_peer import scrape
from .procs import Peer, free_port
from .test_mesh import close, prompt, wait_for

KEY = b"fleet-key-0123456789abcdef-fleet"


@pytest.fixture
def keyfile(tmp_path):
    f = tmp_path / "fleet.key"
    f.write_bytes(KEY)
    return f


def _node(seeds, security, alias):
    """The mesh node a test head runs on."""
    return NodeThread(
        NodeConfig(
            listen="127.0.0.1:0",
            seeds=seeds,
            alias=alias,
            gossip_interval=0.3,
            ttl=2,
            security=security,
        )
    )


def _head(engine, seeds, security=None, alias="head"):
    security = security or Security()
    return HeadRuntime(engine, _node(seeds, security, alias), hash_key=security.block_hash_key)


LOOKUP = "/kvmesh.v1.PrefillCache/Lookup"
LOOKUP_RAW = pb.LookupRequest(namespace=b"x" * 32, block_keys=[b"k" * 32]).SerializeToString()


async def _raw_lookup(address: str, metadata=None, creds=None):
    ch = grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
    async with ch:
        return await pbg.PrefillCacheStub(ch).Lookup(
            pb.LookupRequest.FromString(LOOKUP_RAW), timeout=2, metadata=metadata
        )


def _node_id(address: str) -> str:
    """A keyed peer's node id, asked the way a node first asks a seed."""
    return asyncio.run(fetch_cards(address, FleetAuth(KEY, "asker"), None))[0].node_id


def test_fleet_key_authenticates_calls_cards_and_publishes(tiny_engine, keyfile, tmp_path):
    peer = Peer("--fleet-key-file", str(keyfile), alias="secure", log_dir=tmp_path)
    sec = Security(fleet_key=KEY)
    try:
        # no credential, a wrong key, a replayed credential: UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(_raw_lookup(peer.address))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong = FleetAuth(b"not-the-fleet-key-at-all-000000", "intruder")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(
                _raw_lookup(peer.address, wrong.call_metadata("/kvmesh.v1.PrefillCache/Lookup"))
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = FleetAuth(KEY, "friend")
        md = good.call_metadata(LOOKUP, _node_id(peer.address), body_digest(LOOKUP_RAW))
        asyncio.run(_raw_lookup(peer.address, md))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(_raw_lookup(peer.address, md))  # replay
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # an outsider head cannot publish (nothing stored), a fleet head can
        toks = prompt(tiny_engine, 150, "secure ")
        outsider = _head(tiny_engine, [peer.address], alias="outsider")
        try:
            out = outsider.complete(toks, Sampling(max_tokens=4))
            outsider.flush()
            assert outsider.fleet.members() == []  # its gossip was refused
            assert out.tokens
        finally:
            close(outsider)
        h = _head(tiny_engine, [peer.address], sec, alias="insider")
        try:
            wait_for(lambda: len(h.fleet.members()) == 1, what="gossip with key")
            h.complete(toks, Sampling(max_tokens=4))
            h.flush()
        finally:
            close(h)
        h2 = _head(tiny_engine, [peer.address], sec, alias="insider2")
        try:
            ns = tiny_engine.card.namespace_hex
            wait_for(lambda: any(ns in c.namespaces for c in h2.fleet.members()), what="ns")
            out = h2.complete(toks, Sampling(max_tokens=4))
            assert out.report.source == "remote"
            # block keys are HMACs under the fleet key: not the plain SHA-256 chain
            plain = BlockKeyer(tiny_engine.card.namespace, tiny_engine.card.block_tokens).keys(toks)
            assert h2.keyer.keys(toks).blocks[0] != plain.blocks[0]
        finally:
            close(h2)
    finally:
        peer.kill()


def test_forged_and_unsigned_cards_are_dropped():
    auth = FleetAuth(KEY, "a")
    m = Membership("a", lambda: pb.CapabilityCard(alias="a"), auth)
    good = Membership("b", lambda: pb.CapabilityCard(alias="b"), FleetAuth(KEY, "b")).own_card()
    forged = pb.CapabilityCard()
    forged.CopyFrom(good)
    forged.alias = "evil"
    unsigned = pb.CapabilityCard(node_id="c", alias="c", version=1)
    other_fleet = Membership(
        "d", lambda: pb.CapabilityCard(alias="d"), FleetAuth(b"x" * 32, "d")
    ).own_card()
    assert m.merge([forged, unsigned, other_fleet, good]) == ["b"]
    assert m.rejected_cards == 3
    assert auth.verify_card(card_bytes(good), good.mac)


def test_versions_not_clocks_decide_and_restart_jumps_ahead():
    m = Membership("a", lambda: pb.CapabilityCard(alias="a"))
    m.merge([pb.CapabilityCard(node_id="b", alias="b", version=5, heartbeat=9e9)])
    m.merge([pb.CapabilityCard(node_id="b", alias="stale", version=4, heartbeat=1e10)])
    assert m.live()[0].alias == "b"
    m.merge([pb.CapabilityCard(node_id="a", version=41)])  # our own earlier life
    assert m.own_card().version == 42


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_mutual_tls(tiny_engine, certs, tmp_path, mutual):
    args = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    if mutual:
        args += ["--tls-ca", str(certs / "ca.pem")]
    peer = Peer(*args, alias="tls", log_dir=tmp_path)
    try:
        # plaintext to a TLS port fails
        with pytest.raises(grpc.aio.AioRpcError):
            asyncio.run(_raw_lookup(peer.address))
        ca_only = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        if mutual:  # no client certificate: refused
            with pytest.raises(grpc.aio.AioRpcError):
                asyncio.run(_raw_lookup(peer.address, creds=ca_only))
        # a head is a server too: it presents its own certificate, and uses it as a client
        tls = TLSConfig(cert=certs / "server.pem", key=certs / "server.key", ca=certs / "ca.pem")
        h = _head(tiny_engine, [peer.address], Security(tls=tls), alias="tls-head")
        try:
            wait_for(lambda: len(h.fleet.members()) == 1, what="gossip over TLS")
        finally:
            close(h)
    finally:
        peer.kill()


def test_garbage_publish_is_rejected_and_the_peer_keeps_serving(tiny_engine, tmp_path):
    peer = Peer(alias="garbage", log_dir=tmp_path)

    async def run():
        async with grpc.aio.insecure_channel(peer.address) as ch:
            stub = pbg.PrefillCacheStub(ch)
            bad = [
                [pb.PublishChunk(card_json="{not json", nbytes=10, data=b"x" * 10)],
                [pb.PublishChunk(card_json='{"engine": 1}', nbytes=10, data=b"x" * 10)],
                [pb.PublishChunk(data=b"no card")],
                [pb.PublishChunk(card_json="x" * 100_000)],
            ]
            card = tiny_engine.card.to_json()
            import json

            bad.append([pb.PublishChunk(card_json=json.dumps(card), nbytes=1 << 40, data=b"KVB1")])
            bad.append(
                [
                    pb.PublishChunk(
                        card_json=json.dumps(card), nbytes=100, data=b"KVB1" + b"\xff" * 96
                    )
                ]
            )
            results = []
            for msgs in bad:
                results.append(await stub.Publish(iter(msgs), timeout=5))
            return results, await stub.Lookup(pb.LookupRequest(namespace=b"x" * 32), timeout=2)

    try:
        results, alive = asyncio.run(run())
        assert all(r.stored == 0 and r.rejected == 1 and r.reason for r in results)
        assert alive.epoch == peer.epoch
        assert peer.proc.poll() is None
    finally:
        peer.kill()


class _LyingPeer(pbg.PrefillCacheServicer):
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes  # just over the card's cap: worth fetching, impossible to hold

    async def Lookup(self, request, context):
        return pb.LookupResponse(
            epoch="e",
            blocks=[
                pb.BlockInfo(key=k, nbytes=self.nbytes, digest=b"d" * 32, tokens=32)
                for k in request.block_keys
            ],
            matched_tokens=32 * len(request.block_keys),
        )


def test_oversize_announcement_falls_back_before_allocating(tiny_engine):
    async def serve():
        server = grpc.aio.server()
        pbg.add_PrefillCacheServicer_to_server(
            _LyingPeer(tiny_engine.layout.max_block_bytes + 1), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    node = _node([], Security(), "victim")
    h = HeadRuntime(tiny_engine, node)
    try:
        server, port = node.call(serve())
        liar = pb.CapabilityCard(
            node_id="liar",
            alias="liar",
            epoch="e",
            roles=["cache"],
            version=1,
            namespaces=[tiny_engine.card.namespace_hex],
            endpoints=[pb.Endpoint(address=f"127.0.0.1:{port}", interface="loopback", priority=1)],
        )
        node.node.membership.merge([liar])  # known without gossip: it speaks no Exchange
        toks = prompt(tiny_engine, 100, "liar ")
        out = h.complete(toks, Sampling(max_tokens=4))
        assert out.report.fallback == "oversize_payload" and out.report.source == "compute"
        assert out.tokens == list(
            tiny_engine.generate(tiny_engine.prefill(toks), Sampling(max_tokens=4))
        )
        hit = PeerHit(
            "liar",
            "liar",
            f"127.0.0.1:{port}",
            "loopback",
            "e",
            (pb.BlockInfo(key=b"k" * 32, nbytes=1 << 40, digest=b"d" * 32),),
            None,
            32,
        )
        with pytest.raises(OversizePayload):
            h.fleet.fetch(tiny_engine.layout, hit, 0, lambda _: None, timeout=10)
        node.call(server.stop(0))
    finally:
        close(h)


def test_auth_errors_are_typed():
    auth = FleetAuth(KEY, "a")
    with pytest.raises(Unauthenticated):
        auth.verify_call("/m", (("x-kvmesh-auth", "garbage"),))
    with pytest.raises(Unauthenticated):
        auth.verify_call("/m", None)
    md = auth.call_metadata("/m")
    with pytest.raises(Unauthenticated):
        auth.verify_call("/other", md)  # bound to the method


# -- call credentials bind the destination and the request ------------------------------

FETCH = "/kvmesh.v1.PrefillCache/Fetch"
PUBLISH = "/kvmesh.v1.PrefillCache/Publish"


async def _call(address: str, method: str, raws: list[bytes], metadata) -> str:
    """Send serialized request(s) as they are; the status code's name."""
    async with grpc.aio.insecure_channel(address) as ch:
        kw = dict(request_serializer=None, response_deserializer=None)
        try:
            if method == FETCH:
                async for _ in ch.unary_stream(method, **kw)(raws[0], timeout=5, metadata=metadata):
                    pass
            elif method == PUBLISH:
                await ch.stream_unary(method, **kw)(iter(raws), timeout=5, metadata=metadata)
            else:
                await ch.unary_unary(method, **kw)(raws[0], timeout=5, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return "OK"


def test_a_credential_is_bound_to_its_destination_and_its_request(keyfile, tmp_path):
    """Real keyed peers on loopback. A replayed credential, a credential made for
    another node, and one moved onto another request (unary, server-streaming
    Fetch, client-streaming Publish) are all UNAUTHENTICATED and counted by why;
    the peers keep serving."""
    ma, mb = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    a = Peer("--fleet-key-file", str(keyfile), "--metrics", ma, alias="a", log_dir=tmp_path)
    b = Peer("--fleet-key-file", str(keyfile), "--metrics", mb, alias="b", log_dir=tmp_path)
    me = FleetAuth(KEY, "friend")
    try:
        ida, idb = _node_id(a.address), _node_id(b.address)
        other = pb.LookupRequest(namespace=b"y" * 32, block_keys=[b"j" * 32]).SerializeToString()
        fetch1 = pb.FetchRequest(namespace=b"x" * 32, keys=[b"k" * 32], epoch=a.epoch)
        fetch2 = pb.FetchRequest(namespace=b"x" * 32, keys=[b"q" * 32], epoch=a.epoch)
        f1, f2 = fetch1.SerializeToString(), fetch2.SerializeToString()
        p1 = pb.PublishChunk(card_json="{}", nbytes=10, data=b"x" * 10).SerializeToString()
        p2 = pb.PublishChunk(card_json="{}", nbytes=10, data=b"y" * 10).SerializeToString()

        def cred(method: str, dest: str, raw: bytes):
            return me.call_metadata(method, dest, body_digest(raw))

        replayed = cred(LOOKUP, ida, LOOKUP_RAW)
        assert asyncio.run(_call(a.address, LOOKUP, [LOOKUP_RAW], replayed)) == "OK"
        refused = {
            "replayed": asyncio.run(_call(a.address, LOOKUP, [LOOKUP_RAW], replayed)),
            "for_a_at_b": asyncio.run(
                _call(b.address, LOOKUP, [LOOKUP_RAW], cred(LOOKUP, ida, LOOKUP_RAW))
            ),
            "lookup_body": asyncio.run(
                _call(a.address, LOOKUP, [other], cred(LOOKUP, ida, LOOKUP_RAW))
            ),
            "fetch_body": asyncio.run(_call(a.address, FETCH, [f2], cred(FETCH, ida, f1))),
            "publish_body": asyncio.run(_call(a.address, PUBLISH, [p2], cred(PUBLISH, ida, p1))),
            "other_method": asyncio.run(
                _call(a.address, FETCH, [LOOKUP_RAW], cred(LOOKUP, ida, LOOKUP_RAW))
            ),
            "wildcard": asyncio.run(
                _call(a.address, LOOKUP, [LOOKUP_RAW], cred(LOOKUP, "*", LOOKUP_RAW))
            ),
        }
        assert set(refused.values()) == {"UNAUTHENTICATED"}, refused
        # the same requests with their own credentials are served
        assert (
            asyncio.run(_call(b.address, LOOKUP, [LOOKUP_RAW], cred(LOOKUP, idb, LOOKUP_RAW)))
            == "OK"
        )
        assert asyncio.run(_call(a.address, LOOKUP, [other], cred(LOOKUP, ida, other))) == "OK"
        assert asyncio.run(_call(a.address, FETCH, [f2], cred(FETCH, ida, f2))) == "NOT_FOUND"
        assert asyncio.run(_call(a.address, PUBLISH, [p2], cred(PUBLISH, ida, p2))) == "OK"
        sa, sb = scrape(ma), scrape(mb)
        auth = "kvmesh_rejections_total{{reason={},surface=auth}}"
        assert sa[auth.format("replayed")] == 1
        assert sa[auth.format("bad_mac")] == 4  # lookup, fetch, publish bodies; other method
        assert sa[auth.format("wrong_destination")] == 1  # the wildcard outside Exchange
        assert sb[auth.format("wrong_destination")] == 1
        assert a.proc.poll() is None and b.proc.poll() is None
    finally:
        a.kill()
        b.kill()


def test_the_nonce_cache_is_bounded_and_never_forgets_into_a_replay():
    now = [1000.0]
    server = FleetAuth(KEY, "srv", clock=lambda: now[0], max_nonces=4)
    client = FleetAuth(KEY, "cli", clock=lambda: now[0])
    raw = body_digest(b"req")
    sent = []
    for _ in range(6):
        now[0] += 0.5  # exact in binary: one ms stamp each
        sent.append(client.call_metadata(LOOKUP, "srv", raw))
        server.verify_call(LOOKUP, sent[-1], raw)
    assert len(server.nonces) == 4
    for md in sent:  # forgotten or remembered, every one is refused
        with pytest.raises(Unauthenticated):
            server.verify_call(LOOKUP, md, raw)
    assert server.refusals["replayed"] == 4 and server.refusals["replay_window_full"] == 2
    now[0] += 1.0
    server.verify_call(LOOKUP, client.call_metadata(LOOKUP, "srv", raw), raw)  # fresh: fine
    late = client.call_metadata(LOOKUP, "srv", raw)
    now[0] += MAX_SKEW_S + 1
    with pytest.raises(Unauthenticated):
        server.verify_call(LOOKUP, late, raw)  # outside the time window
    assert server.refusals["stale"] == 1
    server.verify_call(LOOKUP, client.call_metadata(LOOKUP, "srv", raw), raw)
    assert len(server.nonces) == 1  # entries older than the window are gone


def test_replayed_goodbyes_and_a_full_membership_remove_or_add_no_one():
    """A goodbye removes only the life (epoch) and version it names; membership
    holds at most ``max_members`` nodes however many cards arrive."""
    m = Membership("a", lambda: pb.CapabilityCard(alias="a"), max_members=2)
    old_bye = pb.CapabilityCard(node_id="b", epoch="e1", version=3, roles=["leaving"])
    m.merge([pb.CapabilityCard(node_id="b", epoch="e2", version=1, roles=["cache"])])  # new life
    m.merge([old_bye])  # a goodbye of the earlier life, replayed
    assert [c.node_id for c in m.live()] == ["b"]
    m.merge([pb.CapabilityCard(node_id="b", epoch="e2", version=5, roles=["cache"])])
    m.merge([pb.CapabilityCard(node_id="b", epoch="e2", version=4, roles=["leaving"])])  # stale
    assert [c.node_id for c in m.live()] == ["b"]
    flood = [pb.CapabilityCard(node_id=f"n{i}", epoch="e", version=1) for i in range(100)]
    m.merge(flood)
    assert len(m.live()) == 2 and m.rejected_cards == 99
