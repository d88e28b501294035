"""Shared pieces of the benchmarks: the demo-shaped card and synthetic KV blocks
made by the real export code from random cache tensors (no model needed), and the
one owner of everything a benchmark starts outside its own process.

Cleanup contract: every child process a benchmark starts goes through :func:`popen`
(or :func:`spawn_kvmesh`), in its own session, and every network namespace or link
through :func:`own_netns` / :func:`own_link`. :func:`run_main` runs a benchmark's
``main`` and on ANY exit (return, exception, ``SystemExit``, Ctrl-C, SIGTERM) stops
each child's process group (SIGTERM, then SIGKILL after a grace period) and deletes
the namespaces, links and temporary directories (:func:`own_tempdir`: e.g. a
child's ``KVMESH_HOME``). ``KVMESH_BENCH_FAIL=started`` makes a benchmark raise as
soon as its first child is up (or its first namespace exists): how the tests prove
that nothing is left behind. :class:`NetnsPeer` is a peer behind a veth link in
its own namespace, shaped with ``tc`` (root only).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import Block, Layout
from kvmesh.compat import CompatCard
from kvmesh.engine.hf import TransformersEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.procs import free_port, log_tail, lost_port_race  # noqa: E402  (ports no connection takes first)


def demo_card(
    block_tokens: int = 32, layers: int = 24, kv_heads: int = 2, head_dim: int = 64
) -> CompatCard:
    return CompatCard(
        engine="transformers",
        model_id="bench",
        weights_digest="0" * 64,
        tokenizer_digest="0" * 64,
        quantization="none",
        kv_dtype="float32",
        rope="{}",
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        sliding_windows=(0,) * layers,
        vocab_size=320,
        block_tokens=block_tokens,
    )


def fake_engine(card: CompatCard) -> TransformersEngine:
    """The real export/import code of the torch adapter, without a model."""
    eng = object.__new__(TransformersEngine)
    eng.card, eng.layout, eng.dtype, eng.device = (
        card,
        Layout(card),
        torch.float32,
        torch.device("cpu"),
    )
    eng._cache_cls = lambda config=None: SimpleNamespace(
        layers=[DynamicLayer() for _ in range(card.num_layers)]
    )
    eng.model = SimpleNamespace(config=None)
    eng._state_every = 0  # attention only: no recurrent-state checkpoints
    eng.grid, eng._rowwise = 0, False  # not deterministic
    return eng


def random_state(card: CompatCard, n_tokens: int, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    shape = (1, card.num_kv_heads, n_tokens, card.head_dim)
    layers = [DynamicLayer() for _ in range(card.num_layers)]
    for layer in layers:
        layer.lazy_initialization(torch.empty(shape), torch.empty(shape))
        layer.keys, layer.values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    cache = SimpleNamespace(layers=layers)
    return SimpleNamespace(
        tokens=[(seed * 7919 + i) % 256 for i in range(n_tokens)],
        cached=n_tokens,
        cache=cache,
        logits=torch.zeros(card.vocab_size),
    )


def synthetic_blocks(
    card: CompatCard, n_tokens: int, seed: int = 0
) -> tuple[list[Block], list[int]]:
    eng = fake_engine(card)
    state = random_state(card, n_tokens, seed)
    keyer = BlockKeyer(card.namespace, card.block_tokens)
    return eng.export(state, keyer), state.tokens  # type: ignore[arg-type]


def machine() -> dict[str, object]:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {
        "cpu": cpu,
        "cores": __import__("os").cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


FAIL_ENV = "KVMESH_BENCH_FAIL"
VERBOSE_ENV = "KVMESH_BENCH_VERBOSE"  # set: children's logs go to our stderr
START_TIMEOUT_S = 120.0  # a kvmesh process prints its first line by then
GRACE_S = 10.0  # a child's time to stop on SIGTERM before its group is killed


class Owned:
    """What this benchmark process started outside itself, in start order."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        self.netns: list[str] = []
        self.links: list[str] = []
        self.dirs: list[str] = []

    def cleanup(self) -> None:
        """Stop every child (newest first), delete namespaces and links, then the
        temporary directories (no child writes there any more); idempotent. One that
        cannot be stopped or deleted does not keep the rest alive."""
        for p in reversed(self.procs):  # all told at once: they stop in parallel
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(Exception):
                    _signal_group(p, sig)
        while self.procs:
            p = self.procs.pop()
            with contextlib.suppress(Exception):
                stop(p)
        cmds = [["ip", "link", "del", n] for n in reversed(self.links)]
        cmds += [["ip", "netns", "del", n] for n in reversed(self.netns)]
        self.links.clear()
        self.netns.clear()
        for cmd in cmds:
            with contextlib.suppress(Exception):
                subprocess.run(cmd, capture_output=True, timeout=30)
        while self.dirs:
            shutil.rmtree(self.dirs.pop(), ignore_errors=True)


OWNED = Owned()
atexit.register(OWNED.cleanup)  # a main not run through run_main still cleans up


def fail_point(stage: str) -> None:
    """Raise here when ``KVMESH_BENCH_FAIL`` names ``stage`` (cleanup tests)."""
    if os.environ.get(FAIL_ENV) == stage:
        raise RuntimeError(f"{FAIL_ENV}={stage}: failing on purpose")


def popen(cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen`` in a new session (its own process group, so a stop reaches
    anything it forks and a terminal's Ctrl-C reaches only us), owned until stopped."""
    p = subprocess.Popen(list(cmd), start_new_session=True, **kw)
    OWNED.procs.append(p)
    return p


def _signal_group(p: subprocess.Popen[Any], sig: int) -> None:
    if p.poll() is None:  # only a live leader proves the group id is still ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def stop(p: subprocess.Popen[Any], grace_s: float = GRACE_S) -> int | None:
    """SIGTERM the child's group (SIGCONT first: a frozen child cannot stop), SIGKILL it
    after ``grace_s``; reaped and no longer owned. Its exit status."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        _signal_group(p, sig)
    try:
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(p, signal.SIGKILL)
        p.wait(grace_s)
    finally:
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        if p in OWNED.procs:
            OWNED.procs.remove(p)
    return p.returncode


def reap(p: subprocess.Popen[Any], timeout: float = 60.0) -> int:
    """Wait for a child that is meant to finish by itself; stopped if it does not."""
    try:
        return p.wait(timeout)
    finally:
        stop(p)


def own_netns(name: str) -> None:
    """Create network namespace ``name`` (a stale one of that name is deleted first)."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    OWNED.netns.append(name)


def own_link(name: str, *spec: str) -> None:
    """``ip link add NAME SPEC...`` (e.g. a veth pair), deleted at exit."""
    subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "add", name, *spec], check=True, capture_output=True, timeout=30)
    OWNED.links.append(name)


def own_tempdir(what: str) -> str:
    """A new temporary directory, named for this process (``kvmb<pid>-<what>-``, so a
    test can tell it was left behind), deleted at exit."""
    path = tempfile.mkdtemp(prefix=f"kvmb{os.getpid()}-{what}-")
    OWNED.dirs.append(path)
    return path


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_main(main: Callable[[], object]) -> None:
    """Run a benchmark's ``main``; SIGTERM, SIGINT and SIGHUP become ``SystemExit`` (so
    every ``finally`` runs; Ctrl-C too inside ``asyncio.run``, whose own SIGINT
    handler only cancels its task, which a benchmark may absorb and run on), and
    whatever it started is stopped and deleted on any exit."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    try:
        main()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut cleanup short
        OWNED.cleanup()


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def launch_kvmesh(
    *args: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``kvmesh ARGS`` in its own owned process (run under ``prefix``, e.g. ``ip netns
    exec NS``; ``env`` added to ours), not waited for: :func:`await_start`. Its log
    is dropped unless ``KVMESH_BENCH_VERBOSE`` is set."""
    return popen(
        [*prefix, sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE,
        stderr=None if os.environ.get(VERBOSE_ENV) else subprocess.DEVNULL,
        text=True,
        env={**os.environ, **env} if env else None,
    )


def await_start(
    p: subprocess.Popen[str], pattern: str, timeout_s: float = START_TIMEOUT_S
) -> re.Match[str]:
    """The match of ``pattern`` in a launched process's first line (within
    ``timeout_s``); stopped and RuntimeError when it does not come."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    line = p.stdout.readline() if ready else ""
    m = re.search(pattern, line)
    if not m:
        stop(p)
        cmd = [str(a) for a in p.args]  # type: ignore[union-attr]
        what = cmd[cmd.index("kvmesh.cli") + 1] if "kvmesh.cli" in cmd else cmd[0]
        raise RuntimeError(f"kvmesh {what} did not start: {line!r}")
    fail_point("started")
    return m


def spawn_kvmesh(
    *args: str,
    pattern: str,
    prefix: Sequence[str] = (),
    timeout_s: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[str], re.Match[str]]:
    """``kvmesh ARGS`` in its own owned process (run under ``prefix``, e.g. ``ip netns
    exec NS``), once its first line matches ``pattern`` (within ``timeout_s``)."""
    p = launch_kvmesh(*args, prefix=prefix, env=env)
    return p, await_start(p, pattern, timeout_s)


def spawn_vllm(
    python: str, model: str, args: Sequence[str], log: Path, start_s: float, retry: bool = True
) -> tuple[subprocess.Popen[Any], str]:
    """``vllm serve`` (its OpenAI server module, under ``python``: the vLLM venv's) on a
    free loopback port, owned, once ``/health`` answers; (process, URL). Its output
    goes to ``log``. A start that lost a port race (vLLM takes its internal ports by
    ``bind(0)`` and release) is tried once more."""
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], *args]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:  # the child keeps its own copy
        proc = popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    fail_point("started")
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(1)
    exited = proc.poll() is not None
    stop(proc)
    if retry and exited and lost_port_race(log):
        return spawn_vllm(python, model, args, log, start_s, retry=False)
    raise RuntimeError(f"vllm serve did not start; {log_tail(log)}")


def spawn_peer(*args: str) -> tuple[subprocess.Popen[str], str]:
    """A peer on an ephemeral loopback port (4 GiB unless ``args`` set --budget)."""
    p, m = spawn_kvmesh(
        "peer", "--listen", "127.0.0.1:0", "--budget", "4GiB", *args, pattern=r"listening on (\S+)"
    )
    return p, m.group(1)


def write_section(path: Path, text: str, mark: str, end: str) -> None:
    """Replace a benchmark's section of ``path`` (between ``mark`` and ``end``), or
    append it: ``text`` carries the markers itself."""
    old = path.read_text() if path.exists() else ""
    if mark in old and end in old:
        head, rest = old.split(mark, 1)
        path.write_text(head + text + rest.split(end, 1)[1])
    else:
        path.write_text(old.rstrip() + "\n\n" + text + "\n")


def tbf_burst(rate_bits: float) -> int:
    """A token bucket's burst in bytes: 1/100 s of the rate, at least 32 KiB (one
    timer tick must not cap the rate: HZ=250 ticks every 4 ms)."""
    return max(32 << 10, int(rate_bits / 8 / 100))


class NetnsPeer:
    """A ``kvmesh peer`` in its own network namespace behind a veth link, under the
    fleet key (it listens off loopback), shaped with :meth:`shape`. Names carry our
    pid and ``index`` (``kvmb<pid>n<index>``), so runs and several links do not
    collide; the namespace, the link and the peer are owned and go on any exit."""

    def __init__(self, key_file: str, index: int = 0, *peer_args: str) -> None:
        tag = f"kvmb{os.getpid()}" + (f"n{index}" if index else "")
        self.ns, self.host_if, self.peer_if = tag, tag + "h", tag + "p"
        self.host, peer = f"10.78.{index}.1", f"10.78.{index}.2"
        self.address = f"{peer}:7070"
        own_netns(self.ns)
        own_link(self.host_if, "type", "veth", "peer", "name", self.peer_if)
        run = lambda *c: subprocess.run(c, check=True, capture_output=True, timeout=30)  # noqa: E731
        run("ip", "link", "set", self.peer_if, "netns", self.ns)
        run("ip", "addr", "add", f"{self.host}/24", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        for c in (
            ["ip", "addr", "add", f"{peer}/24", "dev", self.peer_if],
            ["ip", "link", "set", self.peer_if, "up"],
            ["ip", "link", "set", "lo", "up"],
        ):
            run("ip", "netns", "exec", self.ns, *c)
        fail_point("netns")
        self.proc = launch_kvmesh(
            "peer",
            "--listen",
            self.address,
            "--plaintext",
            "--advertise",
            f"{self.address},interface=ethernet",
            *peer_args,
            prefix=("ip", "netns", "exec", self.ns),
        )

    def started(self) -> None:
        """Wait for the peer to listen (launched by the constructor)."""
        await_start(self.proc, "listening")

    def shape(self, rate: str, rate_bits: float) -> None:
        """Cap the peer->head direction (the data's) with a token bucket of
        ``rate`` (tc's spelling, ``rate_bits`` bits/s)."""
        cmd = ["tc", "qdisc", "replace", "dev", self.peer_if, "root", "tbf", "rate", rate]
        cmd += ["burst", str(tbf_burst(rate_bits)), "latency", "50ms"]
        subprocess.run(["ip", "netns", "exec", self.ns, *cmd], check=True, timeout=30)

    def received(self) -> int:
        """Bytes the head's side of the link has received (IP packets, headers in)."""
        return int(Path(f"/sys/class/net/{self.host_if}/statistics/rx_bytes").read_text())


def netns_works() -> bool:
    """Network namespaces can be made here (root and iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0
