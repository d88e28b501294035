"""A compiled linear kernel for batched decode steps on the CPU.

Contract: :func:`streamed_linear` computes ``x @ w.T + b`` for a few float32 rows
(a batched decode step's 2-16 sequences) reading each weight row once per group
of up to :data:`GROUP` rows, where MKL's ``F.linear`` with 2-16 rows re-packs the
weights and costs up to twice a one-row step (issue #28). It is a candidate for
the engine's start-up measurement (``hf._calibrate``), never forced: it replaces
``F.linear`` only where it measures faster here, and only in batched steps, so a
lone request computes exactly as before. Its sums run in another order than
MKL's: batched rows agree with the single-sequence path within float32 rounding
(the tolerance the batched tests already use), not bitwise.

The C source below is built once per machine with the system C compiler
(``cc``/``gcc``, ``-O3 -march=native -fopenmp``: plain C vector extensions, so
the compiler picks AVX-512, AVX2 or NEON) into ``$KVMESH_HOME/kernels``, named by
a digest of the source, the compiler and the CPU's flags, written to a temporary
file and renamed (processes building at once never load a half-written file).
No compiler, a failed build or a failed load: :func:`load` returns None and the
engine measures only the other kernels. OpenMP: the library links ``libgomp.so.1``
by soname, which resolves to the copy torch has already loaded, so its threads
are torch's threads (the count passed per call is ``torch.get_num_threads()``).

Inputs are checked before the call (dtype, contiguity, shapes): the C code trusts
the sizes it is given.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch.profiler import record_function

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


def _library_path(cc: str) -> Path:
    from .demo import kvmesh_home

    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    digest = hashlib.sha256(
        "\0".join((_SOURCE, version, platform.machine(), _cpu_flags())).encode()
    ).hexdigest()[:16]
    return kvmesh_home() / "kernels" / f"linear-{digest}.so"


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / "linear.c", Path(tmp) / "linear.so"
        src.write_text(_SOURCE)
        subprocess.run(
            [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(lib), str(src)],
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            check=True,
        )
        os.replace(lib, out)  # atomic: a concurrent builder's file is as good as ours


def load() -> ctypes.CDLL | None:
    """The built kernel library (building it on first use), or None where it cannot be."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        return None
    try:
        path = _library_path(cc)
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None  # no working toolchain here: the other kernels remain
    fn = lib.kvmesh_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def streamed_linear(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x @ w.T + b`` for ``x`` of shape [rows, in]: float32, contiguous, on the
    CPU. Raises NotImplementedError where the kernel does not apply (so the
    start-up measurement leaves it out) and ValueError for mismatched shapes."""
    lib = load()
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
