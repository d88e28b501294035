"""Which thread runs torch's parallel work in a serving process, and on how many cores.

libgomp gives each thread that opens a parallel region a team of its own, and once
a process holds more OpenMP threads than CPUs an idle team member spins ~100 times
(not ~3 ms) before it sleeps on a futex, so every parallel region of a forward
waits to wake its workers. A head whose main thread loaded the model (one team)
and whose engine thread computes (a second), among other threads that compute, is
in that state: measured on the fleet benchmark's model (2-core AMD EPYC), 537 new
tokens over 4,285 took a head's engine thread 35-37 ms, one thread alone 33 ms,
two threads of a process's only team 23 ms.

- :func:`reserve`, first thing in a serving process (before torch is imported),
  makes torch single-threaded by default and keeps the count torch chose: every
  thread but the engine's computes alone, without a team. Idle team members spin
  :data:`SPIN` times (``GOMP_SPINCOUNT``, unless set) before they sleep: enough to
  span the gaps between a forward's parallel regions, short enough that two heads
  that both took two threads at the same moment yield to each other at once.
- :class:`EngineThreads` runs on the engine thread: :meth:`~EngineThreads.fit`
  before each forward gives that thread, and only it, as many threads as the cores
  others leave idle (the count reserved at most, one at least), measured from
  ``/proc/stat`` against this process's own CPU time over the last
  :data:`WINDOW_S` (after an idle spell, from the tasks runnable now). An
  unthrottled team spins between parallel regions: on a core another process
  wants, that spinning and the waits at each region's barrier cost more than the
  second core gives, so a loaded machine gets one thread.

Without :func:`reserve` (a library, a test process) nothing changes: ``fit`` keeps
torch's own count. The counts are set per thread (libgomp's ``omp_set_num_threads``
and MKL's ``mkl_set_num_threads_local``), never through ``torch.set_num_threads``,
which would also change what every thread takes at its first parallel op.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

WINDOW_S = 0.1  # the load others put on the cores is re-measured at most this often
STALE_S = 1.0  # a window longer than this spans an idle spell
SPIN = "10000"  # libgomp's spins (~0.1 ms) before an idle team member sleeps (default ~3 ms)
BUSY_CORE = 0.5  # another process using this much of a core (on average) takes it

_reserved: int | None = None  # the count torch chose, kept for the engine thread
_lock = threading.Lock()


def reserve() -> int:
    """Torch single-threaded by default from now on, its own count kept for the
    engine thread (:class:`EngineThreads`). Call on the main thread before the
    model loads. Returns the count kept."""
    global _reserved
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN)  # read once, as torch loads libgomp
    import torch

    with _lock:
        if _reserved is None:
            _reserved = torch.get_num_threads()
        torch.set_num_threads(1)
        return _reserved


def reserved() -> int | None:
    """The count :func:`reserve` kept (None: none)."""
    return _reserved


def threads_for(free: float, most: int) -> int:
    """The threads a forward takes with ``free`` cores left idle by others: one per
    free core (a core others use less than :data:`BUSY_CORE` of counts as free),
    at least one, at most ``most``."""
    return max(1, min(most, int(free + BUSY_CORE)))


class _Counts:
    """Per-thread setters of OpenMP's and MKL's thread counts (None: unavailable)."""

    def __init__(self) -> None:
        import torch

        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        gomp = _loaded("libgomp", os.path.dirname(lib)) or os.path.join(lib, "libgomp.so.1")
        self.omp = _symbol(gomp, "omp_set_num_threads", ctypes.c_int)
        # MKL's per-thread setter, as torch links it, takes its count by reference
        self.mkl = _symbol(lib + "/libtorch_cpu.so", "mkl_set_num_threads_local", _INT_P)

    def set(self, n: int) -> bool:
        if self.omp is None:
            return False
        self.omp(n)
        if self.mkl is not None:
            self.mkl(ctypes.byref(ctypes.c_int(n)))
        return True


def _loaded(name: str, torch_dir: str) -> str | None:
    """The path of the shared library ``name`` this process loaded from torch's own
    directories (``torch/lib``, or a wheel's ``torch.libs``: a tokenizer's vendored
    libgomp is another runtime, whose counts torch never reads), or None."""
    homes = (torch_dir + os.sep, torch_dir + ".libs" + os.sep)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                base = os.path.basename(path)  # libgomp.so.1, or a wheel's libgomp-<hash>.so.1
                named = base.startswith((name + ".", name + "-")) and ".so" in base
                if named and path.startswith(homes):
                    return path
    except OSError:
        pass
    return None


_INT_P = ctypes.POINTER(ctypes.c_int)


def _symbol(path: str, name: str, arg: Any) -> Any:
    """The function ``name`` of the already loaded library ``path``, taking one
    ``arg`` (None: not loaded, or no such function)."""
    try:
        fn = getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [arg], None
    return fn


class _Load:
    """The cores other processes keep busy on this process's CPUs: over the last
    window, ``/proc/stat``'s busy time of those CPUs less this process's own; after
    an idle spell, the tasks runnable now (``/proc/loadavg``) less this process's."""

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0))
        self.others = 0.0
        self._at = 0.0
        self._busy = 0.0
        self._ours = 0.0

    def sample(self, now: float, team: int = 1) -> float:
        """Others' load: the last window's, re-measured once :data:`WINDOW_S` passed;
        after an idle spell (a window longer than :data:`STALE_S`, or none yet), the
        tasks runnable now beside the caller's ``team`` threads instead."""
        if now - self._at < WINDOW_S:
            return self.others
        stale = now - self._at > STALE_S
        busy, ours = self._busy_s(), _own_cpu_s()
        if self._at and busy >= 0:
            spent = (busy - self._busy) - (ours - self._ours)
            self.others = max(0.0, spent / (now - self._at))
        self._at, self._busy, self._ours = now, busy, ours
        if stale:  # an average over the idle spell says nothing of now
            self.others = max(0.0, _runnable() - max(team, _own_runnable()))
        return self.others

    def _busy_s(self) -> float:
        """Seconds the CPUs this process may use have been busy (-1: unknown)."""
        want = {f"cpu{i}" for i in self.cpus}
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        try:
            with open("/proc/stat") as f:
                for line in f:
                    name, *fields = line.split()
                    if name in want:
                        idle = int(fields[3]) + int(fields[4])  # idle, iowait
                        total += sum(int(x) for x in fields[:8]) - idle
                    elif not name.startswith("cpu"):
                        break
        except (OSError, ValueError, IndexError):
            return -1.0
        return total / tick


def _take_all(n: int) -> int:
    """Without per-thread setters: this thread takes ``n`` for good, and the count a
    thread takes at its first parallel op is put back to one from a thread of its own."""
    import torch

    torch.set_num_threads(n)
    back = threading.Thread(target=torch.set_num_threads, args=(1,), name="kvmesh-threads")
    back.start()
    back.join()
    return n


def _runnable() -> float:
    """Tasks runnable on the machine now, the caller included (0: unknown)."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def _own_runnable() -> int:
    """This process's threads runnable now (a scan of its threads: for rare use)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                n += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
    return n


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class EngineThreads:
    """The engine thread's torch threads (see the module): :meth:`take` then
    :meth:`fit` on that thread."""

    def __init__(self) -> None:
        self.most = 0  # the count reserved (0: none, torch's count is left alone)
        self.now = 0  # the count the engine thread computes with (0: torch's own)
        self.load = _Load()
        self._counts: _Counts | None = None

    def take(self) -> int:
        """On the engine thread, once: it computes with the reserved count from now
        on (see :meth:`fit`). Returns the count."""
        self.most = _reserved or 0
        if self.most > 1:
            import torch

            torch.get_num_threads()  # torch's per-thread set-up first: it would undo ours
            counts = _Counts()
            self._counts = counts if counts.omp is not None else None
        return self.fit()

    def fit(self) -> int:
        """Before a forward: as many threads as the cores others leave idle (see the
        module). Returns the count it computes with (0: torch's own, unchanged)."""
        if self._counts is None:
            if self.most and not self.now:
                self.now = _take_all(self.most)
            return self.now
        others = self.load.sample(time.monotonic(), self.now)
        return self.use(threads_for(len(self.load.cpus) - others, self.most))

    def use(self, n: int) -> int:
        """On the engine thread: compute with ``n`` threads (one to the count reserved)
        from now on. Returns the count it computes with (0: torch's own, unchanged)."""
        n = max(1, min(self.most, n))
        if self._counts is not None and n != self.now and self._counts.set(n):
            self.now = n
        return self.now
