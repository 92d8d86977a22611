"""`rldiag report`: the command line of `rldiag.app.report` (a library usable without argparse)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rldiag.app.cli.options import CliError, add_detector_option, add_tracking_option, store_failed
from rldiag.app.data.store import store_errors
from rldiag.app.errors import DataError
from rldiag.app.report.build import DEFAULT_HTML, DEFAULT_MARKDOWN, EXAMPLES, build_report, departure_lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EXAMPLES
    p.add_argument("--reference", action="append", default=None, metavar="RUN",
                   help="reference run: its name, id or id prefix (repeatable: several seeds make a noise band)")
    p.add_argument("--group", default=None, metavar="G",
                   help="compare the runs tagged rldiag.group=G: rldiag.role=reference vs rldiag.role=candidate")
    p.add_argument("--candidate", action="append", default=None, metavar="RUN",
                   help="candidate run: name, id or id prefix (repeatable; default: the group's candidates)")
    p.add_argument("--experiment", default=None, metavar="NAME", help="only runs of this experiment")
    p.add_argument("--metrics", action="append", default=None, metavar="KEY[,KEY]",
                   help="metrics to chart and compare (default: every canonical metric the runs logged)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"write {DEFAULT_HTML} and {DEFAULT_MARKDOWN} into DIR (default: the current directory)")
    p.add_argument("--html", default=None, metavar="FILE", help="the HTML report's path (overrides --out)")
    p.add_argument("--markdown", default=None, metavar="FILE", help="the Markdown summary's path (overrides --out)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_tracking_option(p, read=True)
    add_detector_option(p)


def run(args: argparse.Namespace) -> int:
    """`rldiag report`: see `rldiag report --help`."""

    out = Path(args.out) if args.out else Path(".")
    html_path = Path(args.html) if args.html else out / DEFAULT_HTML
    md_path = Path(args.markdown) if args.markdown else out / DEFAULT_MARKDOWN
    metrics = [k.strip() for m in args.metrics for k in m.split(",") if k.strip()] if args.metrics else None

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"rldiag report: {msg}", file=sys.stderr, flush=True)

    try:
        report = build_report(args.tracking_uri, reference=args.reference, candidates=args.candidate,
                              group=args.group, experiment=args.experiment, keys=metrics, progress=progress)
    except (DataError, ValueError) as e:
        raise CliError(str(e)) from None
    except store_errors() as e:
        raise store_failed(args.tracking_uri, e) from None
    try:
        written = report.write(html_path, md_path)
    except OSError as e:
        raise CliError(f"cannot write the report ({e}); pass --out DIR (or --html/--markdown FILE) "
                       "somewhere writable") from None
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    for line in departure_lines(report):
        print(line)
    return 0
