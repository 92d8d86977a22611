"""`rldiag report`: the command line of `rldiag.app.report` (a library usable without argparse)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rldiag.app.cli.options import CliError, add_detector_option, add_tracking_option, store_failed
from rldiag.app.report.names import DEFAULT_HTML, DEFAULT_MARKDOWN, EXAMPLES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EXAMPLES
    p.add_argument("--reference", action="append", default=None, metavar="RUN",
                   help="reference run: its name, id or id prefix (repeatable: several seeds make a noise band)")
    p.add_argument("--group", default=None, metavar="G",
                   help="compare the runs tagged rldiag.group=G: rldiag.role=reference vs rldiag.role=candidate")
    p.add_argument("--candidate", action="append", default=None, metavar="RUN",
                   help="candidate run: name, id or id prefix (repeatable; default: the group's candidates)")
    p.add_argument("--experiment", default=None, metavar="NAME", help="only runs of this experiment")
    p.add_argument("--all-groups", action="store_true",
                   help="one report per rldiag.group that has reference and candidate runs (in --experiment, "
                        "else the whole store), each in DIR/<group>/")
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
    from rldiag.app.data.store import store_errors
    from rldiag.app.errors import DataError
    from rldiag.app.report.build import build_report, departure_lines

    out = Path(args.out) if args.out else Path(".")
    html_path = Path(args.html) if args.html else out / DEFAULT_HTML
    md_path = Path(args.markdown) if args.markdown else out / DEFAULT_MARKDOWN
    metrics = [k.strip() for m in args.metrics for k in m.split(",") if k.strip()] if args.metrics else None

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"rldiag report: {msg}", file=sys.stderr, flush=True)

    # before the store is read and the report built (seconds to minutes): a folder it cannot write is one line now
    for path in ([out] if args.all_groups else [html_path, md_path]):
        _check_writable(path if args.all_groups else path.parent)
    if args.all_groups:
        if args.group or args.reference or args.candidate or args.html or args.markdown:
            raise CliError("--all-groups writes every group's report into --out DIR/<group>/; drop --group, "
                           "--reference, --candidate, --html and --markdown with it")
        return _all_groups(args, out, metrics, progress)
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


def _check_writable(folder: Path) -> None:
    """CliError naming `folder` and the fix unless the report can be written there (made if missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".rldiag-write-check-"):
            pass
    except OSError as e:
        raise CliError(f"cannot write the report into {str(folder)!r} ({e.strerror or e}); pass --out DIR (or "
                       "--html/--markdown FILE) somewhere writable") from None


def comparable_groups(tracking_uri: str | None, experiment: str | None) -> list[str]:
    """The rldiag.group values with both reference and candidate runs, sorted."""
    from rldiag.app.data.runs import find_runs
    from rldiag.app.data.store import open_store

    runs = find_runs(open_store(tracking_uri), experiments=experiment)
    roles = runs.groupby("group")["role"].agg(set) if len(runs) else {}
    return sorted(str(g) for g, r in dict(roles).items() if g and {"reference", "candidate"} <= set(r))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"


def _all_groups(args: argparse.Namespace, out: Path, metrics, progress) -> int:
    from rldiag.app.data.store import store_errors
    from rldiag.app.errors import DataError
    from rldiag.app.report.build import build_report, departure_lines
    from rldiag.collectors import keys as K

    try:
        groups = comparable_groups(args.tracking_uri, args.experiment)
    except DataError as e:
        raise CliError(str(e)) from None
    except store_errors() as e:
        raise store_failed(args.tracking_uri, e) from None
    if not groups:
        raise CliError("no rldiag.group has both reference and candidate runs"
                       + (f" in experiment {args.experiment!r}" if args.experiment else "")
                       + f"; tag runs {K.TAG_ROLE}=reference / candidate and rldiag.group=G")
    from rldiag.app.report.html import PLOTLY_FILE, plotly_js

    try:  # plotly.js once beside the group folders, not 4.8 MB in every group's page
        (out / PLOTLY_FILE).write_text(plotly_js(), encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot write the report ({e}); pass --out DIR somewhere writable") from None
    failed = []
    for g in groups:
        progress(f"group {g!r} ({groups.index(g) + 1} of {len(groups)})")
        try:
            report = build_report(args.tracking_uri, group=g, experiment=args.experiment, keys=metrics,
                                  progress=progress, plotly_src=f"../{PLOTLY_FILE}")
            written = report.write(out / _safe(g) / DEFAULT_HTML, out / _safe(g) / DEFAULT_MARKDOWN)
        except OSError as e:
            raise CliError(f"cannot write the report ({e}); pass --out DIR somewhere writable") from None
        except Exception as e:  # noqa: BLE001 - one group's failure never costs the other groups their report
            why = str(e) if isinstance(e, (DataError, ValueError)) else f"{type(e).__name__}: {e} (a bug in rldiag)"
            print(f"rldiag report: group {g!r}: no report: {why.splitlines()[0] if why else type(e).__name__}",
                  file=sys.stderr, flush=True)
            failed.append(g)
            continue
        print(f"## group {g}: wrote {', '.join(str(p) for p in written)}")
        for line in departure_lines(report):
            print(line)
    if failed:
        print(f"rldiag report: {len(failed)} of {len(groups)} groups got no report: {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed else 0

