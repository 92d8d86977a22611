"""One owner per journal: an exclusive, non-blocking `flock` on `<stem>.lock` beside its segments.

The lock is taken before a writer or `rldiag sync` reads or appends a journal and held until it is done
with it; the kernel drops it when its process dies (SIGKILL included), so a journal is never held by a
dead process. The file holds the owner's pid and host, for the message that names the holder.

A lock file is deleted by its owner while still locked; whoever opened the old file meanwhile finds,
after locking it, that the path now names another file (or none) and tries again, so two owners can
never both think they hold one journal. flock is per machine: keep the spill folder on a local disk
(on NFS, two machines could each take the lock).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, journals are not locked
    fcntl = None  # type: ignore[assignment]


class JournalBusy(RuntimeError):
    """The journal is held by a live writer (or a running `rldiag sync`)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by a live writer ({holder}); it delivers the journal itself, so it was "
                         "left alone. Run rldiag sync on it after that process has ended")
        self.path = path
        self.holder = holder


@dataclass
class JournalLock:
    path: Path
    fd: int

    def release(self, *, delete: bool = True) -> None:
        """Let go; by default delete the lock file first (still locked: see the module docstring)."""
        if self.fd < 0:
            return
        if delete:
            try:
                self.path.unlink()
            except OSError:
                pass
        os.close(self.fd)  # closing the last descriptor drops the flock
        self.fd = -1

    def abandon(self) -> None:
        """In a forked child: close the copy of the descriptor, never unlock (the lock is the parent's,
        and flock's LOCK_UN on a shared descriptor would drop it for the parent too)."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


def try_lock(path: Path) -> JournalLock | None:
    """Take the lock at `path`, or None when a live process holds it. OSError if the file cannot be made."""
    for _ in range(20):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    return None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its owner deleted it between our open and our lock: take the new one
                os.close(fd)
                continue
            who = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": int(time.time())})
            os.ftruncate(fd, 0)
            os.pwrite(fd, (who + "\n").encode(), 0)
            return JournalLock(path, fd)
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    return None  # pragma: no cover - 20 owners in a row released it under us


def holder(path: Path) -> str:
    """Who holds the lock at `path`, in words ("pid 123 on host gpu-7 since 11:50:02 UTC")."""
    try:
        info = json.loads(path.read_text() or "{}")
        since = time.strftime("%H:%M:%S UTC", time.gmtime(int(info["since"])))
        return f"pid {int(info['pid'])} on host {info['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"
