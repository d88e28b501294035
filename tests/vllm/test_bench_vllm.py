"""``bench/vllm.py --smoke`` (needs ``.venv-vllm``, so it runs here and not in the
main suite's tests/test_bench_smoke.py): three ``vllm serve`` runs on demo-tiny
(plain, A on a cold fleet, B on the fleet A warmed) each complete every prompt of
vLLM's own serving benchmark, B fetches what A published, the JSON carries the
ratios; nothing it started is left running. No time is asserted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from ..test_bench_smoke import ROOT, finish, start  # noqa: E402

PROMPTS = 4  # bench/vllm.py's SMOKE shape


@pytest.mark.timeout(900)
def test_vllm_with_and_without_kvmesh_serves_the_whole_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "vllm.json"
    proc, tag = start(ROOT / "bench" / "vllm.py", out)  # this interpreter: the venv's
    text = finish(proc, tag)  # asserts no process of the run is left
    assert proc.returncode == 0, text
    d = json.loads(out.read_text())
    rows = {r["server"]: r for r in d["rows"]}
    assert set(rows) == {"plain", "A", "B", "sliding A", "sliding B"}, rows
    for r in rows.values():
        assert r["completed"] == PROMPTS and r["mean_ttft_ms"] > 0, r
    for b in ("B", "sliding B"):  # the warm fleet served B
        assert rows[b]["kvmesh"].get("remote_hits", 0) > 0, rows[b]
    assert rows["sliding A"]["model"] != rows["A"]["model"]
    for key in ("b_over_a", "a_over_plain", "sliding_b_over_a"):
        assert math.isfinite(d[key]) and d[key] > 0, d
