"""The TypeScript SDK (sdk/typescript): its own suite (unit tests, end-to-end tests
and the live-schema type check, with coverage) against a real head started here,
and its quickstart example, which uses only the public API, against the same head."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_api import Head

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "sdk" / "typescript"
KEY = "sdk-pytest-key-0123456789"


def npm(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """``npm args`` in ``cwd`` (``npm ci`` first when its node_modules is missing); the
    output, or a failure that shows it."""
    if shutil.which("npm") is None:
        pytest.fail("npm is not installed (Node 20 and npm: see .ci/run)")
    if not (cwd / "node_modules").is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=cwd,
            check=True,
            capture_output=True,
            timeout=timeout,
        )
    r = subprocess.run(
        ["npm", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NO_COLOR": "1", "FORCE_COLOR": "0", **(env or {})},
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"npm {' '.join(args)} failed in {cwd}:\n{out[-6000:]}"
    return out


def line_coverage(out: str) -> float:
    """The "All files" line coverage of vitest's text report."""
    m = re.search(r"All files\s*\|\s*[\d.]+\s*\|\s*[\d.]+\s*\|\s*[\d.]+\s*\|\s*([\d.]+)", out)
    assert m, out[-3000:]
    return float(m.group(1))


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    keys = tmp_path_factory.mktemp("sdk") / "api-keys"
    keys.write_text(KEY + "\n")
    h = Head("--admin-key-file", str(keys), "--alias", "sdk-head")
    yield h
    h.stop()


def test_sdk_suite_passes_against_a_real_head_with_coverage(head):
    out = npm(SDK, "test", env={"KVMESH_URL": head.url, "KVMESH_API_KEY": KEY})
    assert re.search(r"Tests\s+\d+ passed \(\d+\)", out), out[-3000:]
    assert line_coverage(out) >= 95.0


def test_quickstart_streams_and_sees_the_cache(head):
    npm(SDK, "run", "build")
    r = subprocess.run(
        ["node", str(SDK / "dist" / "examples" / "quickstart.js"), head.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"^summary: \d+ node\(s\), \d+ tokens completed", r.stdout, re.M), r.stdout
    warm = re.search(
        r"^warm: streamed (\d+) chunks .* cached_tokens (\d+)/(\d+) = ", r.stdout, re.M
    )
    assert warm, r.stdout
    chunks, cached, prompt = map(int, warm.groups())
    assert chunks >= 2 and prompt > 100 and cached >= 0.9 * prompt


def test_sdk_and_edge_ship_no_runtime_dependencies():
    """``npm audit --omit=dev`` stays at 0 by construction: neither package has a
    runtime dependency (the lockfiles agree), only dev tools."""
    for pkg in (SDK, ROOT / "edge"):
        manifest = json.loads((pkg / "package.json").read_text())
        lock = json.loads((pkg / "package-lock.json").read_text())
        assert not manifest.get("dependencies") and manifest["devDependencies"], pkg
        assert not lock["packages"][""].get("dependencies"), pkg
        assert all(
            v.get("dev") or v.get("devOptional") for k, v in lock["packages"].items() if k
        ), pkg


def test_dump_openapi_writes_the_schema_the_sdk_is_generated_from(head, tmp_path):
    out = tmp_path / "openapi.json"
    r = subprocess.run(
        [sys.executable, str(SDK / "scripts" / "dump_openapi.py"), str(out), "--url", head.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    live = json.loads(out.read_text())
    committed = json.loads((SDK / "openapi.json").read_text())
    # the request bodies the SDK's types come from are in the live schema
    for name in ("ChatRequest", "CompletionRequest", "GroupIn", "PairIn", "Message"):
        assert name in live["components"]["schemas"] and name in committed["components"]["schemas"]
    assert out.read_text() == json.dumps(live, indent=2, sort_keys=True) + "\n"
