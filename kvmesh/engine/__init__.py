"""Engine adapters: prefill, export / import KV at a prefix, decode.

The engine layer knows nothing of the network. The runtime sees an
:class:`~kvmesh.engine.protocol.Engine`; a backend is an
:class:`~kvmesh.engine.base.EngineBase` subclass named in
:mod:`kvmesh.engine.registry`, which :func:`load_engine` consults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..blocks import DEFAULT_BLOCK_TOKENS
from ..errors import ConfigError
from . import registry
from .decode import Decoded, Decoder, Sampling, TokenLogprob
from .protocol import PREFILL_CHUNK, Engine
from .state import Importer, KVState

ENGINES = registry.names()
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def pick_device(
    device: str = "auto",
    engine: str = "torch",
    *,
    cuda: Callable[[], bool] | None = None,
    mps: Callable[[], bool] | None = None,
) -> str | None:
    """The device ``engine`` runs on: ``auto`` is CUDA when available, else MPS,
    else the CPU. A device that is not there is a :class:`ConfigError` that says
    so. A backend that picks its device itself (mlx): None, and any other request
    is an error.
    ``cuda`` / ``mps`` say whether those are available (default: ask torch)."""
    kind, _, index = device.partition(":")  # torch's cuda:1 is cuda too
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise ConfigError(f"unknown device {device!r}; choose from {DEVICES}")
    why = registry.backend(engine).own_device
    if why is not None:
        if device != "auto":
            raise ConfigError(f"--device {device} does not apply to the {engine} engine: {why}")
        return None
    if cuda is None or mps is None:
        import torch

        cuda = cuda or torch.cuda.is_available
        mps = mps or torch.backends.mps.is_available
    if device == "auto":
        return "cuda" if cuda() else "mps" if mps() else "cpu"
    if kind == "cuda" and not cuda():
        raise ConfigError(f"--device {device}: CUDA is not available (no GPU, or a CPU-only torch)")
    if kind == "mps" and not mps():
        raise ConfigError("--device mps: MPS is not available (it needs Apple silicon)")
    return device


def pick_dtype(dtype: str = "auto", engine: str = "torch") -> str | None:
    """The weights' dtype to load, or None for the engine's own choice (torch:
    float32 on the CPU, the checkpoint's dtype on a GPU; mlx: the checkpoint's)."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    why = registry.backend(engine).own_dtype
    if why is not None and dtype != "auto":
        raise ConfigError(f"--dtype {dtype} is not supported by the {engine} engine: {why}")
    return None if dtype == "auto" else dtype


def load_engine(
    model: str,
    engine: str = "torch",
    *,
    block_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    deterministic_grid: int = 0,
    **kwargs: Any,
) -> Engine:
    """Load ``model`` (``demo``, ``demo-tiny`` or a local directory) on ``engine``.
    ``device`` and ``dtype`` take :data:`DEVICES` / :data:`DTYPES` (``auto``: see
    :func:`pick_device`, :func:`pick_dtype`); None is the CPU and the engine's dtype.
    ``deterministic_grid`` > 0: deterministic mode on that grid (torch only; see
    :mod:`kvmesh.engine.deterministic`). ``kwargs`` are the engine's own options
    (``block_digest``; torch ``threads``; mlx
    ``kv_bits``, ``kv_group_size``), checked by its constructor: one the engine does
    not take is a TypeError."""
    from .embedded import resolve_model

    backend = registry.backend(engine)
    if deterministic_grid:
        from .deterministic import check

        check(engine, deterministic_grid, block_tokens or DEFAULT_BLOCK_TOKENS)
        kwargs["deterministic_grid"] = deterministic_grid
    if device and (where := pick_device(device, engine)):
        kwargs["device"] = where
    if dtype and (weights := pick_dtype(dtype, engine)):
        kwargs["dtype"] = weights
    path = resolve_model(model, progress)
    engine_class = backend.engine_class()
    loaded: Engine = engine_class(path, block_tokens=block_tokens, **kwargs)
    return loaded


__all__ = [
    "DEVICES",
    "DTYPES",
    "ENGINES",
    "PREFILL_CHUNK",
    "Decoded",
    "Decoder",
    "Engine",
    "Importer",
    "KVState",
    "Sampling",
    "TokenLogprob",
    "load_engine",
    "pick_device",
    "pick_dtype",
]
