"""``kvmesh demo --json`` (two real processes and a restarted head) reports the
remote hit's stages and the local reference measured in the same run (issue #27).

The figures themselves are timing and are never asserted; what is asserted is
that they are there, that the stages add up to the hit's TTFT, that the hit was a
real remote fetch with the cold run's output, and that the reference imported
the same prompt.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from kvmesh.runtime.head import STAGES


def test_the_demo_reports_the_hits_stages_and_its_local_reference():
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "demo", "--json", "--model", "demo-tiny"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["source"] == "remote" and row["checksum_ok"] and row["outputs_identical"]
    assert row["reused_tokens"] == row["prompt_tokens"] and row["bytes_transferred"] > 0
    stages = row["hit_breakdown_ms"]
    assert tuple(stages) == STAGES and all(v >= 0 for v in stages.values())
    assert stages["transfer"] > 0 and stages["connect"] > 0  # fetched over a stream
    # each stage is rounded to a microsecond: their sum is the TTFT to within that
    assert math.isclose(sum(stages.values()), row["hit_ttft_s"] * 1000, abs_tol=0.01)
    assert row["local_reused_tokens"] == row["prompt_tokens"]  # the same prompt, all imported
    assert row["local_hit_ttft_s"] > 0
    ratio = row["hit_ttft_s"] / row["local_hit_ttft_s"]
    assert math.isclose(row["hit_vs_local"], ratio, abs_tol=0.006)  # rounded to 2 places
