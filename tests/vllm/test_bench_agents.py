"""``bench/agents.py --smoke --modes vllm,vllm-off`` (needs ``.venv-vllm``): the agent
trace replayed against ``vllm serve`` with the same model, tools and tool parser as
the heads, prefix caching on and off; every turn answered, reuse only with the cache
on, the constrained-decoding step measured; nothing it started is left running (the
kvmesh modes run in the main suite, ``tests/test_bench_smoke.py``). No time is
asserted.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from ..test_bench_smoke import ROOT, finish, start  # noqa: E402

AGENTS, TURNS = 2, 3  # bench/agents.py's smoke trace


@pytest.mark.timeout(1200)
def test_the_agent_trace_against_vllm_serve_with_and_without_its_prefix_cache(
    tmp_path: Path,
) -> None:
    out = tmp_path / "agents.json"
    args = ("--modes", "vllm,vllm-off", "--vllm-python", sys.executable)
    proc, tag = start(ROOT / "bench" / "agents.py", out, sys.executable, *args)
    text = finish(proc, tag)  # asserts no process of the run is left
    assert proc.returncode == 0, text
    d = json.loads(out.read_text())
    on, off = d["modes"]["vllm"], d["modes"]["vllm-off"]
    for m in (on, off):
        assert len(m["turns"]) == AGENTS * TURNS and m["servers"] == 1, m
        assert all(t["ttft_s"] > 0 for t in m["turns"]), m["turns"]
    assert on["prompt_tokens"] == off["prompt_tokens"] > 0
    assert on["reused_tokens"] > 0 and off["reused_tokens"] == 0, (on, off)
    g = on["grammar_per_step"]
    assert g["free_step_ms"] > 0 and math.isfinite(g["constrained_step_ms"]), g
    assert "grammar_per_step" not in off
    assert d["ratios"] == {}  # no kvmesh mode in this run
