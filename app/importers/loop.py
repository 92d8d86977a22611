"""Import every run at a path once, or keep importing them (`follow`) until Ctrl-C or `max_polls`.

    status = import_path("wandb", "wandb/", "sqlite:///mlruns.db", tags_for=lambda name: {})

Each poll reads what the trackers wrote since the previous one and sends it; with `follow`, new runs
under the path are picked up too, a W&B run ends when its exit record arrives, and the others are
ended FINISHED when following stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from rldiag.app.importers.common import Outcome, Reader, RunImport

TRACKERS = ("tensorboard", "wandb")


def find_runs(tracker: str, path: str) -> list[Reader]:
    """The tracker's runs at `path`; ValueError (one line naming the path) when there are none."""
    if tracker == "tensorboard":
        from rldiag.app.importers.tensorboard import find_runs as find
    elif tracker == "wandb":
        from rldiag.app.importers.wandb import find_runs as find
    else:
        raise ValueError(f"tracker {tracker!r} is not one of {TRACKERS}")
    return find(path)


def import_path(
    tracker: str,
    path: str,
    tracking_uri: str,
    *,
    tags_for: Callable[[str], Mapping[str, str]],
    experiment: str | None = None,
    follow: bool = False,
    interval_s: float = 10.0,
    max_polls: int | None = None,
    say: Callable[[str], None] = print,
) -> int:
    """Import (and with `follow`, keep importing) every run at `path`. Returns 0, or 1 when a file had a
    problem or points were not delivered (each said in one line through `say`)."""
    imports: dict[str, RunImport] = {}
    ended: set[str] = set()  # runs whose tracker recorded their end: not opened again while following
    status, polls = 0, 0
    try:
        while True:
            polls += 1
            last = not follow or (max_polls is not None and polls >= max_polls)
            for reader in _runs(tracker, path, first=polls == 1, say=say):
                key = str(reader.source)
                if key not in imports and key not in ended:
                    imports[key] = RunImport(reader, tracking_uri, tags=tags_for, experiment=experiment)
            for key, imp in list(imports.items()):
                before = _points(imp)
                out = imp.poll(final=last)
                for line in out.problems:
                    say(line)
                    status = 1
                out.problems.clear()
                if not follow:  # one run at a time: its writer's threads end before the next run's start
                    status |= _finish(imp, out.ended or "FINISHED", say)
                    del imports[key]
                    continue
                if out.run_id and _points(imp) > before:
                    imp.flush()
                    say(f"{imp.reader.name}: +{_points(imp) - before} points (run {out.run_id})")
                if out.ended is not None:
                    status |= _finish(imp, out.ended, say)
                    del imports[key]
                    ended.add(key)
            if last:
                break
            time.sleep(interval_s)
    except KeyboardInterrupt:
        say("stopped following; ending the imported runs")
    for imp in imports.values():
        status |= _finish(imp, imp.outcome.ended if imp.outcome and imp.outcome.ended else "FINISHED", say)
    return status


def _runs(tracker: str, path: str, *, first: bool, say: Callable[[str], None]) -> list[Reader]:
    """The runs at `path`; while following, a path that has gone is said, and the runs known go on."""
    try:
        return find_runs(tracker, path)
    except ValueError as e:
        if first:
            raise
        say(f"{e} (following the runs already found)")
        return []


def _points(imp: RunImport) -> int:
    return imp.outcome.points if imp.outcome is not None else 0


def _finish(imp: RunImport, end: str, say: Callable[[str], None]) -> int:
    out: Outcome | None = imp.close(end)
    if out is None:
        return 0
    verb = "new run" if out.created else "already imported run"
    skipped = f"; {out.skipped} points already imported were skipped" if out.skipped else ""
    params = f", {out.params} params" if out.params else ""
    say(f"{imp.reader.source}: {verb} {out.run_id} ({imp.reader.name}): {out.points} points of {len(out.keys)} keys"
        f"{params} imported{skipped}; ended {end}")
    if out.undelivered:
        say(f"{imp.reader.source}: {out.undelivered} points were not delivered to the store; run the import "
            "again (it adds only what is missing)")
        return 1
    return 0
