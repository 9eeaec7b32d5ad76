"""Klein routes for tus 1.0.0 at ``/files/``: OPTIONS, POST, HEAD, PATCH.

Thin adapters.  POST and PATCH bodies were already streamed by the request (see ``stream.py``);
the handlers wait for the stream's :class:`~canner.tus.intake.Outcome` and render it.  Every
expected refusal is a :class:`TusError`, rendered in :meth:`TusRoutes.refusal`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from attrs import define
from klein import Klein
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from canner.tus import protocol
from canner.tus.answer import Answer
from canner.tus.intake import Outcome, UploadIntake
from canner.tus.protocol import TusError
from canner.tus.stream import BodyStream

log = Logger()


def render_error(request: IRequest, error: TusError) -> bytes:
    """A refusal given once the request reached its route (see ``answer.py``)."""
    return Answer.of(error).apply(request)


def _offset_headers(request: IRequest, outcome: Outcome) -> None:
    # No body: no Content-Type (Twisted would add text/html).
    request.defaultContentType = None  # type: ignore[attr-defined]
    request.setHeader("Upload-Offset", str(outcome.offset))
    if outcome.receipt is not None:
        request.setHeader("Artifact-Receipt", outcome.receipt.header_value())


@define(eq=False)
class TusRoutes:
    """The tus endpoints of one receiver."""

    app: ClassVar[Klein] = Klein()
    _intake: UploadIntake
    _max_upload_bytes: int

    @app.handle_errors(TusError)
    def refusal(self, request: IRequest, failure: Any) -> bytes:
        return render_error(request, failure.value)

    # Mounted at /files: "/" is the collection, "/<upload_id>" one upload.
    @app.route("/", methods=["OPTIONS"])
    @app.route("/<upload_id>", methods=["OPTIONS"])
    def options(self, request: IRequest, upload_id: str | None = None) -> bytes:
        request.setResponseCode(204)
        request.setHeader("Tus-Version", protocol.TUS_VERSION)
        request.setHeader("Tus-Extension", protocol.TUS_EXTENSIONS)
        request.setHeader("Tus-Max-Size", str(self._max_upload_bytes))
        return b""

    @app.route("/", methods=["POST"])
    async def create(self, request: IRequest) -> bytes:
        outcome: Outcome = await _stream(request).result()
        request.setResponseCode(201)
        assert outcome.location is not None
        request.setHeader("Location", outcome.location)
        _offset_headers(request, outcome)
        return b""

    @app.route("/<upload_id>", methods=["HEAD"])
    async def status(self, request: IRequest, upload_id: str) -> bytes:
        request.setHeader("Cache-Control", "no-store")
        outcome = await self._intake.status(request.requestHeaders, upload_id)
        request.setHeader("Upload-Length", str(outcome.size))
        if outcome.metadata:
            request.setHeader("Upload-Metadata", protocol.format_metadata(outcome.metadata))
        _offset_headers(request, outcome)
        return b""

    @app.route("/<upload_id>", methods=["PATCH"])
    async def append(self, request: IRequest, upload_id: str) -> bytes:
        outcome: Outcome = await _stream(request).result()
        request.setResponseCode(204)
        _offset_headers(request, outcome)
        return b""


def _stream(request: IRequest) -> BodyStream:
    stream = getattr(request, "body_sink", None)
    if not isinstance(stream, BodyStream):
        # Only a request whose head named a tus body route gets here, and those always stream.
        raise TusError(404, "no such upload")
    return stream
