"""``bench/serve_compare.py --smoke`` (needs ``.venv-vllm``): vLLM's serving benchmark
runs against a ``kvmesh head`` and a ``vllm serve`` on demo-tiny, every request
completes on both with no failure, every output token arrives, the JSON carries the
head / vLLM ratios and the head's counters account for every request the benchmark
sent; nothing it started is left running. No time is asserted (speed is the
benchmark's report, not a test's).
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

PROMPTS, OUT = 4, 4  # bench/vllm.py's SMOKE shape


@pytest.mark.timeout(900)
def test_the_head_and_vllm_both_serve_the_whole_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    proc, tag = start(ROOT / "bench" / "serve_compare.py", out)  # this interpreter: the venv's
    text = finish(proc, tag)  # asserts no process of the run is left
    assert proc.returncode == 0, text
    d = json.loads(out.read_text())
    assert d["shape"]["prompts"] == PROMPTS and d["shape"]["out"] == OUT, d["shape"]
    (rnd,) = d["rounds"]
    for server in ("vllm", "head"):
        r = rnd[server]
        assert r["completed"] == PROMPTS and r["failed"] == 0, r
        assert r["output_tokens"] == PROMPTS * OUT, r  # --ignore-eos: every token streamed
        assert r["mean_ttft_ms"] > 0 and r["duration_s"] > 0, r
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "duration_s"):
        q = rnd["ratios"][key]
        if key == "mean_tpot_ms" and rnd["vllm"][key] == 0:  # vLLM sent one chunk: no TPOT
            assert q is None
            continue
        assert q is not None and math.isfinite(q) and q > 0, rnd["ratios"]
        assert q == pytest.approx(rnd["head"][key] / rnd["vllm"][key], rel=1e-2)
    assert d["head_over_vllm"] == rnd["ratios"]
    # every prompt the benchmark sent (it sends no test prompt first), counted by the head
    m = rnd["head"]["metrics"]
    assert m["requests"] == PROMPTS, m
    assert m["completion_tokens"] == PROMPTS * OUT, m
    assert m["kv_assisted_tokens"] + m["computed_prompt_tokens"] == m["prompt_tokens"] > 0, m
