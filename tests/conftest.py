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


# Modules whose tests each start what they need (no module-scoped fixture): under
# xdist's --dist loadgroup their tests spread over the workers one by one.
SPREAD = {"test_bench_smoke"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n N --dist loadgroup`` (the README's test command), a module's tests
    run in one worker, so its module-scoped heads, peers and models are made once;
    the tests of the modules in ``SPREAD`` go to whichever worker is free."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        if module not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(module))
