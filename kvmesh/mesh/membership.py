"""Capability cards and push-pull gossip.

Each node issues its own card with a per-node ``version`` counter and re-issues
it every interval. Cards merge by version, never by wall-clock time; a node that
sees a card of its own id with a version at or above its own (an earlier life
before a restart) jumps past it. A card expires ``ttl`` seconds (local monotonic
clock) after its last version increase. Under a fleet key every card carries an
HMAC and unsigned or forged cards are dropped. Gossip carries no tensors.

Nothing a card says is taken on trust beyond its bounds: a card larger than
``MAX_CARD_BYTES`` or naming more than ``MAX_CARD_NAMESPACES`` namespaces is
dropped, membership holds at most ``max_members`` nodes (a clear log line when
full), and a goodbye removes only the life (epoch) and version it names, so a
replayed goodbye of an earlier life never removes a live member.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .proto import kvmesh_pb2 as pb
from .security import FleetAuth

log = logging.getLogger("kvmesh.membership")

INTERFACE_PRIORITY = {
    "thunderbolt": 0,
    "ethernet": 1,
    "loopback": 1,
    "tailscale": 2,
    "wifi": 3,
    "unknown": 4,
}
INTERFACES = tuple(INTERFACE_PRIORITY)
LEAVING = "leaving"  # the only role of a goodbye card
MAX_CARD_BYTES = 32 * 1024
MAX_CARD_NAMESPACES = 64
MAX_MEMBERS = 256


def interface_kind(name: str) -> str:
    n = name.lower()
    if n == "lo" or n.startswith("lo"):
        return "loopback"
    if n.startswith(("thunderbolt", "tb", "bridge")):
        return "thunderbolt"
    if n.startswith(("tailscale", "ts", "utun")):
        return "tailscale"
    if n.startswith(("wl", "wifi", "ath")):
        return "wifi"
    if n.startswith(("en", "eth", "veth", "br", "bond")):
        return "ethernet"
    return "unknown"


def parse_advertise(spec: str) -> pb.Endpoint:
    """``HOST:PORT[,interface=KIND]``."""
    addr, _, rest = spec.partition(",")
    kind = "unknown"
    if rest:
        k, _, v = rest.partition("=")
        if k != "interface" or v not in INTERFACE_PRIORITY:
            raise ValueError(
                f"bad --advertise {spec!r}: use ADDR[,interface={'|'.join(INTERFACES)}]"
            )
        kind = v
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad --advertise address {addr!r}: use HOST:PORT")
    if kind == "unknown" and host in ("127.0.0.1", "localhost", "::1"):
        kind = "loopback"
    return pb.Endpoint(address=addr, interface=kind, priority=INTERFACE_PRIORITY[kind])


def detect_endpoints(host: str, port: int) -> list[pb.Endpoint]:
    """Endpoints for a listener on ``host``; wildcard hosts list each interface."""
    if host not in ("0.0.0.0", "::", ""):
        kind = "loopback" if host.startswith("127.") or host in ("::1", "localhost") else "unknown"
        for name, addr in _interface_addresses():
            if addr == host:
                kind = interface_kind(name)
        return [
            pb.Endpoint(address=f"{host}:{port}", interface=kind, priority=INTERFACE_PRIORITY[kind])
        ]
    eps = [
        pb.Endpoint(
            address=f"{addr}:{port}",
            interface=interface_kind(name),
            priority=INTERFACE_PRIORITY[interface_kind(name)],
        )
        for name, addr in _interface_addresses()
    ]
    eps.sort(key=lambda e: (e.priority, e.interface == "loopback"))
    return eps or [pb.Endpoint(address=f"127.0.0.1:{port}", interface="loopback", priority=1)]


def _interface_addresses() -> list[tuple[str, str]]:
    if shutil.which("ip"):
        try:
            out = subprocess.run(
                ["ip", "-j", "-4", "addr"], capture_output=True, text=True, timeout=2, check=True
            ).stdout
            return [
                (i["ifname"], a["local"])
                for i in json.loads(out)
                for a in i.get("addr_info", [])
                if a.get("family") == "inet"
            ]
        except (OSError, ValueError, subprocess.SubprocessError, KeyError):
            pass
    try:
        return [("unknown", socket.gethostbyname(socket.gethostname()))]
    except OSError:
        return []


@dataclass
class _Member:
    card: pb.CapabilityCard
    updated: float  # local monotonic time of the last version increase
    rtt_ms: dict[str, float] = field(default_factory=dict)  # address -> EWMA


def _within_bounds(card: pb.CapabilityCard) -> bool:
    return (
        card.ByteSize() <= MAX_CARD_BYTES
        and len(card.namespaces) <= MAX_CARD_NAMESPACES
        and len(card.card_summaries) <= MAX_CARD_NAMESPACES
    )


def card_bytes(card: pb.CapabilityCard) -> bytes:
    c = pb.CapabilityCard()
    c.CopyFrom(card)
    c.ClearField("mac")
    return c.SerializeToString(deterministic=True)


class Membership:
    def __init__(
        self,
        node_id: str,
        make_card: Callable[[], pb.CapabilityCard],
        auth: FleetAuth | None = None,
        ttl: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_members: int = MAX_MEMBERS,
    ) -> None:
        self.node_id = node_id
        self.max_members = max_members
        self._full_logged = 0.0
        self._make_card = make_card
        self.auth = auth
        self.ttl = ttl
        self._clock = clock
        self._version = 0
        self._members: dict[str, _Member] = {}
        self._left: dict[str, str] = {}  # node id -> epoch of a life that said goodbye
        self.leaving = False
        self._lock = threading.Lock()
        self.rejected_cards = 0
        self.on_join: Callable[[pb.CapabilityCard], None] = lambda c: log.info(
            "peer joined: %s (%s) epoch %s", c.alias, c.node_id[:8], c.epoch[:8]
        )
        self.on_leave: Callable[[pb.CapabilityCard], None] = lambda c: log.info(
            "peer left: %s (%s)", c.alias, c.node_id[:8]
        )

    # -- own card --------------------------------------------------------------

    def own_card(self) -> pb.CapabilityCard:
        card = self._make_card()
        if self.leaving:  # a goodbye: peers drop this life at once instead of after the TTL
            del card.roles[:]
            card.roles.append(LEAVING)
            del card.endpoints[:]
        card.node_id = self.node_id
        card.version = self._version
        card.heartbeat = time.time()
        if self.auth:
            card.mac = self.auth.sign_card(card_bytes(card))
        return card

    def bump(self) -> None:
        with self._lock:
            self._version += 1

    # -- merging ---------------------------------------------------------------

    def merge(self, cards: list[pb.CapabilityCard] | tuple[pb.CapabilityCard, ...]) -> list[str]:
        """Merge received cards; return node ids that joined."""
        joined: list[pb.CapabilityCard] = []
        left: list[pb.CapabilityCard] = []
        now = self._clock()
        with self._lock:
            for card in cards:
                if self.auth and not self.auth.verify_card(card_bytes(card), card.mac):
                    self.rejected_cards += 1
                    continue
                if not card.node_id or not _within_bounds(card):
                    self.rejected_cards += 1
                    continue
                if card.node_id == self.node_id:
                    if card.version >= self._version:  # an earlier life of this node
                        self._version = card.version + 1
                    continue
                if self._left.get(card.node_id) == card.epoch:
                    continue  # a relayed card of a life that already left
                m = self._members.get(card.node_id)
                if LEAVING in card.roles:
                    if m is not None and (
                        m.card.epoch != card.epoch or m.card.version > card.version
                    ):
                        continue  # a goodbye of another life, or older than what we know
                    self._left[card.node_id] = card.epoch
                    if m is not None:
                        left.append(self._members.pop(card.node_id).card)
                    continue
                self._left.pop(card.node_id, None)
                if m is None:
                    if len(self._members) >= self.max_members:
                        self._log_full(card)
                        continue
                    self._members[card.node_id] = _Member(card, now)
                    joined.append(card)
                elif card.version > m.card.version:
                    if card.epoch != m.card.epoch:
                        log.info("peer restarted: %s epoch %s", card.alias, card.epoch[:8])
                    m.card, m.updated = card, now
        for c in joined:
            self.on_join(c)
        for c in left:
            self.on_leave(c)
        self.expire()
        return [c.node_id for c in joined]

    def _log_full(self, card: pb.CapabilityCard) -> None:
        self.rejected_cards += 1
        now = self._clock()
        if now - self._full_logged > 10:  # once per 10 s, not once per gossip round
            self._full_logged = now
            log.warning(
                "membership full (%d nodes): not adding %s (%s); raise --max-members",
                self.max_members,
                card.alias,
                card.node_id[:8],
            )

    def expire(self) -> None:
        now = self._clock()
        with self._lock:
            dead = [m for m in self._members.values() if now - m.updated > self.ttl]
            for m in dead:
                del self._members[m.card.node_id]
        for m in dead:
            self.on_leave(m.card)

    def outgoing(self) -> list[pb.CapabilityCard]:
        self.expire()
        with self._lock:
            return [self.own_card()] + [m.card for m in self._members.values()]

    # -- views -----------------------------------------------------------------

    def live(self) -> list[pb.CapabilityCard]:
        self.expire()
        with self._lock:
            return [m.card for m in self._members.values()]

    def age(self, node_id: str) -> float | None:
        m = self._members.get(node_id)
        return None if m is None else self._clock() - m.updated

    def record_rtt(self, node_id: str, address: str, rtt_ms: float) -> None:
        with self._lock:
            m = self._members.get(node_id)
            if m is not None:
                old = m.rtt_ms.get(address)
                m.rtt_ms[address] = rtt_ms if old is None else 0.7 * old + 0.3 * rtt_ms

    def rtt(self, node_id: str, address: str) -> float | None:
        m = self._members.get(node_id)
        return None if m is None else m.rtt_ms.get(address)

    def ranked_endpoints(self, card: pb.CapabilityCard) -> list[pb.Endpoint]:
        """Interface priority first, then measured RTT (unmeasured last)."""
        return sorted(
            card.endpoints,
            key=lambda e: (e.priority, self.rtt(card.node_id, e.address) or float("inf")),
        )

    def gossip_targets(self, seeds: list[str], fanout: int = 3) -> list[tuple[str | None, str]]:
        """(node id or None for a seed, address) to exchange with this round."""
        live = self.live()
        picks = random.sample(live, min(fanout, len(live)))
        known = {e.address for c in live for e in c.endpoints}
        out: list[tuple[str | None, str]] = [(None, s) for s in seeds if s not in known]
        for c in picks:
            eps = self.ranked_endpoints(c)
            if eps:
                out.append((c.node_id, eps[0].address))
        return out
