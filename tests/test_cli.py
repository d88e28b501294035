import json
import subprocess
import sys

import pytest


def _kvmesh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_demo_local_json_on_tiny_model(engine):
    out = _kvmesh("demo", "--local", "--json", "--model", "demo-tiny", "--engine", engine)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(row) >= {
        "prompt_tokens",
        "reused_tokens",
        "cold_ttft_s",
        "hit_ttft_s",
        "speedup",
        "outputs_identical",
    }
    assert row["outputs_identical"] is True
    assert row["reused_tokens"] == row["prompt_tokens"] >= 900


def test_help_and_bad_model():
    assert "demo" in _kvmesh("--help").stdout
    bad = _kvmesh("demo", "--local", "--model", "/nonexistent/model")
    assert bad.returncode != 0 and "nothing is downloaded" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_two_node_demo_json_on_tiny_model(engine):
    out = _kvmesh("demo", "--json", "--model", "demo-tiny", "--engine", engine)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["outputs_identical"] is True and row["checksum_ok"] is True
    assert row["source"] == "remote" and row["reused_tokens"] == row["prompt_tokens"] >= 900
    assert row["bytes_transferred"] > 0
    assert row["turn2_cached_tokens"] > 0  # turn 2 reused turn 1's prompt and answer
