"""What every `rldiag` command shares: the one-line error type and the tracking-store options."""

from __future__ import annotations

import argparse
import math
import os

from rldiag.app.data.store import BACKEND_ENV


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a step, a count); anything else is one line naming the value."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative: give a step or count of 0 or more")
    return n


def positive_seconds(raw: str, option: str = "--interval", example: float = 30) -> float:
    """A positive, finite number of seconds, or the one-line error naming the value and an example."""
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise CliError(f"{option} {raw!r} is not a positive number of seconds; use e.g. {option} {example:g}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = non_negative_int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("0: give 1 or more")
    return n


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


def add_detector_option(p: argparse.ArgumentParser) -> None:
    """`--detector KEY=VALUE` (repeatable): the divergence detector's options, for this command and,
    through $RLDIAG_DETECTOR, for the dashboard's server process. `--detector help` lists them."""
    p.add_argument("--detector", action=_DetectorOption, default=None, metavar="KEY=VALUE",
                   help="a divergence-detector option, repeatable, e.g. --detector k=6 (the defaults suit most "
                        "runs; `--detector help` lists every option with its default)")


def detector_options_text() -> str:
    """Every detector option with its default, one a line (`--detector help`)."""
    from rldiag.app.analysis.divergence import DivergenceConfig

    lines = [f"  {f}={_show(getattr(DivergenceConfig(), f))}" for f in DivergenceConfig.__dataclass_fields__]
    return ("divergence-detector options (--detector KEY=VALUE, repeatable; see "
            "rldiag.app.analysis.divergence.DivergenceConfig):\n" + "\n".join(lines))


def _show(v) -> str:
    if isinstance(v, tuple):
        return ",".join(":".join(map(str, x)) if isinstance(x, tuple) else str(x) for x in v)
    return str(v)


class _DetectorOption(argparse.Action):
    """Checks each option at once (exit 2 with the key and an example) and exports them all."""

    def __call__(self, parser, namespace, values, option_string=None):
        from rldiag.app.analysis.divergence import DETECTOR_ENV, DivergenceConfig

        if values.strip() == "help":
            print(detector_options_text())
            parser.exit(0)
        items = [*(getattr(namespace, self.dest) or []), values]
        try:
            DivergenceConfig.from_options(items)
        except ValueError as e:
            parser.error(f"--detector: {e}")
        setattr(namespace, self.dest, items)
        os.environ[DETECTOR_ENV] = " ".join(items)


class _SetEnv(argparse.Action):
    """Store the value and export it, so that the dashboard's server process and every loader see it."""

    def __init__(self, *args, env: str, **kwargs):
        self.env = env
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        os.environ[self.env] = values


def store_failed(uri: str | None, e: BaseException) -> CliError:
    """The one-line error for a store that failed under a command: its URI without secrets, the
    library's first line, and where to fix it."""
    from rldiag.collectors.uri import redact_uri

    return CliError(f"the tracking store {redact_uri(uri or '(default)')!r} failed: {first_line(e)}. "
                    "Check --tracking-uri (or MLFLOW_TRACKING_URI).")


def first_line(e: BaseException) -> str:
    """`Type: first line of the message`, what a one-line error shows of an exception from a library,
    with any credentials in it hidden (MLflow's errors quote the URL they called, password included)."""
    from rldiag.collectors.uri import redact_text

    text = str(e)
    return redact_text(f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
