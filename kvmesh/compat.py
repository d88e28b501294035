"""Compatibility cards and the cache namespace.

A :class:`CompatCard` locks a cache namespace: KV produced under one card is only
ever imported under a byte-identical card (invariant 5). Fields are derived from
the loaded model, never typed in by an operator. The namespace is the SHA-256 of
the card's canonical JSON encoding.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .blocks import KEPT_LAST_BLOCKS

# 2: block_digest joined the card; 3: a block's sliding-window layers carry all of
# its positions and a prefix of any length imports (the last window of them);
# 4: per-layer geometry (layer_geometry) and recurrent state checkpoints (state_every)
# 5: a block's digest is a root over its header and its parts' digests (codec.block_digest),
# so a block trimmed to the parts an import needs is still verified against it
# 6: a block may carry the recurrent state off its card's grid (after a prompt's last
# whole blocks), and an import ends on any block that carries it
SCHEMA_VERSION = 6
#: ``state_every`` of a card whose blocks carry the recurrent state where its producer
#: kept one (vLLM's ``--mamba-cache-mode align``: the end of each prefill chunk), not on
#: a fixed grid: an import ends on a block that carries it (see ``state_optional``)
STATE_WHERE_SAVED = -1
# a card's engine ending so holds a vision model's picture encoder rows, not KV
# (kvmesh.engine.vision.Vision.rows_card): never announced to routers as KV
ROWS_ENGINE = "+image-encoder"
BLOCK_DIGESTS = ("blake3", "sha256")  # 256-bit cryptographic; blake3 is ~3.5x faster here

# Weight and tokenizer files whose bytes define a model for caching purposes.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".npz", ".gguf", ".pt")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


_STATE_SPEC = re.compile(r"([a-z0-9]+)\[(\d+(?:,\d+)*)\]")
_KV_SPEC = re.compile(r"kv:(\d+)x(\d+)(?::w(\d+))?")


@dataclass(frozen=True)
class LayerGeometry:
    """What one layer's cache holds, as probed from a real forward.

    ``kind``: ``kv`` (attention keys and values, ``kv_heads`` x ``head_dim`` in the
    card's ``kv_dtype``, ``window`` 0 for full attention), ``state`` (a recurrent
    layer: Gated DeltaNet, Mamba, short conv; ``state`` lists its tensors, whose
    values after a position are all a continuation needs), ``kv+state`` (both),
    ``shared`` (attends to another layer's KV: nothing of its own to ship) or
    ``none`` (no attention and no state). Encoded in the card as one short
    string per layer (:meth:`encode`), e.g. ``kv:2x32:w512``, ``shared``,
    ``state:float32[1,96,4];float32[1,2,16,16]``."""

    kind: str
    kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    state: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (dtype, shape) per tensor

    @property
    def has_kv(self) -> bool:
        return self.kind in ("kv", "kv+state")

    @property
    def state_bytes(self) -> int:
        total = 0
        for dtype, shape in self.state:
            n = dtype_size(dtype)
            for d in shape:
                n *= d
            total += n
        return total

    def encode(self) -> str:
        parts = []
        if self.has_kv:
            parts.append(
                f"kv:{self.kv_heads}x{self.head_dim}" + (f":w{self.window}" if self.window else "")
            )
        if self.state:
            specs = ";".join(f"{d}[{','.join(map(str, s))}]" for d, s in self.state)
            parts.append(f"state:{specs}")
        return "+".join(parts) or self.kind

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def decode(cls, text: str) -> LayerGeometry:
        """The inverse of :meth:`encode`; ValueError on anything else."""
        if text in ("shared", "none"):
            return cls(text)
        kv = re.fullmatch(_KV_SPEC.pattern + r"(?:\+(state:.*))?", text)
        rest = text if kv is None else kv.group(4)
        heads = dim = window = 0
        if kv is not None:
            heads, dim, window = int(kv.group(1)), int(kv.group(2)), int(kv.group(3) or 0)
            if not heads or not dim:
                raise ValueError(f"bad layer geometry {text[:80]!r}")
        state: list[tuple[str, tuple[int, ...]]] = []
        if rest is not None:
            if not rest.startswith("state:"):
                raise ValueError(f"bad layer geometry {text[:80]!r}")
            for spec in rest[len("state:") :].split(";"):
                m = _STATE_SPEC.fullmatch(spec)
                if m is None:
                    raise ValueError(f"bad state spec {spec[:40]!r}")
                dtype_size(m.group(1))
                state.append((m.group(1), tuple(int(d) for d in m.group(2).split(","))))
        kind = "kv+state" if kv is not None and state else "kv" if kv is not None else "state"
        return cls(kind, heads, dim, window, tuple(state))


@dataclass(frozen=True)
class CompatCard:
    """Everything that must match for KV to be interchangeable.

    A model whose layers all hold attention KV of one geometry is described by
    ``num_kv_heads``, ``head_dim`` and ``sliding_windows`` alone (``layer_geometry``
    empty). Any other model (per-layer head dims, KV-shared layers, recurrent
    layers) lists every layer in ``layer_geometry`` (:class:`LayerGeometry`), with
    ``num_kv_heads`` and ``head_dim`` 0. A model with recurrent layers checkpoints
    their state every ``state_every`` blocks (and at every tail): only such a
    block, or a tail, can end an imported prefix."""

    engine: str
    model_id: str
    weights_digest: str
    tokenizer_digest: str
    quantization: str
    kv_dtype: str
    rope: str  # canonical JSON of the position-encoding config
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int, ...]  # per layer; 0 = full attention
    vocab_size: int
    block_tokens: int
    kv_quant: str = "none"  # "none" or "q{bits}g{group}" (quantized KV cache)
    block_digest: str = "blake3"  # how a block's bytes are digested: blake3 | sha256
    layer_geometry: tuple[str, ...] = ()  # per layer (LayerGeometry.encode); () = uniform
    state_every: int = 0  # blocks between recurrent-state checkpoints; 0 = no state
    prefill_grid: int = 0  # deterministic mode: tokens per canonical prefill forward; 0 = off
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.block_digest not in BLOCK_DIGESTS:
            raise ValueError(
                f"unknown block digest {self.block_digest!r}; one of {', '.join(BLOCK_DIGESTS)}"
            )
        geometry = self.geometry  # parses: a bad card fails here, not at its first block
        if self.layer_geometry and len(geometry) != self.num_layers:
            raise ValueError(f"{len(geometry)} layer geometries for {self.num_layers} layers")
        if self.state_every < STATE_WHERE_SAVED:
            raise ValueError(f"bad state_every {self.state_every}")
        if any(g.state for g in geometry) != (self.state_every != 0):
            raise ValueError("state_every must be set exactly when some layer holds a state")
        if self.prefill_grid and (self.prefill_grid % self.block_tokens or self.state_every):
            raise ValueError(
                "prefill_grid must be a multiple of block_tokens, on a model without recurrent state"
            )

    @functools.cached_property
    def geometry(self) -> tuple[LayerGeometry, ...]:
        """Every layer's :class:`LayerGeometry`."""
        if self.layer_geometry:
            return tuple(LayerGeometry.decode(g) for g in self.layer_geometry)
        return tuple(
            LayerGeometry("kv", self.num_kv_heads, self.head_dim, w) for w in self.sliding_windows
        )

    @property
    def rows(self) -> bool:
        """The card of a picture's encoder rows (:data:`ROWS_ENGINE`), not of KV."""
        return isinstance(self.engine, str) and self.engine.endswith(ROWS_ENGINE)

    @property
    def uniform(self) -> bool:
        """Every layer holds attention KV of one geometry (the scalar fields say it)."""
        return not self.layer_geometry

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent-state checkpoint (every layer's state)."""
        return sum(g.state_bytes for g in self.geometry)

    @property
    def state_optional(self) -> bool:
        """Blocks carry the recurrent state where their producer kept one
        (:data:`STATE_WHERE_SAVED`); :meth:`carries_state` says where one must."""
        return self.state_every == STATE_WHERE_SAVED

    @property
    def may_carry_state(self) -> bool:
        """A block may carry the recurrent state where :meth:`carries_state` does not
        say it must: where its producer kept one (every card with recurrent layers)."""
        return self.state_every != 0

    def carries_state(self, kind: str, start: int) -> bool:
        """Whether a block of ``kind`` starting at ``start`` must carry the recurrent
        state after its last token: every tail, and every ``state_every``-th block
        (none must on a :attr:`state_optional` card)."""
        if self.state_every <= 0:
            return False
        return kind == "tail" or (start // self.block_tokens + 1) % self.state_every == 0

    def importable_blocks(self, blocks: int, states: Sequence[bool] = ()) -> int:
        """The most of a chain's first ``blocks`` whole blocks an import can end
        after: a model with recurrent state ends on a checkpoint (its grid's, or a
        block whose flag in ``states`` says it carries one); a deterministic one on
        its prefill grid."""
        every = max(self.state_every, 0) or self.prefill_grid // self.block_tokens
        if not every:
            return blocks
        carrying = [i + 1 for i, s in enumerate(states[:blocks]) if s]
        return max([blocks - blocks % every, *carrying])

    def canonical(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @functools.cached_property  # (a frozen card never changes; asked once per block read)
    def namespace(self) -> bytes:
        """32-byte SHA-256 of the canonical encoding."""
        return hashlib.sha256(self.canonical()).digest()

    @property
    def namespace_hex(self) -> str:
        return self.namespace.hex()

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes per position: every layer's K and V, plus the recurrent
        state's checkpoints spread over the positions between them."""
        q = kv_quant_params(self.kv_quant)
        size = dtype_size(self.kv_dtype)
        total = 0
        for g in self.geometry:
            if not g.has_kv:
                continue
            if q is None:
                per_head = g.head_dim * size
            else:
                bits, group = q
                per_head = g.head_dim * bits // 8 + 2 * (g.head_dim // group) * size
            total += 2 * g.kv_heads * per_head
        if self.state_every > 0:
            total += -(-self.state_bytes // (self.state_every * self.block_tokens))
        return total

    def sequence_bytes(self, tokens: int) -> int:
        """Cache bytes one sequence of ``tokens`` positions may hold: their KV and the
        grid's states (:attr:`kv_bytes_per_token`), and the states a prompt keeps
        off the grid (at its end and after its last whole blocks)."""
        off_grid = (KEPT_LAST_BLOCKS + 1) * self.state_bytes if self.state_every else 0
        return self.kv_bytes_per_token * tokens + off_grid

    def summary(self) -> str:
        """One line for logs and the dashboard."""
        q = "" if self.quantization == "none" else f" {self.quantization}"
        q += "" if self.kv_quant == "none" else f" kv:{self.kv_quant}"
        if self.uniform:
            shape = f"{self.num_layers}L×{self.num_kv_heads}kv×{self.head_dim}d"
        else:
            kinds = [g.kind for g in self.geometry]
            shape = (
                f"{self.num_layers}L ("
                + ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
                + ")"
            )
            if self.state_every:
                shape += f" state/{self.state_every}B"
        return (
            f"{self.engine} {self.model_id}{q} · {shape} {self.kv_dtype} · "
            f"w:{self.weights_digest[:8]} · B={self.block_tokens} · ns:{self.namespace_hex[:12]}"
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not self.prefill_grid:  # off: the card (and namespace) of a head without the mode
            del out["prefill_grid"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompatCard:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown card fields: {sorted(unknown)}")
        data = dict(data)
        data["sliding_windows"] = tuple(data.get("sliding_windows", ()))
        data["layer_geometry"] = tuple(data.get("layer_geometry", ()))
        return cls(**data)


_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,  # vLLM's FP8 KV pages (stored as uint8)
    "float8_e5m2": 1,
    "int32": 4,
    "uint32": 4,
    "float64": 8,
}


def kv_quant_name(bits: int, group_size: int) -> str:
    return f"q{bits}g{group_size}"


def kv_quant_params(name: str) -> tuple[int, int] | None:
    """(bits, group size) of a quantized-KV tag, or None for plain KV."""
    if name == "none":
        return None
    m = re.fullmatch(r"q(\d+)g(\d+)", name)
    if not m:
        raise ValueError(f"bad kv_quant {name!r}")
    return int(m.group(1)), int(m.group(2))


def dtype_size(name: str) -> int:
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


# -- digests ---------------------------------------------------------------

_digest_lock = threading.Lock()


def _digest_cache_path() -> Path:
    home = Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh"))
    return home / "digests.json"


def file_sha256(path: Path, bufsize: int = 8 << 20) -> str:
    """SHA-256 of one file, memoised by (path, size, mtime) so a large model is
    hashed once per change rather than once per start."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = _digest_cache_path()
    with _digest_lock:
        try:
            cache: dict[str, str] = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if ident in cache:
            return cache[ident]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    digest = h.hexdigest()
    with _digest_lock:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        cache[ident] = digest
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    return digest


def files_digest(root: Path, names: Iterable[str]) -> str:
    """Digest over (relative name, file SHA-256) pairs, order-independent."""
    h = hashlib.sha256()
    for name in sorted(set(names)):
        h.update(name.encode() + b"\0" + file_sha256(root / name).encode() + b"\n")
    return h.hexdigest()


def weights_digest(model_dir: Path) -> str:
    names = [
        str(p.relative_to(model_dir))
        for p in model_dir.rglob("*")
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
    ]
    if not names:
        raise FileNotFoundError(f"no weight files in {model_dir}")
    return files_digest(model_dir, names)


def tokenizer_digest(model_dir: Path) -> str:
    names = [n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    return files_digest(model_dir, names)


def rope_from_config(cfg: dict[str, Any]) -> str:
    """Canonical position-encoding fields of a Hugging Face style config dict."""
    keys = (
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "partial_rotary_factor",
        "rope_traditional",
        "position_embedding_type",
    )
    return canonical_json({k: cfg[k] for k in keys if cfg.get(k) is not None})
