"""Replaying a writer journal into the store (`rldiag sync FILE`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from rldiag.collectors.journal import Journal, JournalBusy
from rldiag.collectors.journal_read import segment_files, segment_problem, split_name
from rldiag.collectors.settings import MLFLOW_CREDENTIAL_VARS, MLFLOW_TRACKING_URI, default_tracking_uri
from rldiag.collectors.uri import redact_uri, same_store, strip_secrets
from rldiag.collectors.writer import MetricWriter, SendFn, WriterStats

log = logging.getLogger("rldiag.sync")


__all__ = ["JournalBusy", "JournalError", "NotAJournal", "journal_tracking_uri", "sync_journal"]


class JournalError(ValueError):
    """The file is not an rldiag journal, or it names no run."""


class NotAJournal(JournalError):
    """A file that is not an rldiag journal segment (`segment_problem`): left byte-identical."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path} is not an rldiag journal ({why}): left as it is")
        self.path, self.why = path, why


def journal_tracking_uri(contents, tracking_uri: str | None = None) -> tuple[str, str | None]:
    """The store to replay into, and a one-line note when its credentials could not be found.

    `contents` is what a journal's header says (`.tracking_uri`, `.uri_redacted`: a `JournalContents`
    or an opened `Journal`'s `stored_uri`). `tracking_uri` (`--tracking-uri`) wins; else the journal's own URI. Journals keep that URI without
    its credentials: then it is `MLFLOW_TRACKING_URI` when that names the same store; else the URI
    without the hidden parts, which works for a store that needs no credentials or gets them from
    MLflow's own variables (MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN); the note says which.
    """
    if tracking_uri:
        return tracking_uri, None
    stored = getattr(contents, "stored_uri", None) or getattr(contents, "tracking_uri", None)
    if not stored:
        return default_tracking_uri(), None
    if not contents.uri_redacted:
        return stored, None
    env = MLFLOW_TRACKING_URI.get()
    if env and same_store(env, stored):
        return env, None
    bare = strip_secrets(stored)
    if any(os.environ.get(v) for v in MLFLOW_CREDENTIAL_VARS):
        return bare, None
    elsewhere = f" (MLFLOW_TRACKING_URI names another store, {redact_uri(env)})" if env else ""
    return bare, (f"the journal's store {stored} had credentials, which journals never keep, and neither "
                  f"--tracking-uri nor MLFLOW_TRACKING_URI gives them{elsewhere}: trying {redact_uri(bare)} "
                  "without; pass --tracking-uri with the credentials if the store refuses")


def sync_journal(path: str | Path, *, tracking_uri: str | None = None, send: SendFn | None = None,
                 timeout_s: float = 120.0, on_note: Callable[[str], None] | None = None) -> tuple[WriterStats, int]:
    """Deliver a journal's unacknowledged batches; returns the writer's stats and the damaged-line count.

    The store is `tracking_uri`, else the one the journal names (its credentials from
    MLFLOW_TRACKING_URI: see `journal_tracking_uri`), else the default. Calls stay within MLflow's
    limits whatever the journal's batches hold (older rldiag wrote 1000 points plus tags in one);
    points the store refuses for good are set aside with a warning and counted in `stats.refused`,
    and never hold up the rest. The file is removed once everything in it is delivered or set aside,
    and kept (with acks for what was delivered) otherwise. A note about the store (credentials not
    found) goes to `on_note` before anything is sent, or is logged as a warning without it.

    `path` is any segment of a journal (`<stem>.jsonl`, `<stem>.K.jsonl`; `<stem>.jsonl` also once that
    segment is delivered and gone): all its segments are read, streamed, never all in memory. A journal
    that a live writer (or another sync) holds raises `JournalBusy`, naming it, and is left untouched.
    A file that is not a journal segment (`segment_problem`: no header for its name) raises `NotAJournal`
    and is never changed; only verified segments whose batches are all acknowledged are removed.
    """
    path = Path(path)
    folder, stem, _ = split_name(path)
    if path.is_dir() or not segment_files(folder, stem):
        raise JournalError(f"{path} does not exist; journals live in .rldiag/spill/<run_id>.jsonl by default")
    segments = segment_files(folder, stem)
    verdicts = [(p, segment_problem(p)) for _, p in segments]
    if all(why is not None for _, why in verdicts):  # checked before the lock: no lock file beside a foreign one
        named = next((why for p, why in verdicts if p == path), None) or verdicts[0][1]
        raise NotAJournal(path, named)
    if path.exists() and (why := segment_problem(path)) is not None:
        raise NotAJournal(path, why)
    journal = Journal.for_file(path)
    try:
        if not journal.run_id:
            raise JournalError(f"{path} has no rldiag journal header (first line); is it a writer journal?")
        uri, note = journal_tracking_uri(journal, tracking_uri)
        if note is not None and send is None:
            if on_note is not None:
                on_note(note)
            else:
                log.warning("rldiag sync %s: %s", path, note)
        if send is None:
            from rldiag.collectors.mlflow_store import make_sender

            send = make_sender(uri)
        writer = MetricWriter(journal.run_id, send, tracking_uri=uri, journal=journal, close_timeout_s=timeout_s)
    except BaseException:
        journal.close(delete=False)
        raise
    stats = writer.close()
    return stats, journal.corrupt_lines
