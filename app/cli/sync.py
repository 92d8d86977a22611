"""`rldiag sync`: deliver the batches of a writer journal that the store never acknowledged."""

from __future__ import annotations

import argparse

from rldiag.app.cli.options import CliError, add_tracking_option


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Deliver the batches of an rldiag journal that the store never acknowledged. "
                     "Safe to run twice: SQL stores keep identical points once.")
    p.add_argument("files", nargs="+", metavar="FILE", help="journal files, e.g. .rldiag/spill/<run_id>.jsonl")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to keep trying per file (default: 120)")
    add_tracking_option(p)


def run(args: argparse.Namespace) -> int:
    from rldiag.collectors.sync import JournalError, sync_journal

    status = 0
    for f in args.files:
        try:
            stats, corrupt = sync_journal(f, tracking_uri=args.tracking_uri, timeout_s=args.timeout,
                                          on_note=lambda note, f=f: print(f"{f}: {note}", flush=True))
        except JournalError as e:
            raise CliError(str(e)) from None
        note = f", {corrupt} damaged lines skipped" if corrupt else ""
        if stats.undelivered:
            status = 1
            print(f"{f}: delivered {stats.delivered} points, {stats.undelivered} still undelivered "
                  f"(last error: {stats.last_error}); the file is kept, run sync again{note}")
        else:
            print(f"{f}: delivered {stats.delivered} points; journal removed{note}")
    return status
