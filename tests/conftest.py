from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Hermetic model/digest cache for the whole run (subprocesses inherit it).
os.environ.setdefault("KVMESH_HOME", tempfile.mkdtemp(prefix="kvmesh-test-home-"))


@pytest.fixture(scope="session")
def tiny_engine():
    from kvmesh.engine import load_engine

    return load_engine("demo-tiny", "torch")


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from kvmesh.engine.demo import ensure_demo

    return ensure_demo("demo-tiny")
