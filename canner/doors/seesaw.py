"""``PUT /seesaw/{project}/{downloader}/{filename}``: the door for Archive Team's workers.

seesaw's ``curl --fail ... --location --upload-file FILE TARGET`` appends the file's name to the
target a tracker hands out; nothing else is asked of the worker (no checksum, no tus).  This
module owns what the head of such a PUT means: the target (:func:`parse_target`), the digests it
declares (:func:`declared_digests`), its admission before any body byte (:class:`SeesawDoor`,
through the door-neutral :mod:`canner.accept.intake`) and its answer (:class:`SeesawRoutes`:
``201`` with the receipt once it is durable, ``200`` with the first object's receipt for a copy).
The statuses it answers are listed in the README ("What the receiver speaks"); acceptance, the
origin rule and the clean-up of a PUT that ends without a receipt are the intake's and
acceptance's.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Container
from functools import partial
from urllib.parse import unquote_to_bytes

from attrs import define, frozen
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.web.http_headers import Headers
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import Request

from canner.accept.intake import UploadIntake, UploadStanding
from canner.config import Config
from canner.doors.base import Door, DoorParts
from canner.store.uploads import DECLARED_DIGESTS, LockedUpload, UploadDoor, UploadInfo
from canner.web.answer import answer_later, render_error
from canner.web.channel import BodySink, ReceiverRequest
from canner.web.errors import HTTPError
from canner.web.routing import OTHER, Kind, Route, Surface, single_header
from canner.web.stream import body_stream

# A name is one path segment of at most this many bytes (UTF-8), as on every common filesystem.
NAME_MAX_BYTES = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@frozen
class PutTarget:
    """What the path of a PUT names."""

    project: str
    downloader: str
    filename: str


def _name(raw: bytes, what: str) -> str:
    """One percent-decoded path segment as a safe name; 400 with the reason otherwise."""
    decoded = unquote_to_bytes(raw)
    try:
        name = decoded.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPError(400, f"the {what} is not UTF-8") from None
    if not name:
        raise HTTPError(400, f"the {what} is empty")
    if "/" in name or "\\" in name:
        raise HTTPError(400, f"the {what} contains a path separator")
    if name in (".", ".."):
        raise HTTPError(400, f"the {what} may not be {name!r}")
    if _CONTROL.search(name):
        raise HTTPError(400, f"the {what} contains a control character")
    if len(decoded) > NAME_MAX_BYTES:
        raise HTTPError(400, f"the {what} is longer than {NAME_MAX_BYTES} bytes")
    return name


def parse_target(rest: str, projects: Container[str]) -> PutTarget:
    """The target named by the path after ``/seesaw/`` (``Route.target``, percent-encoded):
    ``{project}/{downloader}/{filename}``.  400 with the reason for a bad name, 404 for a path
    of another shape or a project this node does not serve."""
    segments = rest.encode("latin-1").split(b"/")
    if len(segments) != 3:
        raise HTTPError(404, "PUT files to /seesaw/{project}/{downloader}/{filename}")
    project = unquote_to_bytes(segments[0]).decode("utf-8", "replace")
    if project not in projects:
        raise HTTPError(404, f"no such project: {project!r}")
    return PutTarget(project, _name(segments[1], "downloader"), _name(segments[2], "file name"))


def _base64_digest(text: str, size: int, what: str) -> str:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise HTTPError(400, f"{what} is not the base64 of a {size}-byte digest")
    return raw.hex()


def declared_digests(headers: Headers) -> dict[str, str]:
    """The digests a request declares, as sidecar metadata (``canner.store.uploads``
    ``DECLARED_DIGESTS``): ``Content-MD5`` (RFC 1864) and the ``sha-256`` member of
    ``Content-Digest`` (RFC 9530); other algorithms are ignored.  400 when malformed."""
    found: dict[str, str] = {}
    md5 = single_header(headers, "Content-MD5")
    if md5 is not None:
        found[DECLARED_DIGESTS["md5"]] = _base64_digest(md5.strip(), 16, "Content-MD5")
    digest = single_header(headers, "Content-Digest")
    for member in (digest or "").split(","):
        key, _, value = member.partition("=")
        if key.strip() != "sha-256":
            continue
        value = value.strip()
        if len(value) < 2 or value[0] != ":" or value[-1] != ":":
            raise HTTPError(400, "Content-Digest: sha-256 must be sha-256=:<base64>:")
        found[DECLARED_DIGESTS["sha256"]] = _base64_digest(
            value[1:-1], 32, "Content-Digest sha-256"
        )
    return found


@define(eq=False, kw_only=True)
class SeesawDoor:
    """Admission of ``PUT /seesaw/...`` bodies."""

    _config: Config
    _intake: UploadIntake
    _clock: IReactorTime

    def open_body(
        self, request: ReceiverRequest, route: Route, length: int | None
    ) -> BodySink | None:
        if route.kind is not Kind.PUT:
            return None
        admission = partial(self._admit, request.requestHeaders, route.target, length)
        intake = self._intake
        return intake.open_stream(request, admission, intake.finish_whole, intake.discard_whole)

    def _admit(
        self, headers: Headers, rest: str, length: int | None
    ) -> Deferred[LockedUpload | UploadStanding]:
        """Everything the head tells, at once (pure); then the node's state in a thread."""
        target = parse_target(rest, self._config.projects)
        if length is None:
            raise HTTPError(411, "Content-Length is required")
        if length == 0:
            raise HTTPError(400, "the file is empty: empty artifacts cannot be receipted")
        if length > self._config.max_upload_bytes:
            raise HTTPError(
                413, f"the file exceeds the maximum of {self._config.max_upload_bytes} bytes"
            )
        metadata = {
            "project": target.project,
            "downloader": target.downloader,
            "filename": target.filename,
            **declared_digests(headers),
        }
        info = UploadInfo(
            upload_id=self._config.object_ids.new(),
            size=length,
            metadata=metadata,
            created_at=int(self._clock.seconds()),
            door=UploadDoor.PUT,
        )
        return self._intake.admit_creation(info)


class SeesawRoutes(Resource):
    """Answers ``PUT /seesaw/...`` once its body is accepted (or refused); 405 for any other
    method there."""

    isLeaf = True

    def render(self, request: Request) -> int | bytes:
        route: Route = getattr(request, "route", OTHER)
        if route.surface is not Surface.SEESAW or route.kind is not Kind.PUT:
            request.setHeader("Allow", "PUT")
            return render_error(request, HTTPError(405, "only PUT: upload a file here"))
        try:
            stream = body_stream(request)
        except HTTPError as e:
            return render_error(request, e)
        return answer_later(request, maybeDeferred(stream.result).addCallback(_receipted, request))


def _receipted(outcome: UploadStanding, request: IRequest) -> bytes:
    """201 with the receipt (its JSON, and in ``Artifact-Receipt``); 200 when the file was a
    copy of an object accepted before, with that object's receipt."""
    receipt = outcome.receipt
    if receipt is None:  # never: a whole file is accepted or refused
        raise HTTPError(500, "internal error")
    request.setResponseCode(201 if receipt.object_id == outcome.upload_id else 200)
    request.setHeader("Content-Type", "application/json")
    request.setHeader("Artifact-Receipt", receipt.header_value())
    request.setHeader("Cache-Control", "no-store")
    return receipt.to_json()


def door(parts: DoorParts) -> Door:
    """The seesaw door: ``/seesaw/`` (:data:`~canner.web.routing.Surface.SEESAW`)."""
    admission = SeesawDoor(config=parts.config, intake=parts.intake, clock=parts.clock)
    return Door(name="seesaw", serves=Surface.SEESAW, body=admission, resource=SeesawRoutes())
