"""tus 1.0.0 at ``/files/``: OPTIONS, POST, HEAD, PATCH.

Thin adapters, dispatched on the route the request already has (``canner.web.routing``): nothing
matches a tus path a second time.  POST and PATCH bodies were already streamed by the request
(``channel.py``, ``stream.py``); their handlers wait for the stream's
:class:`~canner.accept.intake.UploadStanding` and render it.  Every expected refusal is a
:class:`HTTPError`, rendered by the one renderer (:mod:`canner.web.answer`); anything else is a
500 with the failure logged.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import Request

from canner.accept.intake import UploadStanding
from canner.doors.base import Door, DoorParts
from canner.doors.tus import protocol
from canner.doors.tus.admission import TusAdmission
from canner.web.answer import answer_later, render_error
from canner.web.errors import TUS_VERSION, HTTPError
from canner.web.routing import OTHER, Kind, Route, Surface
from canner.web.stream import body_stream

Handler = Callable[[IRequest, Route], Deferred[bytes]]


def door(parts: DoorParts) -> Door:
    """The tus door: ``/files/`` (:data:`~canner.web.routing.Surface.TUS`)."""
    admission = TusAdmission(config=parts.config, intake=parts.intake, clock=parts.clock)
    routes = TusRoutes(admission, parts.config.max_upload_bytes)
    return Door(name="tus", serves=Surface.TUS, body=admission, resource=routes)


def _offset_headers(request: IRequest, outcome: UploadStanding) -> None:
    # No body: no Content-Type (Twisted would add text/html).
    request.defaultContentType = None  # type: ignore[attr-defined]
    request.setHeader("Upload-Offset", str(outcome.offset))
    if outcome.receipt is not None:
        request.setHeader("Artifact-Receipt", outcome.receipt.header_value())


class TusRoutes(Resource):
    """The tus endpoints of one receiver, mounted at ``/files``."""

    isLeaf = True

    def __init__(self, admission: TusAdmission, max_upload_bytes: int) -> None:
        super().__init__()
        self._admission = admission
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
        return answer_later(request, maybeDeferred(handler, request, route))

    def options(self, request: IRequest, route: Route) -> Deferred[bytes]:
        request.setResponseCode(204)
        request.setHeader("Tus-Version", TUS_VERSION)
        request.setHeader("Tus-Extension", protocol.TUS_EXTENSIONS)
        request.setHeader("Tus-Max-Size", str(self._max_upload_bytes))
        request.defaultContentType = None  # type: ignore[attr-defined]
        return succeed(b"")

    def create(self, request: IRequest, route: Route) -> Deferred[bytes]:
        def created(outcome: UploadStanding) -> bytes:
            request.setResponseCode(201)
            assert outcome.location is not None
            request.setHeader("Location", outcome.location)
            _offset_headers(request, outcome)
            return b""

        return body_stream(request).result().addCallback(created)

    def status(self, request: IRequest, route: Route) -> Deferred[bytes]:
        request.setHeader("Cache-Control", "no-store")

        def found(outcome: UploadStanding) -> bytes:
            request.setHeader("Upload-Length", str(outcome.size))
            if outcome.metadata:
                request.setHeader("Upload-Metadata", protocol.format_metadata(outcome.metadata))
            _offset_headers(request, outcome)
            return b""

        return self._admission.status(request.requestHeaders, route.target).addCallback(found)

    def append(self, request: IRequest, route: Route) -> Deferred[bytes]:
        def appended(outcome: UploadStanding) -> bytes:
            request.setResponseCode(204)
            _offset_headers(request, outcome)
            return b""

        return body_stream(request).result().addCallback(appended)
