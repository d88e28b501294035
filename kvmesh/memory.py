"""Keep a head's heap warm while it works, and give it back when it is idle.

A fetched prefix is received into fresh buffers and copied into fresh cache
tensors; glibc hands allocations that large to mmap and returns them to the
kernel on free, so every fetch would fault its pages in anew. Raising glibc's mmap
and trim thresholds keeps freed memory in the heap, and touching a warm-up region
at start pre-faults it. No-op where glibc's mallopt is not available.

Both work on one heap only: glibc gives threads heaps (arenas) of their own, and
memory freed in one is never handed to a thread of another. A process calls
:func:`one_heap` before its first threads allocate (before the model loads:
torch's threads do).

A warm heap is given back when its process goes idle: the engine loop and the
publisher call :func:`after_request` (``idle=False`` while they work,
``idle=True`` when they have nothing left); after :data:`IDLE_S` with both quiet
a thread collects reference cycles and, when more than :data:`MIN_RELEASE` of
free heap lies beyond the warm pad, trims (:func:`trim_heap`: ``malloc_trim``, then
the pad faulted in again). Idle RSS then comes back to what the process held when
it was ready plus what it keeps (store, sessions).

:func:`report` is what ``/healthz`` and the dashboard show: RSS against the model
and the budgets the operator set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvmesh.memory")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

IDLE_S = 1.0  # quiet this long after the last request before the heap is trimmed
MIN_RELEASE = 32 << 20  # free heap beyond the warm pad worth a trim
_PIECE = 1 << 20  # the warm pad is touched again after a trim in pieces this large


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes the main heap spans (brk)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in mmapped chunks
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use
            "fordblks",  # bytes free in the heap
            "keepcost",  # bytes free at its top
        )
    ]


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def _fn(name: str, restype: Any, *argtypes: Any) -> Any:
    fn = getattr(_LIBC, name, None)
    if fn is not None:
        fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_MALLOPT: Callable[[int, int], int] | None = _fn(
    "mallopt", ctypes.c_int, ctypes.c_int, ctypes.c_int
)
_MALLOC_TRIM = _fn("malloc_trim", ctypes.c_int, ctypes.c_size_t)
_MALLINFO2 = _fn("mallinfo2", _Mallinfo2)


def _mallopt() -> Callable[[int, int], int] | None:
    return _MALLOPT


def one_heap() -> bool:
    """Let every thread allocate from glibc's main heap. Call first thing in a
    process, before other threads allocate: glibc gives new threads heaps of
    their own (up to eight per core), and a thread keeps the heap it got; a
    limit set later only makes new threads share the heaps that exist then
    (measured: a fresh head's hashers imported 27.6 MB into 6.7k freshly faulted
    pages; with the limit set first, ~240 faults in all). True if it took effect."""
    mallopt = _mallopt()
    return bool(mallopt and mallopt(M_ARENA_MAX, 1))


class _State:
    """What :func:`keep_heap_warm` set up, and the trims since (for :func:`report`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.warm_bytes = 0  # the pad kept faulted in (0: the heap is not kept warm)
        self.idle_trim = True  # trimmed when idle (off: nobody can tell when it is idle)
        self.ready_rss = 0  # RSS once the heap was warm: the process before any request
        self.idle = 0  # idle passes (cycles collected, trimmed if worth it)
        self.trims = 0
        self.released = 0  # RSS given back by trims, in all
        self.last_trim = 0.0  # time.time() of the last trim
        self.trimmed_rss = 0  # RSS right after the last trim


_STATE = _State()


def keep_heap_warm(warm_bytes: int = 128 << 20, idle_trim: bool = True) -> bool:
    """Call once, after the model is loaded (its tensors then stay out of the warm
    region). ``warm_bytes`` is also the pad an idle trim keeps (see the module).
    ``idle_trim=False``: never trim (:func:`after_request` does nothing), for a
    process whose callers cannot tell when it is idle (a vLLM worker: its engine
    runs outside kvmesh, and a trim holds the heap's lock for its allocations).
    True if it took effect."""
    mallopt = _mallopt()
    ok = (
        mallopt is not None
        and one_heap()  # idempotent: a process should have called it first (see there)
        and mallopt(M_MMAP_THRESHOLD, 256 << 20)
        and mallopt(M_TRIM_THRESHOLD, 1 << 30)
    )
    if not ok:
        return False
    warm = [bytearray(_PIECE) for _ in range(warm_bytes // _PIECE)]  # zero-filled: pages touched
    del warm
    with _STATE.lock:
        _STATE.warm_bytes = warm_bytes
        _STATE.idle_trim = idle_trim
        _STATE.ready_rss = rss_bytes()
    log.debug("heap kept warm: %d MiB", warm_bytes >> 20)
    return True


# -- how much, and giving it back ---------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (0 where /proc has none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def heap() -> dict[str, int] | None:
    """The malloc heap: ``size`` (what it spans), ``in_use``, ``free`` (``top_free``
    of it at its end) and ``mmapped`` (large chunks outside it); None without
    glibc's ``mallinfo2``."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return {
        "size": m.arena,
        "in_use": m.uordblks,
        "free": m.fordblks,
        "top_free": m.keepcost,
        "mmapped": m.hblkhd,
    }


def trim_heap(keep_bytes: int | None = None) -> int:
    """Give free heap back to the kernel (``malloc_trim``: every free page, wherever
    it lies in the heap), then fault ``keep_bytes`` (by default the warm pad) back
    in, as :func:`keep_heap_warm` did at start; returns the RSS given back (bytes).
    Holds the heap's lock while it releases (measured: 0.4-0.7 s for 2 GiB; other
    threads' allocations wait), so it is for an idle process."""
    if _MALLOC_TRIM is None:
        return 0
    keep = _STATE.warm_bytes if keep_bytes is None else keep_bytes
    before = rss_bytes()
    _MALLOC_TRIM(0)
    warm = [bytearray(_PIECE) for _ in range(keep // _PIECE)]  # zero-filled: every page touched
    del warm
    after = rss_bytes()
    released = max(0, before - after)
    with _STATE.lock:
        _STATE.trims += 1
        _STATE.released += released
        _STATE.last_trim = time.time()
        _STATE.trimmed_rss = after
    log.debug("heap trimmed: %d MiB given back", released >> 20)
    return released


def excess() -> int:
    """About what a trim would give back now (0 if unknown): the free heap beyond
    the warm pad, but no more than RSS grew since the last trim (free heap a trim
    released stays free heap, no longer resident)."""
    info = heap()
    if info is None:
        return 0
    free = max(0, info["free"] - _STATE.warm_bytes)
    if not _STATE.trimmed_rss:
        return free
    return min(free, max(0, rss_bytes() - _STATE.trimmed_rss))


class IdleTrim:
    """Trims the heap (:func:`trim_heap`) once every source of work (the engine loop,
    the publisher) has been idle ``idle_s``, when more than ``min_release`` bytes
    of free heap lie beyond the warm pad. Told of activity by :meth:`after_request`;
    the trim runs on its own thread."""

    def __init__(self, idle_s: float = IDLE_S, min_release: int = MIN_RELEASE) -> None:
        self.idle_s = idle_s
        self.min_release = min_release
        self._cv = threading.Condition()
        self._busy: set[str] = set()
        self._due: float | None = None
        self._thread: threading.Thread | None = None

    def after_request(self, idle: bool, source: str = "engine") -> None:
        """``idle``: ``source`` has nothing left to run (a trim is due after
        ``idle_s`` once no source works); else it is working (none is due)."""
        with self._cv:
            if not idle:
                self._busy.add(source)
                self._due = None
                return
            self._busy.discard(source)
            if self._busy:
                return
            self._due = time.monotonic() + self.idle_s
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvmesh-heap-trim", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._due is None or time.monotonic() < self._due:
                    wait = None if self._due is None else self._due - time.monotonic()
                    self._cv.wait(wait)
                self._due = None
            gc.collect()  # cycles a request left (its plan and state): their tensors too
            with self._cv:
                if self._busy or self._due is not None:  # work came back meanwhile
                    continue
            if excess() > self.min_release:
                trim_heap()
            with _STATE.lock:
                _STATE.idle += 1


_IDLE = IdleTrim()


def after_request(idle: bool = True, source: str = "engine") -> None:
    """``source`` (the engine loop; the publisher says ``"publish"``) finished its
    work (``idle``: it has nothing else to run) or started working again
    (``idle=False``). A process whose heap is kept warm (:func:`keep_heap_warm`)
    trims it after :data:`IDLE_S` with every source quiet; cheap enough to call
    on every request and every step (one lock, no system call)."""
    if _STATE.warm_bytes and _STATE.idle_trim:
        _IDLE.after_request(idle, source)


def model_bytes(model: Any) -> int:
    """Bytes of a loaded model's weights: a torch module's parameters and buffers
    (storage shared between them counted once), or an MLX module's parameters;
    0 for None (an engine without a model object)."""
    if model is None:
        return 0
    if hasattr(model, "buffers") and hasattr(model, "parameters"):  # torch.nn.Module
        storages: dict[int, int] = {}
        for t in (*model.parameters(), *model.buffers()):
            if t.is_mkldnn:  # oneDNN's own layout (packed weights): no storage to share
                storages[id(t)] = t.nbytes
                continue
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())
    total, todo = 0, [model.parameters()]  # MLX: nested dicts and lists of arrays
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        else:
            total += int(item.nbytes)
    return total


def report(
    budget_bytes: int | None, kv_budget_bytes: int | None, model_bytes: int
) -> dict[str, Any]:
    """Memory as an operator sizes it, for ``/healthz`` and the dashboard.

    ``ratio``: RSS now over ``bound_bytes``, the model + ``--budget`` (the block
    store's RAM tier) + ``--kv-budget`` (the KV running sequences and sessions
    hold; an unset budget counts 0). ``ready_bytes``: RSS when the process was
    ready (model loaded, heap warm, before any request), so ``ready_ratio``, RSS
    over ``ready_bytes`` + the budgets, also counts what the runtime itself holds
    (interpreter, libraries, the warm pad: ~550 MiB for ``demo-tiny`` on torch).
    Then the heap (:func:`heap`), its warm pad, the idle passes (after each
    quiet period: cycles collected, and the heap trimmed when worth it), the
    trims so far and ``excess_bytes``, about what a trim would give back now
    (:func:`excess`; after an idle pass, no more than :data:`MIN_RELEASE`)."""
    rss = rss_bytes()
    budgets = (budget_bytes or 0) + (kv_budget_bytes or 0)
    bound = model_bytes + budgets
    with _STATE.lock:
        ready = _STATE.ready_rss
        state = {
            "warm_bytes": _STATE.warm_bytes,
            "idle_passes": _STATE.idle,
            "trims": _STATE.trims,
            "released_bytes": _STATE.released,
            "last_trim": _STATE.last_trim or None,
        }
    return {
        "rss_bytes": rss,
        "model_bytes": model_bytes,
        "budget_bytes": budget_bytes,
        "kv_budget_bytes": kv_budget_bytes,
        "bound_bytes": bound,
        "ratio": round(rss / bound, 3) if bound else None,
        "ready_bytes": ready,
        "ready_ratio": round(rss / (ready + budgets), 3) if ready else None,
        **state,
        "excess_bytes": excess(),
        "heap": heap(),
    }
