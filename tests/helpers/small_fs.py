"""A real small filesystem for the journal's fault tests (the `small_fs` fixture, tests/collectors/conftest.py):
a mounted tmpfs filled and freed by writing a real file."""

from __future__ import annotations

import os
from pathlib import Path


class SmallFs:
    """A mounted tmpfs: `fill()` writes a filler file until the disk is full, `free()` removes it."""

    def __init__(self, root: Path):
        self.root = root
        self.filler = root / "filler.bin"

    def fill(self) -> int:
        """Write until ENOSPC; the bytes written."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        n = 0
        try:
            while True:
                n += os.write(fd, b"\0" * 4096)
        except OSError as e:
            if e.errno != 28:  # ENOSPC: full, as wanted
                raise
        finally:
            os.close(fd)
        return n

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def used(self) -> int:
        st = os.statvfs(self.root)
        return (st.f_blocks - st.f_bfree) * st.f_frsize
