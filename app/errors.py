"""Errors the read side shows a user: each message names the value at fault and the fix."""

from __future__ import annotations


class DataError(Exception):
    """A problem with the tracking store or with what was asked of it; `str(e)` is the user's message."""


class StoreUnreachable(DataError):
    """The tracking store does not answer, does not exist, or is not an MLflow store."""


class ExperimentNotFound(DataError):
    """A named experiment is not in the store."""


class RunNotFound(DataError):
    """A run id is not in the store."""


class NoRunsFound(DataError):
    """The query is valid but matches no runs."""
