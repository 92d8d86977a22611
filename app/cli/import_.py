"""`rldiag import tensorboard LOGDIR` and `rldiag import wandb RUN_DIR`: tracker runs into MLflow runs."""

from __future__ import annotations

import argparse
import fnmatch
import json
import signal
import threading

from rldiag.app.cli.options import CliError, add_tracking_option, positive_seconds
from rldiag.collectors.keys import ROLES, TAG_GROUP, TAG_ROLE, TAG_VARIANT

EXAMPLES = """\
examples:
  rldiag import tensorboard tensorboard_log/ --group gsm8k --role reference
  rldiag import wandb wandb/offline-run-20261207_065157-fkd04nes --group gsm8k --role candidate --variant fix
  rldiag import wandb wandb/ --map runs.json       # per-run tags by name patterns
  rldiag import tensorboard tb/ --follow &          # keep importing while it trains; rldiag watch sees it
a mapping file (--map) is JSON: {"<run name pattern>": {"group": ..., "role": ..., "variant": ...}, ...};
patterns are shell-style (fnmatch) on the run's name (TensorBoard: its folder relative to LOGDIR; W&B: its
display name, else its id); every matching entry applies, later ones win, and they override the flags.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Import TensorBoard logdirs or W&B run folders (online or offline) into the tracking store: "
                     "one MLflow run per source run, every scalar at its step (NaN and inf kept), config as params. "
                     "Importing again adds only new points.")
    p.epilog = EXAMPLES
    p.add_argument("tracker", choices=("tensorboard", "wandb"), help="the tracker that wrote PATH")
    p.add_argument("path", metavar="PATH",
                   help="TensorBoard: a logdir (every folder under it with event files is a run); W&B: a run folder "
                        "(wandb/run-... or wandb/offline-run-...), a run-<id>.wandb file, or the wandb/ folder")
    p.add_argument("--experiment", default=None, metavar="NAME",
                   help="MLflow experiment for new runs (default: the W&B project, or 'tensorboard')")
    p.add_argument("--group", default=None, help=f"tag {TAG_GROUP} on every imported run")
    p.add_argument("--role", default=None, choices=ROLES, help=f"tag {TAG_ROLE} on every imported run")
    p.add_argument("--variant", default=None, help=f"tag {TAG_VARIANT} on every imported run")
    p.add_argument("--map", default=None, metavar="FILE",
                   help="JSON mapping of run-name patterns to group/role/variant")
    p.add_argument("--follow", action="store_true",
                   help="keep importing runs that are still being written (and new runs under PATH) until Ctrl-C "
                        "or SIGTERM")
    p.add_argument("--interval", default="10", metavar="SECONDS",
                   help="seconds between polls with --follow (default 10)")
    p.add_argument("--max-polls", type=int, default=None, metavar="N", help="with --follow, stop after N polls")
    add_tracking_option(p)


def _interval(raw: str) -> float:
    return positive_seconds(raw, example=10)


FIELDS = {"group": TAG_GROUP, "role": TAG_ROLE, "variant": TAG_VARIANT}


def load_map(path: str) -> list[tuple[str, dict[str, str]]]:
    """The mapping file's (pattern, {tag: value}) entries, checked: one line naming the file and the fix."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise CliError(f"--map {path!r}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise CliError(f"--map {path!r} is not JSON ({e.msg} at line {e.lineno}); write "
                       '{"<run name pattern>": {"group": "...", "role": "reference"}}') from None
    if not isinstance(raw, dict):
        raise CliError(f"--map {path!r} holds a {type(raw).__name__}, not an object; write "
                       '{"<run name pattern>": {"group": "...", "role": "reference"}}')
    out = []
    for pattern, entry in raw.items():
        if not isinstance(entry, dict) or not set(entry) <= set(FIELDS) or \
                not all(isinstance(v, str) for v in entry.values()):
            raise CliError(f"--map {path!r}: the entry for {pattern!r} is {entry!r}; give an object with string "
                           f"values for some of {sorted(FIELDS)}")
        if "role" in entry and entry["role"] not in ROLES:
            raise CliError(f"--map {path!r}: role {entry['role']!r} for {pattern!r} is not one of {ROLES}")
        out.append((pattern, {FIELDS[k]: v for k, v in entry.items()}))
    return out


def tags_for(args: argparse.Namespace, mapping: list[tuple[str, dict[str, str]]]):
    base = {FIELDS[k]: getattr(args, k) for k in FIELDS if getattr(args, k) is not None}

    def tags(name: str) -> dict[str, str]:
        out = dict(base)
        for pattern, entry in mapping:
            if fnmatch.fnmatchcase(name, pattern):
                out.update(entry)
        return out

    return tags


def run(args: argparse.Namespace) -> int:
    from rldiag.app.importers.loop import find_runs, import_path
    from rldiag.collectors.settings import default_tracking_uri

    interval = _interval(args.interval)
    if args.max_polls is not None and args.max_polls < 1:
        raise CliError(f"--max-polls {args.max_polls} is under 1; give a number of polls, e.g. --max-polls 60")
    mapping = load_map(args.map) if args.map else []
    find_runs(args.tracker, args.path)  # no runs at all: one line (ValueError), before any store is touched
    uri = args.tracking_uri or default_tracking_uri()
    # SIGTERM (kill, systemd, Kubernetes; a backgrounded `--follow &` never gets Ctrl-C) stops following as
    # Ctrl-C does: the imported runs are ended, never left RUNNING for the watcher
    on_term = args.follow and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_term else None
    try:
        return import_path(args.tracker, args.path, uri, tags_for=tags_for(args, mapping),
                           experiment=args.experiment, follow=args.follow, interval_s=interval,
                           max_polls=args.max_polls, say=lambda line: print(line, flush=True))
    finally:
        if on_term:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
