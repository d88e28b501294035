"""The disk tier's files: one verified block per file, crash-safe.

Layout of a disk tier directory::

    DIR/blocks/<digest hex>.kvb   one block's wire blob (codec form), named by its digest
    DIR/tmp/                      files being written; anything here at start is torn

Contract:

- A file is written to ``tmp/``, flushed, fsync'd and renamed into ``blocks/``; the
  directory is fsync'd after each batch. SIGKILL at any moment leaves either a
  whole file under its final name or a temp file, which the next start deletes.
- :meth:`DiskFiles.scan` reads headers only (never payloads), parsed strictly (the
  codec's card-free form checks): a file whose name, prefix, header or size is
  wrong is deleted and counted as ``corrupt``. Cards are checked by the store
  once it knows them (``BlockStore.expect``), and by every import.
- :meth:`DiskFiles.open` verifies the digest of the whole file against its name
  before returning a block (under either block-digest algorithm, BLAKE3 tried
  first; both are cryptographic) and raises on a mismatch (the store deletes the
  file and counts it). A block of at most ``MAX_CHUNK_BYTES`` is read into one
  ``bytes``; a larger one is an ``mmap``-backed view that a fetch slices chunk by
  chunk.
- :class:`Writer` is one thread draining a byte-bounded queue: a request never
  waits on a disk write, and a full queue refuses (the caller drops the write).

The index, budget and eviction order of the tier live in :mod:`kvmesh.store.disk`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..codec import (
    MAX_CHUNK_BYTES,
    MAX_HEADER_BYTES,
    PREFIX,
    Block,
    BlockHeader,
    block_digest,
    check_form,
    read_header,
)
from ..codec import parse_prefix as _parse_prefix
from ..compat import BLOCK_DIGESTS
from ..errors import MalformedPayload

SUFFIX = ".kvb"
ADMIT = ("evicted", "hit")
DEFAULT_QUEUE_BYTES = 64 << 20


@dataclass(frozen=True)
class DiskConfig:
    """A disk tier under a store's RAM tier.

    ``admit="evicted"``: every block is also written to disk (behind, by the
    writer thread), so a block leaving RAM is still on disk and a SIGKILL loses
    only the writes in flight. ``admit="hit"``: only blocks hit at least once are
    written (sparing SSD writes); the others are dropped when RAM evicts them.
    A disk block hit ``promote_hits`` times is copied back into RAM when it fits."""

    path: str
    budget_bytes: int
    admit: str = "evicted"
    promote_hits: int = 1
    queue_bytes: int = DEFAULT_QUEUE_BYTES

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("disk budget must be positive")
        if self.admit not in ADMIT:
            raise ValueError(f"disk admission must be one of {ADMIT}")


@dataclass
class DiskStats:
    budget_bytes: int
    used_bytes: int = 0
    entries: int = 0
    hits: int = 0  # lookups answered (in part) from disk
    admissions: int = 0  # files written
    evictions: int = 0  # files deleted to stay within the budget
    promotions: int = 0  # disk blocks copied back into RAM
    corrupt: int = 0  # files found bad (scan or read) and deleted
    torn: int = 0  # temp files of interrupted writes, deleted at start
    orphans: int = 0  # files whose parent chain was gone at start, deleted
    dropped: int = 0  # writes refused (queue full, no room, I/O error)


@dataclass(frozen=True)
class DiskRecord:
    """What a scan learns from one file without reading its payload."""

    header: BlockHeader
    digest: bytes
    nbytes: int
    mtime: float


class _Interner:
    """Blocks of one namespace share their layer specs: keep one copy in the index."""

    def __init__(self) -> None:
        self._seen: dict[Any, Any] = {}

    def __call__(self, value: Any) -> Any:
        return self._seen.setdefault(value, value)


def read_disk_header(raw: bytes, intern: Callable[[Any], Any] = lambda v: v) -> BlockHeader:
    """A file's header, parsed strictly but without a card (a disk tier serves
    many namespaces): the codec's structure and card-free form checks. The store
    checks it against the card too once it knows the namespace's layout."""
    header = read_header(raw, intern=intern)
    check_form(header)
    return header


class DiskFiles:
    """The files of one disk tier directory (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.blocks = self.root / "blocks"
        self.tmp = self.root / "tmp"
        self.blocks.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.reads = 0

    def path(self, digest: bytes) -> Path:
        return self.blocks / (digest.hex() + SUFFIX)

    # -- start --------------------------------------------------------------

    def clear_torn(self) -> int:
        """Delete the temp files of writes a crash interrupted."""
        n = 0
        for entry in os.scandir(self.tmp):
            unlink(entry.path)
            n += 1
        return n

    def scan(self, on_bad: Callable[[str, str], None]) -> Iterator[DiskRecord]:
        """Every well-formed file's record; ``on_bad(path, why)`` for the others
        (the caller deletes and counts them)."""
        intern = _Interner()
        for entry in os.scandir(self.blocks):
            try:
                yield self._record(entry, intern)
            except (MalformedPayload, OSError) as e:
                on_bad(entry.path, str(e))

    def _record(self, entry: os.DirEntry[str], intern: _Interner) -> DiskRecord:
        name = entry.name
        if not (name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX)):
            raise MalformedPayload("not a block file name")
        digest = bytes.fromhex(name[:64])
        st = entry.stat()
        with open(entry.path, "rb", buffering=0) as f:
            head = f.read(PREFIX.size + MAX_HEADER_BYTES)
        end = PREFIX.size + _parse_prefix(head)
        if len(head) < end:
            raise MalformedPayload("truncated header")
        header = read_disk_header(head[PREFIX.size : end], intern)
        if st.st_size != end + header.payload_bytes:
            raise MalformedPayload(f"file is {st.st_size} bytes, header says more or less")
        return DiskRecord(header, digest, st.st_size, st.st_mtime)

    # -- reads and writes ---------------------------------------------------

    def open(self, header: BlockHeader, digest: bytes, nbytes: int) -> Block:
        """The verified block stored under ``digest``; raises ``MalformedPayload``
        (or ``OSError``) when the file is missing, short, long or corrupt."""
        self.reads += 1
        with open(self.path(digest), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != nbytes:
                raise MalformedPayload(f"file is {size} bytes, index says {nbytes}")
            if nbytes <= MAX_CHUNK_BYTES:
                blob: bytes | memoryview = f.read(nbytes + 1)
            else:  # streamed by slices; never whole in a Python object
                blob = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        start = nbytes - header.payload_bytes
        if len(blob) != nbytes or start < PREFIX.size:
            raise MalformedPayload("file disagrees with its header")
        for algo in BLOCK_DIGESTS:
            actual, parts = block_digest(blob, start, header, algo)
            if actual == digest:
                return Block(header, cast(bytes, blob), digest, start, parts)
        raise MalformedPayload("digest mismatch")

    def write(self, block: Block) -> None:
        """Temp name, flush, fsync, rename: the final name only ever holds a whole file."""
        tmp = self.tmp / f"{block.digest.hex()}.{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb", buffering=0) as f:
                view = memoryview(block.blob)
                while view:
                    view = view[f.write(view) :]
                os.fsync(f.fileno())
            os.replace(tmp, self.path(block.digest))
        except BaseException:
            unlink(str(tmp))
            raise

    def sync_dir(self) -> None:
        """Make renames durable (a power loss, not SIGKILL, needs this)."""
        fd = os.open(self.blocks, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, digest: bytes) -> None:
        unlink(str(self.path(digest)))


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Writer:
    """One daemon thread running ``work(key)`` for queued keys, FIFO, with the
    bytes queued bounded by ``max_bytes`` (a full queue refuses; nobody waits)."""

    def __init__(
        self, work: Callable[[bytes], None], idle: Callable[[], None], max_bytes: int
    ) -> None:
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self._work = work
        self._idle = idle
        self._queue: deque[tuple[bytes, int]] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-disk", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, nbytes: int) -> bool:
        with self._cv:
            if self._closed or self.queued_bytes + nbytes > self.max_bytes:
                return False
            self._queue.append((key, nbytes))
            self.queued_bytes += nbytes
            self._cv.notify()
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                if not self._queue:
                    self._busy = False
                    self._cv.notify_all()
                    return
                key, nbytes = self._queue.popleft()
                self._busy = True
            try:
                self._work(key)
            finally:
                with self._cv:
                    self.queued_bytes -= nbytes
                if not self._queue:
                    self._idle()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (tests, benches, clean shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
