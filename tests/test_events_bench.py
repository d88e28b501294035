"""bench/events.py runs (smoke mode) and its claims hold: every change reaches a
reading subscriber with no sequence gap and no drop, and a head serving requests
announces every full block of every prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "events.py"


def test_the_events_benchmark_runs_without_gaps_or_drops(tmp_path):
    out = tmp_path / "events.json"
    r = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    rate, head, per = res["rate"], res["head"], res["per_block"]
    assert rate["received"] == rate["changes"] and rate["gaps"] == 0 and rate["dropped"] == 0
    assert head["gaps"] == 0 and head["dropped"] == 0
    assert head["blocks_announced"] == (head["requests"] + 2) * 4  # 4 full blocks a prompt
    assert per["blocks"] > 0 and per["ratio"] > 0
