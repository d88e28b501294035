from __future__ import annotations

import os
import tempfile
from pathlib import Path

import hypothesis.internal.observability  # noqa: F401
import pytest

# (hypothesis's pytest plugin imports that module lazily at the very end of a run,
# through pytest's assertion rewriter; CPython 3.11.7 can fail that late
# ast.parse with "AST constructor recursion depth mismatch" after tests that
# leave coroutines to the garbage collector. Imported here, it is parsed first.)

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
