"""The `rldiag` command line. Subcommands import what they need when they run, so `--help` is instant."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from rldiag.app.cli.options import CliError
from rldiag.collectors.import_utils import extra_for

EPILOG = """\
The tracking store is MLFLOW_TRACKING_URI (or --tracking-uri); unset, it is the SQLite file
mlruns.db in the current directory. Examples:
  rldiag demo --nan-at 30                   the example RL loop, a NaN gradient injected at step 30
  rldiag experiment masked-vs-unmasked      reproduce NaN gradients behind a finite loss (minutes)
  rldiag app                                open the dashboard on the store
  rldiag report --group v0_vs_v1            an HTML + Markdown comparison of one group's runs
  rldiag watch --divergence                 alert on NaN gradients and departures in active runs
  rldiag preflight --model DIR              engine-trainer logprob parity before a run
  rldiag sync .rldiag/spill/                replay metrics a run could not deliver
  rldiag import tensorboard runs/exp1       a TensorBoard logdir (or a W&B run folder) into the store
  rldiag COMMAND --help                     options of one command
"""

# One module per command, imported only when that command runs (so `rldiag --help` stays instant).
# Each has `add_arguments(parser)` and `run(args) -> int`; it raises `CliError` (or ValueError) for bad
# input, which prints as one line with exit status 2.
COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help)
    "demo": ("rldiag.app.cli.demo", "run the example RL loop with rldiag's collectors into the tracking store"),
    "sync": ("rldiag.app.cli.sync", "replay a writer journal (metrics not yet delivered) into the store"),
    "experiment": ("rldiag.app.cli.experiment", "run a reproduction (masked-vs-unmasked, engine-parity) into the store"),
    "watch": ("rldiag.app.cli.watch", "alert on non-finite gradients and degenerate importance weights in active runs"),
    "report": ("rldiag.app.cli.report", "write a run-comparison report: self-contained HTML and a Markdown summary"),
    "app": ("rldiag.app.cli.app", "open the dashboard in the browser: overlay runs, divergence, NaN events, config diff"),
    "preflight": ("rldiag.app.cli.preflight", "check engine-trainer logprob parity at equal weights before a run, knob by knob"),
    "import": ("rldiag.app.cli.import_", "import TensorBoard logdirs and W&B run folders into the store (--follow: live)"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rldiag",
        description="Diagnostics for LLM RL training runs on MLflow: per-step policy metrics, "
                    "non-finite gradient alerts, run comparison.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = _command_in(argv)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == wanted:  # only the command that runs imports its module
            _command_module(name).add_arguments(p)
    return parser


class MissingExtra(Exception):
    """A command whose packages are not installed: one line naming the pip extra."""


def _command_module(name: str):
    try:
        return importlib.import_module(COMMANDS[name][0])
    except ImportError as e:
        extra = extra_for(e)
        if extra is None:
            raise
        raise MissingExtra(f"rldiag {name} needs the package {e.name!r} of the [{extra}] extra, which is not "
                           f"installed here: pip install 'rldiag[{extra}]'") from None


def _command_in(argv: list[str] | None) -> str | None:
    args = sys.argv[1:] if argv is None else argv
    return next((a for a in args if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one tiny alerts file per run
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        parser = build_parser(argv)
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return _command_module(args.command).run(args)
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # a package that a command imports when it runs
        if extra_for(e) is None:
            raise
        print(f"rldiag {args.command}: error: it needs the package {e.name!r} of the [{extra_for(e)}] extra, "
              f"which is not installed here: pip install 'rldiag[{extra_for(e)}]'", file=sys.stderr)
        return 2
    except CliError as e:
        print(f"rldiag {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line for anything the store or the input throws
        from rldiag.collectors.mlflow_store import TrackingStoreError

        if isinstance(e, (TrackingStoreError, ValueError, OSError)):
            print(f"rldiag {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
