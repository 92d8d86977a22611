"""Environment variables rldiag reads, each in one place with a type, a default and strict parsing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    help: str

    def get(self) -> str | None:
        return os.environ.get(self.name, self.default)

    def get_bool(self) -> bool:
        raw = (self.get() or "").strip().lower()
        if raw in _TRUE:
            return True
        if raw in _FALSE:
            return False
        raise ValueError(f"{self.name}={raw!r} is not a boolean; use one of {sorted(_TRUE | _FALSE - {''})}")

    def get_float(self) -> float:
        raw = self.get()
        try:
            return float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}={raw!r} is not a number; set it to seconds, e.g. {self.default}") from None

    def get_int(self) -> int:
        raw = self.get()
        try:
            return int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}={raw!r} is not a whole number; e.g. {self.default}") from None


MLFLOW_TRACKING_URI = EnvVar("MLFLOW_TRACKING_URI", None, "Tracking store; unset means sqlite:///mlruns.db here.")
RLDIAG_SPILL_DIR = EnvVar("RLDIAG_SPILL_DIR", ".rldiag/spill", "Where the writer journals batches before sending.")
RLDIAG_WEBHOOK_URL = EnvVar("RLDIAG_WEBHOOK_URL", None, "Webhook for non-finite gradient alerts (never logged).")
RLDIAG_ALERTS_JSONL = EnvVar("RLDIAG_ALERTS_JSONL", None, "JSONL file that receives every alert event.")
RLDIAG_CLOSE_TIMEOUT = EnvVar("RLDIAG_CLOSE_TIMEOUT", "30", "Seconds close() waits for the store.")
RLDIAG_BACKLOG_POINTS = EnvVar("RLDIAG_BACKLOG_POINTS", "200000", "Points the writer's outage backlog keeps in "
                               "memory (about 140 bytes each); the rest waits in the journal on disk.")
RLDIAG_QUEUE_POINTS = EnvVar("RLDIAG_QUEUE_POINTS", "500000", "Points that may wait between log_metrics and the "
                             "writer's ingest thread (about 100 bytes each); past it a log call still returns at "
                             "once and its points are counted lost (stats.lost_queue) with a warning.")
RLDIAG_SIGNALS = EnvVar("RLDIAG_SIGNALS", "1", "On SIGTERM/SIGINT, drain and end open runs as KILLED, then go on "
                        "with the process's own handling (0: leave the signal handlers alone).")
# MLflow's own credential variables: what a tracking URI without userinfo authenticates with.
MLFLOW_CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                          "MLFLOW_TRACKING_CLIENT_CERT_PATH", "DATABRICKS_TOKEN")

DEFAULT_DB = "mlruns.db"


def default_tracking_uri(cwd: str | os.PathLike | None = None) -> str:
    """`MLFLOW_TRACKING_URI` if set, else a SQLite file `mlruns.db` in the working directory."""
    uri = MLFLOW_TRACKING_URI.get()
    if uri:
        return uri
    return "sqlite:///" + str((Path(cwd or os.getcwd()) / DEFAULT_DB).resolve())
