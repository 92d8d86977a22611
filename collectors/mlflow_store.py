"""The MLflow side of the write path: opening runs and the writer's send function.

mlflow is imported here, lazily, never by `import collectors`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

from rldiag.collectors.compat.mlflow import rest_host_creds, tracking_store
from rldiag.collectors.journal import Point
from rldiag.collectors.limits import MAX_KEY_CHARS, Refused, clean_key, key_problem
from rldiag.collectors.uri import is_http, probe_server, redact_text, redact_uri

log = logging.getLogger("rldiag.mlflow")

MAX_PARAM_CHARS = 6000  # MLflow truncates longer param values with only a warning
MAX_PARAMS_PER_CALL = 100
FAIL_RUN_TIMEOUT_S = 10.0  # how long a failed open_run waits to end the run it created


class TrackingStoreError(RuntimeError):
    """The tracking store cannot be reached or refused the request; the message says what to fix."""


class InvalidNameError(ValueError):
    """A param or tag name MLflow would refuse; raised before any run is created."""


def check_names(params: Mapping[str, str], tags: Mapping[str, str]) -> None:
    """Raise `InvalidNameError` naming every param and tag name MLflow refuses, with a name it takes."""
    bad = [(kind, k, why) for kind, names in (("param", params), ("tag", tags)) for k in names
           if (why := key_problem(k)) is not None]
    if bad:
        shown = "; ".join(f"{kind} {k!r} {why} (e.g. {clean_key(k, MAX_KEY_CHARS)!r})" for kind, k, why in bad[:5])
        more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise InvalidNameError(
            f"MLflow does not accept these names, so no run was created: {shown}{more}. Rename them: letters, "
            "digits, _ - . / : and spaces, no '//', '..' or leading '/', at most 250 characters "
            "(nested params= dicts become dotted names)."
        )


def _mlflow():
    try:
        import mlflow  # noqa: F401
        from mlflow.tracking import MlflowClient
    except ImportError as e:  # pragma: no cover - mlflow is a core dependency
        raise ImportError("rldiag needs mlflow: pip install 'mlflow>=3.17,<3.18'") from e
    return MlflowClient


def client_for(tracking_uri: str):
    return _mlflow()(tracking_uri)


_NONFINITE_JSON = {"nan": '"NaN"', "inf": '"Infinity"', "-inf": '"-Infinity"'}  # protobuf JSON spellings


def log_batch_json(run_id: str, metrics: list[Point], tags: Mapping[str, str], key_json: dict[str, str]) -> str:
    """The body of MLflow's `runs/log-batch` request, as MLflow's client would send it.

    Built with string joins, point by point, rather than through MLflow's entities, protobuf and
    `message_to_json` (30-70 ms of Python per 1000 points, against about 1 ms here): the sender
    thread then holds the interpreter lock for less, in short pieces, and the training thread waits
    less for it. `key_json` caches each key's JSON string.
    """
    parts = []
    for k, v, ts, st in metrics:
        kj = key_json.get(k)
        if kj is None:
            kj = key_json[k] = json.dumps(k)
        val = repr(v) if math.isfinite(v) else _NONFINITE_JSON[repr(v)]
        parts.append(f'{{"key":{kj},"value":{val},"timestamp":{int(ts)},"step":{int(st)}}}')
    tag_json = ",".join(f'{{"key":{json.dumps(k)},"value":{json.dumps(v)}}}' for k, v in tags.items())
    return f'{{"run_id":{json.dumps(run_id)},"metrics":[{",".join(parts)}],"tags":[{tag_json}]}}'


# 4xx answers that say "not now" rather than "never": retried like an outage.
RETRY_HTTP_STATUS = frozenset({408, 409, 425, 429, 499})


def refused_for_good(http_status: int) -> bool:
    """True for an HTTP status that refuses the request itself (400 invalid parameter, 404, 413 ...):
    sending it again would be refused again. 5xx, 408, 409, 429 may pass: the writer retries those."""
    return 400 <= http_status < 500 and http_status not in RETRY_HTTP_STATUS


def make_sender(tracking_uri: str, *, request_timeout_s: float = 60.0):
    """`send(run_id, metrics, tags)` for the writer: one `log_batch` call, no internal retries.

    It raises the writer's `Refused` when the store refuses the call for good (MLflow's validation
    errors: INVALID_PARAMETER_VALUE, a 4xx answer; see `refused_for_good`), which the writer answers by
    isolating and setting aside the refused entries; any other error (connection refused or reset, a
    timeout, 5xx, 429, SQLite's "database is locked") propagates and the writer retries.

    Over REST it posts to `runs/log-batch` itself with `max_retries=0`, so a down server fails fast
    and the writer's own back-off (which never blocks training) decides when to try again; MLflow's
    client would otherwise retry inside the call for minutes. The timeout is generous on purpose: a
    batch that timed out has often been stored anyway, and its re-send takes MLflow's slow duplicate
    check (10-15 s for 1000 points on a loaded 2-core server), which a short timeout would cut off
    again and again.
    """
    from mlflow.entities import Metric, RunTag

    client = client_for(tracking_uri)
    store = tracking_store(client)
    creds = rest_host_creds(client)

    def entities(metrics: list[Point], tags: Mapping[str, str]):
        return [Metric(k, v, ts, st) for k, v, ts, st in metrics], [RunTag(k, v) for k, v in tags.items()]

    if creds is not None:
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        endpoint = "/api/2.0/mlflow/runs/log-batch"
        key_json: dict[str, str] = {}

        def send(run_id: str, metrics: list[Point], tags: dict[str, str]) -> None:
            resp = http_request(
                creds, endpoint, "POST", max_retries=0, timeout=request_timeout_s,
                data=log_batch_json(run_id, metrics, tags, key_json).encode(),
                extra_headers={"Content-Type": "application/json"},
            )
            if refused_for_good(resp.status_code):  # by status: a proxy's 413 or 403 is not MLflow JSON
                raise Refused(f"HTTP {resp.status_code} from {endpoint}: {resp.text[:300]}")
            verify_rest_response(resp, endpoint)

        return send

    from mlflow.exceptions import MlflowException

    def send(run_id: str, metrics: list[Point], tags: dict[str, str]) -> None:
        ms, ts = entities(metrics, tags)
        try:
            store.log_batch(run_id, metrics=ms, params=[], tags=ts)
        except MlflowException as e:
            # The SQL store's validation errors are INVALID_PARAMETER_VALUE (HTTP 400); a locked or
            # lost database is TEMPORARILY_UNAVAILABLE (503), other failures INTERNAL_ERROR (500).
            if refused_for_good(e.get_http_status_code()):
                raise Refused(f"{e.error_code}: {e.message}"[:500]) from e
            raise

    return send


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts become dotted keys; values become strings, cut to MLflow's limit with a warning."""
    out: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_params(v, key + "."))
            continue
        s = str(v)
        if len(s) > MAX_PARAM_CHARS:
            log.warning("rldiag: param %r is %d characters; MLflow keeps %d, logging it truncated",
                        key, len(s), MAX_PARAM_CHARS)
            s = s[:MAX_PARAM_CHARS]
        out[key] = s
    return out


def _probe_server(tracking_uri: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, not minutes, on an http(s) store that does not answer (MLflow's client would
    retry for about four minutes)."""
    if not is_http(tracking_uri):
        return
    why = probe_server(tracking_uri, timeout_s)
    if why is not None:
        raise TrackingStoreError(
            f"cannot reach the MLflow tracking server at {redact_uri(tracking_uri)!r} ({redact_text(why, tracking_uri)}). "
            "Start it (mlflow server --host 127.0.0.1 --port 5000) or fix MLFLOW_TRACKING_URI; "
            "unset it to use the local sqlite:///mlruns.db."
        )


def _experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created if missing. Two jobs starting at once may both try to create
    it; the one that loses the race reads the winner's."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def open_run(
    tracking_uri: str,
    *,
    experiment: str,
    run_name: str | None = None,
    run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    params: Mapping[str, Any] | None = None,
):
    """Create (or, with `run_id`, resume) a run; returns `(client, run)`. Errors name the store and the fix.

    Param and tag names are checked before the run is created (`InvalidNameError`, naming each); if the
    store still refuses the params, a run created here is ended FAILED and a resumed one keeps its
    status: an open that fails leaves no run RUNNING.
    """
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException

    flat = flatten_params(params or {})
    all_tags = {str(k): str(v) for k, v in (tags or {}).items()}
    check_names(flat, all_tags)
    shown = redact_uri(tracking_uri)
    _probe_server(tracking_uri)
    created = None
    try:
        client = client_for(tracking_uri)
        items = [Param(k, v) for k, v in flat.items()]
        if run_id is not None:
            run = client.get_run(run_id)
        else:
            exp_id = _experiment_id(client, experiment)
            run = created = client.create_run(exp_id, run_name=run_name, tags=all_tags)
        for i in range(0, len(items), MAX_PARAMS_PER_CALL):
            client.log_batch(run.info.run_id, params=items[i : i + MAX_PARAMS_PER_CALL])
        if run_id is not None:
            if all_tags:
                client.log_batch(run_id, tags=[RunTag(k, v) for k, v in all_tags.items()])
            client.update_run(run_id, status="RUNNING")  # last: a refused param leaves its status as it was
    except MlflowException as e:
        _fail(client if created is not None else None, created)
        first = redact_text(e.message.splitlines()[0] if e.message else str(e), tracking_uri)
        raise TrackingStoreError(
            f"MLflow at {shown!r} refused to open the run: {first}. "
            + ("The run it had created is ended FAILED. " if created is not None else "")
            + "Check MLFLOW_TRACKING_URI (or tracking_uri=), the run id, and that params are not re-logged "
            "with other values (a resumed run keeps the params it has: log changed ones under a new name)."
        ) from None
    except Exception as e:  # noqa: BLE001 - connection errors come in many types
        _fail(client if created is not None else None, created)
        raise TrackingStoreError(
            f"cannot reach the MLflow tracking store at {shown!r}: "
            f"{redact_text(f'{type(e).__name__}: {e}', tracking_uri)}. "
            "Start the server or fix MLFLOW_TRACKING_URI; unset it to use the local sqlite:///mlruns.db."
        ) from None
    return client, run


def _fail(client, run) -> None:
    """End a run that open_run created before the store refused the rest: FAILED, not an orphan RUNNING."""
    if client is None or run is None:
        return

    def end() -> None:
        try:
            client.set_terminated(run.info.run_id, status="FAILED")
        except Exception:  # the store's first refusal is the error to show
            log.debug("could not end run %s as FAILED", run.info.run_id, exc_info=True)

    t = threading.Thread(target=end, name="rldiag-fail-run", daemon=True)  # bounded: MLflow may retry for minutes
    t.start()
    t.join(FAIL_RUN_TIMEOUT_S)
