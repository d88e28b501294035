import json
import math
import subprocess
import sys

import pytest

from kvmesh.runtime.head import STAGES


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


def test_peer_and_head_share_option_declarations():
    """An option both roles take is the same option: same flags, default, type and
    help (``--listen`` is the one name each role means differently); none lacks help."""
    import click

    from kvmesh.cli import main

    def options(role: str) -> dict[str, click.Option]:
        params = main.commands[role].params
        return {p.name: p for p in params if isinstance(p, click.Option) and p.name != "help"}

    peer, head = options("peer"), options("head")
    shared = (set(peer) & set(head)) - {"listen"}
    assert {"budget", "seed", "gossip_interval", "ttl", "region", "fleet_key_file"} <= shared
    assert {"disk", "kv_events", "verbose"} <= shared
    for name in shared:
        a, b = peer[name], head[name]
        assert (a.opts, a.default, a.help, repr(a.type)) == (
            b.opts,
            b.default,
            b.help,
            repr(b.type),
        )
    for role, opts in (("peer", peer), ("head", head)):
        assert not [n for n, o in opts.items() if not o.help], role
    text = " ".join(_kvmesh("head", "--help").stdout.split())
    assert "--gossip-interval FLOAT Seconds between gossip rounds." in text


def test_node_options_are_made_from_the_library_declarations():
    """Every mesh-node option of ``peer`` and ``head`` is its row in
    kvmesh/mesh/options.py (flag, help, default), --help shows each kind as before
    the move (choices, ranges, FILE, metavars), and the rows' own checks run on the
    command line too (a size, positive seconds): exit status 2 naming the flag."""
    import click
    from click.testing import CliRunner

    from kvmesh.cli import main
    from kvmesh.mesh.options import NODE

    for role in ("peer", "head"):
        params = {p.name: p for p in main.commands[role].params if isinstance(p, click.Option)}
        for name, row in NODE.items():
            if name in params:
                p = params[name]
                assert (p.opts, p.help) == ([row.flag], row.help), (role, name)
                assert row.default is None or p.default == row.default, (role, name)
        assert {n for n in NODE if n in params} >= {"budget", "tls_ca", "disk_admit", "kv_events"}
    runner = CliRunner()
    text = " ".join(runner.invoke(main, ["head", "--help"]).output.split())
    for shown in (
        "--engine [torch|mlx]",
        "--max-members INTEGER RANGE Most nodes kept in the membership view. [default: 256; x>=1]",
        "--fleet-key-file FILE",
        "--disk DIR",
        "--disk-admit [evicted|hit]",
        "--kv-events ENDPOINT",
        "--audit-rate FLOAT RANGE",
        "-v, --verbose Log at DEBUG level.",
        "--grpc-listen TEXT gRPC HOST:PORT of this node's own cache service",
        "--lookup-timeout FLOAT Seconds a lookup may take. [default: 0.25]",
        "--region TEXT Coarse region label shown publicly. -v, --verbose",  # no empty default
    ):
        assert shown in text, shown
    for args, flag in (
        (["peer", "--ttl", "0"], "--ttl"),
        (["peer", "--budget", "lots"], "--budget"),
        (["head", "--kv-budget", "lots"], "--kv-budget"),
        (["head", "--tenant-budget", "0"], "--tenant-budget"),
    ):
        out = runner.invoke(main, args)
        assert out.exit_code == 2 and f"Invalid value for '{flag}'" in out.output, (
            args,
            out.output,
        )


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
    # the hit's stages (issue #27): there, summing to its TTFT (each rounded to a
    # microsecond), fetched over a stream; the local reference imported the same prompt
    stages = row["hit_breakdown_ms"]
    assert tuple(stages) == STAGES and all(v >= 0 for v in stages.values())
    assert stages["transfer"] > 0 and stages["connect"] > 0
    assert math.isclose(sum(stages.values()), row["hit_ttft_s"] * 1000, abs_tol=0.01)
    assert row["local_reused_tokens"] == row["prompt_tokens"] and row["local_hit_ttft_s"] > 0
    ratio = row["hit_ttft_s"] / row["local_hit_ttft_s"]
    assert math.isclose(row["hit_vs_local"], ratio, abs_tol=0.006)  # rounded to 2 places


def test_two_node_demo_with_pictures():
    """``kvmesh demo --vision`` (issue #51): two pictures in the prompt, the whole of it
    a remote hit after the restart, no encoder run there, the same answer."""
    out = _kvmesh("demo", "--vision", "--json", "--model", "demo-vl-tiny", "--prompt-tokens", "300")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["images"] == 2 and row["hit_images_encoded"] == 0
    assert row["outputs_identical"] is True and row["source"] == "remote"
    assert row["reused_tokens"] == row["prompt_tokens"] > 2 * 16  # 16 tokens a picture
    assert row["local_hit_ttft_s"] is None  # no in-process reference for pictures
    refused = _kvmesh("demo", "--vision", "--local")
    assert refused.returncode == 2 and "--vision" in refused.stderr


def test_a_non_loopback_listener_needs_client_authentication(tmp_path):
    """Anyone who reaches an unauthenticated listener could publish and fetch: a
    non-loopback listener without a fleet key or mutual TLS is refused at start."""
    bad = _kvmesh("peer", "--listen", "0.0.0.0:0", "--plaintext")
    assert bad.returncode == 2 and "unauthenticated listener" in bad.stderr
    assert "--fleet-key-file" in bad.stderr and "Traceback" not in bad.stderr
    key = tmp_path / "fleet.key"
    key.write_text("k" * 64)
    for extra in (["--fleet-key-file", str(key)], ["--allow-unauthenticated"]):
        ok = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "peer",
                "--listen",
                "0.0.0.0:0",
                "--plaintext",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert "listening on" in ok.stdout.readline()
        finally:
            ok.kill()
            ok.wait(10)


def test_head_default_max_tokens_caps_requests_that_set_none():
    """``--default-max-tokens`` (also spelt ``--max-tokens-default``) caps a request
    without ``max_tokens``; a request's own limit wins; ``--help`` states the default."""
    from kvmesh.api.head_options import DEFAULT_MAX_TOKENS, HeadOptions

    from .test_api import Head

    text = " ".join(_kvmesh("head", "--help").stdout.split())
    assert "--default-max-tokens, --max-tokens-default" in text
    assert f"[default: {DEFAULT_MAX_TOKENS}; x>=0]" in text and "0: the rest of the context" in text
    assert HeadOptions().max_tokens_default == DEFAULT_MAX_TOKENS == 1024
    bad = _kvmesh("head", "--default-max-tokens", "-1")
    assert bad.returncode == 2 and "-1 is not in the range x>=0" in bad.stderr, bad.stderr
    body = {"model": "demo-tiny", "prompt": "cap", "temperature": 0, "ignore_eos": True}
    for flag in ("--default-max-tokens", "--max-tokens-default"):
        h = Head(flag, "3", "--no-publish")
        try:
            out = h.http.post("/v1/completions", json=body).json()
            assert out["usage"]["completion_tokens"] == 3, out
            out = h.http.post("/v1/completions", json={**body, "max_tokens": 5}).json()
            assert out["usage"]["completion_tokens"] == 5, out
        finally:
            h.stop()
