"""The ``kvmesh`` command: ``demo``, ``peer``, ``head``, ``status``, ``store``, ``config``.

Contract: expected failures (bad flags, a missing model, refused settings) end in
one line and exit status 2, never a traceback. Every option is declared once, as
a row (:mod:`kvmesh.cli.options` says where, and makes the click options); library
code never imports this package, which only turns flags into the library's own
configs (:func:`kvmesh.mesh.settings.node_from`, ``HeadOptions.from_values``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..engine import pick_device, pick_dtype
from ..engine.deterministic import check as check_deterministic
from ..engine.lora import NEEDS as ADAPTER_NEEDS
from ..errors import ConfigError, KVMeshError
from .options import (
    client_security_options,
    deterministic_options,
    head_options,
    model_options,
    peer_options,
)
from .store import store

if TYPE_CHECKING:
    from rich.console import Console

    from ..api.head_options import HeadOptions
    from .demo import LocalResult


def _console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


class _Group(click.Group):
    """Turns expected failures into one clear line and exit status 2, not a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (FileNotFoundError, ValueError, KVMeshError, NotImplementedError) as e:
            raise click.ClickException(str(e)) from None


def _load_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    from .. import config

    if value:
        try:
            ctx.default_map = config.read_config(value, main, ctx)
        except KVMeshError as e:
            raise click.ClickException(str(e)) from None
    ctx.meta["config_file"] = value


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "KVMESH"},
)
@click.version_option(package_name="kvmesh")
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    envvar="KVMESH_CONFIG",
    is_eager=True,
    expose_value=False,
    callback=_load_config,
    help="TOML file with [common], [peer] and [head] settings (env: KVMESH_CONFIG).",
)
def main() -> None:
    """kvmesh: a peer-to-peer prefill KV cache network for LLM inference.

    Run `kvmesh demo` for the two-node evidence on the embedded demo model,
    `kvmesh peer` for a cache node, `kvmesh head` for an inference head.
    Every flag can also come from the config file or KVMESH_<ROLE>_<FLAG>.
    """


main.add_command(store)


@main.group("config")
def config_group() -> None:
    """Inspect configuration."""


@config_group.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Print the effective settings of every role, with where each came from."""
    from .. import config

    root = ctx.find_root()
    report = config.effective(main, root, dict(root.default_map or {}))
    report["config_file"] = root.meta.get("config_file")
    if as_json:
        print(json.dumps(report, indent=1, default=str))
        return
    print(f"# config file: {report['config_file'] or '(none)'}")
    for role in config.ROLES:
        print(f"[{role}]")
        for name, row in report[role].items():
            print(f"{name} = {json.dumps(row['value'], default=str)}  # {row['source']}")


@main.command()
@click.option(
    "--local", is_flag=True, help="Single process: cold prefill vs. import from a local store."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON line instead of a table.")
@click.option(
    "--vision",
    is_flag=True,
    help="Two pictures in the prompt, on the embedded vision-language model demo-vl "
    "(unless --model names another).",
)
@model_options
@click.option("--prompt-tokens", default=1000, show_default=True, help="Approximate prompt length.")
@deterministic_options
def demo(
    local: bool,
    as_json: bool,
    vision: bool,
    model: str,
    engine: str,
    prompt_tokens: int,
    deterministic: bool,
    deterministic_grid: int,
) -> None:
    """Show a prefix imported instead of recomputed, with identical output."""
    from ..memory import keep_heap_warm, one_heap

    one_heap()  # the local figures are a head's: its heap, set up as a head sets it up
    console = _console()
    grid = deterministic_grid if deterministic else 0
    if deterministic:
        with _usage_errors():
            check_deterministic(engine, deterministic_grid)
    if vision and local:
        raise click.UsageError("--vision runs the two-node demo (not --local)")
    if not local:
        from .demo import run_two_node

        run_two_node(
            model="demo-vl" if vision and model == "demo" else model,
            engine=engine,
            prompt_tokens=prompt_tokens,
            as_json=as_json,
            grid=grid,
            images=2 if vision else 0,
        )
        return
    from ..engine import load_engine
    from .demo import as_dict, run_local

    with console.status("loading model") as status:

        def progress(msg: str) -> None:
            status.update(msg)

        eng = load_engine(model, engine, progress=progress, deterministic_grid=grid)
        keep_heap_warm()
        progress(f"loaded {eng.card.summary()}")
        result = run_local(eng, prompt_tokens, progress=progress)
    if as_json:
        print(json.dumps(as_dict(result)))
        return
    _print_local(result, eng.card.summary())


def _print_local(result: LocalResult, summary: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvmesh demo --local · {summary}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("prompt tokens", str(result.prompt_tokens))
    t.add_row(
        "reused tokens",
        f"{result.reused_tokens} ({result.reused_tokens / result.prompt_tokens:.0%})",
    )
    t.add_row("cold prefill TTFT", f"{result.cold_ttft_s * 1000:.1f} ms")
    t.add_row("import TTFT", f"{result.hit_ttft_s * 1000:.1f} ms")
    t.add_row("speedup", f"{result.speedup:.0f}×")
    t.add_row("stored", f"{result.blocks} blocks / {result.bytes_stored / 2**20:.1f} MiB")
    t.add_row("outputs identical", "yes" if result.outputs_identical else "NO")
    Console().print(t)
    if not result.outputs_identical:
        sys.exit(1)


@contextmanager
def _usage_errors() -> Iterator[None]:
    """The library's refusals (a :class:`ConfigError`) as usage errors: exit status 2."""
    try:
        yield
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


def _logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("grpc").setLevel(logging.WARNING)


@main.command()
@peer_options
def peer(
    listen: str,
    metrics: str | None,
    join: str | None,
    pairing_token: str | None,
    verbose: bool,
    **node: object,
) -> None:
    """Run a cache-only node: stores blocks, serves lookups and fetches, gossips."""
    import asyncio

    from ..mesh.peer import run_peer
    from ..mesh.settings import node_from

    _logging(verbose)
    joined = None
    if join or pairing_token:
        if not (join and pairing_token):
            raise click.UsageError("--join and --pairing-token go together")
        joined = _pair(join, pairing_token, str(node["alias"] or ""))
    with _usage_errors():
        cfg = node_from(node, ("cache",), listen)
    if joined:
        cfg.seeds = [*cfg.seeds, *joined.seeds]
        if joined.fleet_key:
            key = joined.fleet_key.encode("latin-1")
            cfg.security = dataclasses.replace(cfg.security, fleet_key=key)
    asyncio.run(run_peer(cfg, metrics))


@dataclass(frozen=True)
class _Pairing:
    """What a head answers a redeemed pairing token: seeds, and the fleet key if any."""

    seeds: list[str]
    fleet_key: str


def _pair(head_url: str, token: str, alias: str) -> _Pairing:
    """Redeem a pairing token at a head: seeds (and the fleet key where one is used)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        head_url.rstrip("/") + "/v1/network/pair",
        data=json.dumps({"token": token, "alias": alias}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise click.ClickException(
            f"pairing refused by {head_url}: HTTP {e.code} {e.read()[:200]!r}"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise click.ClickException(f"cannot reach {head_url}: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("seeds"), list):
        raise click.ClickException(f"unexpected pairing answer from {head_url}")
    return _Pairing([str(s) for s in body["seeds"]], str(body.get("fleet_key") or ""))


@main.command()
@head_options
def head(verbose: bool, **given: object) -> None:
    """Serve the OpenAI-compatible API with prefill from the mesh; decode stays local."""
    from ..api.head_options import HeadOptions
    from ..api.server import run_head
    from ..mesh.settings import node_from

    _logging(verbose)
    opts = _checked_head(HeadOptions.from_values(given))
    with _usage_errors():
        cfg = node_from(given, ("head", "cache"))
    run_head(opts, cfg)


def _checked_head(opts: HeadOptions) -> HeadOptions:
    """``opts`` checked now, before the model loads (a usage error naming the flag),
    with ``auto`` resolved to the device the engine will run on."""
    if bool(opts.http_tls_cert) != bool(opts.http_tls_key):
        raise click.UsageError("--http-tls-cert and --http-tls-key go together")
    with _usage_errors():  # a device that is not there is a clear error now, not at load
        pick_dtype(opts.dtype, opts.engine)
        device = pick_device(opts.device, opts.engine) or opts.device
        if opts.deterministic:
            check_deterministic(opts.engine, opts.deterministic_grid)
    _tenant_options(opts.tenant_header, opts.shared_tenant)
    _access(opts)
    _adapters(opts)
    if opts.tenant_secret_file:
        from ..api.credentials import KeyFileError, head_secret

        try:
            head_secret(opts.tenant_secret_file)  # made now when missing: a bad path fails here
        except KeyFileError as e:
            raise click.BadParameter(str(e), param_hint="--tenant-secret-file") from None
    return dataclasses.replace(opts, device=device)


def _adapters(opts: HeadOptions) -> None:
    """``--lora`` checked before the model loads: NAME=PATH, names free, each a
    directory with a PEFT config and safetensors weights, on an engine that applies
    them (the weights themselves are checked against the model when it loads)."""
    try:
        adapters = opts.lora_modules()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--lora") from None
    if adapters and (opts.engine != "torch" or opts.deterministic):
        raise click.UsageError("--lora needs the torch engine, without --deterministic")
    for name, path in adapters.items():
        missing = [f for f in ADAPTER_NEEDS if not (Path(path) / f).is_file()]
        if missing:
            raise click.BadParameter(
                f"{name}={path}: no {' or '.join(missing)} there", param_hint="--lora"
            )


def _access(opts: HeadOptions) -> None:
    """The head's key options checked now, as the app checks them at start (a clear
    error naming the flag before the model loads)."""
    from ..api.credentials import KeyFileError, load_credentials

    try:
        load_credentials(
            opts.api_key_file,
            opts.admin_key_file,
            opts.gateway_key_file,
            header=opts.tenant_header,
            scope=opts.api_key_scope,
        )
    except KeyFileError as e:
        raise click.BadParameter(str(e), param_hint=e.flag) from None


def _tenant_options(header: str | None, shared: tuple[str, ...]) -> None:
    """Check the tenant flags now (a clear error before the model loads)."""
    from ..api.credentials import check_tenant_name

    if header is not None and not re.fullmatch(r"[A-Za-z0-9-]{1,64}", header):
        raise click.BadParameter(
            "a header name of letters, digits and -", param_hint="--tenant-header"
        )
    for name in shared:
        try:
            check_tenant_name(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--shared-tenant") from None


@main.command()
@click.argument("address")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@client_security_options
def status(address: str, as_json: bool, **sec: str | None) -> None:
    """The fleet as the node at ADDRESS (HOST:PORT, gRPC) sees it."""
    import asyncio

    import grpc

    from ..mesh.security import FleetAuth, TLSConfig, load_fleet_key
    from ..mesh.status import describe, fetch_cards, links_text

    auth = (
        FleetAuth(load_fleet_key(sec["fleet_key_file"]), "kvmesh-status")
        if sec["fleet_key_file"]
        else None
    )
    tls = TLSConfig.from_options(sec)
    try:
        cards = asyncio.run(fetch_cards(address, auth, tls))
    except grpc.aio.AioRpcError as e:
        raise click.ClickException(f"{address}: {e.code().name}: {e.details()}") from None
    rows = describe(cards)
    if as_json:
        print(json.dumps({"address": address, "members": rows}, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvmesh fleet as seen by {address}")
    for col in (
        "alias",
        "roles",
        "epoch",
        "card age",
        "endpoints",
        "used / budget",
        "entries",
        "hit ratio",
        "links measured",
    ):
        t.add_column(col)
    for r in rows:
        eps = ", ".join(f"{e['address']} ({e['interface']})" for e in r["endpoints"])
        used = f"{r['used_bytes'] / 2**20:.1f} / {r['budget_bytes'] / 2**30:.1f} GiB"
        hit = "–" if r["hit_ratio"] is None else f"{r['hit_ratio']:.0%}"
        name = r["alias"] + (" *" if r["answering"] else "")
        t.add_row(
            name,
            ",".join(r["roles"]),
            r["epoch"][:8],
            f"{r['card_age_s']:.1f} s",
            eps,
            used,
            str(r["entries"]),
            hit,
            links_text(r),
        )
    Console(width=None if sys.stdout.isatty() else 200).print(t)
