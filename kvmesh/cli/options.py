"""Every option of the ``kvmesh`` commands, made from declarations.

Contract: a mesh node's options are declared once, as plain data, in
:mod:`kvmesh.mesh.options` (the vLLM connector's settings come from the same
rows); the options only a command takes are declared here the same way, and
:func:`option` turns any row into a click option (type, default, help, and the
declaration's own check where click has none: a size, a positive number). Each
group below is a decorator that adds its options in order, with the same flag
names, defaults and help text wherever it is used. The flags' names are also the
config file's keys and the ``KVMESH_<ROLE>_<FLAG>`` variables'
(:mod:`kvmesh.config`), so renaming one renames those too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

from ..api.server import DEFAULT_MAX_TOKENS
from ..api.tools import PARSER_CHOICES
from ..compat import BLOCK_DIGESTS
from ..engine import DEVICES, DTYPES, ENGINES
from ..engine.base import PREFILL_CHUNK
from ..engine.deterministic import DEFAULT_GRID
from ..mesh.options import CLIENT_SECURITY, DISK, EVENTS, HEAD, MEMBERSHIP, SECURITY, Option

F = TypeVar("F", bound=Callable[..., Any])


def stack(*options: Callable[[Any], Any]) -> Callable[[F], F]:
    """One decorator applying ``options`` so they list in the given order in --help."""

    def apply(fn: F) -> F:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return apply


def _int(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def _type(opt: Option) -> click.ParamType | type | None:
    bounded = opt.low is not None or opt.high is not None
    if opt.kind == "int":
        return click.IntRange(_int(opt.low), _int(opt.high)) if bounded else int
    if opt.kind in ("float", "positive"):
        return click.FloatRange(opt.low, opt.high) if bounded else float
    if opt.kind == "choice":
        return click.Choice(opt.choices)
    if opt.kind in ("file", "path"):
        return click.Path(exists=opt.kind == "file", dir_okay=False)
    return None  # text, size: a string


def _checked(opt: Option) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """The declaration's own check, for what click's type cannot say (a size, a
    positive or finite number); the value itself is passed on as click made it."""

    def check(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value is not None:
            try:
                opt.parse(value)
            except ValueError as e:
                raise click.BadParameter(str(e)) from None
        return value

    return check


def option(opt: Option) -> Callable[[F], F]:
    """The click option of one declaration."""
    kw: dict[str, Any] = {"help": opt.help, "metavar": opt.metavar}
    if opt.kind == "flag":
        kw["is_flag"] = True
    elif opt.multiple:
        kw["multiple"] = True
    else:
        kw.update(default=opt.default, type=_type(opt))
        # what click prints as "[default: ...]": a real value, not an empty one
        kw["show_default"] = opt.default not in (None, "")
    if opt.kind in ("size", "positive", "float"):  # click lets "lots", 0 and nan through
        kw["callback"] = _checked(opt)
    return click.option(*(opt.flags or (opt.flag,)), opt.name, **kw)


def options(rows: Iterable[Option]) -> Callable[[F], F]:
    """One decorator adding the options of ``rows``, in order."""
    return stack(*(option(o) for o in rows))


#: What a client of the mesh (``kvmesh status``) needs to reach a secured node.
client_security_options = options(CLIENT_SECURITY.values())
#: Transport security and the node's own limits, for ``peer`` and ``head``.
security_options = options(SECURITY.values())
#: ``--kv-events ENDPOINT``, ``--kv-events-replay ENDPOINT``, ``--kv-events-topic``.
events_options = options(EVENTS.values())
#: What makes a process a mesh node: its store, its neighbours, its name.
membership_options = options(MEMBERSHIP.values())
#: ``--disk DIR``, ``--disk-budget SIZE``, ``--disk-admit evicted|hit``.
disk_options = options(DISK.values())

VERBOSE = Option("verbose", "Log at DEBUG level.", kind="flag", flags=("-v", "--verbose"))

#: Every option of a mesh node, ``peer`` and ``head`` alike.
node_options = stack(
    membership_options, option(VERBOSE), security_options, disk_options, events_options
)

MODEL = (
    Option("model", "demo, demo-tiny or a local model directory.", "demo"),
    Option(
        "engine",
        "torch (CPU, CUDA, MPS) or mlx (Apple silicon).",
        "torch",
        "choice",
        choices=ENGINES,
    ),
)
#: The model a command loads, for ``demo`` and ``head``.
model_options = options(MODEL)

#: ``kvmesh peer``'s own options (before :data:`node_options`).
PEER = (
    Option("listen", "gRPC HOST:PORT (port 0 = any).", "127.0.0.1:7070"),
    Option("metrics", "Serve Prometheus metrics on HOST:PORT."),
    Option("join", "Join the fleet of this head (with --pairing-token).", metavar="HEAD_URL"),
    Option("pairing_token", "Single-use token from POST /v1/network/nodes/register."),
)
peer_options = stack(options(PEER), node_options)

#: Deterministic mode, for ``head`` and ``demo``.
DETERMINISTIC = (
    Option(
        "deterministic",
        "Every answer (tokens and logprobs) bitwise the one a cold run of the request alone "
        "gives, whatever was cached, imported or batched: prefill on a fixed token grid "
        "(hits rounded down to it), row-invariant decode, and a card of its own (blocks "
        "shared only with heads that compute the same way). torch engine, on the CPU.",
        kind="flag",
    ),
    Option(
        "deterministic_grid",
        "Tokens per prefill forward with --deterministic (a multiple of the block size): "
        "a hit is rounded down to a multiple of it.",
        DEFAULT_GRID,
        "int",
        low=16,
    ),
)
deterministic_options = options(DETERMINISTIC)

#: ``kvmesh head``'s options (before :data:`node_options`), in --help's order.
HEAD_ONLY = (
    *MODEL,
    Option(
        "device",
        "Where the torch engine runs; auto: CUDA, else MPS, else the CPU. "
        "(mlx picks Metal or the CPU itself: auto only.)",
        "auto",
        "choice",
        choices=DEVICES,
    ),
    Option(
        "dtype",
        "Weights' dtype (the KV cache follows, and so does the card's namespace); auto: "
        "float32 on the CPU, the checkpoint's dtype on a GPU. (mlx: auto only.)",
        "auto",
        "choice",
        choices=DTYPES,
    ),
    Option(
        "block_digest",
        "How block bytes are verified (part of the card: heads with different digests "
        "share nothing). Both are 256-bit cryptographic hashes; blake3 is several times faster.",
        "blake3",
        "choice",
        choices=BLOCK_DIGESTS,
    ),
    *DETERMINISTIC,
    Option("listen", "HTTP HOST:PORT.", "127.0.0.1:8000"),
    HEAD["grpc_listen"],
    Option(
        "api_key_file",
        "Tenant API keys, one `KEY [TENANT]` per line: a request's key names its tenant "
        "(a key without a TENANT is its own tenant). A tenant key never administers.",
        kind="file",
    ),
    Option(
        "admin_key_file",
        "Admin API keys, one per line: network writes, pairing, /v1/admin/*, addresses "
        "and per-tenant metrics. No key in two files.",
        kind="file",
    ),
    Option(
        "gateway_key_file",
        "Keys of trusted gateways, one per line: only a request carrying one may name "
        "its tenant with --tenant-header.",
        kind="file",
    ),
    Option(
        "tenant_header",
        "Take a request's tenant from this header (e.g. x-tenant-id), honoured only on a "
        "request carrying a --gateway-key-file key; from anyone else it is refused.",
    ),
    Option(
        "forwarded_allow_ips",
        "Proxies (comma-separated IPs or CIDRs, * for any) whose X-Forwarded-For and "
        "X-Forwarded-Proto name the client and scheme. Default: none, loopback included.",
    ),
    Option(
        "exact_reuse_by_address",
        "Give a request without a key token-exact reuse of its own address's earlier "
        "prompts (exact tails, a session beyond whole blocks). Only where every address "
        "is one user: behind a proxy or a NAT, users would read each other's prompts.",
        kind="flag",
    ),
    Option(
        "shared_tenant",
        "A tenant whose cache is deliberately the shared one (repeatable), e.g. for a "
        "public system prompt.",
        multiple=True,
    ),
    Option(
        "tenant_secret_file",
        "Secret (hex; made 0600 when missing) that tenant roots derive from, so tenants' "
        "caches survive a restart; heads that share tenants' caches use the same file. "
        "Default: tenant-secret in $KVMESH_HOME (~/.cache/kvmesh).",
        kind="path",
    ),
    Option(
        "tenant_budget",
        "Most bytes one tenant's blocks may hold in the local store, in RAM and on disk "
        "each; a tenant at it evicts only its own blocks. Default: no per-tenant cap.",
        kind="size",
    ),
    HEAD["no_publish"],
    Option(
        "served_model_name",
        "Name clients use for the model (repeatable; the first is listed by /v1/models). "
        "The --model argument as given and its directory name are accepted too.",
        multiple=True,
    ),
    Option(
        "max_tokens_default",
        "Most tokens generated for a request that sets no max_tokens (never past the "
        "context window), so leaving it out cannot hold a batch slot for a whole context. "
        "0: the rest of the context window, as OpenAI and vLLM.",
        DEFAULT_MAX_TOKENS,
        "int",
        low=0,
        flags=("--default-max-tokens", "--max-tokens-default"),
    ),
    Option(
        "tool_call_parser",
        "How the model writes tool calls, parsed into OpenAI's tool_calls (chat requests "
        "with tools): hermes (Qwen, Hermes), llama3_json, mistral, harmony (gpt-oss; also "
        "openai); auto picks one from the chat template where only one fits; none returns "
        "text (tool_choice auto is then refused).",
        "auto",
        "choice",
        choices=PARSER_CHOICES,
    ),
    Option(
        "audit_rate",
        "Fraction of remote hits whose random block is recomputed off the request path and "
        "compared with the peer's bytes; a peer that disagrees is quarantined.",
        0.0,
        "float",
        low=0.0,
        high=1.0,
    ),
    Option(
        "api_key_scope",
        "What needs a key: admin (only what an admin key opens: network writes, pairing, "
        "private reads) or all (also /v1/completions, /v1/chat/completions, /v1/models and "
        "/v1/cache/query, with a key of any role, like vLLM's --api-key).",
        "admin",
        "choice",
        choices=("admin", "all"),
    ),
    Option(
        "max_batch",
        "Sequences decoded together in one forward per step (continuous batching); "
        "more wait in the queue. 1 decodes one sequence at a time.",
        8,
        "int",
        low=1,
    ),
    Option(
        "kv_budget",
        "KV cache the running sequences may hold at their longest (prompt + max_tokens, "
        "times n); a request that would exceed it waits. One request alone always runs.",
        "4GiB",
        "size",
    ),
    Option(
        "max_sessions",
        "Finished requests whose KV the head keeps so the next chat turn resumes it "
        "(charged to --kv-budget; the oldest gives way). 0: none kept.",
        8,
        "int",
        low=0,
    ),
    Option(
        "prefill_chunk",
        "Most prompt tokens one request computes in one forward: a long prompt (a resumed "
        "session's too) is computed in chunks with decode steps between, so running streams "
        "wait at most one chunk. Its working memory counts in --kv-budget.",
        PREFILL_CHUNK,
        "int",
        low=16,
    ),
    Option(
        "max_queue",
        "Requests that may wait for the engine; one more is answered 503 with Retry-After.",
        64,
        "int",
        low=1,
    ),
    Option(
        "max_body_bytes", "Largest HTTP request body; a larger one is answered 413.", "4MiB", "size"
    ),
    Option("http_tls_cert", "Certificate (PEM) for the HTTP listener: serve HTTPS.", kind="file"),
    Option("http_tls_key", "Private key (PEM) of --http-tls-cert.", kind="file"),
    HEAD["lookup_timeout"],
    HEAD["fetch_timeout"],
)
head_options = stack(options(HEAD_ONLY), node_options)

__all__ = [
    "HEAD_ONLY",
    "MODEL",
    "PEER",
    "client_security_options",
    "deterministic_options",
    "disk_options",
    "events_options",
    "head_options",
    "membership_options",
    "model_options",
    "node_options",
    "option",
    "options",
    "peer_options",
    "security_options",
    "stack",
]
