"""What ``kvmesh head`` is told beyond its mesh node, declared once.

Contract: each field of :class:`HeadOptions` is declared by its option row
(:class:`kvmesh.mesh.options.Option`: help, default, kind, checks), and
:data:`HEAD_ROWS` holds those rows by name, in the fields' order. The CLI makes
``kvmesh head``'s click options from :data:`HEAD_ROWS`, so a row is at once a
flag, a ``[head]`` key of the config file, a line of ``kvmesh config show`` and a
field, with one name, one default and one help. A field holds its value as the
head uses it: a size in bytes, a repeatable option as a tuple, and
``deterministic_grid`` 0 unless ``deterministic``. The mesh node's options
(:data:`kvmesh.mesh.options.NODE`) are not here, except ``no_publish``, which the
head reads itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..compat import BLOCK_DIGESTS
from ..engine import DEVICES, DTYPES, ENGINES
from ..engine.base import PREFILL_CHUNK
from ..engine.deterministic import DEFAULT_GRID
from ..mesh.options import HEAD, Kind, Option, Value
from ..runtime.prefill import LONE_FORWARD_S, LONE_PREFILL
from ..units import parse_size
from .tools import PARSER_CHOICES

DEFAULT_MAX_TOKENS = 1024  # a generous answer; a longer one is asked for with max_tokens
_ROW = "kvmesh.option"  # where a field keeps its row (dataclasses' field metadata)

#: The model a command loads (``head``, and ``demo`` too).
MODEL = (
    Option("model", "demo, demo-tiny, demo-vl, demo-vl-tiny or a local model directory.", "demo"),
    Option(
        "engine",
        "torch (CPU, CUDA, MPS) or mlx (Apple silicon).",
        "torch",
        "choice",
        choices=ENGINES,
    ),
)

#: Deterministic mode (``head``, and ``demo`` too).
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


def _held(row: Option, value: Value) -> Any:
    """``value`` (as :meth:`Option.parse` gives it) as a field holds it."""
    if row.multiple:
        return tuple(value) if isinstance(value, list) else ()
    if row.kind == "size" and value is not None:
        return parse_size(str(value))
    return value


def _of(row: Option) -> Any:
    """A field declared by ``row`` (a row shared with other commands or the node)."""
    return dataclasses.field(default=_held(row, row.initial), metadata={_ROW: row})


def _row(
    help: str, default: str | int | float | None = None, kind: Kind = "text", **kw: Any
) -> Any:
    """A field declared by a row of its own (the row's name is the field's)."""
    return _of(Option("", help, default, kind, **kw))


@dataclass
class HeadOptions:
    """Everything ``kvmesh head`` serves with, one field per row (see the module)."""

    model: str = _of(MODEL[0])
    engine: str = _of(MODEL[1])
    device: str = _row(
        "Where the torch engine runs; auto: CUDA, else MPS, else the CPU. "
        "(mlx picks Metal or the CPU itself: auto only.)",
        "auto",
        "choice",
        choices=DEVICES,
    )
    dtype: str = _row(
        "Weights' dtype (the KV cache follows, and so does the card's namespace); auto: "
        "float32 on the CPU, the checkpoint's dtype on a GPU. (mlx: auto only.)",
        "auto",
        "choice",
        choices=DTYPES,
    )
    block_digest: str = _row(
        "How block bytes are verified (part of the card: heads with different digests "
        "share nothing). Both are 256-bit cryptographic hashes; blake3 is several times faster.",
        "blake3",
        "choice",
        choices=BLOCK_DIGESTS,
    )
    deterministic: bool = _of(DETERMINISTIC[0])
    deterministic_grid: int = _of(DETERMINISTIC[1])
    listen: str = _row("HTTP HOST:PORT.", "127.0.0.1:8000")
    api_key_file: str | None = _row(
        "Tenant API keys, one `KEY [TENANT]` per line: a request's key names its tenant "
        "(a key without a TENANT is its own tenant). A tenant key never administers.",
        kind="file",
    )
    admin_key_file: str | None = _row(
        "Admin API keys, one per line: network writes, pairing, /v1/admin/*, addresses "
        "and per-tenant metrics. No key in two files.",
        kind="file",
    )
    gateway_key_file: str | None = _row(
        "Keys of trusted gateways, one per line: only a request carrying one may name "
        "its tenant with --tenant-header.",
        kind="file",
    )
    tenant_header: str | None = _row(
        "Take a request's tenant from this header (e.g. x-tenant-id), honoured only on a "
        "request carrying a --gateway-key-file key; from anyone else it is refused.",
    )
    forwarded_allow_ips: str | None = _row(
        "Proxies (comma-separated IPs or CIDRs, * for any) whose X-Forwarded-For and "
        "X-Forwarded-Proto name the client and scheme. Default: none, loopback included.",
    )
    exact_reuse_by_address: bool = _row(
        "Give a request without a key token-exact reuse of its own address's earlier "
        "prompts (exact tails, a session beyond whole blocks). Only where every address "
        "is one user: behind a proxy or a NAT, users would read each other's prompts.",
        kind="flag",
    )
    shared_tenant: tuple[str, ...] = _row(
        "A tenant whose cache is deliberately the shared one (repeatable), e.g. for a "
        "public system prompt.",
        multiple=True,
    )
    tenant_secret_file: str | None = _row(
        "Secret (hex; made 0600 when missing) that tenant roots derive from, so tenants' "
        "caches survive a restart; heads that share tenants' caches use the same file. "
        "Default: tenant-secret in $KVMESH_HOME (~/.cache/kvmesh).",
        kind="path",
    )
    tenant_budget: int | None = _row(
        "Most bytes one tenant's blocks may hold in the local store, in RAM and on disk "
        "each; a tenant at it evicts only its own blocks. Default: no per-tenant cap.",
        kind="size",
    )
    no_publish: bool = _of(HEAD["no_publish"])
    served_model_name: tuple[str, ...] = _row(
        "Name clients use for the model (repeatable; the first is listed by /v1/models). "
        "The --model argument as given and its directory name are accepted too.",
        multiple=True,
    )
    lora: tuple[str, ...] = _row(
        "Serve a LoRA adapter: NAME=PATH, a PEFT adapter directory (adapter_config.json, "
        "adapter_model.safetensors; repeatable). A request whose model is NAME computes with "
        "it; its KV is keyed by the adapter's weights digest, so it is shared only with "
        "requests for the same weights, on any head. torch engine, not --deterministic.",
        multiple=True,
        flags=("--lora", "--lora-modules"),
    )
    max_tokens_default: int = _row(
        "Most tokens generated for a request that sets no max_tokens (never past the "
        "context window), so leaving it out cannot hold a batch slot for a whole context. "
        "0: the rest of the context window, as OpenAI and vLLM.",
        DEFAULT_MAX_TOKENS,
        "int",
        low=0,
        flags=("--default-max-tokens", "--max-tokens-default"),
    )
    tool_call_parser: str = _row(
        "How the model writes tool calls, parsed into OpenAI's tool_calls (chat requests "
        "with tools): hermes (Qwen, Hermes), llama3_json, mistral, harmony (gpt-oss; also "
        "openai); auto picks one from the chat template where only one fits; none returns "
        "text (tool_choice auto is then refused).",
        "auto",
        "choice",
        choices=PARSER_CHOICES,
    )
    audit_rate: float = _row(
        "Fraction of remote hits whose random block is recomputed off the request path and "
        "compared with the peer's bytes; a peer that disagrees is quarantined.",
        0.0,
        "float",
        low=0.0,
        high=1.0,
    )
    api_key_scope: str = _row(
        "What needs a key: admin (only what an admin key opens: network writes, pairing, "
        "private reads) or all (also /v1/completions, /v1/chat/completions, /v1/models and "
        "/v1/cache/query, with a key of any role, like vLLM's --api-key).",
        "admin",
        "choice",
        choices=("admin", "all"),
    )
    max_batch: int = _row(
        "Sequences decoded together in one forward per step (continuous batching); "
        "more wait in the queue. 1 decodes one sequence at a time.",
        8,
        "int",
        low=1,
    )
    kv_budget: int = _row(
        "KV cache the running sequences may hold at their longest (prompt + max_tokens, "
        "times n); a request that would exceed it waits. One request alone always runs.",
        "4GiB",
        "size",
    )
    max_sessions: int = _row(
        "Finished requests whose KV the head keeps so the next chat turn resumes it "
        "(charged to --kv-budget; the oldest gives way). 0: none kept.",
        8,
        "int",
        low=0,
    )
    prefill_chunk: int = _row(
        "Most prompt tokens one request computes in one forward: a long prompt (a resumed "
        "session's too) is computed in chunks with decode steps between, so running streams "
        "wait at most one chunk. Its working memory counts in --kv-budget. A prompt alone "
        f"on the engine (nothing decoding or waiting) takes up to {LONE_PREFILL} tokens a "
        f"forward, as many as the head computes in about {LONE_FORWARD_S:g} s, where "
        "--kv-budget holds them.",
        PREFILL_CHUNK,
        "int",
        low=16,
    )
    max_queue: int = _row(
        "Requests that may wait for the engine (vLLM queues without a count; a waiting "
        "request holds a thread and its prompt); one more is answered 503 with Retry-After.",
        1024,
        "int",
        low=1,
    )
    max_queued_tokens: int = _row(
        "Prompt tokens the waiting requests may hold together; a request past it is answered "
        "503 with Retry-After (one alone is always let wait).",
        1 << 20,
        "int",
        low=1,
    )
    max_body_bytes: int = _row(
        "Largest HTTP request body; a larger one is answered 413.", "4MiB", "size"
    )
    http_tls_cert: str | None = _row(
        "Certificate (PEM) for the HTTP listener: serve HTTPS.", kind="file"
    )
    http_tls_key: str | None = _row("Private key (PEM) of --http-tls-cert.", kind="file")

    def __post_init__(self) -> None:
        if not self.deterministic:  # what the engine is given: 0 is "not deterministic"
            self.deterministic_grid = 0

    @classmethod
    def from_values(cls, values: Mapping[str, object]) -> HeadOptions:
        """The options from values by row name, as the CLI or a config file gives
        them (sizes as written; a name that is no row is not read). ValueError
        names the flag of a value its row refuses."""
        held: dict[str, Any] = {}
        for name, row in HEAD_ROWS.items():
            try:
                held[name] = _held(row, row.parse(values.get(name)))
            except ValueError as e:
                raise ValueError(f"invalid {row.flag} {values.get(name)!r}: {e}") from None
        return cls(**held)

    # the names kvmesh.api.server reads
    @property
    def publish(self) -> bool:
        return not self.no_publish

    @property
    def shared_tenants(self) -> tuple[str, ...]:
        return self.shared_tenant

    @property
    def kv_budget_bytes(self) -> int:
        return self.kv_budget

    @property
    def tenant_budget_bytes(self) -> int | None:
        return self.tenant_budget

    def lora_modules(self) -> dict[str, str]:
        """``--lora``'s adapters, name -> directory. ValueError for a value that is
        not NAME=PATH, a name given twice, or one that is the model's own name."""
        out: dict[str, str] = {}
        base = {self.model_names()[0], *self.model_names()[1]}
        for value in self.lora:
            name, sep, path = value.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path:
                raise ValueError(f"invalid --lora {value!r}: NAME=PATH")
            if name in out or name in base:
                raise ValueError(f"invalid --lora {value!r}: the name {name!r} is taken")
            out[name] = path
        return out

    def model_names(self) -> tuple[str, tuple[str, ...]]:
        """(canonical name, accepted aliases): the first ``--served-model-name``,
        else the model directory's name (vLLM lists ``--model`` as given, but a
        local path is not for public eyes); ``--model`` as given is accepted too."""
        given = self.model.rstrip("/") or self.model
        names = (*self.served_model_name, Path(given).name, given)
        return names[0], tuple(dict.fromkeys(n for n in names[1:] if n != names[0]))


def _rows() -> dict[str, Option]:
    rows: dict[str, Option] = {}
    for f in dataclasses.fields(HeadOptions):
        row: Option = f.metadata[_ROW]
        if row.name not in ("", f.name):
            raise TypeError(f"HeadOptions.{f.name} is declared by the row {row.name!r}")
        rows[f.name] = dataclasses.replace(row, name=f.name)
    return rows


#: Every row of :class:`HeadOptions`, by name, in the fields' (and --help's) order.
HEAD_ROWS = _rows()

__all__ = ["DEFAULT_MAX_TOKENS", "DETERMINISTIC", "HEAD_ROWS", "MODEL", "HeadOptions"]
