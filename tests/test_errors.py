"""Each transport's error map: every typed error it carries comes back as itself,
through a real gRPC call on loopback and a real socket; the rest as PeerUnavailable."""

import asyncio
import socket
import time
from collections.abc import Iterable

import grpc
import pytest

from kvmesh import errors
from kvmesh.errors import KVMeshError, PeerUnavailable, wire_reason, wire_text
from kvmesh.mesh import bulk_wire as bulk
from kvmesh.mesh import rpc_errors
from kvmesh.mesh.security import CallRefused


def _all_typed() -> list[type[KVMeshError]]:
    """Every typed error there is: errors.py's and the transports' own subclasses."""
    seen, todo = [], [KVMeshError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def _make(cls: type[KVMeshError]) -> KVMeshError:
    return cls("why", "a refused credential") if cls is CallRefused else cls("something broke")


def _carrier(
    cls: type[KVMeshError], table: Iterable[type[KVMeshError]]
) -> type[KVMeshError] | None:
    """The type ``cls`` travels as in a transport carrying ``table``'s types."""
    return next((t for t in table if issubclass(cls, t)), None)


def test_every_typed_error_is_known_here():
    names = {c.__name__ for c in _all_typed()}
    assert {"StaleEpoch", "PeerBusy", "FetchStalled", "AuthDeadline", "CallRefused"} <= names
    assert all(isinstance(c.reason, str) and c.reason for c in _all_typed())


def test_wire_text_names_the_reason_once():
    assert wire_text(errors.StaleEpoch("stale_epoch")) == "stale_epoch"
    assert (
        wire_text(errors.LeaseExpired("lease_expired: block gone")) == "lease_expired: block gone"
    )
    assert wire_text(errors.StoreFull("publish later")) == "store_full: publish later"
    assert wire_text(errors.PeerBusy()) == "busy"
    for cls in _all_typed():
        assert wire_reason(wire_text(_make(cls))) == cls.reason
    assert type(wire_text(errors.StaleEpoch("stale_epoch"))) is str  # gRPC takes no str subclass


@pytest.mark.parametrize("cls", _all_typed(), ids=lambda c: c.__name__)
def test_grpc_map_round_trips_in_process(cls):
    code, details = rpc_errors.to_status(_make(cls))
    back = rpc_errors.from_status(code, details)
    carrier = _carrier(cls, rpc_errors.STATUS)
    if carrier is None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and type(back) is PeerUnavailable
        assert cls.reason in str(back) and "something broke" in str(back)
    else:
        assert code == rpc_errors.STATUS[carrier] and type(back) is carrier
        assert back.reason == carrier.reason


def test_statuses_a_kvmesh_server_never_sends_are_peer_unavailable():
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        e = rpc_errors.from_status(code, None)
        assert type(e) is PeerUnavailable and code.name in str(e)
    assert type(rpc_errors.from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "")) is errors.PeerTimeout


def test_grpc_map_round_trips_through_a_real_call():
    """A loopback server aborts the i-th call with the i-th typed error; the client
    raises what the map makes of the status it got."""
    made = [_make(c) for c in _all_typed()]
    made += [c(c.reason) for c in _all_typed() if c is not CallRefused]  # details: the reason
    typed = [type(e) for e in made]

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(*rpc_errors.to_status(made[int(raw)]))
        return b""

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Fail": grpc.unary_unary_rpc_method_handler(handle)}
    )

    async def run() -> list[KVMeshError]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        got = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary("/t.T/Fail")
                for i in range(len(typed)):
                    try:
                        await call(str(i).encode(), timeout=10)
                    except grpc.aio.AioRpcError as e:
                        got.append(rpc_errors.from_rpc_error(e))
        finally:
            await server.stop(0)
        return got

    got = asyncio.run(run())
    assert len(got) == len(typed)
    for cls, back in zip(typed, got, strict=True):
        want = _carrier(cls, rpc_errors.STATUS) or PeerUnavailable
        assert type(back) is want, (cls, back)


@pytest.mark.parametrize("cls", _all_typed(), ids=lambda c: c.__name__)
def test_bulk_error_frames_round_trip_over_a_socket(cls):
    a, b = socket.socketpair()
    try:
        deadline = time.monotonic() + 5
        sender, receiver = bulk.Stream(a, 5.0, deadline), bulk.Stream(b, 5.0, deadline)
        sender.frame(bulk.ERROR, bulk.error_frame(_make(cls)))
        with pytest.raises(KVMeshError) as caught:
            receiver.read_frame(1 << 20)
    finally:
        a.close()
        b.close()
    back = caught.value
    if cls.reason in bulk.FRAME_ERRORS:
        assert type(back) is bulk.FRAME_ERRORS[cls.reason] and back.reason == cls.reason
    else:
        assert type(back) is PeerUnavailable and f"peer refused: {cls.reason}" in str(back)


def test_bulk_map_carries_what_it_did():
    """The reasons a bulk ERROR frame carries back as their own types (unchanged)."""
    assert set(bulk.FRAME_ERRORS) == {
        "stale_epoch",
        "lease_expired",
        "unauthenticated",
        "oversize_payload",
        "malformed_payload",
        "checksum_mismatch",
        "store_full",
        "timeout",
        "busy",
    }
    assert all(t.reason == r for r, t in bulk.FRAME_ERRORS.items())
