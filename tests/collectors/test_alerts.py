"""Alert sinks against real endpoints: a webhook server on 127.0.0.1, a JSONL file, Python logging."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rldiag.collectors import AlertDispatcher, JsonlSink, LoggingSink, NonFiniteGradAlert, WebhookSink
from tests.helpers.net import free_port

NAN = float("nan")


class WebhookServer:
    """A real HTTP server on 127.0.0.1 that records every POSTed JSON body (a stand-in for Slack)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.content_types: list[str] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                raw = self.rfile.read(int(self.headers["Content-Length"]))

                def reject(token: str):
                    raise ValueError(f"non-standard JSON constant {token}")

                body = json.loads(raw, parse_constant=reject)  # strict JSON, as Slack parses it
                recorder.bodies.append(body)
                recorder.paths.append(self.path)
                recorder.content_types.append(self.headers["Content-Type"])
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str = "/services/T000/B000/XXXX") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def webhook_server():
    server = WebhookServer()
    yield server
    server.stop()


class FakeClock:
    """An injected monotonic clock that only moves when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingSink:
    """A sink that keeps what it receives (a real sink implementation, in memory)."""

    def __init__(self, *, rate_limited: bool = False) -> None:
        self.rate_limited = rate_limited
        self.events: list[dict] = []
        self.closed = False

    def send(self, event: dict) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed = True


class BrokenSink:
    """A sink whose every call fails, like a full disk or a bad credential."""

    rate_limited = False

    def send(self, event: dict) -> None:
        raise OSError("No space left on device")

    def close(self) -> None:
        raise OSError("No space left on device")


def alert(step: int, **kw) -> NonFiniteGradAlert:
    fields = dict(run_id="0123abcd", run_name="grpo-v1-defaults", step=step, grad_norm=NAN,
                  params=["model.layers.3.mlp.down_proj.weight"])
    fields.update(kw)
    return NonFiniteGradAlert(**fields)


# --- (a) the webhook body ---------------------------------------------------------------------------


def test_webhook_posts_slack_compatible_json_naming_run_step_and_parameter(webhook_server):
    sink = WebhookSink(webhook_server.url())
    sink.send(alert(7, positions=[{"micro_batch": 1, "sample": 2, "position": 40}], nonfinite_positions=1).as_dict())
    sink.close()

    assert sink.sent == 1 and sink.failed == 0
    assert webhook_server.paths == ["/services/T000/B000/XXXX"]
    assert webhook_server.content_types == ["application/json"]
    [body] = webhook_server.bodies
    text = body["text"]
    assert "grpo-v1-defaults" in text and "0123abcd" in text
    assert "step 7" in text
    assert "model.layers.3.mlp.down_proj.weight" in text
    assert "sample 2 token 40" in text
    # the structured fields travel too; NaN is a string so that strict JSON parsers accept it
    assert body["step"] == 7 and body["run_id"] == "0123abcd" and body["grad_norm"] == "nan"
    assert body["positions"] == [{"micro_batch": 1, "sample": 2, "position": 40}]


def test_alert_text_shortens_long_parameter_lists():
    params = [f"layers.{i}.weight" for i in range(8)]
    text = alert(3, params=params).text()
    # five names shown, then "and 3 more"; the total count is still there
    assert "layers.4.weight" in text and "layers.5.weight" not in text
    assert "and 3 more" in text and "8 parameter tensor(s)" in text


# --- (b) rate limiting --------------------------------------------------------------------------------


def test_rate_limit_holds_back_webhook_posts_but_the_jsonl_keeps_every_event(webhook_server, tmp_path):
    clock = FakeClock()
    webhook = WebhookSink(webhook_server.url())
    jsonl = JsonlSink(tmp_path / "alerts.jsonl")
    dispatcher = AlertDispatcher([webhook, jsonl], burst=3, interval_s=60.0, clock=clock)
    for step in range(1000):  # a run that is NaN from step 0 on, all within one minute
        dispatcher.emit(alert(step))
    dispatcher.close("0123abcd", "grpo-v1-defaults")  # sends the summary, waits for the webhook thread

    assert dispatcher.total == 1000
    lines = (tmp_path / "alerts.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1000))

    # burst = 3 alerts (steps 0, 1, 2), then one summary of the 997 held back (steps 3..999)
    bodies = webhook_server.bodies
    assert [b["kind"] for b in bodies] == ["nonfinite_grad"] * 3 + ["summary"]
    assert [b["step"] for b in bodies[:3]] == [0, 1, 2]
    summary = bodies[3]
    assert summary["suppressed"] == 997 and (summary["first_step"], summary["last_step"]) == (3, 999)
    assert "997" in summary["text"] and "grpo-v1-defaults" in summary["text"]
    assert "3..999" in summary["text"]
    assert webhook.sent == 4


def test_rate_limit_window_reopens_after_the_interval(webhook_server, tmp_path):
    clock = FakeClock()
    webhook = WebhookSink(webhook_server.url())
    jsonl = JsonlSink(tmp_path / "alerts.jsonl")
    dispatcher = AlertDispatcher([webhook, jsonl], burst=3, interval_s=60.0, clock=clock)
    for step in range(1000):
        if step == 500:
            clock.now = 61.0  # a new window: the held-back summary goes out first, then 3 more alerts
        dispatcher.emit(alert(step))
    dispatcher.close("0123abcd", "grpo-v1-defaults")

    bodies = webhook_server.bodies
    # window 1: steps 0-2 sent, 3..499 held (497); window 2: summary, steps 500-502, close: 503..999 (497)
    assert [(b["kind"], b.get("step", b.get("suppressed"))) for b in bodies] == [
        ("nonfinite_grad", 0), ("nonfinite_grad", 1), ("nonfinite_grad", 2),
        ("summary", 497),
        ("nonfinite_grad", 500), ("nonfinite_grad", 501), ("nonfinite_grad", 502),
        ("summary", 497),
    ]
    assert (bodies[3]["first_step"], bodies[3]["last_step"]) == (3, 499)
    assert (bodies[7]["first_step"], bodies[7]["last_step"]) == (503, 999)
    assert len((tmp_path / "alerts.jsonl").read_text(encoding="utf-8").splitlines()) == 1000


def test_no_summary_when_nothing_was_held_back(webhook_server):
    webhook = WebhookSink(webhook_server.url())
    dispatcher = AlertDispatcher([webhook], burst=3, clock=FakeClock())
    for step in range(2):
        dispatcher.emit(alert(step))
    dispatcher.close("0123abcd")
    assert [b["kind"] for b in webhook_server.bodies] == ["nonfinite_grad", "nonfinite_grad"]


# --- (c) the webhook URL is a secret --------------------------------------------------------------


def test_webhook_url_secret_never_logged_when_unreachable(caplog):
    caplog.set_level(logging.DEBUG)
    secret_path, secret_query = "XSECRETPATHX", "token=hunter2hunter2"
    port = free_port()  # bound and closed again: nothing listens there
    url = f"http://127.0.0.1:{port}/services/T0/B0/{secret_path}?{secret_query}"
    sink = WebhookSink(url, timeout_s=2.0, retries=1)
    dispatcher = AlertDispatcher([LoggingSink(), sink], clock=FakeClock())
    dispatcher.emit(alert(5))
    dispatcher.close("0123abcd")  # joins the webhook thread after its retry

    assert sink.sent == 0 and sink.failed == 1
    failures = [r for r in caplog.records if "webhook" in r.getMessage()]
    assert len(failures) == 1
    assert f"127.0.0.1:{port}" in failures[0].getMessage()  # says where, without the secret
    everything = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert secret_path not in everything and "hunter2" not in everything
    assert secret_path not in repr(sink) and "hunter2" not in repr(sink)
    assert secret_path not in str(sink)


def test_bad_webhook_scheme_error_does_not_echo_the_secret():
    with pytest.raises(ValueError, match="http:// or https://") as err:
        WebhookSink("hooks.slack.com/services/T0/B0/XSECRETPATHX")
    assert "XSECRETPATHX" not in str(err.value)


# --- (d) a failing sink does not stop the others ----------------------------------------------------


def test_a_failing_sink_does_not_stop_the_others(tmp_path, caplog, webhook_server):
    caplog.set_level(logging.WARNING, logger="rldiag.alerts")
    recording = RecordingSink()
    webhook = WebhookSink(webhook_server.url())
    jsonl = JsonlSink(tmp_path / "alerts.jsonl")
    dispatcher = AlertDispatcher([BrokenSink(), jsonl, recording, webhook], clock=FakeClock())
    dispatcher.emit(alert(1))
    dispatcher.emit(alert(2))
    webhook.close()
    assert jsonl.flush()

    assert [e["step"] for e in recording.events] == [1, 2]
    assert len((tmp_path / "alerts.jsonl").read_text(encoding="utf-8").splitlines()) == 2
    assert [b["step"] for b in webhook_server.bodies] == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if "alert sink" in r.getMessage()]
    assert len(warnings) == 2 and "No space left on device" in warnings[0]


def test_a_sink_failing_on_close_does_not_stop_the_others_closing():
    recording = RecordingSink()
    dispatcher = AlertDispatcher([BrokenSink(), recording], clock=FakeClock())
    dispatcher.emit(alert(1))
    dispatcher.close("0123abcd")
    assert recording.closed


def test_jsonl_sink_writes_one_parseable_line_per_event(tmp_path):
    sink = JsonlSink(tmp_path / "nested" / "alerts.jsonl")  # creates the folder
    sink.send(alert(4, grad_norm=float("inf")).as_dict())
    sink.close()
    [line] = (tmp_path / "nested" / "alerts.jsonl").read_text(encoding="utf-8").splitlines()

    def reject(token: str):
        raise ValueError(token)

    event = json.loads(line, parse_constant=reject)
    assert event["step"] == 4 and event["grad_norm"] == "inf" and event["kind"] == "nonfinite_grad"
    assert "step 4" in event["text"]


def test_webhook_url_with_a_bad_port_is_refused_at_configuration():
    with pytest.raises(ValueError, match="invalid port") as err:
        WebhookSink("http://127.0.0.1:abc/SECRET-PATH")
    assert "SECRET" not in str(err.value)


# --- (e) the JSONL sink does no file I/O on the caller's (training) thread ---------------------------
_opened: list[tuple[str, int]] = []  # (path, thread id) of every open() of a file named alerts-audit*.jsonl


def _audit(event: str, args: tuple) -> None:
    path = args[0] if event == "open" and args else None
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if isinstance(path, str) and "alerts-audit" in path:
        _opened.append((path, threading.get_ident()))


sys.addaudithook(_audit)  # Python's own audit events: every open() in this process, whoever calls it


def test_jsonl_sink_opens_its_file_only_off_the_calling_thread_and_in_batches(tmp_path):
    path = tmp_path / "alerts-audit.jsonl"
    sink = JsonlSink(path)
    dispatcher = AlertDispatcher([sink], clock=FakeClock())
    _opened.clear()
    for step in range(500):
        dispatcher.emit(alert(step))
    dispatcher.close("0123abcd")  # writes what is queued, then stops the thread
    opened = list(_opened)  # before this test reads the file itself
    assert [json.loads(line)["step"] for line in path.read_text(encoding="utf-8").splitlines()] == list(range(500))
    assert opened, "the file was never opened"
    assert all(tid != threading.get_ident() for _, tid in opened)  # never on the thread that emitted
    assert len(opened) < 500 and sink.written == 500 and sink.failed == 0


def test_jsonl_sink_flush_writes_what_was_sent_and_a_later_event_after_close_still_lands(tmp_path):
    path = tmp_path / "alerts.jsonl"
    sink = JsonlSink(path)
    sink.send(alert(1).as_dict())
    assert sink.flush() and len(path.read_text(encoding="utf-8").splitlines()) == 1
    sink.close()
    sink.send(alert(2).as_dict())  # after close: a new thread, never lost
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text(encoding="utf-8").splitlines()] == [1, 2]


def test_jsonl_sink_that_cannot_write_counts_and_warns_and_never_raises(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rldiag.alerts")
    sink = JsonlSink(tmp_path / "alerts.jsonl")
    (tmp_path / "alerts.jsonl").mkdir()  # a folder where the file should be: open() fails
    sink.send(alert(1).as_dict())
    sink.close()
    assert sink.failed == 1 and sink.written == 0
    assert any("could not append 1 alert event" in r.getMessage() for r in caplog.records)


def test_jsonl_sink_in_the_foreground_writes_before_send_returns(tmp_path):
    path = tmp_path / "alerts.jsonl"
    sink = JsonlSink(path, background=False)  # rldiag watch: on disk before its state is saved
    sink.send(alert(3).as_dict())
    assert json.loads(path.read_text(encoding="utf-8"))["step"] == 3
