"""Keep a head's heap warm, so that importing a prefix does not pay for page faults.

A fetched prefix is received into new buffers and copied into new cache tensors:
~55 MB of fresh memory for a 1,000-token prefix of the 0.5B demo model. glibc
hands allocations that large to mmap and returns them to the kernel on free, so
every fetch takes ~20k page faults (measured in a head process: 19-20k faults,
30-60 ms of a 70-90 ms fetch). Raising glibc's mmap and trim thresholds keeps
freed memory in the heap, and touching a warm-up region at start pre-faults it.
No-op where glibc's mallopt is not available.

Both only work on one heap: glibc gives threads heaps (arenas) of their own, and
memory freed in one is never handed to a thread of another. A process sets that
up with :func:`one_heap` before its first threads allocate (before the model
loads: torch's threads do), or the fetch's threads import into cold heaps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger("kvmesh.memory")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6").mallopt  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def one_heap() -> bool:
    """Let every thread allocate from glibc's main heap. Call first thing in a
    process, before other threads allocate: glibc gives new threads heaps of
    their own (up to eight per core), and a thread keeps the heap it got; a
    limit set later only makes new threads share the heaps that exist then
    (measured: a fresh head's hashers imported 27.6 MB into 6.7k freshly faulted
    pages; with the limit set first, ~240 faults in all). True if it took effect."""
    mallopt = _mallopt()
    return bool(mallopt and mallopt(M_ARENA_MAX, 1))


def keep_heap_warm(warm_bytes: int = 128 << 20) -> bool:
    """Call once, after the model is loaded (its tensors then stay out of the warm
    region). True if it took effect."""
    mallopt = _mallopt()
    ok = (
        mallopt is not None
        and one_heap()  # idempotent: a process should have called it first (see there)
        and mallopt(M_MMAP_THRESHOLD, 256 << 20)
        and mallopt(M_TRIM_THRESHOLD, 1 << 30)
    )
    if not ok:
        return False
    warm = [bytearray(1 << 20) for _ in range(warm_bytes >> 20)]  # zero-filled: every page touched
    del warm
    log.debug("heap kept warm: %d MiB", warm_bytes >> 20)
    return True
