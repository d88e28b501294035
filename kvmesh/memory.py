"""Keep a head's heap warm, so that importing a prefix does not pay for page faults.

A fetched prefix is received into new buffers and copied into new cache tensors:
~55 MB of fresh memory for a 1,000-token prefix of the 0.5B demo model. glibc
hands allocations that large to mmap and returns them to the kernel on free, so
every fetch takes ~20k page faults (measured in a head process: 19-20k faults,
30-60 ms of a 70-90 ms fetch). Raising glibc's mmap and trim thresholds keeps
freed memory in the heap, and touching a warm-up region at start pre-faults it.
No-op where glibc's mallopt is not available.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvmesh.memory")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def keep_heap_warm(warm_bytes: int = 128 << 20) -> bool:
    """Call once, after the model is loaded (its tensors then stay out of the warm
    region). True if it took effect."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (
        mallopt(M_ARENA_MAX, 1)  # one heap for all threads: one warm-up serves all
        and mallopt(M_MMAP_THRESHOLD, 256 << 20)
        and mallopt(M_TRIM_THRESHOLD, 1 << 30)
    )
    if not ok:
        return False
    warm = [bytearray(1 << 20) for _ in range(warm_bytes >> 20)]  # zero-filled: every page touched
    del warm
    log.debug("heap kept warm: %d MiB", warm_bytes >> 20)
    return True
