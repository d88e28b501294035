"""The compiled linear kernel of batched decode steps (kvmesh/engine/compiled.py):
built here with the system compiler, it matches ``F.linear`` for every row count
and odd shapes (tails of the 16-wide vectors, of the 4-row groups, of the 48-row
chunks), with and without bias, on one and two threads; it refuses what it does
not compute (other dtypes) and mismatched shapes before the C code sees them; a
profiled call is named. The start-up measurement runs every kernel on one thread
(CPU time) and gives the thread count back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine import compiled


@pytest.fixture(scope="module")
def built():
    if compiled._compiler() is None:
        pytest.fail("no C compiler: CI installs gcc, and the kernel is built with it")
    assert compiled.load_kernel() is not None
    return compiled.streamed_linear


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(131, 37), (64, 896), (600, 447)])  # (out, in)
def test_matches_linear_for_every_row_count(built, shape, threads):
    if shape == (600, 447):  # large enough to be split between threads
        assert shape[0] * shape[1] >= compiled.PARALLEL_MIN
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(sum(shape) + threads)
        w = torch.randn(shape, generator=gen)
        b = torch.randn(shape[0], generator=gen)
        for rows in range(1, 11):
            x = torch.randn((rows, shape[1]), generator=gen)
            for bias in (None, b):
                got = built(w, bias, x)
                assert got.shape == (rows, shape[0]) and got.is_contiguous()
                torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(saved)


def test_refuses_other_dtypes_and_mismatched_shapes(built):
    w = torch.ones((8, 16))
    with pytest.raises(NotImplementedError):
        built(w.bfloat16(), None, torch.ones((2, 16)).bfloat16())
    with pytest.raises(ValueError, match="does not match"):
        built(w, None, torch.ones((2, 15)))
    with pytest.raises(ValueError, match="bias"):
        built(w, torch.ones(7), torch.ones((2, 16)))
    with pytest.raises(ValueError, match="does not match"):
        built(w, None, torch.ones((0, 16)))


def test_the_library_is_cached_by_digest(built):
    import hashlib
    import json
    import os
    import stat

    path = compiled._library_path(compiled._compiler())
    assert path.exists() and path.parent.name == "kernels"
    assert compiled.load_kernel() is compiled.load_kernel()  # built once per process
    # privately (tests/test_kernel_cache.py: what is refused), its bytes recorded
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert os.stat(path).st_uid == os.geteuid() and not os.stat(path).st_mode & 0o077
    rec = json.loads(path.with_suffix(".sha256").read_text())
    assert rec["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_profiled_call_is_named_for_the_step_costs(built):
    from torch.profiler import profile

    w, x = torch.ones((8, 16)), torch.ones((2, 16))
    with profile() as prof:
        y = built(w, None, x)
    assert {ev.key for ev in prof.key_averages()} >= {compiled.PROFILE_NAME}
    torch.testing.assert_close(y, torch.full((2, 8), 16.0))  # the same result as unprofiled


def test_calibration_times_the_engines_own_thread_count(plain_tiny_engine):
    from kvmesh.engine.hf import KERNELS, _calibrate

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    kernel = KERNELS["streamed"]

    def counting(w, b, x):  # the real kernel, recording the thread count it ran under
        seen.append(torch.get_num_threads())
        return kernel(w, b, x)

    KERNELS["streamed"] = counting
    try:
        with torch.inference_mode():
            chosen = _calibrate(plain_tiny_engine.model, reps=1)
        assert torch.get_num_threads() == 2  # left as it was
    finally:
        KERNELS["streamed"] = kernel
        torch.set_num_threads(saved)
    assert seen and set(seen) == {2}  # measured on the threads the engine computes with
    assert set(chosen.values()) <= set(KERNELS)
