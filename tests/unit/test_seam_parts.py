"""The upload seam's small parts: the one routing decision (canner.web.routing), the one answer
renderer (canner.web.answer) and the body stream's transition table (canner.web.stream)."""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import succeed
from twisted.python.failure import Failure

from canner.blocking import run_inline
from canner.web.answer import OVER_CAPACITY, Answer
from canner.web.errors import HTTPError
from canner.web.routing import Kind, Route, Surface, route
from canner.web.stream import (
    BODIES_HIGH_WATER,
    NEXT,
    PENDING_HIGH_WATER,
    SHARE_MIN,
    BodyBudget,
    BodyStream,
    IllegalTransition,
    Phase,
)

OID = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        (b"POST", b"/files/", Route(Kind.CREATE, Surface.TUS)),
        (b"POST", b"/files", Route(Kind.CREATE, Surface.TUS)),
        (b"OPTIONS", b"/files/", Route(Kind.COLLECTION, Surface.TUS)),
        (b"PATCH", b"/files/" + OID.encode(), Route(Kind.APPEND, Surface.TUS, OID)),
        (b"HEAD", b"/files/" + OID.encode(), Route(Kind.UPLOAD, Surface.TUS, OID)),
        (b"PATCH", b"/files/..%2f", Route(Kind.APPEND, Surface.TUS, "../")),
        (b"PATCH", b"/files/a/b", Route(Kind.OTHER, Surface.TUS)),
        (b"GET", b"/api/v1/receipts/" + OID.encode(), Route(Kind.RECEIPT, Surface.RECEIVER, OID)),
        (b"GET", b"/api/v1/objects/" + OID.encode(), Route(Kind.HQ, Surface.HQ)),
        (b"POST", b"/api/v1/objects:query", Route(Kind.HQ, Surface.HQ)),
        (b"POST", b"/api/v1/releases", Route(Kind.HQ, Surface.HQ)),
        (b"GET", b"/api/v1/receipts", Route(Kind.OTHER, Surface.RECEIVER)),
        (b"GET", b"/", Route(Kind.STATUS_PAGE, Surface.RECEIVER)),
        (b"GET", b"/healthz", Route(Kind.HEALTH, Surface.RECEIVER)),
        (b"GET", b"/readyz", Route(Kind.READY, Surface.RECEIVER)),
        (b"GET", b"/metrics", Route(Kind.METRICS, Surface.RECEIVER)),
        (b"GET", b"/filesystem", Route(Kind.OTHER, Surface.RECEIVER)),
    ],
)
def test_each_path_has_one_route(method: bytes, path: bytes, expected: Route) -> None:
    """Method and path decide what a request is, which app serves it and which id it names."""
    assert route(method, path) == expected


@given(
    st.one_of(st.binary(max_size=40), st.builds(lambda s: b"files/" + s, st.binary(max_size=40))),
    st.sampled_from([b"GET", b"POST", b"PATCH", b"HEAD", b"PUT"]),
)
def test_only_creations_and_appends_stream_their_body(path: bytes, method: bytes) -> None:
    """A body goes to an upload only for POST to /files(/) or PATCH to /files/<one segment>."""
    full = b"/" + path
    tail = full[len(b"/files/") :]
    creation = method == b"POST" and full in (b"/files", b"/files/")
    append = method == b"PATCH" and full.startswith(b"/files/") and tail and b"/" not in tail
    assert route(method, full).streams_body == (creation or bool(append))


def test_an_answer_renders_the_same_on_the_wire_and_through_a_request() -> None:
    """Status, Tus-Resumable, extra headers, a text body: the same from both renderings."""
    answer = Answer.of(HTTPError(429, "insufficient storage", (("Retry-After", "60"),)))
    wire = answer.wire()
    assert wire.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
    head, body = wire.split(b"\r\n\r\n", 1)
    assert body == b"insufficient storage\n"
    lines = head.split(b"\r\n")[1:]
    assert lines == [
        b"Tus-Resumable: 1.0.0",
        b"Retry-After: 60",
        b"Content-Type: text/plain; charset=utf-8",
        b"Content-Length: 21",
        b"Connection: close",
    ]

    class Recorder:
        code: int | None = None
        headers: ClassVar[dict[str, str]] = {}

        def setResponseCode(self, code: int, message: bytes | None = None) -> None:
            self.code, self.message = code, message

        def setHeader(self, name: str, value: str) -> None:
            self.headers = {**self.headers, name: value}

    request = Recorder()
    assert answer.apply(request) == body
    assert request.code == 429 and request.message == b"Too Many Requests"
    assert request.headers == {
        "Tus-Resumable": "1.0.0",
        "Retry-After": "60",
        "Content-Type": "text/plain; charset=utf-8",
    }


def test_an_answer_without_a_message_has_no_body() -> None:
    """The connection cap's 503 is headers only, and closes the connection."""
    assert OVER_CAPACITY.wire() == (
        b"HTTP/1.1 503 Service Unavailable\r\nTus-Resumable: 1.0.0\r\nRetry-After: 5\r\n"
        b"Content-Length: 0\r\nConnection: close\r\n\r\n"
    )


def test_every_body_stream_phase_leads_to_done() -> None:
    """The transition table has no dead end: from every phase, DONE can be reached."""
    for start in Phase:
        seen, frontier = {start}, [start]
        while frontier:
            for nxt in NEXT[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert Phase.DONE in seen, start


def test_a_body_stream_refuses_a_transition_its_table_lacks() -> None:
    """Admitting a stream that was already answered is a bug, and says so."""

    class Transport:
        def pauseProducing(self) -> None: ...
        def resumeProducing(self) -> None: ...

    stream = BodyStream(
        run_inline,
        Transport(),
        lambda upload, chunks: succeed(0),
        lambda upload, lost: succeed(None),
    )
    stream.answered(Failure(HTTPError(404, "no such upload")))
    assert stream.phase is Phase.ANSWERED
    with pytest.raises(IllegalTransition, match="answered -> writing"):
        stream.admitted(None)  # type: ignore[arg-type]
    stream.body_ended()
    assert stream.phase is Phase.DONE
    failure = []
    stream.result().addErrback(failure.append)
    assert failure[0].value.status == 404


def test_bodies_streaming_at_once_share_their_memory() -> None:
    """Each body waiting for the disk pauses its socket at its share of the process's memory for
    bodies: a full share while few stream, less while many do (what 32 bodies at once hold
    stays near what 8 hold), and the share grows again as they end."""

    class Transport:
        paused = False

        def pauseProducing(self) -> None:
            self.paused = True

        def resumeProducing(self) -> None:
            self.paused = False

    budget = BodyBudget()
    streams: list[tuple[BodyStream, Transport]] = []
    for _ in range(32):
        transport = Transport()
        stream = BodyStream(
            run_inline,
            transport,
            lambda upload, chunks: succeed(0),
            lambda upload, lost: succeed(None),
            budget=budget,
        )
        streams.append((stream, transport))
    share = budget.share()
    assert share < PENDING_HIGH_WATER
    # What 32 bodies hold together: the budget, or each one's smallest share.
    assert 32 * 3 * share <= max(BODIES_HIGH_WATER, 32 * 3 * SHARE_MIN)
    waiting, transport = streams[0]
    assert waiting.read_size == share
    waiting.chunk(b"x" * (share - 1))
    assert not transport.paused
    waiting.chunk(b"x")
    assert transport.paused, "a body past its share keeps reading"

    for stream, _ in streams[1:]:
        stream.answered(Failure(HTTPError(404, "no such upload")))
        stream.body_ended()
    assert budget.streams == 1
    assert budget.share() == PENDING_HIGH_WATER
