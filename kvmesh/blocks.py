"""Cutting token ids into blocks and chaining their keys.

Block ``i`` covers tokens ``[i*B, (i+1)*B)`` and its key is
``H(key_{i-1} || "B" || tokens_i)`` with ``key_{-1} = namespace``. ``H`` is
SHA-256, or HMAC-SHA256 under the fleet key so that a key seen on the wire cannot
be matched to a prompt by anyone outside the fleet.

The *tail* of a published sequence of ``n`` tokens is the ``n mod B`` tokens after
its last full block (possibly none). Its key is ``H(parent || "T" || tokens)``;
a tail entry carries those tokens' KV plus the next-token logits of position
``n-1``, so an exact repeat needs no forward pass before its first sampled token.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

# Default block size, measured by bench/codec.py on the ~0.5B demo KV shape
# (24 KiB/token) for a 1024-token prefix: B=16 encodes at 0.46 GB/s and imports
# at 2.5 GB/s, B=32 at 0.85 and 4.3, B=64 at 1.09 and 5.8. Below 32 per-block
# overhead dominates; above it the gain is a few ms per 25 MB while the reuse lost
# at a divergence point (B/2 tokens on average) costs ~8 ms of prefill per token.
DEFAULT_BLOCK_TOKENS = 32

KEY_BYTES = 32
_BLOCK_TAG = b"B"
_TAIL_TAG = b"T"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


@dataclass(frozen=True)
class PrefixKeys:
    """The keys of one token sequence: full blocks, then its exact tail."""

    block_tokens: int
    n_tokens: int
    blocks: tuple[bytes, ...]
    tail: bytes  # key of tokens[len(blocks)*B : n] under the last full block

    @property
    def tail_tokens(self) -> int:
        return self.n_tokens - len(self.blocks) * self.block_tokens


class BlockKeyer:
    """Computes chained block keys for one namespace."""

    def __init__(self, namespace: bytes, block_tokens: int, fleet_key: bytes | None = None) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if len(namespace) != KEY_BYTES:
            raise ValueError("namespace must be 32 bytes")
        self.namespace = namespace
        self.block_tokens = block_tokens
        self._fleet_key = fleet_key

    def _h(self, parent: bytes, tag: bytes, tokens: Sequence[int]) -> bytes:
        msg = parent + tag + len(tokens).to_bytes(4, "little") + _token_bytes(tokens)
        if self._fleet_key is not None:
            return hmac.new(self._fleet_key, msg, hashlib.sha256).digest()
        return hashlib.sha256(msg).digest()

    def block_key(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        if len(tokens) != self.block_tokens:
            raise ValueError(f"a block has {self.block_tokens} tokens, got {len(tokens)}")
        return self._h(parent, _BLOCK_TAG, tokens)

    def tail_key(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        if len(tokens) >= self.block_tokens:
            raise ValueError("a tail is shorter than a block")
        return self._h(parent, _TAIL_TAG, tokens)

    def keys(self, tokens: Sequence[int]) -> PrefixKeys:
        b = self.block_tokens
        n_full = len(tokens) // b
        chain: list[bytes] = []
        parent = self.namespace
        for i in range(n_full):
            parent = self.block_key(parent, tokens[i * b : (i + 1) * b])
            chain.append(parent)
        tail = self.tail_key(parent, tokens[n_full * b :])
        return PrefixKeys(b, len(tokens), tuple(chain), tail)

    def parent_of(self, keys: PrefixKeys, index: int) -> bytes:
        """Parent key of full block ``index`` (the namespace for block 0)."""
        return self.namespace if index == 0 else keys.blocks[index - 1]
