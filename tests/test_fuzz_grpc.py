"""Fuzzing every gRPC method of a live peer process (hypothesis).

Two real ``kvmesh peer`` processes with small limits (64 MiB budget, 8 MiB
blocks, 16 MiB in flight): one plaintext, one under a fleet key. Each example
sends one call to one of them: raw bytes, or a structurally valid protobuf with
wrong contents (huge key lists, wrong namespaces, bad epochs, random card JSON,
random chunk sizes, cards naming thousands of namespaces). For the keyed peer
the call carries a valid credential for exactly those bytes, so the fuzz reaches
the code behind the authentication; sometimes a wrong one. Every call must end
in a valid response or a gRPC status other than UNKNOWN (an unhandled exception
in a handler); the peers never die, store nothing, and their resident memory
stays under the RSS they had at start plus budget plus in-flight cap.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.mesh.security import FleetAuth, body_digest
from kvmesh.mesh.status import fetch_cards

from .helpers import small_card
from .hostile_peer import rss, scrape
from .procs import Peer
from .test_hostile import small_peer

KEY = b"fuzz-fleet-key-0123456789abcdef!"
MiB = 1 << 20
BOUND = 64 * MiB + 16 * MiB  # budget + in-flight cap, over the RSS at start
LOOKUP = "/kvmesh.v1.PrefillCache/Lookup"
FETCH = "/kvmesh.v1.PrefillCache/Fetch"
PUBLISH = "/kvmesh.v1.PrefillCache/Publish"
EXCHANGE = "/kvmesh.v1.Membership/Exchange"
HEALTH = "/grpc.health.v1.Health/Check"
FUZZ = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


class Live:
    def __init__(self, peer: Peer, metrics: str, auth: FleetAuth | None) -> None:
        self.peer, self.metrics, self.auth = peer, metrics, auth
        self.node_id = asyncio.run(fetch_cards(peer.address, auth, None))[0].node_id
        self.baseline = rss(peer.proc.pid)


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    keyfile = d / "fleet.key"
    keyfile.write_bytes(KEY)
    live = []
    for alias, extra, auth in (
        ("plain", (), None),
        ("keyed", ("--fleet-key-file", str(keyfile)), FleetAuth(KEY, "fuzzer")),
    ):
        peer, metrics = small_peer(d, *extra, alias=alias)
        live.append(Live(peer, metrics, auth))
    yield live
    for p in live:
        p.peer.kill()


async def _send(address: str, method: str, raws: list[bytes], metadata) -> tuple[str, list[bytes]]:
    kw = dict(request_serializer=None, response_deserializer=None)
    out: list[bytes] = []
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            if method == FETCH:
                async for r in ch.unary_stream(method, **kw)(
                    raws[0], timeout=20, metadata=metadata
                ):
                    out.append(r)
            elif method == PUBLISH:
                out.append(
                    await ch.stream_unary(method, **kw)(iter(raws), timeout=20, metadata=metadata)
                )
            else:
                out.append(
                    await ch.unary_unary(method, **kw)(raws[0], timeout=20, metadata=metadata)
                )
        except grpc.aio.AioRpcError as e:
            return e.code().name, out
    return "OK", out


def call(
    live: Live, method: str, raws: list[bytes], forge: bool = False
) -> tuple[str, list[bytes]]:
    """One call; the keyed peer gets a credential bound to ``raws`` (or a forged one)."""
    md = None
    if live.auth is not None:
        first = raws[0] if raws else b""
        md = live.auth.call_metadata(
            method, live.node_id, body_digest(first + (b"!" if forge else b""))
        )
    code, out = asyncio.run(_send(live.peer.address, method, raws, md))
    assert code != "UNKNOWN", (method, code)  # an exception escaped a handler
    if live.auth is not None and forge and method != HEALTH:  # health checks are public
        assert code == "UNAUTHENTICATED", (method, code)
    assert live.peer.proc.poll() is None, "the peer died"
    assert rss(live.peer.proc.pid) <= live.baseline + BOUND
    return code, out


def after(peers: list[Live]) -> None:
    for live in peers:
        seen = scrape(live.metrics)
        assert seen["kvmesh_store_entries"] == 0 and seen["kvmesh_publish_inflight_bytes"] == 0
        assert live.peer.proc.poll() is None


# -- strategies -----------------------------------------------------------------

which = st.integers(0, 1)
blob = st.binary(max_size=64)
many = st.integers(0, 70_000)  # past MAX_LOOKUP_KEYS (65,536) at the top


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(n)]


CARD = small_card().to_json()
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


@st.composite
def card_json(draw) -> str:
    """Random text, or the real card with fields replaced, dropped or added."""
    if draw(st.booleans()):
        return draw(st.text(max_size=200))
    card = dict(CARD)
    for field in draw(st.lists(st.sampled_from(sorted(CARD) + ["extra"]), max_size=3)):
        if draw(st.booleans()):
            card[field] = draw(json_value)
        else:
            card.pop(field, None)
    return json.dumps(card)


@st.composite
def publish_stream(draw) -> list[bytes]:
    msgs = []
    for i in range(draw(st.integers(0, 5))):
        msg = pb.PublishChunk(
            block=draw(st.integers(0, 2**32 - 1)),
            nbytes=draw(
                st.sampled_from([0, 1, 10, 4096, 8 * MiB, 8 * MiB + 1, 2**64 - 1])
                | st.integers(0, 2**64 - 1)
            ),
            digest=draw(blob),
            data=draw(st.binary(max_size=8192)),
        )
        if i == 0 or draw(st.booleans()):
            msg.card_json = draw(card_json())
        msgs.append(msg.SerializeToString())
    return msgs


@st.composite
def capability_card(draw) -> pb.CapabilityCard:
    n_ns = draw(st.sampled_from([0, 1, 64, 65, 3000]))
    return pb.CapabilityCard(
        node_id=draw(st.text(max_size=20)),
        alias=draw(st.text(max_size=40)),
        epoch=draw(st.text(max_size=20)),
        roles=draw(st.lists(st.sampled_from(["cache", "head", "leaving", "x"]), max_size=3)),
        endpoints=[
            pb.Endpoint(
                address=f"127.0.0.1:{draw(st.integers(1, 65535))}",
                interface=draw(st.text(max_size=10)),
                priority=draw(st.integers(-(2**31), 2**31 - 1)),
            )
            for _ in range(draw(st.integers(0, 3)))
        ],
        namespaces=[f"{i:064x}" for i in range(n_ns)],
        card_summaries=["s" * draw(st.integers(0, 300))] * draw(st.integers(0, 3)),
        budget_bytes=draw(st.integers(0, 2**64 - 1)),
        version=draw(st.integers(0, 2**64 - 1)),
        heartbeat=draw(st.floats()),
        mac=draw(blob),
    )


# -- the fuzz -------------------------------------------------------------------

METHODS = [LOOKUP, FETCH, PUBLISH, EXCHANGE, HEALTH]


@FUZZ
@given(i=which, method=st.sampled_from(METHODS), raw=st.binary(max_size=4096), forged=st.booleans())
def test_raw_bytes_to_every_method(peers, i, method, raw, forged):
    call(peers[i], method, [raw], forged)


@FUZZ
@given(
    i=which, ns=blob, n=many, tails=st.lists(blob, max_size=100), mixed=st.lists(blob, max_size=8)
)
def test_lookup(peers, i, ns, n, tails, mixed):
    req = pb.LookupRequest(namespace=ns, block_keys=mixed + keys(n), tail_keys=tails)
    code, out = call(peers[i], LOOKUP, [req.SerializeToString()])
    if code == "OK":
        assert not pb.LookupResponse.FromString(out[0]).blocks  # nothing stored, nothing found


@FUZZ
@given(
    i=which,
    ns=blob,
    n=st.sampled_from([0, 1, 3, 65_537]) | st.integers(0, 100),
    dup=st.booleans(),
    real_epoch=st.booleans(),
    epoch=st.text(max_size=40),
    chunk=st.sampled_from([0, 1, 4 * MiB, 4 * MiB + 1, 2**32 - 1]) | st.integers(0, 2**32 - 1),
    ttl=st.floats(width=32),
)
def test_fetch(peers, i, ns, n, dup, real_epoch, epoch, chunk, ttl):
    live = peers[i]
    ks = keys(n) + (keys(1) if dup else [])
    req = pb.FetchRequest(
        namespace=ns,
        keys=ks,
        epoch=live.peer.epoch if real_epoch else epoch,
        chunk_bytes=chunk,
        lease_ttl_s=ttl,
    )
    code, out = call(live, FETCH, [req.SerializeToString()])
    assert not out  # nothing stored: never a byte of a block
    if dup:
        assert code != "OK"  # a key named twice is refused
    if code == "OK":
        assert not ks


@FUZZ
@given(i=which, msgs=publish_stream())
def test_publish(peers, i, msgs):
    code, out = call(peers[i], PUBLISH, msgs)
    if code == "OK":
        assert pb.PublishResponse.FromString(out[0]).stored == 0


@FUZZ
@given(i=which, cards=st.lists(capability_card(), max_size=4))
def test_exchange(peers, i, cards):
    code, out = call(peers[i], EXCHANGE, [pb.ExchangeRequest(cards=cards).SerializeToString()])
    if code == "OK":
        assert pb.ExchangeResponse.FromString(out[0]).cards  # at least the peer's own card


@FUZZ
@given(i=which, service=st.text(max_size=100))
def test_health(peers, i, service):
    raw = health_pb2.HealthCheckRequest(service=service).SerializeToString()
    code, _ = call(peers[i], HEALTH, [raw])
    assert code in ("OK", "NOT_FOUND")


def test_the_peers_are_whole_after_the_fuzz(peers):
    """Runs last in this module: nothing stored, no reservation leaked, all counted."""
    after(peers)
    keyed = scrape(peers[1].metrics)
    assert keyed["kvmesh_events_total{kind=unauthenticated,side=server}"] > 0
