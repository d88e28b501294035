"""The ``kvmesh`` command: ``demo``, ``peer``, ``head``, ``status``, ``store``, ``config``.

Contract: expected failures (bad flags, a missing model, refused settings) end in
one line and exit status 2, never a traceback. Options shared by several commands
are declared once, in :mod:`kvmesh.cli.options`; library code never imports this
package (it only turns flags into the library's own configs).
"""

from __future__ import annotations

import json
import re
import sys

import click

from ..api.server import DEFAULT_MAX_TOKENS
from ..compat import BLOCK_DIGESTS
from ..engine import DEVICES, DTYPES, pick_device, pick_dtype
from ..errors import ConfigError, KVMeshError
from ..store_cli import store
from .options import client_security_options, model_options, node_options


def _console():  # type: ignore[no-untyped-def]
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
            ctx.default_map = config.load(value, ctx.command, ctx)  # type: ignore[arg-type]
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
    report = config.effective(root.command, root, root.default_map)  # type: ignore[arg-type]
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
@model_options
@click.option("--prompt-tokens", default=1000, show_default=True, help="Approximate prompt length.")
def demo(local: bool, as_json: bool, model: str, engine: str, prompt_tokens: int) -> None:
    """Show a prefix imported instead of recomputed, with identical output."""
    console = _console()
    if not local:
        from ..runtime.demo import run_two_node

        run_two_node(model=model, engine=engine, prompt_tokens=prompt_tokens, as_json=as_json)
        return
    from ..demo import as_dict, run_local
    from ..engine import load_engine

    with console.status("loading model") as status:

        def progress(msg: str) -> None:
            status.update(msg)

        eng = load_engine(model, engine, progress=progress)
        progress(f"loaded {eng.card.summary()}")
        result = run_local(eng, prompt_tokens, progress=progress)
    if as_json:
        print(json.dumps(as_dict(result)))
        return
    _print_local(result, eng.card.summary())


def _print_local(result, summary: str) -> None:  # type: ignore[no-untyped-def]
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


def node_config(*args: object, **kw: object):  # type: ignore[no-untyped-def]
    """The library's checked node config; its refusals are usage errors here."""
    from ..mesh.settings import node_config as build

    try:
        return build(*args, **kw)  # type: ignore[arg-type]
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
@click.option(
    "--listen", default="127.0.0.1:7070", show_default=True, help="gRPC HOST:PORT (port 0 = any)."
)
@click.option("--metrics", help="Serve Prometheus metrics on HOST:PORT.")
@click.option(
    "--join", metavar="HEAD_URL", help="Join the fleet of this head (with --pairing-token)."
)
@click.option("--pairing-token", help="Single-use token from POST /v1/network/nodes/register.")
@node_options
def peer(
    listen: str,
    budget: str,
    seed: tuple[str, ...],
    alias: str | None,
    advertise: tuple[str, ...],
    metrics: str | None,
    gossip_interval: float,
    ttl: float,
    region: str,
    join: str | None,
    pairing_token: str | None,
    verbose: bool,
    **sec: object,
) -> None:
    """Run a cache-only node: stores blocks, serves lookups and fetches, gossips."""
    import asyncio
    import dataclasses

    from ..mesh.peer import run_peer

    _logging(verbose)
    joined: dict[str, object] = {}
    if join or pairing_token:
        if not (join and pairing_token):
            raise click.UsageError("--join and --pairing-token go together")
        joined = _pair(join, pairing_token, alias or "")
    cfg = node_config(
        listen,
        budget,
        seed,
        alias,
        advertise,
        ("cache",),
        sec,
        gossip_interval=gossip_interval,
        ttl=ttl,
        region=region,
    )
    if joined:
        cfg.seeds = [*cfg.seeds, *map(str, joined["seeds"])]  # type: ignore[call-overload]
        if joined.get("fleet_key"):
            key = str(joined["fleet_key"]).encode("latin-1")
            cfg.security = dataclasses.replace(cfg.security, fleet_key=key)
    asyncio.run(run_peer(cfg, metrics))


def _pair(head_url: str, token: str, alias: str) -> dict[str, object]:
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
    return body


@main.command()
@model_options
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="Where the torch engine runs; auto: CUDA, else MPS, else the CPU. "
    "(mlx picks Metal or the CPU itself: auto only.)",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="auto",
    show_default=True,
    help="Weights' dtype (the KV cache follows, and so does the card's namespace); auto: "
    "float32 on the CPU, the checkpoint's dtype on a GPU. (mlx: auto only.)",
)
@click.option(
    "--block-digest",
    type=click.Choice(BLOCK_DIGESTS),
    default="blake3",
    show_default=True,
    help="How block bytes are verified (part of the card: heads with different digests "
    "share nothing). Both are 256-bit cryptographic hashes; blake3 is several times faster.",
)
@click.option("--listen", default="127.0.0.1:8000", show_default=True, help="HTTP HOST:PORT.")
@click.option(
    "--grpc-listen",
    default="127.0.0.1:0",
    show_default=True,
    help="The head's own cache service (a head is also a peer).",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="API keys, one `KEY [TENANT]` per line, that unlock protected network reads and "
    "writes; a request's key names its tenant (a key without a TENANT is its own tenant).",
)
@click.option(
    "--tenant-header",
    help="Take a request's tenant from this header (e.g. x-tenant-id), set by a trusted "
    "gateway in front of the head; only when given. It wins over the key's tenant.",
)
@click.option(
    "--shared-tenant",
    multiple=True,
    help="A tenant whose cache is deliberately the shared one (repeatable), e.g. for a "
    "public system prompt.",
)
@click.option(
    "--tenant-secret-file",
    type=click.Path(dir_okay=False),
    help="Secret (hex; made when missing) that tenant roots derive from when there is no "
    "fleet key, so tenants' caches survive a restart. Default: a fresh one per process.",
)
@click.option(
    "--tenant-budget",
    help="Most bytes one tenant's blocks may hold in the local store, in RAM and on disk "
    "each; a tenant at it evicts only its own blocks. Default: no per-tenant cap.",
)
@click.option("--no-publish", is_flag=True, help="Never publish new prefixes.")
@click.option(
    "--served-model-name",
    multiple=True,
    help="Name clients use for the model (repeatable; the first is listed by /v1/models). "
    "The --model argument as given and its directory name are accepted too.",
)
@click.option(
    "--default-max-tokens",
    "--max-tokens-default",
    "max_tokens_default",
    default=DEFAULT_MAX_TOKENS,
    show_default=True,
    type=click.IntRange(min=0),
    help="Most tokens generated for a request that sets no max_tokens (never past the "
    "context window), so leaving it out cannot hold a batch slot for a whole context. "
    "0: the rest of the context window, as OpenAI and vLLM.",
)
@click.option(
    "--audit-rate",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Fraction of remote hits whose random block is recomputed off the request path and "
    "compared with the peer's bytes; a peer that disagrees is quarantined.",
)
@click.option(
    "--api-key-scope",
    type=click.Choice(["admin", "all"]),
    default="admin",
    show_default=True,
    help="What --api-key-file protects: admin (network writes and private reads) or all "
    "(also /v1/completions, /v1/chat/completions and /v1/models, like vLLM's --api-key).",
)
@click.option(
    "--max-batch",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Sequences decoded together in one forward per step (continuous batching); "
    "more wait in the queue. 1 decodes one sequence at a time.",
)
@click.option(
    "--kv-budget",
    default="4GiB",
    show_default=True,
    help="KV cache the running sequences may hold at their longest (prompt + max_tokens, "
    "times n); a request that would exceed it waits. One request alone always runs.",
)
@click.option(
    "--max-queue",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests that may wait for the engine; one more is answered 503 with Retry-After.",
)
@click.option(
    "--max-body-bytes",
    default="4MiB",
    show_default=True,
    help="Largest HTTP request body; a larger one is answered 413.",
)
@click.option(
    "--http-tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    help="Certificate (PEM) for the HTTP listener: serve HTTPS.",
)
@click.option(
    "--http-tls-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Private key (PEM) of --http-tls-cert.",
)
@click.option(
    "--lookup-timeout", default=0.25, show_default=True, help="Seconds a lookup may take."
)
@click.option("--fetch-timeout", default=30.0, show_default=True, help="Seconds a fetch may take.")
@node_options
def head(
    model: str,
    engine: str,
    device: str,
    dtype: str,
    block_digest: str,
    listen: str,
    grpc_listen: str,
    budget: str,
    seed: tuple[str, ...],
    alias: str | None,
    advertise: tuple[str, ...],
    api_key_file: str | None,
    tenant_header: str | None,
    shared_tenant: tuple[str, ...],
    tenant_secret_file: str | None,
    tenant_budget: str | None,
    no_publish: bool,
    served_model_name: tuple[str, ...],
    max_tokens_default: int | None,
    audit_rate: float,
    api_key_scope: str,
    max_batch: int,
    kv_budget: str,
    max_queue: int,
    max_body_bytes: str,
    http_tls_cert: str | None,
    http_tls_key: str | None,
    gossip_interval: float,
    ttl: float,
    lookup_timeout: float,
    fetch_timeout: float,
    region: str,
    verbose: bool,
    **sec: object,
) -> None:
    """Serve the OpenAI-compatible API with prefill from the mesh; decode stays local."""
    from ..api.server import HeadOptions, run_head
    from ..units import parse_size

    _logging(verbose)
    if bool(http_tls_cert) != bool(http_tls_key):
        raise click.UsageError("--http-tls-cert and --http-tls-key go together")
    if api_key_scope == "all" and not api_key_file:
        raise click.UsageError("--api-key-scope all needs --api-key-file")
    try:  # a device that is not there is a clear error now, not a traceback at load
        pick_dtype(dtype, engine)
        device = pick_device(device, engine) or device
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    try:
        body_cap = parse_size(max_body_bytes)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-body-bytes") from None
    try:
        kv_cap = parse_size(kv_budget)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--kv-budget") from None
    tenant_cap = _tenant_options(api_key_file, tenant_header, shared_tenant, tenant_budget)
    if tenant_secret_file:
        from ..api.credentials import KeyFileError, head_secret

        try:
            head_secret(tenant_secret_file)  # made now when missing: a bad path fails here
        except KeyFileError as e:
            raise click.BadParameter(str(e), param_hint="--tenant-secret-file") from None
    cfg = node_config(
        grpc_listen,
        budget,
        seed,
        alias,
        advertise,
        ("head", "cache"),
        sec,
        gossip_interval=gossip_interval,
        ttl=ttl,
        region=region,
        lookup_deadline=lookup_timeout,
        fetch_deadline=fetch_timeout,
    )
    run_head(
        HeadOptions(
            model=model,
            engine=engine,
            device=device,
            dtype=dtype,
            block_digest=block_digest,
            listen=listen,
            publish=not no_publish,
            api_key_file=api_key_file,
            served_model_names=served_model_name,
            max_tokens_default=max_tokens_default or None,  # 0: no cap
            audit_rate=audit_rate,
            max_queue=max_queue,
            max_batch=max_batch,
            kv_budget_bytes=kv_cap,
            max_body_bytes=body_cap,
            api_key_scope=api_key_scope,
            http_tls_cert=http_tls_cert,
            http_tls_key=http_tls_key,
            tenant_header=tenant_header,
            shared_tenants=shared_tenant,
            tenant_secret_file=tenant_secret_file,
            tenant_budget_bytes=tenant_cap,
        ),
        cfg,
    )


def _tenant_options(
    api_key_file: str | None, header: str | None, shared: tuple[str, ...], budget: str | None
) -> int | None:
    """Check the tenant flags and the key file now (a clear error before the model
    loads); the per-tenant budget in bytes, or None."""
    from ..api.credentials import KeyFileError, check_tenant_name, read_key_file
    from ..units import parse_size

    try:
        if api_key_file:
            read_key_file(api_key_file)
    except KeyFileError as e:
        raise click.BadParameter(str(e), param_hint="--api-key-file") from None
    if header is not None and not re.fullmatch(r"[A-Za-z0-9-]{1,64}", header):
        raise click.BadParameter(
            "a header name of letters, digits and -", param_hint="--tenant-header"
        )
    for name in shared:
        try:
            check_tenant_name(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--shared-tenant") from None
    if budget is None:
        return None
    try:
        cap = parse_size(budget)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tenant-budget") from None
    if cap <= 0:
        raise click.BadParameter("must be positive", param_hint="--tenant-budget")
    return cap


@main.command()
@click.argument("address")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@client_security_options
def status(address: str, as_json: bool, **sec: str | None) -> None:
    """The fleet as the node at ADDRESS (HOST:PORT, gRPC) sees it."""
    import asyncio

    import grpc

    from ..mesh.security import FleetAuth, TLSConfig, load_fleet_key
    from ..mesh.status import describe, fetch_cards

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
    ):
        t.add_column(col)
    for r in rows:
        eps = ", ".join(f"{e['address']} ({e['interface']})" for e in r["endpoints"])
        used = f"{r['used_bytes'] / 2**20:.1f} / {r['budget_bytes'] / 2**30:.1f} GiB"
        hit = "–" if r["hit_ratio"] is None else f"{r['hit_ratio']:.0%}"
        name = r["alias"] + (" *" if r["answering"] else "")
        t.add_row(name, ",".join(r["roles"]), r["epoch"][:8], f"{r['card_age_s']:.1f} s", eps, used,
                  str(r["entries"]), hit)  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 200).print(t)
