"""Secrets kept in files: read only when they are this user's alone.

:func:`read_private` opens a file once (never through a symbolic link), checks
what it opened — a regular file, owned by the effective user, neither readable
nor writable by group or others — and reads that same descriptor, so no rename
between the check and the read can swap what is read. A file that fails a check
is a :class:`PrivateFileError` naming the fix; nothing is loosened or repaired.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_PRIVATE_BYTES = 1 << 20  # a key or a secret, never a large file


class PrivateFileError(ValueError):
    """A secret file that is not this user's alone, or cannot be read."""


def read_private(path: str | Path) -> str:
    """The text of ``path`` if only this user may read or write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise PrivateFileError(f"{path}: cannot read it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PrivateFileError(f"{path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise PrivateFileError(f"{path}: belongs to another user (it must be yours alone)")
        if st.st_mode & 0o077:
            raise PrivateFileError(f"{path}: other users may read or write it: chmod 600 it")
        data = f.read(MAX_PRIVATE_BYTES + 1)
    if len(data) > MAX_PRIVATE_BYTES:
        raise PrivateFileError(f"{path}: larger than {MAX_PRIVATE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PrivateFileError(f"{path}: not UTF-8 text") from None


__all__ = ["MAX_PRIVATE_BYTES", "PrivateFileError", "read_private"]
