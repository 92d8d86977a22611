"""TensorBoard logdirs: each folder that holds event files is one run (as TensorBoard shows it).

    for run in find_runs("tensorboard_log"):   # verl: tensorboard_log/<project>/<experiment>
        poll = run.poll(final=True)            # scalars since the previous poll, hparams, problems

Each event file is read from where the previous poll stopped (a run still being written is followed
cheaply); a partial record at the end waits for its writer; a record that fails its CRC is one line
naming the file, and reading goes on at the next record whose CRCs pass (`compat_tensorboard.resync`).
"""

from __future__ import annotations

from pathlib import Path

from rldiag.app.importers import compat_tensorboard as compat
from rldiag.app.importers.common import Poll, read_whole_records

EXPERIMENT = "tensorboard"
EVENTS = "tfevents"  # event files are named events.out.tfevents.<time>.<host>...


class NotALogdir(ValueError):
    """A path with no TensorBoard event file under it."""


def _is_event_file(p: Path) -> bool:
    return EVENTS in p.name and p.is_file()


def find_runs(logdir: str | Path) -> list[TensorBoardRun]:
    """One run per folder under `logdir` (itself included) that holds event files, named by its path
    relative to `logdir` (`logdir`'s own name for `logdir` itself)."""
    root = Path(logdir).expanduser().absolute()
    if not root.exists():
        raise NotALogdir(f"{root}: no such folder; give the folder that SummaryWriter(log_dir=...) wrote to "
                         "(verl: its tensorboard_log folder, $TENSORBOARD_DIR)")
    if root.is_file():
        if not _is_event_file(root):
            raise NotALogdir(f"{root}: not a TensorBoard event file (events.out.tfevents.*); give its folder")
        root = root.parent
    folders = sorted({p.parent for p in root.rglob(f"*{EVENTS}*") if p.is_file()})
    if not folders:
        raise NotALogdir(f"{root}: no TensorBoard event files (events.out.tfevents.*) in it or below it; give the "
                         "folder that SummaryWriter(log_dir=...) wrote to")
    return [TensorBoardRun(f, root) for f in folders]


class TensorBoardRun:
    """The scalars of one run folder, read incrementally across its event files."""

    tracker = "tensorboard"

    def __init__(self, folder: Path, root: Path):
        self.source = folder.resolve()
        self.name = root.name if folder == root else str(folder.relative_to(root))
        self.experiment = EXPERIMENT
        self._offsets: dict[Path, int] = {}
        self._broken: set[Path] = set()
        self._scalar_tags: set[str] = set()
        self._hparams: dict[str, object] = {}

    def poll(self, *, final: bool, limit: int = 1 << 62) -> Poll:
        out = Poll()
        for f in sorted(p for p in self.source.iterdir() if _is_event_file(p)):
            if f not in self._broken:
                self._read(f, out, final, limit)
            if out.more:
                break
        if self._hparams:
            out.params, self._hparams = self._hparams, {}
        return out

    def _read(self, f: Path, out: Poll, final: bool, limit: int) -> None:
        def parse(record: bytes, out: Poll) -> None:
            for s in compat.parse_event(record, self._scalar_tags, self._hparams):
                out.points.append((s.tag, s.step, s.wall_ms, s.value))

        self._offsets[f], broken = read_whole_records(f, self._offsets.get(f, 0), compat, parse, out, limit=limit,
                                                      final=final, what="a TensorBoard event",
                                                      writer="its writer", resync=compat.resync)
        if broken:
            self._broken.add(f)
