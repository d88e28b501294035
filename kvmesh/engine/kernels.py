"""Which linear kernel the model's linear layers take on the CPU, by row count.

``F.linear`` (MKL's sgemm on x86) may run far below what this CPU does: at one
row a decode step reads the weights at half the speed the compiled kernel does,
and at a prefill's tens to hundreds of rows oneDNN's linear beats it by 1.1-1.5x
(docs/benchmarks.md, serve_compare). So at start each row count 1..:data:`MAX_ROWS_FIRST`
(decode steps, lone or batched) and every larger count (:data:`MORE_ROWS`: prefill
chunks, measured at :data:`PREFILL_ROWS` rows) is given the kernel of :data:`KERNELS`
that measured faster than ``F.linear`` here by :data:`MARGIN` (on the engine's own
threads, best calls: :func:`_calibrate`) and computes what it does (:func:`_agrees`);
the choice is kept in the private kernel cache, so a restart takes the same kernels
(float rounding depends on them). Inside :func:`batched` the model's linear layers take
the chosen kernel for their row count; outside it ``F.linear``.

One kernel is all or nothing: ``packed``, oneDNN's linear on the weights in its own
blocked layout, which is then their only copy (:func:`pack_weights`: the same
memory; the plain weights and the model file's mapping are given back). It takes
every row count when it wins overall (:func:`_choose`; measured on the 0.5B demo,
2-core AMD EPYC: 1.1x oneDNN on plain weights at 576 rows, 1.4x at 64, 1.5x the
compiled kernel at 4-16 rows, even at one; on a Zen 3 EPYC, two threads: 1.3-2.8x
``F.linear`` at 1-16 rows, 1.15x at 64); packed layers compute with it everywhere. Deterministic
mode keeps the plain weights (its prefill takes ``F.linear``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from . import deterministic as det
from . import lora
from .compiled import streamed_linear

_batched = threading.local()  # .kernels: {rows: kernel} during a batched step
MAX_ROWS_FIRST = 16  # row counts up to here are decode steps, each bucket measured alone
_BUCKETS = (1, 2, 4, 8, MAX_ROWS_FIRST)
MORE_ROWS = MAX_ROWS_FIRST + 1  # in a kernel table: every row count above MAX_ROWS_FIRST
PREFILL_ROWS = 64  # the row count MORE_ROWS is measured at (a prefill chunk's scale)
MARGIN = 0.95  # another kernel replaces F.linear only if measured 5% faster
# the packed kernel may trail the fastest at some row counts if it wins overall: at one row
# it trailed oneDNN on the plain weights by 5-14% on a Zen 3 EPYC, led every kernel by
# 30-40% at 2-16 rows and 8% at 64
PACKED_TOLERANCE = 0.8
BASE = "F.linear"  # in calibration's times: what every other kernel must beat


def _rows_first_linear(model: Any) -> None:
    """Route the model's linear layers through :func:`_linear`: a batched decode
    step takes the kernel chosen for its row count (at a few rows ``F.linear`` may
    run far below its one-row speed; docs/benchmarks.md, serving), anything else
    ``F.linear``."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_linear, module)  # type: ignore[method-assign]


def _rows_first(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    # contiguous rows: a transposed view would push SDPA off its fused kernel
    y = (w @ x.T).T.contiguous()
    return y if b is None else y + b


def _onednn(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")  # type: ignore[no-any-return]


def _packed(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    # weights packed in place (pack_weights), or the copy calibration packed; else
    # the plain weights (a tied layer, a correctness check): the same numbers from
    # four rows up, within float rounding below
    p = w if w.is_mkldnn else getattr(_packing, "copies", {}).get(id(w), w)
    return torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")  # type: ignore[no-any-return]


def _pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` in oneDNN's blocked layout (the row-count hint changes neither speed
    nor numbers measurably: 16 to 4,096 rows measured alike)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PREFILL_ROWS)  # type: ignore[no-any-return]


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]] = {
    "rows_first": _rows_first,  # W @ x.T
    "onednn": _onednn,  # oneDNN's linear, the weights as they are (no packed copy)
    "streamed": streamed_linear,  # compiled C: each weight row read once for 4 rows
    "packed": _packed,  # oneDNN's linear on its own weight layout: every row count or none
}
PACKED = "packed"
_packing = threading.local()  # .copies: {id(weight): its packed copy} while measuring


@contextlib.contextmanager
def batched(kernels: Mapping[int, str]) -> Iterator[None]:
    """Within it, the linear layers routed by :func:`_rows_first_linear` take
    ``kernels`` (row count, or :data:`~.deterministic.ANY_ROWS`, -> kernel name)."""
    _batched.kernels = kernels
    try:
        yield
    finally:
        _batched.kernels = {}


def _linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's output by the chosen kernel, plus its LoRA deltas (:mod:`.lora`)."""
    return lora.add_deltas(self, x, _base_linear(self, x))


def _base_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if self.weight.is_mkldnn:  # packed in place: the plain weights are gone
        return _packed(self.weight, self.bias, x.reshape(rows, x.shape[-1])).reshape(
            *x.shape[:-1], self.out_features
        )
    kernels = getattr(_batched, "kernels", {})
    kernel = kernels.get(min(rows, MORE_ROWS), kernels.get(det.ANY_ROWS))
    if kernel is not None:
        y = KERNELS[kernel](self.weight, self.bias, x.reshape(rows, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _calibrate(model: Any, reps: int = 5) -> dict[int, str]:
    """The kernel each row count (1..MAX_ROWS_FIRST, and MORE_ROWS) takes on this
    machine where one beats ``F.linear``: for each bucket of :data:`_BUCKETS` (and
    :data:`PREFILL_ROWS` rows for :data:`MORE_ROWS`), every kernel runs every
    linear layer of the model once (the weight traffic of a decode step), interleaved,
    ``reps`` rounds. A kernel's time is the sum over the model's layers of its best
    call on a layer of that shape; it replaces ``F.linear`` where that beats
    ``F.linear``'s by :data:`MARGIN` (:func:`_choose`); one twice as slow as
    ``F.linear`` after a round is not timed again. A kernel this torch lacks, or one
    that computes something else, is not a candidate.

    Each call is timed by the wall clock on the threads the engine computes with
    (``torch.get_num_threads()``): a kernel's speed at a few rows is in how it splits
    them between threads (MKL's two-thread ``F.linear`` at two rows took 4x oneDNN's
    packed kernel on a Zen 3 EPYC; on one thread they were on a par), so one thread's
    CPU time ranks them wrongly. The best of many interleaved calls is what a kernel
    does when nothing else runs: work beside it lengthens some calls, not all."""
    import time

    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    shapes = list({tuple(m.weight.shape): m for m in layers}.values())
    with _packed_copies(layers) as packed:
        skip = () if packed else (PACKED,)
        return _calibrate_buckets(layers, shapes, reps, time.perf_counter, skip)


@contextlib.contextmanager
def _packed_copies(layers: Sequence[Any]) -> Iterator[bool]:
    """Within it the packed kernel reads a packed copy of each layer's weight (see
    :func:`_pack`) on this thread: measured and checked as it runs once packed.
    Yields False (no copies) where this torch cannot pack them, or where the copies
    would not fit in memory now with as much again to spare."""
    from .compiled import log

    need = sum(m.weight.nbytes for m in layers)
    _packing.copies = {}
    if not _room_for(2 * need):
        log.info("packed weights not measured: a copy of %d MiB would not fit", need >> 20)
    else:
        try:
            _packing.copies = {id(m.weight): _pack(m.weight) for m in layers}
        except Exception:  # no oneDNN, or not for this dtype: the kernel is no candidate
            _packing.copies = {}
    try:
        yield bool(_packing.copies)
    finally:
        _packing.copies = {}


def _room_for(nbytes: int) -> bool:
    """Whether ``nbytes`` fit in the memory available now (Linux's MemAvailable;
    where that is unknown, no)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return nbytes <= int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return False


def _calibrate_buckets(
    layers: list[Any],
    shapes: list[Any],
    reps: int,
    clock: Callable[[], float],
    skip: Sequence[str] = (),
) -> dict[int, str]:
    from .compiled import log

    totals: list[tuple[Sequence[int], dict[str, float]]] = []
    for rows, serves in _measured():
        xs = {
            m.in_features: torch.zeros((rows, 1, m.in_features), dtype=m.weight.dtype)
            for m in layers
        }
        # those that compute what F.linear does here
        alive = [k for k in KERNELS if k not in skip and _agrees(k, shapes, rows)]
        fastest: dict[tuple[str | None, Any], float] = {}  # (kernel, weight shape) -> s
        for rep in range(reps + 1):  # round 0 warms up (oneDNN builds its kernels), untimed
            for kernel in (None, *alive):
                _batched.kernels = {min(rows, MORE_ROWS): kernel} if kernel else {}
                try:
                    for m in shapes if rep == 0 else layers:
                        t0 = clock()
                        _linear(m, xs[m.in_features])
                        at = (kernel, m.weight.shape)
                        if rep:
                            fastest[at] = min(clock() - t0, fastest.get(at, float("inf")))
                except Exception:  # not built into this torch (or not for this dtype), or
                    if kernel in alive:  # it failed: not a candidate (never fails a start)
                        alive.remove(kernel)
                finally:
                    _batched.kernels = {}
            best = {
                k: sum(fastest.get((k, m.weight.shape), 0.0) for m in layers)
                for k in (None, *alive)
            }
            if rep and best[None]:  # twice F.linear's time is no near miss: not timed again
                alive = [k for k in alive if best[k] < 2 * best[None]]
        totals.append((serves, {BASE: best[None], **{k: best[k] for k in alive}}))
        log.debug("kernels at %d rows: %s", rows, best)
    return _choose(totals)


def _choose(totals: Sequence[tuple[Sequence[int], Mapping[str, float]]]) -> dict[int, str]:
    """Each bucket's kernel from the time each kernel took there (:data:`BASE`:
    ``F.linear``'s; a kernel is a candidate where it beat that by :data:`MARGIN`;
    none: ``F.linear``). The packed kernel holds the weights in a layout only it
    reads, so it serves every row count or none: all of them when it is the fastest
    at the prefill rows, a candidate at every bucket, at most :data:`PACKED_TOLERANCE`
    behind the fastest at any, and its times summed over the buckets (each weighed
    alike) beat the sum of each bucket's best other choice by :data:`MARGIN`;
    otherwise each bucket's fastest other kernel."""

    def candidates(times: Mapping[str, float]) -> dict[str, float]:
        base = times.get(BASE, float("inf"))
        return {k: t for k, t in times.items() if k != BASE and t < MARGIN * base}

    def fastest(times: Mapping[str, float], skip: str = "") -> str | None:
        return min((k for k in times if k != skip), key=lambda k: times[k], default=None)

    buckets = [
        (serves, candidates(times), times.get(BASE, float("inf"))) for serves, times in totals
    ]
    prefill = next((c for serves, c, _ in buckets if MORE_ROWS in serves), {})
    packs = bool(buckets) and fastest(prefill) == PACKED
    packs = packs and all(
        PACKED in c and c[PACKED] * PACKED_TOLERANCE <= min(c.values()) for _, c, _ in buckets
    )
    if packs:
        packed = sum(c[PACKED] for _, c, _ in buckets)
        other = sum(
            min((t for k, t in c.items() if k != PACKED), default=base) for _, c, base in buckets
        )
        packs = packed < MARGIN * other
    chosen: dict[int, str] = {}
    for serves, c, _ in buckets:
        best = PACKED if packs else fastest(c, skip=PACKED)
        if best is not None:
            chosen.update(dict.fromkeys(serves, best))
    return chosen


def packs(kernels: Mapping[int, str]) -> bool:
    """Whether ``kernels`` (a choice of :func:`_choose_kernels`) packs the weights."""
    return bool(kernels) and set(kernels.values()) == {PACKED}


def pack_weights(model: Any) -> int:
    """Every linear layer routed by :func:`_rows_first_linear` takes its weights packed
    (:func:`_pack`) in place of the plain ones, which are dropped (the same memory,
    in oneDNN's layout), except a weight another parameter shares (tied embeddings:
    its layer takes oneDNN's linear on the plain weights, the same numbers from four
    rows). From then on those layers compute with the packed kernel at every row
    count, inside :func:`batched` or not. Returns the layers packed."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        at = p.untyped_storage().data_ptr()
        owners[at] = owners.get(at, 0) + 1
    n = 0
    for m in model.modules():
        if type(m) is not torch.nn.Linear or m.weight.is_mkldnn:
            continue
        if owners[m.weight.untyped_storage().data_ptr()] == 1:
            m.weight = torch.nn.Parameter(_pack(m.weight), requires_grad=False)
            n += 1
    _copy_out(model)
    return n


def _copy_out(model: Any) -> None:
    """The tensors left plain copied to memory of their own: loaded from safetensors
    they are views of the model file's mapping, which would otherwise stay resident
    (the dropped plain weights with it) as long as one of them lives."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if not t.is_mkldnn:
                t.data = t.data.clone()


def _measured() -> list[tuple[int, Sequence[int]]]:
    """Each row count calibration measures, with the row counts its winner serves:
    a bucket of :data:`_BUCKETS` serves the counts above the one before it."""
    low, out = 1, []
    for rows in _BUCKETS:
        out.append((rows, range(low, rows + 1)))
        low = rows + 1
    return [*out, (PREFILL_ROWS, (MORE_ROWS,))]


def _agrees(kernel: str, layers: Sequence[Any], rows: int) -> bool:
    """Whether ``kernel`` computes what ``F.linear`` does for ``rows`` random rows on
    each of ``layers`` (within float rounding: the largest difference at most
    1e-3 of the largest output, 5e-2 in half precision): one that fails, raises or
    returns garbage is no candidate. The packed kernel is checked on packed copies."""
    from .compiled import log

    if kernel == PACKED and not getattr(_packing, "copies", None):
        with _packed_copies(layers) as packed:
            return packed and _agrees(kernel, layers, rows)
    gen = torch.Generator().manual_seed(rows)
    try:
        for m in layers:
            x = torch.randn((rows, m.in_features), generator=gen).to(m.weight.dtype)
            want = torch.nn.functional.linear(x, m.weight, m.bias).float()
            got = KERNELS[kernel](m.weight, m.bias, x).float()
            tol = 1e-3 if m.weight.dtype == torch.float32 else 5e-2
            if got.shape != want.shape or not bool(
                (got - want).abs().max() <= tol * (want.abs().max() + 1)
            ):
                log.warning("kernel %s disagrees with F.linear at %d rows: not used", kernel, rows)
                return False
    except Exception:  # not in this torch, not for this dtype, or broken: not a candidate
        return False
    return True


def _choose_kernels(model: Any) -> dict[int, str]:
    """The kernel each batch size takes: :func:`_calibrate`'s measurement the
    first time this model's linear shapes run on this machine (torch, CPU, compiler
    and kernel source alike), then the same choice on every later start, kept in
    the private kernel cache (``compiled.remembered``). Timing depends on the load
    at start; a batched step's numbers depend on the kernel (float rounding), so a
    restart must not change them by measuring again. A kept kernel that no longer
    runs here (or disagrees with ``F.linear``) is dropped, with a log line: its
    batch sizes take ``F.linear``."""
    from . import compiled
    from .compiled import log

    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    shapes: dict[tuple[int, int, bool, str], int] = {}
    for m in layers:
        k = (m.out_features, m.in_features, m.bias is not None, str(m.weight.dtype))
        shapes[k] = shapes.get(k, 0) + 1
    key = json.dumps(
        {
            "linear": sorted([*k, n] for k, n in shapes.items()),
            "buckets": _BUCKETS,
            "prefill_rows": PREFILL_ROWS,
            "margin": MARGIN,
            "threads": torch.get_num_threads(),  # what calibration measured on
            "kernels": sorted(KERNELS),
            "torch": torch.__version__,
            "build": compiled.fingerprint(),
        }
    )

    def valid(v: Any) -> bool:
        return isinstance(v, dict) and all(
            isinstance(r, str) and r.isdigit() and 1 <= int(r) <= MORE_ROWS and k in KERNELS
            for r, k in v.items()
        )

    kept = compiled.remembered(
        "choice", key, lambda: {str(r): k for r, k in _calibrate(model).items()}, valid
    )
    chosen = {int(r): k for r, k in kept.items()}
    one = {tuple(m.weight.shape): m for m in layers}.values()
    for kernel in sorted(set(chosen.values())):
        if not _agrees(kernel, list(one), min(r for r, k in chosen.items() if k == kernel)):
            log.warning("kept kernel choice %s does not run here now: F.linear instead", kernel)
            chosen = {r: k for r, k in chosen.items() if k != kernel}
    return chosen
