"""Replaying a writer journal into the store (`rldiag sync FILE`)."""

from __future__ import annotations

from pathlib import Path

from rldiag.collectors.journal import read_journal
from rldiag.collectors.settings import default_tracking_uri
from rldiag.collectors.writer import MetricWriter, SendFn, WriterStats


class JournalError(ValueError):
    """The file is not an rldiag journal, or it names no run."""


def sync_journal(path: str | Path, *, tracking_uri: str | None = None, send: SendFn | None = None,
                 timeout_s: float = 120.0) -> tuple[WriterStats, int]:
    """Deliver a journal's unacknowledged batches; returns the writer's stats and the damaged-line count.

    The store is `tracking_uri`, else the one the journal names, else the default. Calls stay within
    MLflow's limits whatever the journal's batches hold (older rldiag wrote 1000 points plus tags in
    one); points the store refuses for good are set aside with a warning and counted in
    `stats.refused`, and never hold up the rest. The file is removed once everything in it is
    delivered or set aside, and kept (with acks for what was delivered) otherwise.
    """
    path = Path(path)
    if not path.is_file():
        raise JournalError(f"{path} does not exist; journals live in .rldiag/spill/<run_id>.jsonl by default")
    contents = read_journal(path)
    if contents.run_id is None:
        raise JournalError(f"{path} has no rldiag journal header (first line); is it a writer journal?")
    uri = tracking_uri or contents.tracking_uri or default_tracking_uri()
    if send is None:
        from rldiag.collectors.mlflow_store import make_sender

        send = make_sender(uri)
    writer = MetricWriter(contents.run_id, send, tracking_uri=uri, journal_file=path, close_timeout_s=timeout_s)
    return writer.close(), contents.corrupt_lines
