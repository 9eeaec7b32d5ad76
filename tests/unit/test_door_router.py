"""A door added without touching any module of canner: a test-only door registered in the router of
doors (``canner.doors.router``) takes a body over a path routing has never heard of, and the
upload reaches a receipt through the same intake and acceptance as tus and seesaw's PUT."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from attrs import define
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import Request

from canner.accept.intake import UploadIntake, UploadStanding
from canner.config import Config
from canner.doors.base import Door, DoorParts
from canner.doors.router import DOORS, DoorRouter
from canner.store.uploads import LockedUpload, UploadInfo
from canner.web.answer import answer_later, render_error
from canner.web.channel import BodySink, ReceiverRequest
from canner.web.errors import HTTPError
from canner.web.routing import OTHER, DoorPath, Kind, Route, Surface
from canner.web.stream import body_stream
from tests.unit.receiver_harness import InMemoryReceiver, blake3_hex

DATA = b"a file through a door canner does not know\n" * 100


# -- the door: POST /drop/{project} with the file as its body ------------------------------------


@define(eq=False)
class DropAdmission:
    """Admits ``POST /drop/{project}`` bodies as whole files."""

    _config: Config
    _intake: UploadIntake
    _now: float

    def open_body(
        self, request: ReceiverRequest, route: Route, length: int | None
    ) -> BodySink | None:
        admission = partial(self._admit, route.target, length)
        intake = self._intake
        return intake.open_stream(request, admission, intake.finish_whole, intake.discard_whole)

    def _admit(self, project: str, length: int | None) -> Deferred[LockedUpload | UploadStanding]:
        if project not in self._config.projects:
            raise HTTPError(404, f"no such project: {project!r}")
        if not length:
            raise HTTPError(411, "a drop needs its Content-Length")
        info = UploadInfo(
            upload_id=self._config.object_ids.new(),
            size=length,
            metadata={"project": project},
            created_at=int(self._now),
        )
        return self._intake.admit_creation(info)


class DropRoutes(Resource):
    """201 with the receipt once the drop is accepted; 405 for any other method."""

    isLeaf = True

    def render(self, request: Request) -> int | bytes:
        route: Route = getattr(request, "route", OTHER)
        if route.kind is not Kind.BODY:
            request.setHeader("Allow", "POST")
            return render_error(request, HTTPError(405, "only POST: drop a file here"))
        answered = maybeDeferred(body_stream(request).result).addCallback(_receipted, request)
        return answer_later(request, answered)


def _receipted(outcome: UploadStanding, request: IRequest) -> bytes:
    assert outcome.receipt is not None
    request.setResponseCode(201)
    request.setHeader("Content-Type", "application/json")
    return outcome.receipt.to_json()


def drop_door(parts: DoorParts) -> Door:
    admission = DropAdmission(parts.config, parts.intake, parts.clock.seconds())
    return Door(
        name="drop",
        serves=DoorPath("drop", frozenset({b"POST"})),
        body=admission,
        resource=DropRoutes(),
    )


# -- the tests -----------------------------------------------------------------------------------


@pytest.fixture
def rcv(tmp_path: Path) -> InMemoryReceiver:
    return InMemoryReceiver.build(tmp_path, doors=(*DOORS, drop_door))


def test_a_registered_door_takes_a_body_to_a_receipt(rcv: InMemoryReceiver) -> None:
    """A POST to the door's own path is streamed, accepted and receipted like a PUT: 201 with the
    receipt of the stored bytes, served by the receipt lookup and handed to delivery."""
    r = rcv.exchange("POST", "/drop/example", [], DATA)
    assert r.status == 201, r.body
    doc = json.loads(r.body)
    oid = doc["object_id"]
    assert doc["checksum"] == blake3_hex(DATA) and doc["size_bytes"] == len(DATA)
    assert rcv.stored(oid) == DATA
    assert rcv.receipt_ids_on_disk() == [oid]
    [(receipt, origin)] = rcv.enqueued
    assert (receipt.object_id, origin.project) == (oid, "example")
    assert rcv.get_receipt(oid).body == r.body


def test_the_doors_canner_has_keep_working_beside_it(rcv: InMemoryReceiver) -> None:
    """tus and seesaw's PUT still reach their own doors when another is registered."""
    oid = rcv.new_upload(DATA)
    patched = rcv.patch(oid, 0, DATA)
    assert patched.status == 204
    rcv.verify_receipt(patched.header("Artifact-Receipt"), oid, DATA)
    put = rcv.exchange("PUT", "/seesaw/example/alice/f.warc", [], DATA)
    assert put.status == 201, put.body


def test_the_door_refuses_from_the_head_and_answers_its_other_methods(
    rcv: InMemoryReceiver,
) -> None:
    """Its admission's refusal is the answer (nothing stored); another method on its path gets
    its resource's 405; a path no door declared stays 404."""
    assert rcv.exchange("POST", "/drop/nowhere", [], DATA).status == 404
    assert rcv.exchange("GET", "/drop/example").status == 405
    assert rcv.exchange("POST", "/dropped/example", [], b"x").status == 404
    assert rcv.receipt_ids_on_disk() == [] and rcv.upload_entries() == set()


def test_a_door_cannot_take_the_routes_of_another(tmp_path: Path) -> None:
    """Two doors serving the same routes are refused when the router is built."""
    rcv = InMemoryReceiver.build(tmp_path)
    parts = DoorParts(config=rcv.config, intake=rcv.intake, clock=rcv.clock)
    with pytest.raises(ValueError, match="drop"):
        DoorRouter.build(parts, (*DOORS, drop_door, drop_door))
    router = DoorRouter.build(parts, (*DOORS, drop_door))
    assert router.paths == (DoorPath("drop", frozenset({b"POST"})),)
    assert router.door_of(Route(Kind.PUT, Surface.SEESAW)) is not None
    assert router.door_of(Route(Kind.RECEIPT, Surface.RECEIVER)) is None
