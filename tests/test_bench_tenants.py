"""bench/tenants.py runs (smoke mode: demo-tiny on a real head with two tenant keys)
and its correctness figures hold: another tenant's identical prompt reuses nothing,
the owner's repeat reuses it all. (Its timing ratios are printed, never asserted.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "tenants.py"


def test_the_tenants_benchmark_runs(tmp_path):
    out = tmp_path / "tenants.json"
    r = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["cross_cached_tokens"] == [0] * len(result["trials"])
    assert result["repeat_cached_fraction"] >= 0.9
    assert result["cross_vs_cold"] > 0 and "x" in r.stdout
