"""Real peer processes and a fault-injecting TCP proxy for integration tests."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# Ports handed to servers come from below the kernel's ephemeral range: a port from
# bind(0), released for a child to bind seconds later (vLLM imports for ~10 s first),
# can be taken meanwhile by any outgoing connection on the machine
PORTS_FROM = 10000
_cursor = itertools.count(os.getpid())  # where a process starts in its slice: its pid


def _port_slice() -> range:
    """This process's ports: its xdist worker's share of [PORTS_FROM, ephemeral start)
    (two workers never pick the same one); empty when the kernel leaves no room."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (low - PORTS_FROM) // workers
    return range(PORTS_FROM + worker % workers * size, PORTS_FROM + (worker % workers + 1) * size)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address: a server on any of them holds it
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port no socket holds now, for a server started in another process: the
    next bindable one of this process's slice (see ``_port_slice``), else one the
    kernel picks."""
    ports = _port_slice()
    if len(ports) >= 100:
        for _ in range(len(ports)):
            port = ports[next(_cursor) % len(ports)]
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, lines: int = 40) -> str:
    """A child's log path and last lines, for an error CI prints (CI's machine, and
    the log with it, is gone when the report is read)."""
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return f"log: {log} ({e})"
    return f"log: {log}, last {len(tail)} lines:\n" + "\n".join(tail)


def lost_port_race(log: Path, since: int = 0) -> bool:
    """What a server wrote to ``log`` after its first ``since`` bytes says a port it
    took was taken first (vLLM takes its internal ports by ``bind(0)`` and release, a
    race nothing outside it can close): worth one more start."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            return b"Address already in use" in f.read()
    except OSError:
        return False


class Peer:
    """``kvmesh peer`` in its own process."""

    def __init__(
        self,
        *args: str,
        port: int = 0,
        alias: str = "peer",
        log_dir: Path | None = None,
        command: tuple[str, ...] = ("kvmesh.cli", "peer"),
    ) -> None:
        self.args = args
        self.command = command
        self.alias = alias
        self.port = port or free_port()
        self.log_dir = log_dir
        self.proc: subprocess.Popen[str] | None = None
        self.epoch = ""
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            *self.command,
            "--listen",
            self.address,
            "--alias",
            self.alias,
            "--gossip-interval",
            "0.3",
            "--ttl",
            "2",
            *self.args,
        ]
        err = open(self.log_dir / f"{self.alias}.log", "a") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ.copy()
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (\S+) epoch (\w+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"peer did not start: {line!r}")
        self.epoch = m.group(2)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        return self.proc.wait(10)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def restart(self) -> None:
        self.kill()
        self.start()


class FaultProxy:
    """TCP proxy in front of a peer. ``corrupt_at(n)`` flips one bit of the n-th
    server->client byte counted from the call; ``stall()`` stops forwarding."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._corrupt_at: int | None = None
        self._stall_at: int | None = None
        self._down = 0
        self.stalled = threading.Event()
        self.corrupted = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def corrupt_at(self, n: int) -> None:
        with self._lock:
            self._down, self._corrupt_at = 0, n

    def stall_at(self, n: int) -> None:
        """Forward ``n`` more server->client bytes, then stop until ``stalled`` is cleared."""
        with self._lock:
            self._down, self._stall_at = 0, n

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(self.target)
            except OSError:
                c.close()
                continue
            self._socks += [c, s]
            self.connections += 1
            threading.Thread(target=self._pipe, args=(c, s, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if down and self._stall_at is not None and self._down + len(data) > self._stall_at:
                    with self._lock:
                        cut = max(0, self._stall_at - self._down)
                        self._stall_at = None
                        self._down += cut
                    dst.sendall(data[:cut])
                    data = data[cut:]
                    self.stalled.set()
                while self.stalled.is_set():
                    time.sleep(0.01)
                if down:
                    with self._lock:
                        if (
                            self._corrupt_at is not None
                            and self._down + len(data) > self._corrupt_at
                        ):
                            buf = bytearray(data)
                            buf[self._corrupt_at - self._down] ^= 0x10
                            data = bytes(buf)
                            self._corrupt_at = None
                            self.corrupted += 1
                        self._down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def sever(self) -> None:
        """Reset every proxied connection, as a dead host's link would."""
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it (close would not)
            with contextlib.suppress(OSError):
                s.close()
        self._socks.clear()

    def close(self) -> None:
        self.sever()
        self.sock.close()
