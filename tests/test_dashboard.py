"""The dashboard in a real browser (Playwright driving Debian's Chromium)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from .test_network_api import HOSTILE, IP, KEY, fetched_from_a_peer, fleet  # noqa: F401

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (.ci/run installs it)"
)
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def test_dashboard_shows_the_fleet_live_and_safely(fleet, browser):  # noqa: F811
    head, _, _ = fleet
    head.http.post(
        "/v1/network/groups",
        json={"name": HOSTILE, "members": [HOSTILE]},
        headers={"X-API-Key": KEY},
    )
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(head.url + "/")
    page.wait_for_function(
        "document.querySelectorAll('#nodes tbody tr').length >= 3", timeout=15000
    )
    rows = page.locator("#nodes tbody tr").all_inner_texts()
    assert any("peer-one" in r for r in rows) and any(HOSTILE in r for r in rows)
    assert any("head" in r for r in rows)
    # hostile alias and group name are inert text
    assert page.title() == "kvmesh · inference network" and dialogs == []
    assert page.locator("img").count() == 0
    assert HOSTILE in page.locator("#groups").inner_text()
    # public mode: no addresses, no hashes
    body = page.locator("body").inner_text()
    assert not IP.search(body) and not re.search(r"[0-9a-f]{32,}", body)

    def completed() -> int:
        cards = page.locator("#summary .card").all_inner_texts()
        return int(next(c for c in cards if "completed tokens" in c).split("\n")[0])

    before = completed()
    r = head.http.post(
        "/v1/completions", json={"model": "demo-tiny", "prompt": "dashboard " * 30, "max_tokens": 7}
    )
    assert r.status_code == 200
    made = r.json()["usage"]["completion_tokens"]  # up to 7: EOS may come first
    assert made >= 1
    page.wait_for_function(
        f"[...document.querySelectorAll('#summary .card')].some(c => c.innerText.includes('completed tokens')"
        f" && parseInt(c.innerText) >= {before + made})",
        timeout=10000,
    )
    assert completed() >= before + made
    DOCS.mkdir(exist_ok=True)
    page.screenshot(path=str(DOCS / "dashboard.png"), full_page=True)
    # with a key, the private view shows addresses
    page.fill("#apikey", KEY)
    page.click("#keyform button")
    page.wait_for_function(
        "document.getElementById('status').innerText.startsWith('private')", timeout=10000
    )
    page.close()


def test_the_link_column_shows_a_measured_peer_to_admins(fleet, browser, tiny_engine):  # noqa: F811
    """After the head fetched from a peer, the private nodes table shows its link
    (Mbit/s and the last choice); the public one shows none."""
    head, _, _ = fleet
    peer = fetched_from_a_peer(fleet, tiny_engine)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(head.url + "/")
    page.wait_for_function(
        "document.querySelectorAll('#nodes tbody tr').length >= 3", timeout=15000
    )
    assert "Mbit/s" not in page.locator("#nodes").inner_text()
    page.fill("#apikey", KEY)
    page.click("#keyform button")
    page.wait_for_function(
        "[...document.querySelectorAll('#nodes tbody tr')].some(r => r.innerText.includes("
        f"{peer!r}) && r.innerText.includes('Mbit/s') && r.innerText.includes('fetch'))",
        timeout=10000,
    )
    page.close()


def _backed_off(head, alias: str) -> bool:
    return f'kvmesh_peer_backoff_seconds{{peer="{alias}"}}' in head.http.get("/metrics").text


def _peer_failures(head) -> float:
    """The head's failed fetches and lookups, all reasons together (its /metrics): a
    peer is backed off for either (on a loaded machine the liar's lookup may time out
    before its bytes are ever asked for)."""
    text = head.http.get("/metrics").text
    pattern = r'^kvmesh_(?:peer|lookup)_failures_total\{reason="(\w+)"\} (\S+)$'
    return sum(float(n) for _, n in re.findall(pattern, text, re.M))


def test_peer_health_in_metrics_and_on_the_dashboard(browser, tiny_engine, tmp_path):
    """A peer whose KV fails an audit is quarantined; a peer that sends bad bytes
    is backed off (longer on each failure). /metrics and the dashboard say so."""
    from .procs import Peer
    from .test_api import Head
    from .test_audit import _publish_wrong
    from .test_mesh import prompt, wait_for

    forger = Peer(alias="forging-peer", log_dir=tmp_path)
    forged = prompt(tiny_engine, 200, "forged for the dashboard ")
    _publish_wrong(tiny_engine, forger, forged)
    head = Head("--seed", forger.address, "--audit-rate", "1", "--alias", "health-head")
    liar = Peer(
        "--seed",
        head.grpc,
        alias="liar",
        log_dir=tmp_path,
        command=("tests.hostile_peer", "wrong-bytes"),
    )
    try:
        head.wait(lambda s: s["compatible_peers"] >= 2)
        body = {"model": "demo-tiny", "prompt": forged, "max_tokens": 2, "temperature": 0}
        assert head.http.post("/v1/completions", json=body).json()["kvmesh"]["source"] == "remote"
        wait_for(lambda: head.metric("kvmesh_audit_mismatches_total") == 1, what="the audit")
        assert head.metric('kvmesh_peer_quarantined{peer="forging-peer"}') == 1
        assert head.metric("kvmesh_audits_total") == 1
        # the forged prompt's request may have tried the liar first (its hit can rank
        # first): count the failures from here on
        before = _peer_failures(head)
        # each failure doubles the liar's backoff (1, 2, 4, 8 s): long enough to see
        for i in range(4):
            wait_for(lambda: not _backed_off(head, "hostile-wrong-bytes"), what="backoff over")
            body = {"model": "demo-tiny", "prompt": f"bad bytes {i} " * 30, "max_tokens": 2}
            r = head.http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["kvmesh"]["source"] == "compute"
        assert _peer_failures(head) == before + 4, head.http.get("/metrics").text
        assert _backed_off(head, "hostile-wrong-bytes")
        health = {
            n["alias"]: n["health"] for n in head.http.get("/v1/network/nodes").json()["nodes"]
        }
        assert health == {
            "health-head": "ok",
            "forging-peer": "quarantined",
            "hostile-wrong-bytes": "backed off",
        }
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(head.url + "/")
        page.wait_for_function(
            "[...document.querySelectorAll('#nodes tbody tr')].some(r => "
            "r.innerText.includes('hostile-wrong-bytes') && r.innerText.includes('backed off'))",
            timeout=6000,
        )
        rows = page.locator("#nodes tbody tr").all_inner_texts()
        assert any("forging-peer" in r and "quarantined" in r for r in rows), rows
        assert page.locator(".health-quarantined").count() == 1
        page.close()
    finally:
        head.stop()
        liar.kill()
        forger.kill()


def test_disk_tier_on_the_dashboard(browser, tmp_path):
    """A head with a disk tier, restarted: its own disk serves the prompt, and the
    dashboard shows per-tier figures and the disk source, never the directory."""
    from .test_api import Head
    from .test_mesh import wait_for

    disk = tmp_path / "kv-disk-dir"
    args = ("--disk", str(disk), "--disk-budget", "64MiB", "--alias", "disk-head")
    body = {
        "model": "demo-tiny",
        "prompt": "tiers on the dashboard " * 20,
        "max_tokens": 3,
        "temperature": 0,
    }
    head = Head(*args)
    try:
        assert head.http.post("/v1/completions", json=body).json()["kvmesh"]["source"] == "compute"
        wait_for(
            lambda: head.metric('kvmesh_tier_admissions_total{tier="disk"}') >= 4, what="writes"
        )
    finally:
        head.proc.kill()  # SIGKILL
        head.proc.wait(10)
        head.http.close()
    head = Head(*args)
    try:
        assert head.http.post("/v1/completions", json=body).json()["kvmesh"]["source"] == "disk"
        tiers = {t["tier"]: t for t in head.http.get("/v1/network/prefill").json()["tiers"]}
        assert set(tiers) == {"ram", "disk"} and tiers["disk"]["hits"] == 1
        assert tiers["disk"]["corrupt"] == 0 and tiers["disk"]["used_bytes"] > 0
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(head.url + "/")
        page.wait_for_function(
            "document.querySelectorAll('#tiers tbody tr').length == 2", timeout=10000
        )
        rows = page.locator("#tiers tbody tr").all_inner_texts()
        disk_row = next(r for r in rows if r.startswith("disk")).split("\t")
        # tier, used / budget, blocks, hits, admissions, evictions, promotions, corrupt files
        assert disk_row[1].endswith("/ 67 MB") and int(disk_row[2]) >= 4 and disk_row[3] == "1"
        assert disk_row[7] == "0"
        assert "disk 1" in page.locator("#sources").inner_text()
        text = page.locator("body").inner_text()
        assert "kv-disk-dir" not in text and str(tmp_path) not in text
        page.close()
    finally:
        head.stop()
