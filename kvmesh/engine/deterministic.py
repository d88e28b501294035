"""Deterministic mode (``--deterministic``): a sequence's tokens and log-probabilities
are bitwise those of the same request computed cold and alone, whatever was
cached, imported or batched with it. The torch engine applies these rules; mlx
refuses the mode (its kernels' reduction order is not ours to fix).

- **A canonical prefill grid** of ``grid`` tokens (a multiple of the block size):
  every prefill forward covers at most one grid cell ``[kG, (k+1)G)`` and starts
  on a cell's start or where the previous forward of the same prompt ended, so a
  position is always computed by the same forward shape over the same keys. A
  cache remembers its *canonical frontier*: how far it was computed by whole grid
  cells (or imported; a decode step never moves it, a batched one included); a
  cache is only ever cut back (a hit, a session, a shared prefix) or exported
  (published) up to a grid point at or below that frontier (:func:`restorable`),
  and chunks handed to the engine end on the grid (:func:`chunk_end`). A cold prompt and a hit on it then run the same kernels on
  the same inputs from the grid point on; a cell computed in part (a prompt's
  last) or by decode steps is never reused.
- **Row-invariant decode**: every decode step's linear layers (one row or any
  number) take the compiled kernel (:data:`ANY_ROWS`), whose sum for each output runs in one fixed order
  whatever the number of rows (``compiled.streamed_linear``), and a batched step's
  attention runs each row alone over its own positions (:func:`rowwise`), as a
  lone step does. Where that cannot hold (no C compiler, half-precision weights,
  an attention other than SDPA) sequences decode one at a time.
- **The card says so**: ``prefill_grid`` and the engine string's
  ``deterministic:…`` part (torch version, the CPU's kernel family and AMX, torch's
  thread count, the decode kernel) are in the namespace, so blocks are only shared
  between heads that compute them the same way (:func:`kernel_family`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..blocks import DEFAULT_BLOCK_TOKENS
from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_GRID = 512  # tokens per canonical prefill forward: chosen by bench/deterministic.py
ANY_ROWS = 0  # in a kernel table: the kernel for every row count not listed
CANON = "kvmesh_canonical"  # on a cache: positions computed by whole grid cells (or imported)
_rows = threading.local()  # .lengths: per row of a batched decode step, its positions


def check(engine: str, grid: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
    """A :class:`ConfigError` unless ``engine`` can run deterministic on ``grid``."""
    from .registry import check_deterministic

    check_deterministic(engine)
    if grid < block_tokens or grid % block_tokens:
        raise ConfigError(
            f"--deterministic-grid {grid}: must be a positive multiple of the block size "
            f"({block_tokens} tokens)"
        )


def mark(cache: Any, n: int) -> Any:
    """``cache`` canonical up to ``n`` (an import: the producer computed it so)."""
    setattr(cache, CANON, n)
    return cache


def advance(cache: Any, start: int, sizes: Sequence[int], grid: int) -> None:
    """Record on ``cache`` the forwards of ``sizes`` tokens just run from ``start``:
    the frontier moves over each whole grid cell computed from the frontier on."""
    canon = getattr(cache, CANON, 0)
    pos = start
    for n in sizes:
        if canon == pos and pos % grid == 0 and n == grid:
            canon = pos + n
        pos += n
    setattr(cache, CANON, canon)


def restorable(cache: Any, n: int, grid: int) -> int:
    """The most positions, at most ``n``, on the grid and computed canonically."""
    return min(n // grid * grid, getattr(cache, CANON, 0))


def cropped(src: Any, out: Any, n: int) -> Any:
    """``out``, the first ``n`` positions of ``src``: canonical as far as ``src`` was."""
    return mark(out, min(n, getattr(src, CANON, 0)))


def chunk_end(cached: int, chunk: int, total: int, grid: int) -> int:
    """Where a prefill chunk of ``chunk`` tokens from ``cached`` ends on the grid: at
    the last grid point it reaches, or the next one if it reaches none (or the
    prompt's end)."""
    end = cached + chunk
    if end >= total:
        return total
    aligned = end // grid * grid
    return aligned if aligned > cached else min(total, (cached // grid + 1) * grid)


@functools.cache
def kernel_family() -> str:
    """What of this machine changes the bytes a forward computes: torch's version,
    the CPU kernel family torch dispatches to, AMX, and torch's thread count."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability().lower()
    try:
        with open("/proc/cpuinfo") as f:
            amx = "amx_tile" in f.read(1 << 20)
    except OSError:
        amx = False
    return f"torch{torch.__version__}:{isa}{'+amx' if amx else ''}:t{torch.get_num_threads()}"


@contextlib.contextmanager
def rowwise(lengths: Sequence[int]) -> Iterator[None]:
    """Within: SDPA runs each row of a batch alone over its last ``lengths[row]``
    positions (left padding dropped), as that sequence's lone step would."""
    _rows.lengths = list(lengths)
    try:
        yield
    finally:
        _rows.lengths = None


@functools.cache
def install_rowwise_sdpa() -> None:
    """Route transformers' SDPA attention through :func:`_sdpa_rows`: outside
    :func:`rowwise` it calls SDPA unchanged, with the same arguments."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = functools.partial(_sdpa_rows, sdpa_attention_forward)


def _sdpa_rows(
    sdpa: Any,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    import torch

    lengths = getattr(_rows, "lengths", None)
    if lengths is None or query.shape[0] != len(lengths) or query.shape[2] != 1:
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
    outs = [
        sdpa(
            module,
            query[row : row + 1],
            key[row : row + 1, :, key.shape[2] - n :],
            value[row : row + 1, :, value.shape[2] - n :],
            None,  # a lone step's mask: none (one query over all its positions)
            *args,
            **kwargs,
        )[0]
        for row, n in enumerate(lengths)
    ]
    return torch.cat(outs, 0), None
