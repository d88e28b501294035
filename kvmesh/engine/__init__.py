"""Engine adapters: prefill, export / import KV at a prefix, decode.

The engine layer knows nothing of the network. A new engine is one new module
implementing :class:`~kvmesh.engine.base.Engine`; :func:`load_engine` picks one.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Engine, KVState, Sampling

ENGINES = ("torch", "mlx")


def load_engine(
    model: str,
    engine: str = "torch",
    *,
    block_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
    **kwargs: object,
) -> Engine:
    """Load ``model`` (``demo``, ``demo-tiny`` or a local directory) on ``engine``."""
    from .demo import resolve_model

    path = resolve_model(model, progress)
    if engine == "torch":
        from .hf import TransformersEngine

        return TransformersEngine(path, block_tokens=block_tokens, **kwargs)  # type: ignore[arg-type]
    if engine == "mlx":
        from .mlx import MLXEngine

        return MLXEngine(path, block_tokens=block_tokens, **kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")


__all__ = ["ENGINES", "Engine", "KVState", "Sampling", "load_engine"]
