"""The tus half of the intake: tus 1.0.0 headers in, the door-neutral intake's operations out.

``open_body`` is called (through :mod:`canner.doors.router`) as soon as a request's head is in.
For ``POST /files/`` (creation, with or without upload) and ``PATCH /files/{id}`` it checks the
headers (pure, at once, :mod:`canner.doors.tus.protocol`) and hands the upload to
:class:`~canner.accept.intake.UploadIntake`, which admits it in a thread and streams its body.
HEAD asks the intake where the upload stands.
"""

from __future__ import annotations

from functools import partial

from attrs import define
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime
from twisted.web.http_headers import Headers

from canner.accept.intake import UploadIntake, UploadStanding, not_found
from canner.config import Config
from canner.doors.tus import protocol
from canner.store.uploads import LockedUpload, UploadDoor, UploadInfo
from canner.web.channel import ReceiverRequest
from canner.web.errors import HTTPError
from canner.web.routing import Kind, Route, single_header
from canner.web.stream import BodyStream


@define(eq=False, kw_only=True)
class TusAdmission:
    """Creation and append admission from tus headers, and HEAD."""

    _config: Config
    _intake: UploadIntake
    _clock: IReactorTime

    def open_body(
        self, request: ReceiverRequest, route: Route, length: int | None
    ) -> BodyStream | None:
        """The stream of a creation's or an append's body; None for any other route."""
        if route.kind is Kind.CREATE:
            admission = partial(self._admit_creation, request.requestHeaders, length)
        elif route.kind is Kind.APPEND:
            admission = partial(self._admit_append, request.requestHeaders, route.target, length)
        else:
            return None
        return self._intake.open_stream(request, admission, self._intake.finish)

    def status(self, headers: Headers, upload_id: str) -> Deferred[UploadStanding]:
        """The state of an upload for HEAD (waiting for a running acceptance:
        :meth:`~canner.accept.intake.UploadIntake.standing`)."""
        try:
            protocol.check_tus_resumable(headers)
            if not self._config.object_ids.is_valid(upload_id):
                raise not_found()
        except HTTPError as e:
            return fail(e)
        return self._intake.standing(upload_id)

    def _admit_creation(
        self, headers: Headers, length: int | None
    ) -> Deferred[LockedUpload | UploadStanding]:
        protocol.check_tus_resumable(headers)
        creation = protocol.parse_creation(
            headers, self._config.projects, self._config.max_upload_bytes
        )
        if length != 0:
            if not protocol.has_upload_body(headers):
                raise HTTPError(
                    415, f"a creation body needs Content-Type {protocol.OFFSET_CONTENT_TYPE}"
                )
            if length is not None and length > creation.length:
                raise HTTPError(413, "the body is longer than Upload-Length")
        info = UploadInfo(
            upload_id=self._config.object_ids.new(),
            size=creation.length,
            metadata=dict(creation.metadata),
            created_at=int(self._clock.seconds()),
            durable=0,
            door=UploadDoor.TUS,
        )
        # Everything the answer needs is checked before anything exists on disk.
        location = self._location(headers, info.upload_id)
        return self._intake.admit_creation(info, location, with_body=length != 0)

    def _location(self, headers: Headers, upload_id: str) -> str:
        forwarded: list[tuple[str, str]] = []
        if self._config.trust_forwarded_headers:
            for key in ("proto", "host"):
                value = single_header(headers, f"X-Forwarded-{key}")
                if value:
                    forwarded.append((key, value.split(",")[0].strip()))
        return protocol.location(self._config.public_url, forwarded, upload_id)

    def _admit_append(
        self, headers: Headers, upload_id: str, length: int | None
    ) -> Deferred[LockedUpload | UploadStanding]:
        protocol.check_tus_resumable(headers)
        protocol.check_patch_content_type(headers)
        if not self._config.object_ids.is_valid(upload_id):
            raise not_found()
        offset = protocol.upload_offset(headers)
        return self._intake.admit_append(upload_id, offset, length)
