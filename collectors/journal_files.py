"""A journal's files, made and written so that a kill at any moment leaves nothing a later writer cannot tell
apart: a new segment has its name only with its header whole (`new_segment_file`), every line goes to the OS
in one call sequence (`write_all`), and a file ours is deleted without error where it is already gone.

Why the header first: a segment made in place (O_EXCL) and its header written after left, when the writer was
SIGKILLed between the two, a headerless file named like a segment; every later writer rightly takes such a file
for possibly the user's (foreign: never touched), so it stayed for good (tests/collectors/test_journal_roll_kill.py,
once in a fresh-clone suite: segment 4 left after the restart).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from rldiag.collectors.journal_read import segment_path

# link(2) refused by the filesystem (no hard links: some FUSE and network mounts): the segment is made in place
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)


def header_tmp(folder: Path, stem: str) -> Path:
    """Where a new segment of `stem` gets its header before its name: made and removed under the stem's lock,
    so whoever holds the lock may remove one left by a writer killed there."""
    return folder / f".{stem}.new"


def new_segment_file(folder: Path, stem: str, number: int, header: Callable[[int], bytes]) -> tuple[int, Path, int, int]:
    """A new segment of `stem` numbered `number` or, where a file is there already (a file of the user's with a
    segment's name), the next free number: (its fd, open for appending; its path; its number; its size). Its
    `header(number)` is written under a hidden name of the stem's (`header_tmp`) and hard-linked into place.
    Where the filesystem has no hard links, the file is made in place (O_EXCL) and its header written after."""
    tmp = header_tmp(folder, stem)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    fd = os.open(tmp, flags | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        private(fd)
        while True:
            line = header(number)
            os.ftruncate(fd, 0)
            write_all(fd, line)
            path = segment_path(folder, stem, number)
            try:
                os.link(tmp, path)
            except FileExistsError:
                number += 1
                continue
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                os.close(fd)
                fd = -1
            break
    except BaseException:
        if fd >= 0:
            os.close(fd)
        unlink(tmp)
        raise
    unlink(tmp)
    if fd >= 0:
        return fd, path, number, len(line)
    return _in_place(folder, stem, number, header, flags)


def _in_place(folder: Path, stem: str, number: int, header: Callable[[int], bytes], flags: int) -> tuple[int, Path, int, int]:
    while True:
        path = segment_path(folder, stem, number)
        try:
            fd = os.open(path, flags | os.O_EXCL, 0o600)
            break
        except FileExistsError:
            number += 1
    try:
        private(fd)
        write_all(fd, header(number))
    except BaseException:
        os.close(fd)
        unlink(path)  # made here (O_EXCL), its header not whole: ours, and not a journal
        raise
    return fd, path, number, os.fstat(fd).st_size


def private(fd: int) -> None:
    """Our file readable by us alone (a journal holds the run's metrics and its tracking URI)."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077 and st.st_uid == os.getuid():
        os.fchmod(fd, 0o600)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
