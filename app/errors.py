"""Errors the read side shows a user: each message names the value at fault and the fix.

Every message is redacted where it is made (`DataError.__init__`): passwords in URLs, secret query values
(token, password, key, secret, ...) and, wherever they occur, the secrets of the store URIs this process
opened (`remember_uri`). So no error path (listing experiments, a run not found, a store that does not
answer) can show a credential, in the terminal or on the dashboard.
"""

from __future__ import annotations

_KNOWN_URIS: set[str] = set()  # the tracking and backend URIs opened here: their secrets are hidden anywhere


def remember_uri(*uris: str | None) -> None:
    """Hide the secrets of `uris` (a tracking or backend store URI) in every later read-side error."""
    _KNOWN_URIS.update(u for u in uris if u)


def redact(text: str, *uris: str | None) -> str:
    """`text` without secrets: those of any URL in it, of `uris` and of the store URIs opened here."""
    from rldiag.collectors.uri import redact_text

    return redact_text(text, *(u for u in uris if u), *sorted(_KNOWN_URIS))


class DataError(Exception):
    """A problem with the tracking store or with what was asked of it; `str(e)` is the user's message,
    with its secrets hidden."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(redact(str(message)), *args)


class StoreUnreachable(DataError):
    """The tracking store does not answer, does not exist, or is not an MLflow store."""


class ExperimentNotFound(DataError):
    """A named experiment is not in the store."""


class RunNotFound(DataError):
    """A run id is not in the store."""


class NoRunsFound(DataError):
    """The query is valid but matches no runs."""
