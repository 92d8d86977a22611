"""A real small filesystem for the journal's fault tests: a tmpfs of a few hundred KB mounted under the
test's tmp folder (CI and the dev machine run as root), filled and freed by writing a real file."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.small_fs import SmallFs


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
