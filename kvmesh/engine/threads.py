"""Which thread runs torch's parallel (OpenMP) work in a serving process.

libgomp gives each thread that opens a parallel region a team of its own, and
once a process holds more OpenMP threads than CPUs, an idle team member spins
~100 times (not ~3 ms) before it sleeps on a futex: each of the thousands of
small parallel regions of a forward then waits for a wake-up. A head whose main
thread had loaded and warmed the model (one team) and whose engine thread
computes (a second) is in that state on a 2-core machine.

:func:`reserve`, first thing in a serving process, makes torch single-threaded
by default and keeps the count torch chose; :func:`take`, on the thread that runs
the forwards, gives that thread the count back. Every other thread (loading,
imports, exports, requests) computes alone, without a team. Without
:func:`reserve` (a library, a test) :func:`take` changes nothing. Measured on the
fleet benchmark's model (2-core AMD EPYC): a head's cold 1,574-token turn, 44–47 ms
from request to first token with two teams, 30–32 ms with the engine's alone.
"""

from __future__ import annotations

import threading

_reserved: int | None = None  # the count torch chose, kept for the engine thread


def reserve() -> None:
    """Torch single-threaded by default from now on, its own count kept for
    :func:`take`. Call on the main thread before the model loads."""
    global _reserved
    import torch

    if _reserved is None:
        _reserved = torch.get_num_threads()
    torch.set_num_threads(1)


def take() -> int:
    """On the engine thread: its forwards run on the reserved count (nothing
    reserved: torch's as it is). Returns the count this thread computes with.
    Threads that start computing later still default to one."""
    import torch

    if _reserved is None:
        return torch.get_num_threads()
    torch.get_num_threads()  # torch's per-thread set-up first: it would undo the count below
    torch.set_num_threads(_reserved)
    # torch's setter also sets the count a thread takes at its first parallel op:
    # put that back to one from a thread of its own (this one keeps its count)
    back = threading.Thread(target=torch.set_num_threads, args=(1,), name="kvmesh-threads")
    back.start()
    back.join()
    return torch.get_num_threads()


def reserved() -> int | None:
    """The count :func:`reserve` kept (None: none)."""
    return _reserved
