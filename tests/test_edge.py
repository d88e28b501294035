"""The public edge (edge/): its own suite (workerd via miniflare, a real head as
origin, wrangler's dry run), then ``node edge/serve.mjs`` in front of a real head:
the dashboard through the edge in Chromium shows the live fleet, public reads carry
no addresses, writes are refused even with a valid key, and the origin SIGKILLed
leaves the summary answering, marked stale.

That edge caches nothing fresh (``--cache-ttl 0``: the fresh copy's expiry is the
Worker suite's to test, against a clock it controls better): every read goes to
the origin and keeps its answer as the stale copy, so once the origin is dead the
next read is that copy, by construction, however slow the machine or however its
clock moves. ``--timeout-ms`` is long because a live origin must never look dead
to a loaded machine; a killed one refuses connections at once."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from .procs import Peer, free_port
from .test_api import Head
from .test_dashboard import ARGS, CHROMIUM
from .test_sdk_typescript import line_coverage, npm

ROOT = Path(__file__).resolve().parent.parent
EDGE = ROOT / "edge"
KEY = "edge-pytest-key-0123456789"
IP = re.compile(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b")


class Edge:
    """``node edge/serve.mjs`` in its own process."""

    def __init__(self, origin: str, *args: str) -> None:
        port = free_port()
        self.proc = subprocess.Popen(
            ["node", str(EDGE / "serve.mjs"), "--origin", origin, "--port", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"kvmesh edge (http://\S+) -> ", line)
        if not m:
            self.stop()
            raise RuntimeError(f"edge did not start: {line!r}")
        self.url = m.group(1)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def test_edge_suite_in_workerd_and_wrangler_dry_run():
    out = npm(EDGE, "test")
    assert "--dry-run: exiting now" in out and 'env.ORIGIN ("https://' in out
    assert re.search(r"Tests\s+\d+ passed \(\d+\)", out), out[-3000:]
    # the Worker's coverage as it ran in workerd (test/coverage.mjs fails below 95 %)
    assert line_coverage(out) >= 95.0 and re.search(r"worker\.ts\s*\|", out)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("edge")
    (d / "keys").write_text(KEY + "\n")
    peer = Peer(alias="edge-peer", log_dir=d)
    head = Head("--seed", peer.address, "--admin-key-file", str(d / "keys"), "--alias", "edge-head")
    edge = None
    try:
        head.wait(lambda s: s["peers"] >= 1)
        npm(EDGE, "--version")  # node_modules present (npm ci) before serve.mjs runs
        edge = Edge(head.url, "--cache-ttl", "0", "--timeout-ms", "30000")
        yield head, peer, edge
    finally:
        if edge:
            edge.stop()
        head.stop()
        peer.kill()


def test_dashboard_through_the_edge_shows_the_live_fleet(fleet):
    from playwright.sync_api import sync_playwright

    head, _, edge = fleet
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []  # CSP violations are console errors
            page.on(
                "console", lambda m: errors.append(m.text) if "Content Security" in m.text else None
            )
            failed: list[str] = []  # the browser's own /favicon.ico is a 404 at the head too
            page.on(
                "response",
                lambda r: (
                    failed.append(r.url)
                    if r.status >= 400 and not r.url.endswith("/favicon.ico")
                    else None
                ),
            )
            page.goto(edge.url + "/")
            # a locator, not wait_for_function: the edge's CSP forbids eval, Playwright's too
            page.locator("#nodes tbody tr").nth(1).wait_for(timeout=20000)
            rows = page.locator("#nodes tbody tr").all_inner_texts()
            assert any("edge-peer" in r for r in rows) and any("edge-head" in r for r in rows)
            assert "live" in " ".join(rows)
            # a key typed into the public page does not unlock it: the edge strips it
            page.fill("#apikey", KEY)
            page.click("#keyform button")
            page.wait_for_timeout(1500)  # two refreshes of the dashboard's poll
            assert not page.locator("#status").inner_text().startswith("private")
            assert not IP.search(page.locator("body").inner_text())
            assert errors == [] and failed == []  # the CSP lets the dashboard run; all loads pass
        finally:
            browser.close()


SDK_IN_PAGE = """async (edge) => {
  const client = new kvmesh.KvmeshClient({ baseUrl: edge, maxRetries: 0 });
  const summary = await client.network.summary();
  const nodes = await client.network.nodes();
  const mark = (await fetch(edge + "/v1/network/groups")).headers.get("x-kvmesh-edge");
  let write = "accepted";
  try { await client.network.createGroup({ name: "from-a-browser" }); }
  catch (e) { write = e.name; }
  return { summary, aliases: nodes.map((n) => n.alias), mark, write };
}"""


def test_the_sdk_in_a_browser_reads_through_the_edge_cross_origin(fleet, tmp_path):
    """The SDK bundled for browsers, on a page of another origin (the head's own),
    reads the fleet through the edge's CORS; a write is refused."""
    from playwright.sync_api import sync_playwright

    head, _, edge = fleet
    bundle = tmp_path / "kvmesh-sdk.js"
    esbuild = EDGE / "node_modules" / ".bin" / "esbuild"
    subprocess.run(
        [
            str(esbuild),
            str(ROOT / "sdk/typescript/src/index.ts"),
            "--bundle",
            "--format=iife",
            "--global-name=kvmesh",
            f"--outfile={bundle}",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    before = head.http.get("/v1/network/groups").json()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.goto(head.url + "/healthz")  # another origin than the edge's (another port)
            page.add_script_tag(content=bundle.read_text())
            got = page.evaluate(SDK_IN_PAGE, edge.url)
        finally:
            browser.close()
    assert got["summary"]["private"] is False and got["summary"]["nodes"] >= 2
    assert {"edge-head", "edge-peer"} <= set(got["aliases"])
    assert got["mark"] == "fresh"  # exposed to cross-origin scripts (nothing cached: TTL 0)
    assert got["write"] == "ConnectionError"  # the preflight allows no POST: the browser blocks it
    assert head.http.get("/v1/network/groups").json() == before


def test_reads_pass_writes_refused_and_a_killed_origin_leaves_a_stale_copy(fleet):
    head, _, edge = fleet
    auth = {"X-API-Key": KEY, "Authorization": f"Bearer {KEY}"}
    r = edge.http.get("/v1/network/summary", headers=auth)
    assert r.status_code == 200 and r.json()["private"] is False
    assert head.http.get("/v1/network/summary", headers=auth).json()["private"] is True
    nodes = edge.http.get("/v1/network/nodes", headers=auth)
    assert nodes.status_code == 200 and not IP.search(nodes.text) and "node_id" not in nodes.text
    before = head.http.get("/v1/network/groups").json()
    w = edge.http.post("/v1/network/groups", json={"name": "via-edge"}, headers=auth)
    assert w.status_code == 405 and w.json()["error"]["code"] == "edge_refused"
    assert head.http.get("/v1/network/groups").json() == before
    last = edge.http.get("/v1/network/summary")  # kept as the stale copy (the Worker's waitUntil)
    assert last.status_code == 200 and last.headers["x-kvmesh-edge"] == "fresh"
    head.proc.send_signal(signal.SIGKILL)
    head.proc.wait(10)
    # TTL 0: no fresh copy to outlive the origin; the answer is the stale copy, or
    # (only until the Worker's background write of it lands) the 502 of no copy
    marks = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = edge.http.get("/v1/network/summary")
        marks.append(s.headers.get("x-kvmesh-edge"))
        if marks[-1] != "error":
            break
        time.sleep(0.1)
    assert set(marks) <= {"stale", "error"}, marks  # never a fresh answer or a cached one
    assert s.status_code == 200 and marks[-1] == "stale", marks
    assert s.json()["nodes"] >= 2 and "Stale" in s.headers["warning"]
    assert edge.http.get("/healthz").status_code == 502
