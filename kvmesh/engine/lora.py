"""LoRA adapters on the torch engine: a PEFT adapter's low-rank deltas added to
its target linear layers, per sequence, without touching the base weights.

:func:`load` reads a PEFT adapter directory once (``adapter_config.json`` and
``adapter_model.safetensors``: pickled ``.bin`` weights are refused) and checks
everything before the model is touched: a plain LoRA (no DoRA, biases, extra
trained modules or per-layer ranks), every weight named for a linear layer of
the model with the shapes that layer takes. Its digest
(:func:`~kvmesh.blocks.adapter_files_digest`) comes from the same bytes, so the
KV it is keyed by is the KV these weights compute.

:func:`attach` hangs the deltas on the layers; inside :func:`rows` each row of a
forward (dimension 0 of its activations: one sequence) takes its own adapter or
none, and a layer routed through :func:`kvmesh.engine.kernels._linear` adds
``scale * B(A(x))`` to those rows, as PEFT computes it. Outside :func:`rows`
nothing is added: a sequence without an adapter computes exactly as before.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..blocks import adapter_files_digest, read_adapter
from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

_rows = threading.local()  # .names: each row's adapter (None: none) in a forward
_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names
_WEIGHTS = "adapter_model.safetensors"
NEEDS = ("adapter_config.json", _WEIGHTS)  # the files of an adapter kvmesh loads
ATTR = "kvmesh_lora"  # a linear layer's {adapter name: (A, B, scale)}


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter: its name (what a request's ``model`` selects), its
    weights digest, and the deltas by module name."""

    name: str
    digest: bytes
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


def _config(raw: bytes, where: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{where}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    unsupported = {
        "use_dora": cfg.get("use_dora"),
        "bias": cfg.get("bias") not in (None, "none") and cfg.get("bias"),
        "modules_to_save": cfg.get("modules_to_save"),
        "rank_pattern": cfg.get("rank_pattern"),
        "alpha_pattern": cfg.get("alpha_pattern"),
        "fan_in_fan_out": cfg.get("fan_in_fan_out"),
    }
    bad = sorted(k for k, v in unsupported.items() if v)
    if bad:
        raise ConfigError(f"{where}: LoRA options kvmesh does not apply: {', '.join(bad)}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if type(r) is not int or r < 1 or type(alpha) not in (int, float):
        raise ConfigError(f"{where}: adapter_config.json needs an integer r >= 1 and lora_alpha")
    return cfg


def _scale(cfg: dict[str, Any]) -> float:
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    return float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)


def load(model: Any, name: str, path: str | Path, dtype: Any, device: Any) -> Adapter:
    """``path``'s adapter for ``model``, checked (ConfigError saying what is wrong),
    its weights in ``dtype`` on ``device`` (the model's). Nothing is attached yet."""
    import torch

    where = Path(path)
    try:
        files = read_adapter(where)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--lora {name}: {e}") from None
    if _WEIGHTS not in files:
        raise ConfigError(f"{where}: weights must be {_WEIGHTS} (pickled .bin is not loaded)")
    cfg = _config(files["adapter_config.json"], where)
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(files[_WEIGHTS])
    except Exception as e:  # a truncated or foreign file: safetensors' own error types
        raise ConfigError(f"{where}: {_WEIGHTS} does not load ({e})") from None
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise ConfigError(f"{where}: unexpected tensor {key!r} (a plain LoRA has A and B)")
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix(_PREFIX)
        a, b = tensors[key], tensors.get(key.replace(".lora_A.", ".lora_B."))
        layer = linears.get(module)
        if layer is None or b is None:
            raise ConfigError(f"{where}: {key!r} names no linear layer of the model, or lacks B")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != cfg["r"] or b.shape[1] != cfg["r"]:
            raise ConfigError(f"{where}: {module}: A and B are not of rank {cfg['r']}")
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise ConfigError(
                f"{where}: {module}: {tuple(b.shape)} x {tuple(a.shape)} does not fit a "
                f"{layer.in_features} -> {layer.out_features} layer (another base model?)"
            )
        a, b = (t.to(dtype=dtype, device=device).contiguous() for t in (a, b))
        deltas[module] = (a, b, _scale(cfg))
    if not deltas or 2 * len(deltas) != len(tensors):
        raise ConfigError(f"{where}: no LoRA layers, or a B without its A")
    return Adapter(name, adapter_files_digest(files), deltas)


def attach(model: Any, adapter: Adapter, served: dict[str, Adapter]) -> None:
    """Hang ``adapter``'s deltas on its layers (:data:`ATTR`), under its name, and
    add it to ``served`` (ConfigError for a name already there)."""
    if adapter.name in served:
        raise ConfigError(f"two adapters named {adapter.name!r}")
    served[adapter.name] = adapter
    modules = dict(model.named_modules())
    for module, delta in adapter.deltas.items():
        layer = modules[module]
        if not hasattr(layer, ATTR):
            setattr(layer, ATTR, {})
        getattr(layer, ATTR)[adapter.name] = delta


@contextlib.contextmanager
def rows(names: Sequence[str | None]) -> Iterator[None]:
    """Within it, row ``i`` of every forward takes adapter ``names[i]`` (None: none).
    All None: nothing is added (the plain forward)."""
    before = getattr(_rows, "names", None)
    _rows.names = tuple(names) if any(names) else None
    try:
        yield
    finally:
        _rows.names = before


def add_deltas(layer: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (``layer``'s output for ``x``) plus each row's adapter delta, if any:
    ``scale * B(A(x))``, as PEFT computes it."""
    held = getattr(layer, ATTR, None)  # first: most layers of most models hold none
    if not held:
        return y
    names = getattr(_rows, "names", None)
    if names is None:
        return y
    import torch  # here, not at import: the engine-neutral modules import this one

    if len(names) != x.shape[0]:
        raise RuntimeError(f"{len(names)} adapter rows for a forward of {x.shape[0]}")
    linear = torch.nn.functional.linear
    for name in dict.fromkeys(n for n in names if n in held):
        a, b, scale = held[name]
        if all(n == name for n in names):
            return y + linear(linear(x, a), b) * scale
        at = torch.tensor([i for i, n in enumerate(names) if n == name], device=x.device)
        y = y.index_add(0, at, linear(linear(x[at], a), b) * scale)
    return y
