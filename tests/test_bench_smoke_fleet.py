"""The fleet's and the head's benchmarks in CI (split from tests/test_bench_smoke.py so that
the README's ``--dist loadfile`` spreads the smoke runs over its workers): each runs in
smoke mode, exits 0, writes its JSON with its claim holding, and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_bench_smoke import benches, smoke


@pytest.mark.parametrize("bench", benches("fleet"), ids=lambda p: p.stem)
def test_each_benchmark_runs_in_smoke_mode_and_cleans_up(bench: Path, tmp_path: Path) -> None:
    smoke(bench, tmp_path)
