"""The `rldiag` command line. Subcommands import what they need when they run, so `--help` is instant."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from app.store import BACKEND_ENV
from collectors.settings import default_tracking_uri

EPILOG = """\
The tracking store is MLFLOW_TRACKING_URI (or --tracking-uri); unset, it is the SQLite file
mlruns.db in the current directory. Examples:
  rldiag demo                          run the example RL loop into ./mlruns.db
  rldiag demo --nan-at 30              ...with a NaN gradient injected at step 30
  rldiag sync .rldiag/spill/RUN.jsonl  replay metrics a run could not deliver
  rldiag COMMAND --help                options of one command
"""

# Commands implemented in their own modules, imported only when that command runs (so `rldiag --help`
# stays instant). Each module has `add_arguments(parser)` and `run(args) -> int`; it raises
# `app.cli.CliError` (or ValueError) for bad input, which prints as one line with exit status 2.
MODULE_COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help)
    "experiment": ("experiments.cli", "run a reproduction (masked-vs-unmasked, engine-parity) into the store"),
    "watch": ("app.watch", "alert on non-finite gradients in active MLflow runs (any logger)"),
    "report": ("app.report", "write a run-comparison report: self-contained HTML and a Markdown summary"),
    "app": ("app.dashboard.launch", "open the dashboard in the browser: overlay runs, divergence, NaN events, config diff"),
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def add_tracking_option(p: argparse.ArgumentParser, *, read: bool = False) -> None:
    """`--tracking-uri`, as every command spells it (None: $MLFLOW_TRACKING_URI, else the embedded default);
    with `read`, also `--backend-store-uri` (a server's SQLite file to read histories from)."""
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db here)")
    if read:
        p.add_argument("--backend-store-uri", default=None, metavar="URI", action=_SetEnv, env=BACKEND_ENV,
                       help="with a tracking server: its own SQLite backend (what `mlflow server "
                            "--backend-store-uri` was given), when this machine can read that file; metric "
                            f"histories are then read from it directly, read-only (default: ${BACKEND_ENV})")


class _SetEnv(argparse.Action):
    """Store the value and export it, so that the dashboard's server process and every loader see it."""

    def __init__(self, *args, env: str, **kwargs):
        self.env = env
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        os.environ[self.env] = values


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rldiag",
        description="Diagnostics for LLM RL training runs on MLflow: per-step policy metrics, "
                    "non-finite gradient alerts, run comparison.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the example RL loop with rldiag's collectors into the tracking store",
                          description="A tiny policy trained by a GRPO-style loop, watched by rldiag.Monitor.")
    demo.add_argument("--steps", type=int, default=40, help="rollout steps (default: 40)")
    demo.add_argument("--nan-at", type=int, default=None, metavar="STEP",
                      help="inject a NaN gradient (finite loss) at this optimizer step")
    demo.add_argument("--policy", choices=("warn", "skip", "raise"), default="skip",
                      help="what to do on non-finite gradients (default: skip)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--experiment", default="rldiag-demo", help="MLflow experiment (default: rldiag-demo)")
    add_tracking_option(demo)

    sync = sub.add_parser("sync", help="replay a writer journal (metrics not yet delivered) into the store",
                          description="Deliver the batches of an rldiag journal that the store never acknowledged. "
                                      "Safe to run twice: SQL stores keep identical points once.")
    sync.add_argument("files", nargs="+", metavar="FILE", help="journal files, e.g. .rldiag/spill/<run_id>.jsonl")
    sync.add_argument("--timeout", type=float, default=120.0, help="seconds to keep trying per file (default: 120)")
    add_tracking_option(sync)

    wanted = _command_in(argv)
    for name, (module, help_) in MODULE_COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == wanted:  # only the command that runs imports its module
            import importlib

            importlib.import_module(module).add_arguments(p)
    return parser


def _command_in(argv: list[str] | None) -> str | None:
    args = sys.argv[1:] if argv is None else argv
    return next((a for a in args if not a.startswith("-")), None)


def cmd_demo(args: argparse.Namespace) -> int:
    from experiments.example_loop import LoopConfig, run

    uri = args.tracking_uri or default_tracking_uri()
    cfg = LoopConfig(steps=args.steps, nan_at=args.nan_at, policy=args.policy, seed=args.seed,
                     experiment=args.experiment)
    res = run(cfg, tracking_uri=uri)
    bad = "none" if res.first_nonfinite_step is None else str(res.first_nonfinite_step)
    print(f"run {res.run_id}  variant example-loop  first non-finite step: {bad}  final reward: {res.final_reward:.3f}")
    print(f"Logged to {uri} (experiment {args.experiment!r}). Look at it with:")
    print(f"  mlflow ui --backend-store-uri {uri}")
    return 0 if res.undelivered == 0 else 1


def cmd_sync(args: argparse.Namespace) -> int:
    from collectors.sync import JournalError, sync_journal

    status = 0
    for f in args.files:
        try:
            stats, corrupt = sync_journal(f, tracking_uri=args.tracking_uri, timeout_s=args.timeout)
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


COMMANDS = {"demo": cmd_demo, "sync": cmd_sync}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one tiny alerts file per run
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command in MODULE_COMMANDS:
            import importlib

            return importlib.import_module(MODULE_COMMANDS[args.command][0]).run(args)
        return COMMANDS[args.command](args)
    except CliError as e:
        print(f"rldiag {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line for anything the store or the input throws
        from collectors.mlflow_store import TrackingStoreError

        if isinstance(e, (TrackingStoreError, ValueError, OSError)):
            print(f"rldiag {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
