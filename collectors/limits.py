"""What MLflow accepts in one `log_batch` call, and which names it refuses: the writer keeps every call
within these and cleans keys before they are journaled. Each constant is MLflow's own
(`mlflow/utils/validation.py`), pinned against it by tests/collectors/test_batch_limits.py."""

from __future__ import annotations

import functools
import json
import posixpath
import re

from rldiag.collectors import keys


class Refused(Exception):
    """Raised by a send function when the store refused the call for good (a validation error: MLflow's
    INVALID_PARAMETER_VALUE, an HTTP 4xx other than 408/409/429): sending the same call again would be
    refused again. Any other exception means "try again later"."""


# MLflow's limits (mlflow.utils.validation; pinned by tests/collectors/test_batch_limits.py).
MAX_ENTITIES = 1000  # MAX_ENTITIES_PER_BATCH: metrics + params + tags in one log_batch call
MAX_BATCH = MAX_ENTITIES  # MAX_METRICS_PER_BATCH is 1000 too
MAX_TAGS = 100  # MAX_PARAMS_TAGS_PER_BATCH
MAX_REQUEST_BYTES = 1_000_000  # MAX_BATCH_LOG_REQUEST_SIZE (and nginx's default body limit)
MAX_KEY_CHARS = 250  # MAX_ENTITY_KEY_LENGTH: metric, param and tag names
MAX_TAG_VALUE_CHARS = 8000  # MAX_TAG_VAL_LENGTH
# A metric key leaves room for its inf flag, `rldiag/inf/<key>`, which must be a valid key too.
MAX_METRIC_KEY_CHARS = MAX_KEY_CHARS - len(keys.INF_FLAG_PREFIX)
MAX_INT64 = 2**63 - 1

KEY_OK = re.compile(r"^[/\w.\- :]*$")  # mlflow.utils.validation.validate_param_and_metric_name (POSIX)
KEY_BAD_CHARS = re.compile(r"[^/\w.\- :]")


def key_problem(key: object) -> str | None:
    """Why MLflow refuses `key` as a metric, param or tag name, or None if it accepts it.

    MLflow's rules (`_validate_metric_name`, `_validate_tag_name`, `_validate_length_limit`): only
    letters, digits, `_ - . / : ` and spaces; the name read as a path is already normal (no `//`,
    `./`, `..`, leading or trailing `/`, not empty); at most 250 characters.
    """
    if not isinstance(key, str):
        return f"is a {type(key).__name__}, not a string"
    if not KEY_OK.match(key):
        return "has characters other than letters, digits, _ - . / : and spaces"
    norm = posixpath.normpath(key)  # mlflow.utils.validation.path_not_unique
    if key == "":
        return "is empty"
    if norm != key:
        return f"would resolve to {norm!r} as a path"
    if norm == "." or norm.startswith(".."):
        return "starts with '..' or is '.', a path outside its folder"
    if norm.startswith("/"):
        return "starts with '/'"
    if len(key) > MAX_KEY_CHARS:
        return f"is {len(key)} characters, over MLflow's {MAX_KEY_CHARS}"
    return None


def clean_key(key: str, max_chars: int = MAX_METRIC_KEY_CHARS) -> str:
    """`key` if MLflow accepts it and it has at most `max_chars` characters, else a close name that does.

    Other characters become `_`; empty and `.` path segments are dropped, `..` becomes `__`; the name
    is cut to `max_chars` (metric keys: 239, so that `rldiag/inf/<key>` fits MLflow's 250).
    """
    if len(key) <= max_chars and key_problem(key) is None:
        return key
    parts = ["__" if p == ".." else p for p in KEY_BAD_CHARS.sub("_", key).split("/") if p not in ("", ".")]
    s = "/".join(parts)
    if s.startswith(".."):
        s = "_" + s[1:]
    s = s[:max_chars].rstrip("/")
    head, sep, last = s.rpartition("/")
    if last in (".", ".."):  # the cut left a path segment MLflow reads as a directory
        s = head + sep + "_" * len(last)
    return s or "_"


@functools.lru_cache(maxsize=1 << 16)
def json_len(s: str) -> int:
    return len(json.dumps(s))  # ASCII JSON, as the REST sender writes it: the exact byte count


# Entries of a send: a metric point (key, value, timestamp_ms, step) or a tag (key, value).
Entry = tuple
POINT_JSON = 39 + 24 + 20 + 20  # {"key":,"value":,"timestamp":,"step":}, plus the longest value, ts, step
TAG_JSON = 18
ENVELOPE_JSON = 200  # {"run_id":"...","metrics":[],"tags":[]} with room to spare


def entry_bytes(e: Entry) -> int:
    if len(e) == 4:
        return json_len(e[0]) + POINT_JSON
    return json_len(e[0]) + len(json.dumps(e[1])) + TAG_JSON


def entry_text(e: Entry) -> str:
    """How a warning names an entry: metric key, value and step, or tag key and value."""
    if len(e) == 4:
        return f"metric {e[0]!r} = {e[1]!r} at step {e[3]}"
    value = e[1] if len(e[1]) <= 80 else e[1][:80] + "..."
    return f"tag {e[0]!r} = {value!r}"


def entry_problem(e: Entry) -> str | None:
    """What MLflow's validation would refuse in one entry, checked before splitting a refused call."""
    why = key_problem(e[0])
    if why is not None:
        return f"key {why}"
    if len(e) == 4:
        _, _, ts, step = e
        if not 0 <= ts <= MAX_INT64:
            return f"timestamp {ts} is outside 0..2**63-1"
        if not -MAX_INT64 - 1 <= step <= MAX_INT64:
            return f"step {step} is not a 64-bit integer"
    return None
