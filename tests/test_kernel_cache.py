"""The batched-decode kernel's cache is trusted only as far as it is private
(kvmesh/engine/compiled.py; issue #36): a library planted at its predictable path
(another user's, writable by others, replaced, a link), a truncated one or one
without its recorded digest is refused before ``dlopen`` (its constructor never
runs; no SIGBUS), removed and rebuilt, with a log line; a cache directory that is
not this user's is not used at all, one others could write is emptied. A real head
started on such a cache serves, batched steps included. The kernel choice is kept
in the same directory, so a restart takes the choice the first start measured.

Each load runs in its own process (the real load path, from a fresh interpreter):
had a truncated library been mapped, that process, not pytest, would die."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvmesh.engine import compiled
from kvmesh.engine.hf import KERNELS, MAX_ROWS_FIRST, _calibrate, _choose_kernels

from .test_api import Head

NOBODY = 65534

PLANTED_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE *f = fopen("%s", "w");
  if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
int kvmesh_linear(const float *w, const float *x, const float *b, float *y,
                  long M, long N, long K, int threads) { return -1; }
"""

LOAD = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import torch
    import torch.nn.functional as F
    from kvmesh.engine import compiled
    lib = compiled.load_kernel()
    ok = False
    if lib is not None:
        w, x = torch.randn(37, 53), torch.randn(3, 53)
        ok = torch.allclose(compiled.streamed_linear(w, None, x), F.linear(x, w), atol=1e-4)
    print(json.dumps({"loaded": lib is not None, "name": lib and lib._name, "ok": ok}))
    """
)


def load_in(home: Path, **env: str) -> tuple[dict, str]:
    """``compiled.load_kernel()`` in a fresh process with ``KVMESH_HOME=home`` (and
    ``env``): what it loaded (and whether it computes a linear layer) and its log."""
    r = subprocess.run(
        [sys.executable, "-c", LOAD],
        env={**os.environ, "KVMESH_HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])  # -7 would be SIGBUS
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache holding the library as this machine builds it (copied by each test)."""
    if compiled._compiler() is None:
        pytest.fail("no C compiler: CI installs gcc, and the kernel is built with it")
    home = tmp_path_factory.mktemp("built")
    got, log = load_in(home)
    assert got == {"loaded": True, "name": got["name"], "ok": True}, log
    assert "refused" not in log and "not used" not in log  # a first build is quiet
    return home / "kernels"


@pytest.fixture
def home(built, tmp_path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(built, home / "kernels")
    return home


@pytest.fixture(scope="module")
def planted_so(tmp_path_factory) -> tuple[Path, Path]:
    """A library that records it ran (its constructor writes ``marker``) and whose
    kernel fails every call: what an attacker would plant."""
    d = tmp_path_factory.mktemp("planted")
    marker = d / "marker"
    (d / "planted.c").write_text(PLANTED_C % marker)
    subprocess.run(
        [
            compiled._compiler(),
            "-shared",
            "-fPIC",
            "-o",
            str(d / "planted.so"),
            str(d / "planted.c"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return d / "planted.so", marker


def names() -> tuple[str, str]:
    lib = compiled._library_name(compiled._compiler())
    return lib, compiled._sidecar(lib)


def digest_record(data: bytes) -> str:
    return json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})


def plant(kernels: Path, planted: Path, owner: int, mode: int, sidecar: bool = True) -> None:
    lib, side = names()
    (kernels / lib).unlink(missing_ok=True)
    shutil.copyfile(planted, kernels / lib)
    os.chown(kernels / lib, owner, owner)
    os.chmod(kernels / lib, mode)
    if sidecar:  # a digest that matches the planted file: only owner and mode betray it
        (kernels / side).write_text(digest_record(planted.read_bytes()))
        os.chown(kernels / side, owner, owner)
        os.chmod(kernels / side, mode)


def assert_rebuilt(home: Path, marker: Path | None = None) -> None:
    """The cache holds this user's library again, private, its digest recorded, and
    a later start takes it without a word."""
    kernels = home / "kernels"
    lib, side = names()
    st = os.stat(kernels / lib, follow_symlinks=False)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert not st.st_mode & 0o077 and not os.stat(kernels).st_mode & 0o077
    rec = json.loads((kernels / side).read_text())
    assert rec["sha256"] == hashlib.sha256((kernels / lib).read_bytes()).hexdigest()
    again, log = load_in(home)
    assert again["loaded"] and again["ok"] and "refused" not in log, log
    if marker is not None:
        assert not marker.exists()


def test_a_first_build_is_private_and_its_digest_recorded(built):
    home = built.parent
    assert stat.S_IMODE(os.stat(built).st_mode) == 0o700
    assert_rebuilt(home)
    # the library is loaded through the descriptor whose bytes were checked
    got, _ = load_in(home)
    assert got["name"].startswith("/proc/") and "/fd/" in got["name"]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("another user's, writable by all", f"belongs to uid {NOBODY}"),
        ("ours, writable by all", "writable by others (mode 666)"),
        ("a link to it", "cannot be read"),
        ("replaced, the digest kept", "bytes,"),
    ],
)
def test_a_planted_library_is_refused_and_rebuilt(home, planted_so, case, reason):
    planted, marker = planted_so
    kernels = home / "kernels"
    lib, side = names()
    if case == "another user's, writable by all":
        plant(kernels, planted, NOBODY, 0o666)
    elif case == "ours, writable by all":
        plant(kernels, planted, os.geteuid(), 0o666)
    elif case == "a link to it":
        (kernels / lib).unlink()
        (kernels / lib).symlink_to(planted)
        (kernels / side).write_text(digest_record(planted.read_bytes()))
    else:  # our sidecar still names the real library
        plant(kernels, planted, os.geteuid(), 0o700, sidecar=False)
    got, log = load_in(home)
    assert got["loaded"] and got["ok"], log  # the rebuilt kernel, computing right
    assert not marker.exists(), "the planted library's constructor ran"
    assert reason in log and "rebuilding" in log, log
    assert_rebuilt(home, marker)


@pytest.mark.parametrize("cut", ["truncated", "one byte changed", "no digest", "empty"])
def test_a_damaged_library_is_never_loaded(home, cut):
    """A truncated library would SIGBUS the loading process on every start (issue
    #36); it is refused by its size or digest before ``dlopen`` and rebuilt."""
    kernels = home / "kernels"
    lib, side = names()
    data = (kernels / lib).read_bytes()
    if cut == "truncated":
        (kernels / lib).write_bytes(data[: len(data) // 2])
        reason = f"has {len(data) // 2} bytes, {len(data)} were built"
    elif cut == "one byte changed":
        i = len(data) // 2
        (kernels / lib).write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
        reason = "is not the library built here"
    elif cut == "no digest":
        (kernels / side).unlink()
        reason = "has no recorded digest"
    else:
        (kernels / lib).write_bytes(b"")
        reason = "has 0 bytes"
    got, log = load_in(home)
    assert got["loaded"] and got["ok"], log
    assert reason in log and "rebuilding" in log, log
    assert_rebuilt(home)


def test_a_cache_directory_of_another_user_is_not_used(home, planted_so):
    planted, marker = planted_so
    kernels = home / "kernels"
    plant(kernels, planted, NOBODY, 0o666)
    os.chown(kernels, NOBODY, NOBODY)
    os.chmod(kernels, 0o777)
    before = sorted(os.listdir(kernels))
    got, log = load_in(home)
    assert got["loaded"] and got["ok"], log  # built privately for this process
    assert f"is not used: it belongs to uid {NOBODY}" in log, log
    assert not marker.exists()
    assert sorted(os.listdir(kernels)) == before  # another user's files are left alone
    # the same for a link in its place, even to a private directory of ours
    os.chown(kernels, os.geteuid(), os.geteuid())
    shutil.rmtree(kernels)
    real = home / "elsewhere"
    real.mkdir(mode=0o700)
    kernels.symlink_to(real)
    got, log = load_in(home)
    assert got["loaded"] and got["ok"] and "is not used" in log, log
    assert os.listdir(real) == []


def test_a_cache_directory_others_could_write_is_emptied(home, planted_so):
    """Files in a directory others could write may be anyone's, whatever their
    owner says (a digest beside a planted library matches it): all go."""
    planted, marker = planted_so
    kernels = home / "kernels"
    plant(kernels, planted, os.geteuid(), 0o700)  # ours by every other check
    (kernels / "junk").mkdir()
    (kernels / "junk" / "x").write_text("x")
    os.chmod(kernels, 0o777)
    got, log = load_in(home)
    assert got["loaded"] and got["ok"], log
    assert "was writable by others (mode 777): emptied, now 0700" in log, log
    assert not marker.exists() and not (kernels / "junk").exists()
    assert_rebuilt(home, marker)


def test_a_cache_directory_only_readable_by_others_is_tightened(home):
    """(What earlier versions made: mode 0755.) No one else could write into it,
    so its files stand or fall by their own checks; it becomes 0700."""
    kernels = home / "kernels"
    os.chmod(kernels, 0o755)
    got, log = load_in(home)
    assert got["loaded"] and got["ok"] and "refused" not in log and "emptied" not in log, log
    assert stat.S_IMODE(os.stat(kernels).st_mode) == 0o700


BROKEN_CC = """#!/bin/sh
# a compiler that fails, or (with an output) writes something that is no library
[ "$1" = --version ] && {{ echo broken-cc 1.0; exit 0; }}
{action}
"""


@pytest.mark.parametrize(
    ("action", "reason"),
    [
        (
            "echo 'linear.c: internal compiler error' >&2; exit 1",
            "not built (the compiler exited 1",
        ),
        (
            'while [ "$1" != -o ]; do shift; done; echo not-an-elf > "$2"',
            "just built is refused",
        ),
    ],
)
def test_a_failed_build_or_load_disables_the_kernel_and_says_so(tmp_path, action, reason):
    """Never a crash, nor a rebuild on every call: this process goes on without
    the kernel (torch's kernels remain), and leaves nothing it could load later."""
    cc = tmp_path / "cc"
    cc.write_text(BROKEN_CC.format(action=action))
    cc.chmod(0o755)
    home = tmp_path / "home"
    got, log = load_in(home, CC=str(cc))
    assert got == {"loaded": False, "name": None, "ok": False}, log
    assert reason in log and log.count("batched-decode kernel") == 1, log
    assert [p.name for p in (home / "kernels").iterdir()] == []


@pytest.mark.parametrize("damage", ["planted", "truncated"])
def test_a_head_on_a_planted_or_truncated_kernel_refuses_it_and_serves(
    home, planted_so, tiny_dir, tmp_path, monkeypatch, damage
):
    """A real head started on the damaged cache: it logs the refusal, rebuilds,
    and answers, batched decode steps (n=3) included; the planted code never runs."""
    planted, marker = planted_so
    kernels = home / "kernels"
    lib, _ = names()
    if damage == "planted":
        plant(kernels, planted, NOBODY, 0o666)
    else:
        data = (kernels / lib).read_bytes()
        (kernels / lib).write_bytes(data[: len(data) // 3])
    (home / "models").symlink_to(tiny_dir.parent)  # the session's demo-tiny
    monkeypatch.setenv("KVMESH_HOME", str(home))
    log_path = tmp_path / "head.log"
    with open(log_path, "w") as log:
        head = Head("--no-publish", "--alias", f"kernel-{damage}", log=log)
        try:
            r = head.http.post(
                "/v1/completions",
                json={
                    "model": "demo-tiny",
                    "prompt": "Explain prefill caching",
                    "max_tokens": 8,
                    "n": 3,
                    "temperature": 1.0,
                    "seed": 1,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            assert len(choices) == 3 and all(c["finish_reason"] == "length" for c in choices)
            assert head.proc.poll() is None
        finally:
            head.stop()
    text = log_path.read_text()
    assert "batched-decode kernel refused" in text and "rebuilding" in text, text[-3000:]
    assert not marker.exists()
    assert_rebuilt(home, marker)


# -- the kernel choice: measured once, kept -----------------------------------------


def choice_files(home: Path) -> list[Path]:
    return sorted((home / "kernels").glob("choice-*.json"))


def test_restarts_take_the_choice_the_first_start_kept(
    plain_tiny_engine, tmp_path, monkeypatch, caplog
):
    model = plain_tiny_engine.model
    home = tmp_path / "home"
    monkeypatch.setenv("KVMESH_HOME", str(home))
    with torch.inference_mode():
        first = _choose_kernels(model)
    (kept,) = choice_files(home)
    st = kept.stat()
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o077
    assert {int(r): k for r, k in json.loads(kept.read_text())["value"].items()} == first
    # a later start reads the record, whatever timing would say now: here a choice
    # no measurement makes (every batch size on W @ x.T)
    rec = json.loads(kept.read_text())
    forced = {str(r): "rows_first" for r in range(2, MAX_ROWS_FIRST + 1)}
    kept.write_text(json.dumps({**rec, "value": forced}))
    with torch.inference_mode():
        again = _choose_kernels(model)
    assert again == {int(r): "rows_first" for r in forced}
    # another thread count is another measurement (a kernel's speed at a few rows is
    # in how it splits them between threads): a record of its own
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with torch.inference_mode():
            _choose_kernels(model)
    finally:
        torch.set_num_threads(threads)
    assert len(choice_files(home)) == 2
    for other in set(choice_files(home)) - {kept}:
        other.unlink()
    # a record planted by another user, or naming a kernel that does not exist, is
    # refused and measured again (and kept, ours)
    for bad, why in [
        ((NOBODY, 0o666, forced), f"belongs to uid {NOBODY}"),
        ((os.geteuid(), 0o600, {"2": "planted"}), "does not hold a valid choice"),
    ]:
        owner, mode, value = bad
        kept.write_text(json.dumps({**rec, "value": value}))
        os.chown(kept, owner, owner)
        os.chmod(kept, mode)
        caplog.clear()
        with torch.inference_mode():
            chosen = _choose_kernels(model)
        assert why in caplog.text and "measuring again" in caplog.text
        assert set(chosen.values()) <= set(KERNELS)
        (kept,) = choice_files(home)
        assert kept.stat().st_uid == os.geteuid() and not kept.stat().st_mode & 0o077


def test_a_restarted_engine_takes_the_kept_choice(tiny_dir, tmp_path, monkeypatch):
    """Two real engine starts on one cache: the second takes the first's choice."""
    from kvmesh.engine import load_engine

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(tiny_dir.parent)
    monkeypatch.setenv("KVMESH_HOME", str(home))
    first = load_engine("demo-tiny", "torch")
    (kept,) = choice_files(home)
    rec = json.loads(kept.read_text())
    # another choice in its place (as another start might have measured): taken
    other = "streamed" if first.kernels.get(2) == "rows_first" else "rows_first"
    kept.write_text(json.dumps({**rec, "value": {"2": other, "3": other}}))
    second = load_engine("demo-tiny", "torch")
    assert second.kernels == {2: other, 3: other}


def test_calibration_skips_a_kernel_that_fails_or_computes_garbage(plain_tiny_engine):
    """A kernel raising (as a bad return code does: ValueError) or returning wrong
    numbers is no candidate; the measurement itself never raises."""
    saved = dict(KERNELS)

    def refusing(w, b, x):
        raise ValueError("linear: the kernel refused shapes")

    def garbage(w, b, x):
        return saved["rows_first"](w, b, x) + 1.0

    KERNELS.clear()
    KERNELS.update({"refusing": refusing, "garbage": garbage})
    try:
        with torch.inference_mode():
            chosen = _calibrate(plain_tiny_engine.model, reps=1)
    finally:
        KERNELS.clear()
        KERNELS.update(saved)
    assert chosen == {}
