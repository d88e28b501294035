from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import hypothesis.internal.observability  # noqa: F401
import pytest

# (hypothesis's pytest plugin imports that module lazily at the very end of a run,
# through pytest's assertion rewriter; CPython 3.11.7 can fail that late
# ast.parse with "AST constructor recursion depth mismatch" after tests that
# leave coroutines to the garbage collector. Imported here, it is parsed first.)

# OpenMP threads sleep when their work is done instead of spinning for milliseconds: three
# test workers, and the heads and peers they start, share two cores, and a spinning
# thread burns a core another process needed (measured: in-process model tests 0.66x the
# wall time and CPU). Results do not depend on it; set it to test with spinning threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Hermetic model/digest cache for the whole run (xdist's workers and every subprocess
# inherit it: ~80 MB of zoo models), removed when the process that made it exits.
if "KVMESH_HOME" not in os.environ:
    os.environ["KVMESH_HOME"] = tempfile.mkdtemp(prefix="kvmesh-test-home-")
    atexit.register(shutil.rmtree, os.environ["KVMESH_HOME"], ignore_errors=True)
# vLLM's IPC sockets (a server that is killed leaves them) in a directory of the run's own
if "VLLM_RPC_BASE_PATH" not in os.environ:
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="kvmesh-test-vllm-rpc-")
    atexit.register(shutil.rmtree, os.environ["VLLM_RPC_BASE_PATH"], ignore_errors=True)


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


# Files that take minutes, started first: the README's command gives each file to one
# worker in collection order, and a long file collected last keeps its worker busy
# after the others ran out of files. Order only (a file missing here runs as before);
# longest first, by the worker-seconds of a whole run (pytest --junitxml).
LONG_FILES = (
    "test_bench_smoke_fleet.py",
    "test_bench_smoke.py",
    "test_bench_smoke_ttft.py",
    "test_harnesses.py",
    "test_zoo_mlx.py",
    "test_cli.py",
    "test_images_head.py",
    "test_today_procs.py",
    "test_deterministic.py",
    "test_zoo_torch.py",
    "test_api.py",
    "test_kernel_cache.py",
    "test_mlx_today.py",
    "test_today_torch.py",
    "test_client_sdks.py",
    "test_head_robust.py",
    "test_edge.py",
    "test_dashboard.py",
    "test_agents.py",
    "test_sliding.py",
    "test_disk.py",
    "test_lint.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))
