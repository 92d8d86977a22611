"""A real small filesystem for the journal's fault tests: a tmpfs of a few hundred KB mounted under the
test's tmp folder (CI and the dev machine run as root), filled and freed by writing a real file."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


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


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[SmallFs]:
    """A 256 KiB tmpfs at tmp_path/small, unmounted after the test."""
    root = tmp_path / "small"
    root.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(root)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {root} ({proc.stderr.strip()}); these fault tests need root")
    try:
        yield SmallFs(root)
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True, check=False)
