"""Get a process ready to serve its first fetch as fast as a ``kvmesh head`` does.

A head's first remote hit is fast because of what it did at start, not because
of anything in the request path; every process that fetches through the mesh
(a head, a library ``HeadRuntime``, the vLLM connector's workers) gets the same
by calling, in this order:

- :func:`prepare_process`, first thing, before a model loads: every thread
  allocates from glibc's one main heap (:func:`kvmesh.memory.one_heap`), so the
  memory the warm-up faults in is the memory a fetch's threads allocate from.
  Idempotent; it marks the process as one that serves (see :func:`ready`).
- :func:`ready`, once the model (if any) is loaded and the node runs: the
  process-wide part once per process (a warm prefill; cycles collected and the
  survivors frozen, so a full collection never walks the model's objects during
  a request; a short GIL switch interval, so a request thread waits less behind
  the engine thread; the heap kept warm, :func:`kvmesh.memory.keep_heap_warm`),
  then on every call the fleet's fetch path (:meth:`~kvmesh.mesh.fleet.Fleet.warm`:
  stream thread, hashers, name lookup, :data:`WARM_TOKENS` of KV pre-faulted on
  the threads that allocate) and the engine's import and first-token paths.

A head builds and warms its engine on a passing thread (:func:`on_passing_thread`),
one that has ended before the head serves. Every thread that runs a parallel torch op keeps an
OpenMP team for life, and once libgomp manages more threads than there are CPUs
it stops spinning between parallel regions (its throttled spin count): each of
the engine thread's small ops then waits for its workers' futex wake-up. A team
built on the main thread at load did that to every forward after (measured on 2
cores: 5,900 context switches over eight 68-token forwards over 512 cached, where
the lone team has 50, and each forward 15-20% slower). A passing thread's team ends
with it, and the engine thread's is the process's only one.

The process-wide part changes the whole process (the collector, the switch
interval, glibc's thresholds), so it runs only where the process asked for it:
after :func:`prepare_process`, or with ``process=True``. A library user that
never calls either gets today's fetch-path warm-up and nothing process-wide.
Every step only pays a first-use cost early: a failure is logged, never raised
(a cold first request is still correct).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from .. import memory
from ..codec import Block, Layout, new_blob
from ..engine import Sampling
from ..engine.base import Decoder

if TYPE_CHECKING:
    from ..engine import Engine
    from ..mesh.fleet import Fleet

log = logging.getLogger("kvmesh.ready")

SWITCH_INTERVAL_S = 0.0005  # a request thread waits at most this for the GIL (default 5 ms)
WARM_TOKENS = 2048  # a fetch of this many tokens' KV finds its heap pre-faulted
MAX_WARM_BYTES = 128 << 20  # ... at most this much, in each of two threads


T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T], name: str = "kvmesh-setup") -> T:
    """``fn()`` run on a thread of its own that has ended when this returns: its
    result, or its exception raised here. Its OpenMP team (if it ran a parallel
    torch op) ends with it (see the module docstring)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # raised again on the caller's thread
            err.append(e)

    # a daemon: a Ctrl-C that ends the caller's wait ends the process, load or not
    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


class _Process:
    """What this process has done (guarded: a head and a test may race to start)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prepared = False  # prepare_process was called: the process serves
        self.ready = False  # the process-wide part of ready() ran


_PROCESS = _Process()


def prepare_process() -> bool:
    """Call first, before the model loads (torch's threads allocate then): one heap
    for every thread. Idempotent. True if glibc took the limit (False elsewhere:
    the rest of :func:`ready` still helps)."""
    with _PROCESS.lock:
        _PROCESS.prepared = True
    return memory.one_heap()


def ready(
    engine: Engine | None,
    fleet: Fleet | None,
    layout: Layout | None,
    *,
    process: bool | None = None,
    idle_trim: bool = True,
) -> float:
    """Pay a serving process's first-use costs now (see the module); the seconds it
    took. ``engine``: its warm prefill, import and first-token paths (None: a
    process without one, e.g. a vLLM worker); ``fleet``/``layout``: the fetch path
    to warm for blocks of that layout (either None: none). ``process``: do the
    process-wide part (once); None: if :func:`prepare_process` was called.
    ``idle_trim``: the warm heap is trimmed when the process is idle (off where
    nothing tells kvmesh so: see :func:`kvmesh.memory.keep_heap_warm`)."""
    t0 = time.perf_counter()
    if process is None:
        process = _PROCESS.prepared
    if process:
        _ready_process(engine, idle_trim)
    if engine is not None and engine.reuse_off is not None:  # nothing imports
        _first_token(engine, None)
        return time.perf_counter() - t0
    if layout is None and engine is not None:
        layout = engine.layout
    sample = _warm_block(layout) if layout is not None else None
    if fleet is not None and sample is not None and layout is not None:
        nbytes = min(layout.card.kv_bytes_per_token * WARM_TOKENS, MAX_WARM_BYTES)
        try:
            fleet.warm(layout, sample, nbytes, timeout=5.0)
        except Exception as e:  # only the first request's speed is at stake
            log.warning("fetch-path warm-up failed: %r", e)
    if engine is not None:
        _first_token(engine, sample)
    took = time.perf_counter() - t0
    log.info("warm-up took %.0f ms", took * 1000)
    return took


def _ready_process(engine: Engine | None, idle_trim: bool) -> None:
    """The process-wide part of :func:`ready`, once per process."""
    with _PROCESS.lock:
        if _PROCESS.ready:
            return
        _PROCESS.ready = True
    if engine is not None:
        try:  # first-call setup is not any request's cost, nor in the warm heap
            engine.prefill(engine.encode("warm up"))
        except Exception as e:
            log.warning("warm prefill failed: %r", e)
    gc.collect()
    gc.freeze()  # the model's objects never die: keep full collections off the request path
    # the engine thread takes the GIL back between torch ops thousands of times a step;
    # a request thread holding it then lets go within this, not the default 5 ms
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # after the model's allocations: the warm heap stays free for imports
    memory.keep_heap_warm(idle_trim=idle_trim)


def _first_token(engine: Engine, sample: Block | None) -> None:
    """The engine's import (of ``sample``; None: a plain prefill) and first-token paths."""
    try:
        if sample is None:
            state = engine.prefill([0])
        else:
            importer = engine.importer(sample.header.tokens)
            importer.add(sample)
            state = engine.prefill([0] * sample.header.tokens, (sample,), importer)
        Decoder(engine, state, Sampling(max_tokens=1)).next()
    except Exception as e:  # only the first request's speed is at stake
        log.warning("engine warm-up failed: %r", e)


def _warm_block(layout: Layout) -> Block:
    """A one-token tail of zeros under a key no prompt has (never stored)."""
    header = layout.header("tail", bytes(32), layout.card.namespace, 0, 1)
    blob, _ = new_blob(header)
    return layout.seal(header, blob)
