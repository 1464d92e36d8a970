"""The file operations the chunk store performs, as one injectable object.

``ChunkStore`` never calls ``os`` directly for anything that touches its files: it goes through a
:class:`FileOps`. Tests pass a subclass that records the order of operations (durability: write,
fsync file, rename, fsync directory) or that stops a writer process at a chosen step (crash tests);
a benchmark can pass one that drops the page cache after each write.

This module deliberately knows nothing about chunk formats, keys or caps: it is thin, blocking,
path-based POSIX I/O that never follows a symlink in the last path component.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

#: flags for opening an existing chunk file to read it; O_NOFOLLOW refuses a symlink
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
#: flags for creating a new temporary file; O_EXCL never reuses (or follows) an existing name
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

#: errno values that say the file system has no room for a write: no space left, quota spent
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class FileOps:
    """Real POSIX file operations. Subclass and override to observe or interrupt them."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """Open ``path`` and return a file descriptor."""
        return os.open(path, flags, mode)

    def write(self, fd: int, buffers: Sequence[bytes | memoryview]) -> int:
        """Write all ``buffers`` in order (one logical step; loops over short writes)."""
        total = 0
        pending = [memoryview(b).cast("B") for b in buffers if len(b)]
        while pending:
            n = os.writev(fd, pending[:1024])  # IOV_MAX is 1024 on Linux
            total += n
            while n and pending:
                head = pending[0]
                if n >= len(head):
                    n -= len(head)
                    pending.pop(0)
                else:
                    pending[0] = head[n:]
                    n = 0
        return total

    def fsync(self, fd: int) -> None:
        """Flush a file's data and metadata to stable storage."""
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        """Read up to ``n`` bytes at ``offset`` (fewer only at end of file)."""
        parts = []
        while n > 0:
            b = os.pread(fd, n, offset)
            if not b:
                break
            parts.append(b)
            n -= len(b)
            offset += len(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def pread_into(self, fd: int, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset`` (fewer bytes only at end of file); returns bytes read.

        One copy from the page cache straight into the caller's (writable) buffer.
        """
        view = memoryview(buf).cast("B")
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                break
            got += n
        return got

    def fadvise_willneed(self, fd: int, offset: int = 0, length: int = 0) -> None:
        """Start reading ``length`` bytes at ``offset`` (0: to the end) into the page cache in the
        background (a hint)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def lstat(self, path: str) -> os.stat_result:
        """stat without following a symlink."""
        return os.lstat(path)

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` by ``src`` (same directory)."""
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (a rename, a new or removed file) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o700)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)
