"""`rldiag sync`: deliver the batches of a writer journal that the store never acknowledged."""

from __future__ import annotations

import argparse

from rldiag.app.cli.options import CliError, add_tracking_option


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Deliver the batches of an rldiag journal that the store never acknowledged. "
                     "Safe to run twice: SQL stores keep identical points once.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="journal files, e.g. .rldiag/spill/<run_id>.jsonl (a journal's segments <run_id>.K.jsonl are "
                        "read with it), or a spill folder for every journal in it")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to keep trying per file (default: 120)")
    add_tracking_option(p)


def _journals(files: list[str]) -> list[tuple[str, bool]]:
    """Each journal once, with whether it was found in a folder (not named): several segments of one
    journal name it once; a folder names each stem of a `.jsonl` file in it."""
    from pathlib import Path

    from rldiag.collectors.journal_read import journal_stems, segment_path, split_name

    out: list[tuple[str, bool]] = []
    seen: set[tuple[Path, str]] = set()
    for f in files:
        p = Path(f)
        named = [(p, stem, str(segment_path(p, stem, 0))) for stem in journal_stems(p)] if p.is_dir() else \
            [(*split_name(p)[:2], f)]
        for folder, stem, shown in named:
            if (folder.resolve(), stem) not in seen:
                seen.add((folder.resolve(), stem))
                out.append((shown, p.is_dir()))
    return out


def run(args: argparse.Namespace) -> int:
    from rldiag.collectors.sync import JournalBusy, JournalError, NotAJournal, sync_journal

    status = 0
    for f, in_folder in _journals(args.files):
        try:
            stats, corrupt = sync_journal(f, tracking_uri=args.tracking_uri, timeout_s=args.timeout,
                                          on_note=lambda note, f=f: print(f"{f}: {note}", flush=True))
        except JournalBusy as e:
            # Its live writer delivers it: not a failure; never replayed or removed from here.
            print(f"{f}: skipped: held by a live writer ({e.holder}), which delivers it; run sync again after "
                  "that process has ended", flush=True)
            continue
        except NotAJournal as e:
            # Never changed, never deleted: one line, and a failure only when it was named on its own.
            print(f"{e.path}: skipped: not an rldiag journal ({e.why}); left as it is", flush=True)
            if not in_folder:
                status = 2
            continue
        except JournalError as e:
            raise CliError(str(e)) from None
        note = f", {corrupt} damaged lines skipped" if corrupt else ""
        if stats.lost:
            note += f", {stats.lost} points in lines that could not be read back"
        if stats.journaled:
            status = 1
            print(f"{f}: delivered {stats.delivered} points, {stats.journaled} still undelivered "
                  f"(last error: {stats.last_error}); the file is kept, run sync again{note}")
        elif stats.undelivered:  # only damaged lines are left: syncing again cannot deliver them
            status = 1
            print(f"{f}: delivered {stats.delivered} points; the journal is kept, holding only lines that "
                  f"cannot be read back{note}")
        else:
            print(f"{f}: delivered {stats.delivered} points; journal removed{note}")
    return status
