"""Operations: config file + env + flags, `kvmesh status`, deployment units."""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import Peer

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def kvmesh(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_config_file_env_and_flags_layer_in_order(tmp_path):
    cfg = tmp_path / "kvmesh.toml"
    cfg.write_text(
        '[common]\nttl = 7.5\n[peer]\nbudget = "3GiB"\nseed = ["10.0.0.9:7070"]\npairing_token = "hunter2"\n'
    )
    out = kvmesh(
        "--config", str(cfg), "config", "show", "--json", env={"KVMESH_PEER_BUDGET": "1GiB"}
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    peer = rep["peer"]
    assert peer["budget"] == {"value": "1GiB", "source": "env KVMESH_PEER_BUDGET"}
    assert peer["seed"] == {"value": ["10.0.0.9:7070"], "source": "file"}
    assert peer["ttl"]["value"] == 7.5 and rep["head"]["ttl"]["value"] == 7.5  # [common]
    assert peer["pairing_token"]["value"] == "<redacted>" and "hunter2" not in out.stdout
    assert rep["head"]["model"] == {"value": "demo", "source": "default"}


def test_flags_beat_env_beat_file_on_a_real_peer(tmp_path):
    cfg = tmp_path / "kvmesh.toml"
    cfg.write_text('[peer]\nalias = "from-file"\nbudget = "3GiB"\n')
    port = __import__("tests.procs", fromlist=["free_port"]).free_port()
    env = {**os.environ, "KVMESH_CONFIG": str(cfg), "KVMESH_PEER_BUDGET": "1GiB"}
    p = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "peer", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = p.stdout.readline()
        assert "from-file" in line
        st = kvmesh("status", "--json", f"127.0.0.1:{port}")
        me = json.loads(st.stdout)["members"][0]
        assert me["alias"] == "from-file" and me["budget_bytes"] == 1 << 30
    finally:
        p.terminate()
        p.wait(10)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[peer]\nbudgte = 1\n", "unknown key 'budgte'"),
        ('[peer]\nttl = "soon"\n', "[peer] ttl"),
        ('[peer]\nseed = "10.0.0.1:1"\n', "seed must be a list"),
        ("[nodes]\nx = 1\n", "unknown section [nodes]"),
        ("[common]\nnope = 1\n", "[common] unknown key 'nope'"),
        ("[peer\n", "not valid TOML"),
    ],
)
def test_bad_config_is_one_clear_error_naming_file_and_key(tmp_path, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    out = kvmesh("--config", str(cfg), "config", "show")
    assert out.returncode != 0 and needle in out.stderr and str(cfg) in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_example_config_is_valid():
    out = kvmesh("--config", str(DEPLOY / "kvmesh.example.toml"), "config", "show", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["peer"]["listen"]["value"] == "0.0.0.0:7070"


def test_status_shows_members_epochs_and_endpoints(tmp_path):
    a = Peer(alias="status-a", log_dir=tmp_path)
    b = Peer("--seed", a.address, alias="status-b", log_dir=tmp_path)
    try:
        import time

        deadline = time.time() + 10
        while time.time() < deadline:
            out = kvmesh("status", "--json", a.address)
            rows = json.loads(out.stdout)["members"]
            if len(rows) == 2:
                break
            time.sleep(0.2)
        assert {r["alias"] for r in rows} == {"status-a", "status-b"}
        me = next(r for r in rows if r["answering"])
        assert me["alias"] == "status-a" and me["epoch"] == a.epoch
        other = next(r for r in rows if not r["answering"])
        assert other["epoch"] == b.epoch and other["endpoints"][0]["interface"] == "loopback"
        assert other["budget_bytes"] == 2 << 30 and other["card_age_s"] < 5
        table = kvmesh("status", a.address)
        assert table.returncode == 0 and "status-b" in table.stdout
    finally:
        a.kill()
        b.kill()
    dead = kvmesh("status", a.address)
    assert dead.returncode != 0 and "UNAVAILABLE" in dead.stderr


@pytest.mark.parametrize("role", ["peer", "head"])
def test_launchd_plists_parse_and_keep_alive(role):
    with open(DEPLOY / "launchd" / f"ai.kvmesh.{role}.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == f"ai.kvmesh.{role}"
    assert (
        plist["ProgramArguments"][-1] == role
        and plist["KeepAlive"] is True
        and plist["RunAtLoad"] is True
    )
    assert plist["EnvironmentVariables"]["KVMESH_CONFIG"].endswith("kvmesh.toml")


@pytest.mark.parametrize("role", ["peer", "head"])
def test_systemd_units_have_the_keys_and_verify(role, tmp_path):
    unit = DEPLOY / "systemd" / f"kvmesh-{role}.service"
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment]
    cp.read(unit)
    svc = cp["Service"]
    assert svc["ExecStart"].split()[-1] == role and svc["Restart"] == "always"
    assert "KVMESH_CONFIG=/etc/kvmesh/kvmesh.toml" in svc["Environment"] or any(
        "KVMESH_CONFIG" in line for line in unit.read_text().splitlines()
    )
    assert cp["Install"]["WantedBy"] == "multi-user.target"
    assert svc["KillSignal"] == "SIGTERM"
    if shutil.which("systemd-analyze"):
        local = tmp_path / unit.name
        local.write_text(
            unit.read_text().replace(
                "/usr/local/bin/kvmesh", shutil.which("kvmesh") or sys.executable
            )
        )
        out = subprocess.run(
            ["systemd-analyze", "verify", str(local)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "script,unit",
    [
        ("install-systemd.sh", "etc/systemd/system/kvmesh-{role}.service"),
        ("install-launchd.sh", "Library/LaunchDaemons/ai.kvmesh.{role}.plist"),
    ],
)
@pytest.mark.parametrize("role", ["peer", "head"])
def test_install_scripts_write_config_and_service(tmp_path, script, unit, role):
    env = {"DESTDIR": str(tmp_path), "DRY_RUN": "1", "PATH": os.environ["PATH"]}
    out = subprocess.run(
        ["bash", str(DEPLOY / script), role], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    written = tmp_path / unit.format(role=role)
    assert written.is_file() and "/usr/local/bin/kvmesh" not in written.read_text()
    conf = next(tmp_path.rglob("kvmesh.toml"))
    assert conf.read_text() == (DEPLOY / "kvmesh.example.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text("[peer]\nnope = 1\n")
    out = subprocess.run(
        ["bash", str(DEPLOY / script), role, str(bad)], capture_output=True, text=True, env=env
    )
    assert out.returncode != 0 and "unknown key 'nope'" in out.stderr
