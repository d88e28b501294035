"""Engine backends by name: what :func:`kvmesh.engine.load_engine` consults.

A :class:`Backend` names its engine class by import path, so listing backends
(the CLI's choices) imports no framework; the class is imported on first load and
called as ``cls(path, block_tokens=..., **options)``, where options are only those
the caller set (``device``, ``dtype``, ``deterministic_grid`` and the backend's own).
A backend that picks its own device or dtype, or cannot run deterministic, says
why; asking it for one is a :class:`ConfigError` with that reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class Backend:
    name: str
    target: str  # "module:Class" of the engine
    own_device: str | None = None  # why --device does not apply; None: torch devices
    own_dtype: str | None = None  # why --dtype does not apply; None: it does
    not_deterministic: str | None = None  # why --deterministic cannot hold; None: it can

    def engine_class(self) -> Any:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Make ``backend`` loadable by its name (a name registered again is replaced)."""
    _BACKENDS[backend.name] = backend


def names() -> tuple[str, ...]:
    """Registered backend names, in registration order."""
    return tuple(_BACKENDS)


def backend(name: str) -> Backend:
    """The backend called ``name``; a ValueError naming the others if none is."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; choose from {names()}") from None


def check_deterministic(name: str) -> None:
    """A :class:`ConfigError` unless backend ``name`` can run deterministic."""
    why = backend(name).not_deterministic
    if why is not None:
        able = tuple(b.name for b in _BACKENDS.values() if b.not_deterministic is None)
        raise ConfigError(f"--deterministic runs on the {' or '.join(able)} engine: {why}")


register(Backend("torch", "kvmesh.engine.hf:TransformersEngine"))
register(
    Backend(
        "mlx",
        "kvmesh.engine.mlx:MLXEngine",
        own_device="mlx runs on Metal where there is one, else on the CPU (use --device auto)",
        own_dtype="it runs the checkpoint's dtype (convert the model with mlx_lm.convert "
        "--dtype instead)",
        not_deterministic="mlx picks its kernels (and their reduction order) by shape, "
        "which kvmesh cannot hold fixed",
    )
)
