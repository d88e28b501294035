"""The code stays ruff-clean, ruff-formatted and mypy-clean (versions pinned in the
test extra): the formatter owns layout."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "kvmesh", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "kvmesh", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy():
    out = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
