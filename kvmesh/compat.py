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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# 2: block_digest joined the card; 3: a block's sliding-window layers carry all of
# its positions and a prefix of any length imports (the last window of them)
SCHEMA_VERSION = 3
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


@dataclass(frozen=True)
class CompatCard:
    """Everything that must match for KV to be interchangeable."""

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
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.block_digest not in BLOCK_DIGESTS:
            raise ValueError(
                f"unknown block digest {self.block_digest!r}; one of {', '.join(BLOCK_DIGESTS)}"
            )

    def canonical(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @functools.cached_property  # (a frozen card never changes; asked once per block read)
    def namespace(self) -> bytes:
        """32-byte SHA-256 of the canonical encoding."""
        return hashlib.sha256(self.canonical()).digest()

    @property
    def namespace_hex(self) -> str:
        return self.namespace.hex()

    @property
    def kv_bytes_per_token(self) -> int:
        q = kv_quant_params(self.kv_quant)
        if q is None:
            per_head = self.head_dim * dtype_size(self.kv_dtype)
        else:
            bits, group = q
            per_head = self.head_dim * bits // 8 + 2 * (self.head_dim // group) * dtype_size(
                self.kv_dtype
            )
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def summary(self) -> str:
        """One line for logs and the dashboard."""
        q = "" if self.quantization == "none" else f" {self.quantization}"
        q += "" if self.kv_quant == "none" else f" kv:{self.kv_quant}"
        return (
            f"{self.engine} {self.model_id}{q} · {self.num_layers}L×{self.num_kv_heads}kv×"
            f"{self.head_dim}d {self.kv_dtype} · w:{self.weights_digest[:8]} · "
            f"B={self.block_tokens} · ns:{self.namespace_hex[:12]}"
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompatCard:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown card fields: {sorted(unknown)}")
        data = dict(data)
        data["sliding_windows"] = tuple(data.get("sliding_windows", ()))
        return cls(**data)


_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
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
