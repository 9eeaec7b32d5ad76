"""The JSON lines written under systemd, and the receiver's access log."""

from __future__ import annotations

import io
import json
import re
from typing import Any

from twisted.logger import Logger, LogPublisher, formatEvent, globalLogPublisher
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest

from canner.daemon.site import MeteredSite
from canner.logs import json_observer
from canner.ops.metrics import RECEIVER, Metrics
from canner.web.routing import route

OID = "0123456789abcdef" * 2


def logged_lines(emit: Any) -> list[dict[str, Any]]:
    out = io.StringIO()
    publisher = LogPublisher(json_observer(out))
    emit(Logger(namespace="canner.test", observer=publisher))
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_are_flat_and_conventional() -> None:
    """ISO 8601 UTC time, level, logger, the rendered message and the event's own fields; no
    Twisted internals."""
    [line] = logged_lines(
        lambda log: log.warn(
            "delivery of {object_id} failed: {error}", object_id=OID, error="503", attempt=2
        )
    )
    assert list(line)[:4] == ["time", "level", "logger", "message"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert line["level"] == "warning" and line["logger"] == "canner.test"
    assert line["message"] == f"delivery of {OID} failed: 503"
    assert (line["object_id"], line["error"], line["attempt"]) == (OID, "503", 2)
    assert not [key for key in line if key.startswith("log_")]


def test_messages_are_twisted_s_rendering_of_the_template() -> None:
    """Format specs, conversions, attribute and item access, Twisted's ``{name()}`` calls and
    templates that cannot be rendered give the text ``formatEvent`` gives."""
    cases: list[tuple[str, dict[str, Any]]] = [
        (
            "accepted {object_id} ({size} bytes) for {project}",
            dict(object_id=OID, size=65536, project="p"),
        ),
        ("{n:>6,} {r!r} {v.real} {d[k]} {{literal}}", dict(n=12345, r="x", v=2.5, d={"k": 1})),
        ("it took {took()} seconds", dict(took=lambda: 1.5)),
        ("missing {absent}", {}),
        ("positional {}", {}),
        ("", {}),
    ]
    out, seen = io.StringIO(), list[dict[str, Any]]()
    log = Logger(namespace="canner.test", observer=LogPublisher(json_observer(out), seen.append))
    for template, fields in cases:
        log.info(template, **fields)
    messages = [json.loads(line)["message"] for line in out.getvalue().splitlines()]
    assert messages == [formatEvent(event) for event in seen]
    assert "Unable to format event" in formatEvent(seen[3])


def test_unexpected_errors_carry_exception_and_traceback() -> None:
    """log.failure adds the exception and its traceback; odd field values become strings."""

    def emit(log: Logger) -> None:
        try:
            raise ValueError("boom")
        except ValueError:
            log.failure("tick failed", path=object())

    [line] = logged_lines(emit)
    assert line["level"] == "critical" and line["exception"] == "ValueError: boom"
    assert "Traceback" in line["traceback"] and isinstance(line["path"], str)


def test_access_log_has_one_structured_line_per_request() -> None:
    """Client, method (after override), path with ids shortened, status, bytes, duration."""
    seen: list[dict[str, Any]] = []
    publisher = LogPublisher()
    publisher.addObserver(seen.append)
    globalLogPublisher.addObserver(publisher)
    try:
        site = MeteredSite(Resource(), object(), Metrics(RECEIVER))  # type: ignore[arg-type]
        quiet = MeteredSite(
            Resource(),
            object(),  # type: ignore[arg-type]
            Metrics(RECEIVER),
            access_log=False,
        )
        request = DummyRequest([b"files", OID.encode()])
        # As a ReceiverRequest has it: the method after X-HTTP-Method-Override, and its route.
        request.method = b"PATCH"
        request.uri = request.path = b"/files/" + OID.encode()
        request.route = route(b"PATCH", request.path)  # type: ignore[attr-defined]
        request.code = 204
        request.sentLength = 0
        site.log(request)
        quiet.log(request)
    finally:
        globalLogPublisher.removeObserver(publisher)
    [event] = [e for e in seen if e.get("log_namespace") == "canner.access"]
    assert (event["method"], event["status"], event["bytes"]) == ("PATCH", 204, 0)
    assert event["path"] == "/files/01234567…" and OID not in json.dumps(event, default=str)
    assert event["client"] and event["duration_s"] is None
