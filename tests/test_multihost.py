"""A head and two peers in three network namespaces joined by veth links.

The head gets a remote hit from a peer in another namespace; cutting the links
mid-stream (``ip link set ... down``) falls back to local prefill with the same
answer. Needs root and ``ip netns`` (CI runs as root); elsewhere it is skipped.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

TAG = f"kvm{os.getpid() % 10000}"
NS = {"head": f"{TAG}h", "p1": f"{TAG}a", "p2": f"{TAG}b"}


def _can_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if not shutil.which("ip"):
        return "iproute2 (ip) is not installed"
    probe = subprocess.run(["ip", "netns", "add", f"{TAG}probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns unavailable: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{TAG}probe"], capture_output=True)
    return None


REASON = _can_netns()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def in_ns(ns: str, *cmd: str) -> None:
    sh("ip", "netns", "exec", ns, *cmd)


@pytest.fixture(scope="module")
def net():
    for ns in NS.values():
        sh("ip", "netns", "add", ns)
        in_ns(ns, "ip", "link", "set", "lo", "up")
    links = [  # (ns_a, addr_a, ns_b or None for the root namespace, addr_b)
        (NS["head"], "10.77.0.2", None, "10.77.0.1"),
        (NS["head"], "10.77.1.1", NS["p1"], "10.77.1.2"),
        (NS["head"], "10.77.2.1", NS["p2"], "10.77.2.2"),
    ]
    for i, (a, addr_a, b, addr_b) in enumerate(links):
        va, vb = f"{TAG}x{i}", f"{TAG}y{i}"
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        sh("ip", "link", "set", va, "netns", a)
        in_ns(a, "ip", "addr", "add", f"{addr_a}/24", "dev", va)
        in_ns(a, "ip", "link", "set", va, "up")
        if b:
            sh("ip", "link", "set", vb, "netns", b)
            in_ns(b, "ip", "addr", "add", f"{addr_b}/24", "dev", vb)
            in_ns(b, "ip", "link", "set", vb, "up")
        else:
            sh("ip", "addr", "add", f"{addr_b}/24", "dev", vb)
            sh("ip", "link", "set", vb, "up")
    yield {
        "head_peer_links": [f"{TAG}x1", f"{TAG}x2"],
        "peer_links": [(NS["p1"], f"{TAG}y1"), (NS["p2"], f"{TAG}y2")],
    }
    for ns in NS.values():
        subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", f"{TAG}y0"], capture_output=True)


# a real fleet: non-loopback listeners need client authentication
FLEET_KEY = Path(tempfile.mkdtemp(prefix="kvmesh-fleet-")) / "fleet.key"
atexit.register(shutil.rmtree, FLEET_KEY.parent, ignore_errors=True)
FLEET_KEY.write_text(secrets.token_hex(32))


def spawn(ns: str, *args: str, pattern: str) -> tuple[subprocess.Popen[str], re.Match[str]]:
    p = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=os.environ.copy(),
    )
    line = p.stdout.readline()
    m = re.search(pattern, line)
    if not m:
        p.kill()
        raise RuntimeError(f"{args[0]} in {ns} did not start: {line!r}")
    return p, m


@pytest.fixture(scope="module")
def peers(net):
    procs = []
    for name, addr in (("p1", "10.77.1.2"), ("p2", "10.77.2.2")):
        p, _ = spawn(
            NS[name],
            "peer",
            "--listen",
            f"{addr}:7070",
            "--plaintext",
            "--alias",
            name,
            "--fleet-key-file",
            str(FLEET_KEY),
            "--advertise",
            f"{addr}:7070,interface=ethernet",
            "--gossip-interval",
            "0.3",
            "--ttl",
            "3",
            pattern=r"listening on",
        )
        procs.append(p)
    yield
    for p in procs:
        p.kill()


class NsHead:
    def __init__(self, alias: str) -> None:
        self.proc, m = spawn(
            NS["head"],
            "head",
            "--model",
            "demo-tiny",
            "--listen",
            "0.0.0.0:8000",
            "--grpc-listen",
            "0.0.0.0:7071",
            "--plaintext",
            "--fleet-key-file",
            str(FLEET_KEY),
            "--seed",
            "10.77.1.2:7070",
            "--seed",
            "10.77.2.2:7070",
            "--exact-reuse-by-address",  # one client: its exact tail is its own
            "--alias",
            alias,
            "--gossip-interval",
            "0.3",
            "--ttl",
            "3",
            "--fetch-timeout",
            "2",
            pattern=r"http://",
        )
        self.http = httpx.Client(base_url="http://10.77.0.2:8000", timeout=60)

    def wait(self, cond, timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if cond(self.http.get("/healthz").json()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("head in its namespace never became ready")

    def complete(self, prompt: str) -> dict:
        body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        return self.http.post("/v1/completions", json=body).json()

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(15)


def _publish_then_restart(prompt: str) -> tuple[dict, NsHead]:
    h = NsHead("ns-head-1")
    try:
        h.wait(lambda s: s["peers"] >= 2)
        cold = h.complete(prompt)
        h.wait(lambda s: s["publish_pending"] == 0)
    finally:
        h.stop()
    h2 = NsHead("ns-head-2")
    h2.wait(lambda s: s["compatible_peers"] >= 1 and s["peers"] >= 2)
    return cold, h2


def test_remote_hit_across_namespaces(peers):
    prompt = "Across network namespaces the prefix travels over veth. " * 12
    cold, h = _publish_then_restart(prompt)
    try:
        hit = h.complete(prompt)
        assert "kvmesh" in hit, hit
        assert hit["kvmesh"]["source"] == "remote" and hit["kvmesh"]["peer"] in ("p1", "p2")
        assert hit["choices"][0]["text"] == cold["choices"][0]["text"]
        assert (
            hit["usage"]["prompt_tokens_details"]["cached_tokens"] == hit["usage"]["prompt_tokens"]
        )
    finally:
        h.stop()


def test_cutting_the_link_mid_stream_falls_back_with_the_same_answer(net, peers):
    prompt = "Cut the link while the blocks are still on the wire. " * 40
    cold, h = _publish_then_restart(prompt)
    links = net["head_peer_links"]
    try:
        for ns, dev in net["peer_links"]:  # slow peer->head so the stream is on the wire when cut
            in_ns(
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                "4mbit",
                "burst",
                "16kbit",
                "latency",
                "500ms",
            )

        def cut() -> None:
            time.sleep(0.4)
            for dev in links:
                in_ns(NS["head"], "ip", "link", "set", dev, "down")

        cutter = threading.Thread(target=cut, daemon=True)
        cutter.start()
        out = h.complete(prompt)
        cutter.join()
        assert out["kvmesh"]["source"] == "compute"
        # the link's fault, or our own budget running out first (#37: no peer's fault)
        assert out["kvmesh"]["fallback"] in ("timeout", "stalled", "peer_unreachable", "budget")
        assert out["choices"][0]["text"] == cold["choices"][0]["text"]
    finally:
        for dev in links:
            subprocess.run(
                ["ip", "netns", "exec", NS["head"], "ip", "link", "set", dev, "up"],
                capture_output=True,
            )
        for ns, dev in net["peer_links"]:
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
            )
        h.stop()
