"""bench/kv_budget.py runs (smoke mode: a 2k-token request among seven short ones
on a real head) and its claim holds: the head's resident memory grows by no more
than --kv-budget plus the overhead the benchmark states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kv_budget.py"


def test_the_kv_budget_benchmark_runs_and_memory_stays_bounded(tmp_path):
    out = tmp_path / "kv_budget.json"
    r = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["within_budget_plus_overhead"] is True
    assert result["real_kv_mib"] > 0 and result["rss_peak_mib"] >= result["rss_base_mib"]
