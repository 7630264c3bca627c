"""Opening a file that something other than this process may have put in place: a FIFO with no writer
would block open() (and read()) forever, a device or folder holds no data of its own, and a symlink may
point anywhere. Used for trace and key files, the SSD tier's LOCK and flush mark."""

from __future__ import annotations

import os
import stat

_ALWAYS = os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


class NotRegularFile(OSError):
    """The path names a FIFO, device, socket or folder."""


def open_regular(
    path: str | os.PathLike, flags: int = os.O_RDONLY, *, follow: bool = True, mode: int = 0o644
) -> int:
    """A descriptor of `path` opened with `flags` (plus O_NONBLOCK, O_CLOEXEC, O_NOCTTY; O_NOFOLLOW unless
    `follow`), or NotRegularFile (nothing left open) when it is not a regular file. The descriptor stays
    non-blocking; that changes nothing for a regular file."""
    fd = os.open(path, flags | _ALWAYS | (0 if follow else os.O_NOFOLLOW), mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(0, "not a regular file (a FIFO, device or folder)")
    except BaseException:
        os.close(fd)
        raise
    return fd
