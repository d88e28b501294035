"""Shared pieces of the benchmarks: the demo-shaped card and synthetic KV blocks
made by the real export code from random cache tensors (no model needed)."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from types import SimpleNamespace

import torch

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import Block, Layout
from kvmesh.compat import CompatCard
from kvmesh.engine.base import Engine
from kvmesh.engine.hf import TransformersEngine


def demo_card(
    block_tokens: int = 32, layers: int = 24, kv_heads: int = 2, head_dim: int = 64
) -> CompatCard:
    return CompatCard(
        engine="transformers", model_id="bench", weights_digest="0" * 64,
        tokenizer_digest="0" * 64, quantization="none", kv_dtype="float32", rope="{}",
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
        sliding_windows=(0,) * layers, vocab_size=320, block_tokens=block_tokens,
    )  # fmt: skip


def fake_engine(card: CompatCard) -> TransformersEngine:
    """The real export/import code of the torch adapter, without a model."""
    eng = object.__new__(TransformersEngine)
    eng.card, eng.layout, eng.dtype, eng.device = (
        card,
        Layout(card),
        torch.float32,
        torch.device("cpu"),
    )
    eng._cache_cls = lambda config=None: SimpleNamespace(
        layers=[
            SimpleNamespace(lazy_initialization=lambda k, v: None) for _ in range(card.num_layers)
        ]
    )
    eng.model = SimpleNamespace(config=None)
    return eng


def random_state(card: CompatCard, n_tokens: int, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    shape = (1, card.num_kv_heads, n_tokens, card.head_dim)
    cache = SimpleNamespace(layers=[
        SimpleNamespace(keys=torch.randn(shape, generator=g), values=torch.randn(shape, generator=g))
        for _ in range(card.num_layers)
    ])  # fmt: skip
    return SimpleNamespace(
        tokens=[(seed * 7919 + i) % 256 for i in range(n_tokens)], cached=n_tokens, cache=cache,
        logits=torch.zeros(card.vocab_size),
    )  # fmt: skip


def synthetic_blocks(
    card: CompatCard, n_tokens: int, seed: int = 0
) -> tuple[list[Block], list[int]]:
    eng = fake_engine(card)
    state = random_state(card, n_tokens, seed)
    keyer = BlockKeyer(card.namespace, card.block_tokens)
    return Engine.export(eng, state, keyer), state.tokens  # type: ignore[arg-type]


def machine() -> dict[str, object]:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {"cpu": cpu, "cores": __import__("os").cpu_count(), "python": sys.version.split()[0],
            "torch": torch.__version__, "platform": platform.platform()}  # fmt: skip


def spawn_kvmesh(*args: str, pattern: str) -> tuple[subprocess.Popen[str], re.Match[str]]:
    """``kvmesh ARGS`` in its own process, once its first line matches ``pattern``."""
    p = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    m = re.search(pattern, p.stdout.readline())
    if not m:
        p.kill()
        raise RuntimeError(f"kvmesh {args[0]} did not start")
    return p, m


def spawn_peer(*args: str) -> tuple[subprocess.Popen[str], str]:
    """A peer on an ephemeral loopback port (4 GiB unless ``args`` set --budget)."""
    p, m = spawn_kvmesh(
        "peer", "--listen", "127.0.0.1:0", "--budget", "4GiB", *args, pattern=r"listening on (\S+)"
    )
    return p, m.group(1)
