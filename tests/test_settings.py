"""kvmesh.mesh.settings: the node checks every role shares, as a library (typed
ConfigError, no command line underneath), used alike by the CLI and the vLLM
connector's settings."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh.errors import ConfigError
from kvmesh.mesh.settings import node_config
from kvmesh.vllm.config import parse_settings


def cfg(listen: str, **sec: object):
    return node_config(listen, "64MiB", (), None, (), ("cache",), sec)


def test_refusals_are_config_errors_naming_the_option():
    with pytest.raises(ConfigError, match="plaintext listener"):
        cfg("0.0.0.0:7070")
    with pytest.raises(ConfigError, match="unauthenticated listener"):
        cfg("0.0.0.0:7070", plaintext=True)
    with pytest.raises(ConfigError, match="--disk-budget"):
        cfg("127.0.0.1:0", disk="/tmp/x", disk_budget="lots")
    ok = cfg("0.0.0.0:7070", plaintext=True, allow_unauthenticated=True, disk="/tmp/x")
    assert ok.disk_budget_bytes == 16 << 30 and ok.budget_bytes == 64 << 20
    with pytest.raises(ConfigError, match="kv_connector_extra_config: refusing a plaintext"):
        parse_settings({"grpc_listen": "0.0.0.0:0"}).node_config()


def test_the_library_does_not_load_the_command_line():
    code = (
        "import sys, kvmesh.mesh.settings, kvmesh.vllm.config; "
        "print(any(m in sys.modules for m in ('kvmesh.cli', 'click')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_node_from_checks_values_by_their_declarations():
    """The flat form (values by their declared names, as the CLI and the connector
    hold them): a missing option takes its declared default, a bad one is a
    ConfigError naming its flag, a name that is no node option is not read."""
    from kvmesh.mesh.settings import node_from

    cfg = node_from({"budget": "64MiB", "seed": ("a:1",), "prefill_tps": 9.0}, ("cache",))
    assert cfg.listen == "127.0.0.1:0" and cfg.seeds == ["a:1"] and cfg.budget_bytes == 64 << 20
    assert (cfg.ttl, cfg.lookup_deadline, cfg.max_members, cfg.bulk) == (5.0, 0.25, 256, True)
    assert node_from({"grpc_listen": "x"}, ("cache",), "127.0.0.1:7").listen == "127.0.0.1:7"
    assert node_from({"seed": "a:1"}, ("cache",)).seeds == ["a:1"]  # one string: one seed


@pytest.mark.parametrize(
    ("bad", "flag"),
    [
        ({"ttl": -1}, "--ttl"),
        ({"max_members": 0}, "--max-members"),
        ({"disk_admit": "never"}, "--disk-admit"),
        ({"seed": [1]}, "--seed"),
    ],
)
def test_node_from_names_the_flag_of_a_bad_value(bad, flag):
    from kvmesh.mesh.settings import node_from

    with pytest.raises(ConfigError, match=f"invalid {flag}"):
        node_from(bad, ("cache",))
