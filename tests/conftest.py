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
def plain_tiny_engine():
    """``demo-tiny`` with its plain weights whatever this machine's kernel choice:
    for the tests that swap the kernel table or calibrate its model again."""
    from kvmesh.engine import load_engine

    return load_engine("demo-tiny", "torch", pack=False)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from kvmesh.engine.embedded import ensure_demo

    return ensure_demo("demo-tiny")


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A CA, a server certificate (localhost, 127.0.0.1) and a client certificate."""
    import trustme

    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("kvmesh-client")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    return d
