"""A compiled linear kernel for batched decode steps on the CPU.

:func:`streamed_linear` computes ``x @ w.T + b`` for a few float32 rows reading
each weight row once per group of up to :data:`GROUP` rows. It is a candidate for
the engine's kernel choice (``hf._choose_kernels``), used only in batched steps
where it measured faster; its sums run in another order than MKL's, so batched
rows agree with a lone sequence within float32 rounding, not bitwise.

The C source is built once per machine with the system C compiler (``cc``/``gcc``,
``-O3 -march=native -fopenmp``) into ``$KVMESH_HOME/kernels``, named by a digest of
the source, the compiler and the CPU's flags. The library links ``libgomp.so.1``
by soname, so its OpenMP threads are the ones torch has loaded.

The cache is trusted only as far as it is private:

- The directory is this user's and mode 0700 (one of ours that others could read
  is tightened; one they could write is emptied first; another user's, or a link,
  is not used: the build goes to a private temporary directory, with a log line).
  It is opened once and used through that descriptor.
- A library is built in a temporary directory inside it, fsynced, and its sha256
  recorded in a sidecar before both are renamed into place (under an flock of the
  directory). Before loading, the file must be a regular file of this user, not
  writable by group or others, with the recorded size and digest of the bytes
  read through the descriptor then loaded: a planted, replaced or truncated file
  is never ``dlopen``'ed.
- Anything refused is removed and rebuilt once; a build or load that fails
  disables the kernel for this process (torch's kernels then), with a log line.
  Nothing here raises into the engine's start.

The directory also keeps the engine's kernel choice (:func:`remembered`), so a
restart takes the kernels the first start measured. Inputs are checked before the
call (dtype, contiguity, shapes): the C code trusts the sizes it is given.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

log = logging.getLogger("kvmesh.kernels")

PROFILE_NAME = "kvmesh::streamed_linear"  # the kernel's calls in a torch.profiler trace
GROUP = 4  # (the C code's) rows per pass over the weights, 6 weight rows at a time
BUILD_TIMEOUT_S = 120.0
# weights below this many elements run on one thread: waking a second one costs
# more than it saves, and on a busy machine it may wait a whole time slice for it
PARALLEL_MIN = 1 << 18

_SOURCE = r"""
#include <stddef.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v16 v) { float s = 0; for (int i = 0; i < 16; i++) s += v[i]; return s; }

/* rows [n0, n1) of y (M rows of N) = x (M rows of K) . w (N rows of K) + b, NB
   weight rows at a time, each weight vector loaded once for all M rows */
#define DEF(M, NB)                                                                \
static void blk_##M(const float *w, const float *x, const float *b, float *y,    \
                    long n0, long n1, long N, long K) {                           \
  long k16 = K & ~15L;                                                            \
  for (long n = n0; n < n1; n += NB) {                                            \
    int nb = n1 - n < NB ? (int)(n1 - n) : NB;                                    \
    v16 acc[NB][M];                                                               \
    const float *wr[NB];                                                          \
    for (int j = 0; j < NB; j++) {                                                \
      wr[j] = w + (n + (j < nb ? j : 0)) * K;                                     \
      for (int m = 0; m < M; m++) acc[j][m] = (v16){0};                           \
    }                                                                             \
    for (long k = 0; k < k16; k += 16) {                                          \
      v16 wv[NB];                                                                 \
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) wv[j] = ld(wr[j] + k); \
      _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                       \
        v16 xv = ld(x + m * K + k);                                               \
        _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) acc[j][m] += wv[j] * xv; \
      }                                                                           \
    }                                                                             \
    for (int j = 0; j < nb; j++)                                                  \
      for (int m = 0; m < M; m++) {                                               \
        float s = hsum(acc[j][m]);                                                \
        for (long k = k16; k < K; k++) s += wr[j][k] * x[m * K + k];              \
        y[m * N + n + j] = s + (b ? b[n + j] : 0.0f);                             \
      }                                                                           \
  }                                                                               \
}
DEF(1, 8) DEF(2, 4) DEF(3, 6) DEF(4, 6)  /* 6 x 4 accumulators: 5% faster than 4 x 4 here */

typedef void (*blk_fn)(const float *, const float *, const float *, float *,
                       long, long, long, long);
static const blk_fn BLK[5] = {0, blk_1, blk_2, blk_3, blk_4};

/* y[M,N] = x[M,K] w[N,K]^T (+ b[N]). Threads split the weights into chunks of 48
   rows (0.9 MB at K = 4864: it stays in L2 while each group of 4 rows of x passes
   over it). */
int kvmesh_linear(const float *w, const float *x, const float *b, float *y,
                  long M, long N, long K, int threads) {
  if (M < 1 || N < 1 || K < 1 || threads < 1) return -1;
  long chunk = 48, nchunks = (N + chunk - 1) / chunk;  /* a multiple of every NB */
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (long c = 0; c < nchunks; c++) {
    long n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    for (long m0 = 0; m0 < M; m0 += 4) {
      long mm = M - m0 < 4 ? M - m0 : 4;
      BLK[mm](w, x + m0 * K, b, y + m0 * N, n0, n1, N, K);
    }
  }
  return 0;
}
"""

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # [] until the first load; [None] if unavailable
_held: list[int] = []  # descriptors of loaded libraries: never reused while the library is mapped
_LIB_MODE = 0o700
_FILE_MODE = 0o600


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


_FINGERPRINTS: dict[str | None, str] = {}


def fingerprint(cc: str | None = None) -> str:
    """A digest of what the library's machine code depends on: the source, the
    compiler (``cc``, default: the one :func:`load_kernel` uses) and the CPU."""
    cc = cc or _compiler()
    if cc not in _FINGERPRINTS:
        version = ""
        if cc is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                version = subprocess.run(
                    [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
                ).stdout
        _FINGERPRINTS[cc] = hashlib.sha256(
            "\0".join((_SOURCE, version, platform.machine(), _cpu_flags())).encode()
        ).hexdigest()[:16]
    return _FINGERPRINTS[cc]


def _library_name(cc: str) -> str:
    return f"linear-{fingerprint(cc)}.so"


def _library_path(cc: str) -> Path:
    """Where the cache keeps the library built with ``cc``."""
    return cache_dir() / _library_name(cc)


def cache_dir() -> Path:
    from .embedded import kvmesh_home

    return kvmesh_home() / "kernels"


class Refused(Exception):
    """A cached file that is not used: why, in words."""


@dataclass
class _Dir:
    """A private directory, opened: ``fd`` and the path that reaches it."""

    fd: int
    shown: str  # the path for log lines
    temporary: bool  # a per-process directory (the cache was not private): nothing kept

    @property
    def path(self) -> str:
        """A path that resolves through the descriptor (for the compiler and
        ``dlopen``), where the system has one."""
        proc = f"/proc/{os.getpid()}/fd/{self.fd}"
        return proc if os.path.isdir(proc) else self.shown

    def open(self, name: str) -> int:
        """A descriptor of the regular file ``name`` here, of this user and
        writable by no one else; :class:`Refused` otherwise (FileNotFoundError:
        there is none)."""
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd
        )
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(f"{name} is not a regular file")
            if st.st_uid != os.geteuid():
                raise Refused(f"{name} belongs to uid {st.st_uid}, not {os.geteuid()}")
            if st.st_mode & 0o022:
                raise Refused(f"{name} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, name: str, limit: int = 1 << 16) -> bytes:
        fd = self.open(name)
        try:
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise Refused(f"{name} is larger than {limit} bytes")
        return data

    def write(self, name: str, data: bytes, exclusive: bool = False) -> bool:
        """``data`` as ``name``, whole or not at all (a temporary file fsynced, then
        renamed; ``exclusive``: linked, and False when ``name`` already exists)."""
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            _FILE_MODE,
            dir_fd=self.fd,
        )
        try:
            with os.fdopen(fd, "wb", closefd=False) as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if exclusive:
                try:
                    os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)
        os.fsync(self.fd)
        return True

    def discard(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)


def _private_fd(path: Path) -> tuple[int | None, str]:
    """A descriptor of ``path`` as a private directory of this user (created mode
    0700), or None and why not. Ours but readable by others: tightened. Ours but
    writable by others: emptied first (anything in it may be anyone's)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return None, f"it cannot be opened as a directory ({e.strerror or e})"
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            return None, f"it belongs to uid {st.st_uid}, not {os.geteuid()}"
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            os.fchmod(fd, 0o700)
            if mode & 0o022:
                log.warning(
                    "kernel cache %s was writable by others (mode %o): emptied, now 0700",
                    path,
                    mode,
                )
                for name in os.listdir(fd):
                    _remove(fd, name)
        return fd, ""
    except OSError as e:
        os.close(fd)
        return None, f"it cannot be made private ({e.strerror or e})"


def _remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` (a tree too) from the directory open at ``dir_fd``."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        for inner in os.listdir(sub):
            _remove(sub, inner)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dir_fd)


_warned: set[str] = set()


@contextlib.contextmanager
def _cache(temporary_ok: bool = True) -> Iterator[_Dir | None]:
    """The private cache directory; where it is not private, a fresh temporary
    one of this process (``temporary_ok``) or None, with a log line once."""
    path = cache_dir()
    fd, why = _private_fd(path)
    if fd is not None:
        try:
            yield _Dir(fd, str(path), temporary=False)
        finally:
            os.close(fd)
        return
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning(
            "kernel cache %s is not used: %s; remove it, or set KVMESH_HOME to a "
            "directory of this user (this process builds its kernel privately, "
            "and its kernel choice is not kept)",
            path,
            why,
        )
    if not temporary_ok:
        yield None
        return
    tmp = tempfile.mkdtemp(prefix="kvmesh-kernels-")  # mode 0700, this user's
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield _Dir(fd, tmp, temporary=True)
    finally:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


def _sidecar(name: str) -> str:
    return name.removesuffix(".so") + ".sha256"


def _verified(d: _Dir, name: str) -> int:
    """A descriptor of library ``name`` whose bytes are the ones its sidecar
    records; :class:`Refused` otherwise (FileNotFoundError: there is none)."""
    fd = d.open(name)
    try:
        try:
            want = json.loads(d.read(_sidecar(name)))
            size, digest = int(want["size"]), str(want["sha256"])
        except FileNotFoundError:
            raise Refused(f"{name} has no recorded digest") from None
        except (ValueError, KeyError, TypeError) as e:
            raise Refused(f"the digest recorded for {name} is unreadable ({e})") from None
        st = os.fstat(fd)
        if st.st_size != size:
            raise Refused(f"{name} has {st.st_size} bytes, {size} were built")
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        if h.hexdigest() != digest:
            raise Refused(f"{name} is not the library built here (sha256 {h.hexdigest()[:16]})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _dlopen(d: _Dir, fd: int, name: str) -> ctypes.CDLL:
    """The library open at ``fd`` (verified), through the descriptor itself where
    the system has /proc: the bytes checked are the bytes mapped. The descriptor
    stays open (a later dlopen of the same /proc path must not name another file)."""
    proc = f"/proc/{os.getpid()}/fd/{fd}"
    lib = ctypes.CDLL(proc if os.path.exists(proc) else os.path.join(d.shown, name))
    fn = lib.kvmesh_linear  # AttributeError: not our library
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    _held.append(fd)
    return lib


def _try_load(d: _Dir, name: str) -> tuple[ctypes.CDLL | None, str]:
    """The library ``name`` loaded from ``d`` if it passes every check, else None
    and why ("" when there is none)."""
    try:
        fd = _verified(d, name)
    except FileNotFoundError:
        return None, ""
    except Refused as e:
        return None, str(e)
    except OSError as e:
        return None, f"{name} cannot be read ({e.strerror or e})"
    try:
        return _dlopen(d, fd, name), ""
    except (OSError, AttributeError) as e:
        os.close(fd)
        return None, f"{name} does not load ({e})"


def _build(cc: str, d: _Dir, name: str) -> None:
    """Compile the library in a temporary directory inside ``d``, then rename it
    and its digest into place (raises OSError or SubprocessError on failure)."""
    work = tempfile.mkdtemp(prefix=".build-", dir=d.path)
    rel = os.path.basename(work)
    try:
        Path(work, "linear.c").write_text(_SOURCE)
        subprocess.run(  # relative names: the output does not depend on the directory
            [
                cc,
                "-O3",
                "-march=native",
                "-fopenmp",
                "-shared",
                "-fPIC",
                "-o",
                "linear.so",
                "linear.c",
            ],
            cwd=work,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            check=True,
        )
        fd = os.open(f"{rel}/linear.so", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d.fd)
        try:
            os.fchmod(fd, _LIB_MODE)
            os.fsync(fd)
            h, size = hashlib.sha256(), 0
            while chunk := os.read(fd, 1 << 20):
                h.update(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        record = json.dumps({"sha256": h.hexdigest(), "size": size, "source": fingerprint(cc)})
        # the library first: a crash between the renames leaves a digest that does
        # not match (refused, rebuilt), never a library taken for another's digest
        os.replace(f"{rel}/linear.so", name, src_dir_fd=d.fd, dst_dir_fd=d.fd)
        d.write(_sidecar(name), record.encode())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_kernel() -> ctypes.CDLL | None:
    """The built kernel library (building it on first use), or None where it cannot be."""
    with _lock:
        if not _loaded:
            try:
                _loaded.append(_load())
            except OSError as e:  # (no private directory could be made at all)
                log.warning("batched-decode kernel disabled: %s", e)
                _loaded.append(None)
        return _loaded[0]


def _load() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        return None  # no toolchain here: the other kernels remain
    name = _library_name(cc)
    with _cache() as d:
        assert d is not None
        with _flock(d):
            lib, why = _try_load(d, name)
            if lib is not None:
                return lib
            if why:
                log.warning("batched-decode kernel refused: %s in %s; rebuilding it", why, d.shown)
            d.discard(name)
            try:
                _build(cc, d, name)
            except (OSError, subprocess.SubprocessError) as e:
                log.warning(
                    "batched-decode kernel not built (%s): batched steps use torch's kernels",
                    _brief(e),
                )
                return None
            lib, why = _try_load(d, name)
            if lib is None:
                log.warning(
                    "batched-decode kernel just built is refused (%s): disabled; batched "
                    "steps use torch's kernels",
                    why or "it vanished",
                )
                d.discard(name)
                d.discard(_sidecar(name))
            return lib


@contextlib.contextmanager
def _flock(d: _Dir) -> Iterator[None]:
    if d.temporary:
        yield
        return
    fcntl.flock(d.fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(d.fd, fcntl.LOCK_UN)


def _brief(e: BaseException) -> str:
    if isinstance(e, subprocess.CalledProcessError):
        err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"the compiler exited {e.returncode}: {err[-1] if err else ''}"
    return str(e)


def remembered(
    kind: str,
    key: str,
    measure: Callable[[], Any],
    valid: Callable[[Any], bool],
) -> Any:
    """What ``measure()`` returned the first time it ran for ``key`` here (kept in
    the private cache directory as ``<kind>-<digest of key>.json``), so every later
    start, and every process sharing ``$KVMESH_HOME``, agrees with it. A record
    that is not this user's, is writable by others, names another key or fails
    ``valid`` is replaced (with a log line); where the cache is not private,
    ``measure()`` runs each time. Processes measuring at once: the first record
    written wins, and each of them returns it."""
    name = f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    with _cache(temporary_ok=False) as d:
        if d is None:
            return measure()
        kept, why = _read_record(d, name, key, valid)
        if why is None:
            return kept
        if why:
            log.warning("kernel choice record refused: %s; measuring again", why)
            d.discard(name)
        value = measure()
        data = json.dumps({"key": key, "value": value}, sort_keys=True).encode()
        try:
            if d.write(name, data, exclusive=True):
                return value
        except OSError as e:
            log.warning("kernel choice not kept (%s): the next start measures again", e)
            return value
        kept, why = _read_record(d, name, key, valid)  # another process's, written first
        return value if why is not None else kept


def _read_record(
    d: _Dir, name: str, key: str, valid: Callable[[Any], bool]
) -> tuple[Any, str | None]:
    """(the value kept, None), or (None, why it is not used: "" when there is none)."""
    try:
        rec = json.loads(d.read(name))
    except FileNotFoundError:
        return None, ""
    except Refused as e:
        return None, str(e)
    except (OSError, ValueError) as e:
        return None, f"{name} is unreadable ({e})"
    if not isinstance(rec, dict) or rec.get("key") != key or not valid(rec.get("value")):
        return None, f"{name} does not hold a valid choice for this model"
    return rec["value"], None


def streamed_linear(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x @ w.T + b`` for ``x`` of shape [rows, in]: float32, contiguous, on the
    CPU. Raises NotImplementedError where the kernel does not apply (so the
    start-up measurement leaves it out) and ValueError for mismatched shapes."""
    lib = load_kernel()
    if lib is None:
        raise NotImplementedError("the compiled linear kernel could not be built here")
    ts = (w, x) if b is None else (w, x, b)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts):
        raise NotImplementedError("the compiled linear kernel takes float32 on the CPU")
    if w.ndim != 2 or x.ndim != 2 or x.shape[1] != w.shape[1] or x.shape[0] < 1:
        raise ValueError(f"linear: x {tuple(x.shape)} does not match w {tuple(w.shape)}")
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"linear: bias {tuple(b.shape)} does not match w {tuple(w.shape)}")
    w, x = w.contiguous(), x.contiguous()
    b = None if b is None else b.contiguous()
    if torch._C._autograd._profiler_enabled():  # a named range in profiles (12 µs: only then)
        with record_function(PROFILE_NAME):
            return _call(lib, w, b, x)
    return _call(lib, w, b, x)


def _call(
    lib: ctypes.CDLL, w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    rc = lib.kvmesh_linear(
        w.data_ptr(),
        x.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        w.shape[0],
        w.shape[1],
        torch.get_num_threads() if w.numel() >= PARALLEL_MIN else 1,
    )
    if rc != 0:
        raise ValueError(f"linear: the kernel refused shapes {tuple(x.shape)} x {tuple(w.shape)}")
    return y
