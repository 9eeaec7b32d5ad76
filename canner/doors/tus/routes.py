"""tus 1.0.0 at ``/files/``: OPTIONS, POST, HEAD, PATCH.

Thin adapters, dispatched on the route the request already has (``canner.web.routing``): nothing
matches a tus path a second time.  POST and PATCH bodies were already streamed by the request
(``channel.py``, ``stream.py``); their handlers wait for the stream's
:class:`~canner.doors.tus.intake.Outcome` and render it.  Every expected refusal is a
:class:`HTTPError`, rendered by :class:`~canner.web.answer.Answer`; anything else is a 500 with
the failure logged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from canner.doors.tus import protocol
from canner.doors.tus.intake import Outcome, UploadIntake
from canner.web.answer import Answer
from canner.web.errors import TUS_VERSION, HTTPError
from canner.web.routing import OTHER, Kind, Route
from canner.web.stream import BodyStream

log = Logger()

Handler = Callable[[IRequest, Route], "Deferred[bytes] | bytes"]


def render_error(request: IRequest, error: HTTPError) -> bytes:
    """A refusal given once the request reached its route (see ``answer.py``)."""
    return Answer.of(error).apply(request)


def _offset_headers(request: IRequest, outcome: Outcome) -> None:
    # No body: no Content-Type (Twisted would add text/html).
    request.defaultContentType = None  # type: ignore[attr-defined]
    request.setHeader("Upload-Offset", str(outcome.offset))
    if outcome.receipt is not None:
        request.setHeader("Artifact-Receipt", outcome.receipt.header_value())


class TusRoutes(Resource):
    """The tus endpoints of one receiver, mounted at ``/files``."""

    isLeaf = True

    def __init__(self, intake: UploadIntake, max_upload_bytes: int) -> None:
        super().__init__()
        self._intake = intake
        self._max_upload_bytes = max_upload_bytes
        self._handlers: dict[Kind, dict[bytes, Handler]] = {
            Kind.CREATE: {b"POST": self.create},
            Kind.COLLECTION: {b"OPTIONS": self.options},
            Kind.APPEND: {b"PATCH": self.append},
            Kind.UPLOAD: {b"OPTIONS": self.options, b"HEAD": self.status},
        }
        # CREATE and COLLECTION are one path, as are APPEND and UPLOAD: one Allow each.
        self._allow = {
            Kind.CREATE: b"OPTIONS, POST",
            Kind.COLLECTION: b"OPTIONS, POST",
            Kind.APPEND: b"OPTIONS, HEAD, PATCH",
            Kind.UPLOAD: b"OPTIONS, HEAD, PATCH",
        }

    def render(self, request: Request) -> int | bytes:
        route: Route = getattr(request, "route", OTHER)
        methods = self._handlers.get(route.kind)
        if methods is None:
            return render_error(request, HTTPError(404, "no such resource"))
        handler = methods.get(request.method)
        if handler is None:
            request.setHeader("Allow", self._allow[route.kind])
            return render_error(request, HTTPError(405, "method not allowed"))
        answered = maybeDeferred(handler, request, route)
        # A connection that drops first cancels the wait (never the upload's stream).
        request.notifyFinish().addErrback(lambda _: answered.cancel())
        answered.addCallbacks(
            self._write, self._refusal, callbackArgs=(request,), errbackArgs=(request,)
        )
        return NOT_DONE_YET

    @staticmethod
    def _write(body: bytes, request: Any) -> None:
        if not request.finished and request.channel is not None:
            request.write(body)
            request.finish()

    @classmethod
    def _refusal(cls, failure: Failure, request: Any) -> None:
        if failure.check(CancelledError):
            return  # the connection went first: nobody to answer
        error = failure.value
        if not isinstance(error, HTTPError):
            log.failure("answering {method} {path}", failure, method=request.method,
                        path=request.path)  # fmt: skip
            error = HTTPError(500, "internal error")
        if not request.finished and request.channel is not None:
            cls._write(render_error(request, error), request)

    def options(self, request: IRequest, route: Route) -> bytes:
        request.setResponseCode(204)
        request.setHeader("Tus-Version", TUS_VERSION)
        request.setHeader("Tus-Extension", protocol.TUS_EXTENSIONS)
        request.setHeader("Tus-Max-Size", str(self._max_upload_bytes))
        request.defaultContentType = None  # type: ignore[attr-defined]
        return b""

    def create(self, request: IRequest, route: Route) -> Deferred[bytes]:
        def created(outcome: Outcome) -> bytes:
            request.setResponseCode(201)
            assert outcome.location is not None
            request.setHeader("Location", outcome.location)
            _offset_headers(request, outcome)
            return b""

        return _stream(request).result().addCallback(created)

    def status(self, request: IRequest, route: Route) -> Deferred[bytes]:
        request.setHeader("Cache-Control", "no-store")

        def found(outcome: Outcome) -> bytes:
            request.setHeader("Upload-Length", str(outcome.size))
            if outcome.metadata:
                request.setHeader("Upload-Metadata", protocol.format_metadata(outcome.metadata))
            _offset_headers(request, outcome)
            return b""

        return self._intake.status(request.requestHeaders, route.target).addCallback(found)

    def append(self, request: IRequest, route: Route) -> Deferred[bytes]:
        def appended(outcome: Outcome) -> bytes:
            request.setResponseCode(204)
            _offset_headers(request, outcome)
            return b""

        return _stream(request).result().addCallback(appended)


def _stream(request: IRequest) -> BodyStream:
    stream = getattr(request, "body_sink", None)
    if not isinstance(stream, BodyStream):
        # Only a request whose head named a tus body route gets here, and those always stream.
        raise HTTPError(404, "no such upload")
    return stream
