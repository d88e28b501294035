"""The ttft benchmark in CI (split from tests/test_bench_smoke.py so that the README's
``--dist loadfile`` gives it a worker of its own): its smoke run, and its failures on
purpose (after its first head started, on a forced fetch that computed, after its
network namespace exists) leave nothing behind and say why."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from .test_bench_smoke import NETNS, ROOT, benches, finish, smoke, start


@pytest.mark.parametrize("bench", benches("ttft"), ids=lambda p: p.stem)
def test_the_ttft_benchmark_runs_in_smoke_mode_and_cleans_up(bench: Path, tmp_path: Path) -> None:
    smoke(bench, tmp_path)


def test_ttft_failing_after_its_first_head_started_leaves_nothing(tmp_path: Path) -> None:
    """Heads, the bare library child, peers, namespaces and the heads' KVMESH_HOME
    all go when the benchmark fails with its first head process up."""
    proc, tag = start(ROOT / "bench" / "ttft.py", tmp_path / "x.json", KVMESH_BENCH_FAIL="head")
    text = finish(proc, tag)
    assert proc.returncode != 0 and "failing on purpose" in text, text
    assert not (tmp_path / "x.json").exists()
    left = list(Path(tempfile.gettempdir()).glob(f"kvmb{proc.pid}-*"))
    assert not left, f"temporary directories left behind: {left}"


def test_ttft_fails_a_forced_fetch_that_computed_and_says_why(tmp_path: Path) -> None:
    """The forced-fetch path's fetches given a deadline no fetch meets: every row
    says it failed and why (the report's fallback reason), the JSON is written, and
    the run exits non-zero naming them."""
    out = tmp_path / "x.json"
    bench = ROOT / "bench" / "ttft.py"  # one model: the failure is the same on both
    proc, tag = start(
        bench, out, sys.executable, "--model", "demo-tiny", KVMESH_BENCH_FAIL="forced-fetch"
    )
    text = finish(proc, tag)
    assert proc.returncode != 0 and "row(s) failed" in text, text
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["fetch_forced_source"] != "remote" for r in rows)
    for r in rows:
        assert r["failed"].startswith("fetch_forced_s computed"), r["failed"]
        assert "no fallback reason" not in r["failed"] and r["failed"] in text
    assert all(r["head_source"] == "remote" for r in rows)  # the other paths fetched


@pytest.mark.skipif(not NETNS, reason="network namespaces need root and iproute2")
def test_ttft_failing_after_its_namespace_exists_deletes_it(tmp_path: Path) -> None:
    proc, tag = start(ROOT / "bench" / "ttft.py", tmp_path / "x.json", KVMESH_BENCH_FAIL="netns")
    text = finish(proc, tag)  # asserts the namespace, its link and the loopback peer are gone
    assert proc.returncode != 0 and "failing on purpose" in text, text
