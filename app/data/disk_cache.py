"""A cache on disk of what the read side builds from a store (metric histories, divergence results,
chart figures), so that a restarted dashboard opens in seconds instead of reading every point again.
It is not the store: nothing here writes to MLflow.

    cache = DiskCache.from_env()           # None when RLDIAG_CACHE_DIR=off
    cache.put("divergence", key, value)    # key: a tuple of plain values (strings, numbers, tuples)
    cache.get("divergence", key)           # the value, or None (a miss)

Entries are pickles under `RLDIAG_CACHE_DIR/<kind>/<sha256 of the key>.pkl`. The key's hash also
covers the source of `rldiag.app` and the collectors' key table, so an upgraded rldiag misses every
old entry rather than reading objects of another shape. Keys are hashed, never stored: a tracking URI
with a password in it stays out of the cache. A pickle runs code when it is loaded, so entries are read
only from a directory this user owns and nobody else can write to (made 0700) and from files this
user owns (written 0600); anything else is ignored with one warning. Beyond RLDIAG_CACHE_MB the least
recently used entries are removed. Reading or writing never fails a caller: an unreadable entry is a
miss (and is removed), a full disk a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import queue
import stat
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from rldiag.collectors.settings import EnvVar

log = logging.getLogger("rldiag.app")

RLDIAG_CACHE_DIR = EnvVar("RLDIAG_CACHE_DIR", None,
                          "Where the read side keeps its cache of metric histories and results (default: "
                          "$XDG_CACHE_HOME/rldiag, else ~/.cache/rldiag); 'off': no cache on disk.")
RLDIAG_CACHE_MB = EnvVar("RLDIAG_CACHE_MB", "4096", "Megabytes the read side's disk cache may use; the least "
                         "recently used entries go beyond it (10 runs x 8 metrics x 100k steps: about 200 MB).")
SUFFIX = ".pkl"
STALE_TMP_S = 3600  # a half-written file older than this is left over from a killed process


# What shapes a cached value: the loaders, the analyses, the figures, the dashboard's cached loaders
# (the entries' classes among them) and the key table. Pages, CLI, report and watcher do not.
VERSIONED = ("data", "analysis", "plots", "dashboard/data.py")


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the source that shapes cached values (`VERSIONED`, and the collectors' key table): part
    of every key, so that an upgraded or edited rldiag never reads an entry built by other code."""
    import rldiag.app
    import rldiag.collectors.keys

    h = hashlib.sha256()
    root = Path(rldiag.app.__file__).parent
    files = sorted(f for part in VERSIONED for f in ([root / part] if part.endswith(".py") else (root / part).rglob("*.py")))
    for path in [*files, Path(rldiag.collectors.keys.__file__)]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def default_root() -> Path | None:
    raw = RLDIAG_CACHE_DIR.get()
    if raw is not None and raw.strip().lower() in ("off", "0", "none", ""):
        return None
    if raw:
        return Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rldiag"


def _private(st: os.stat_result) -> bool:
    """Owned by this user and writable by nobody else."""
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class DiskCache:
    """Pickled entries under `root`, at most `max_bytes` in all (see the module's docstring)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._warned: set[str] = set()
        self._queue: queue.Queue | None = None
        self._lock = threading.Lock()
        self._pending: dict[Path, tuple[str, tuple, Any]] = {}

    @classmethod
    def from_env(cls) -> DiskCache | None:
        """The cache RLDIAG_CACHE_DIR and RLDIAG_CACHE_MB name, or None when it is off (a directory it
        cannot use is said, once, at the first write)."""
        root = default_root()
        if root is None:
            return None
        try:
            mb = float(RLDIAG_CACHE_MB.get())  # type: ignore[arg-type]
        except (TypeError, ValueError):
            log.warning("rldiag: RLDIAG_CACHE_MB=%r is not a number of megabytes (e.g. 4096); using 4096",
                        RLDIAG_CACHE_MB.get())
            mb = 4096.0
        return cls(root, int(mb * 1e6))

    # ---- reading ---------------------------------------------------------------------------------

    def path(self, kind: str, key: tuple) -> Path:
        digest = hashlib.sha256(repr((kind, code_version(), key)).encode()).hexdigest()
        return self.root / kind / (digest + SUFFIX)

    def get(self, kind: str, key: tuple) -> Any | None:
        """The entry for `key`, or None (none, unreadable, or in a place others can write to)."""
        path = self.path(kind, key)
        with self._lock:
            pending = self._pending.get(path)
        if pending is not None:  # queued, not yet on disk
            return pending[2]
        try:
            st = path.stat()
        except OSError:
            return None
        if not self._trusted(path.parent) or not _private(st):
            self._warn_once(str(path), f"rldiag: ignoring the cache entry {path}: it is not a private file of "
                                       "this user (another user could have written it); remove it, or set "
                                       "RLDIAG_CACHE_DIR to a directory only you can write to")
            return None
        try:
            with path.open("rb") as f:
                value = pickle.load(f)
            os.utime(path)  # least recently used: by last use, not by writing
            return value
        except Exception as e:  # noqa: BLE001 - a torn or foreign file is a miss, whatever failed
            log.warning("rldiag: cache entry %s is unreadable (%s: %s); it is removed and rebuilt",
                        path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None

    def _trusted(self, folder: Path) -> bool:
        try:
            return all(_private(p.stat()) for p in (self.root, folder))
        except OSError:
            return False

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)

    # ---- writing ---------------------------------------------------------------------------------

    def put(self, kind: str, key: tuple, value: Any) -> bool:
        """Write the entry now (atomically: a reader sees the old entry or the new one); False when
        it could not be written (a warning says why)."""
        path = self.path(kind, key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self._ensure(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
            self._warn_once(f"put:{type(e).__name__}", f"rldiag: could not write the cache entry {path} "
                                                       f"({type(e).__name__}: {e}); the dashboard works without it")
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        self.prune()
        return True

    def put_later(self, kind: str, key: tuple, value: Any) -> None:
        """`put` in a background thread (a page never waits for a write); a later value for the same
        key replaces one still queued. `get` sees a queued value at once."""
        path = self.path(kind, key)
        with self._lock:
            first = path not in self._pending
            self._pending[path] = (kind, key, value)
            if self._queue is None:
                self._queue = queue.Queue()
                threading.Thread(target=self._writer, name="rldiag-disk-cache", daemon=True).start()
        if first:
            self._queue.put(path)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued entry is written; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.02)
        return False

    def _writer(self) -> None:
        assert self._queue is not None
        while True:
            path = self._queue.get()
            with self._lock:
                item = self._pending.get(path)
            if item is not None:
                self.put(*item)
                with self._lock:
                    if self._pending.get(path) is item:
                        del self._pending[path]
                    else:  # replaced while writing: write the newer one too
                        self._queue.put(path)

    def _ensure(self, folder: Path) -> None:
        for p in (self.root, folder):
            if not p.exists():
                p.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(p, 0o700)  # mkdir's mode is masked by the umask
        if not self._trusted(folder):
            raise PermissionError(f"{self.root} or {folder} is not a private directory of this user "
                                  "(chmod 700 it, or set RLDIAG_CACHE_DIR)")

    def prune(self) -> int:
        """Remove the least recently used entries beyond `max_bytes`, and stale half-written files;
        returns the bytes in the cache afterwards."""
        entries, now = [], time.time()
        for folder in (p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else ():
            for f in folder.iterdir():
                try:
                    st = f.stat()
                except OSError:
                    continue
                if f.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_S:
                        f.unlink(missing_ok=True)
                    continue
                if f.name.endswith(SUFFIX):
                    entries.append((st.st_mtime, st.st_size, f))
        total = sum(size for _, size, _ in entries)
        for _, size, f in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            f.unlink(missing_ok=True)
            total -= size
        return total
