"""``PUT /seesaw/{project}/{downloader}/{filename}`` on the in-memory receiver (the real site,
intake and acceptance over a real data directory), and its pure parsers."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from twisted.web.http_headers import Headers

from canner.delivery.index import AcceptedObject, insert_objects
from canner.doors.seesaw import declared_digests, parse_target
from canner.ids import ObjectIds
from canner.store import drain
from canner.store import uploads as store_module
from canner.store.journal import Journal
from canner.store.receipts import Origin, ReceiptStore
from canner.store.sweep import sweep_stale
from canner.store.uploads import UploadInfo, UploadStore
from canner.web.errors import HTTPError
from canner.web.routing import Kind, Surface, route
from tests.fakes import SyncIndex, succeeded
from tests.unit.receiver_harness import (
    RECEIPT_FIELDS,
    START,
    Connection,
    InMemoryReceiver,
    Response,
    blake3_hex,
    metadata_header,
)

DATA = b"WARC/1.1\r\n" * 1000
PATH = "/seesaw/example/alice/item-1.example.0123456789.warc.zst"
TWO_GIB = str(2 << 30)
BIG = str(64 << 20)  # the largest file the in-memory receiver takes


@pytest.fixture
def rcv(tmp_path: Path) -> InMemoryReceiver:
    return InMemoryReceiver.build(tmp_path)


def put(rcv: InMemoryReceiver, data: bytes = DATA, path: str = PATH, **headers: str) -> Response:
    return rcv.exchange("PUT", path, list(headers.items()), data)


def receipt_of(response: Response) -> dict[str, object]:
    doc: dict[str, object] = json.loads(response.body)
    assert list(doc) == RECEIPT_FIELDS
    header = response.header("Artifact-Receipt") or ""
    assert base64.urlsafe_b64decode(header + "=" * (-len(header) % 4)) == response.body
    return doc


def data_files(rcv: InMemoryReceiver) -> list[str]:
    return sorted(e for e in rcv.upload_entries() if not e.endswith(".info"))


# -- acceptance ------------------------------------------------------------------------------


def test_a_put_is_accepted_with_a_receipt_for_the_stored_bytes(rcv: InMemoryReceiver) -> None:
    """201 with the six-field receipt as body and header, BLAKE3 of the stored bytes, and the
    origin (project, downloader, file name) kept for delivery."""
    r = put(rcv)
    assert r.status == 201, r.body
    assert r.header("Content-Type") == "application/json"
    doc = receipt_of(r)
    oid = str(doc["object_id"])
    assert doc["checksum"] == blake3_hex(DATA) and doc["size_bytes"] == len(DATA)
    assert doc["accepted_at"] == int(START)
    assert rcv.stored(oid) == DATA
    assert rcv.receipt_ids_on_disk() == [oid]
    [(receipt, origin)] = rcv.enqueued
    assert receipt.object_id == oid
    assert (origin.project, origin.downloader, origin.filename) == (
        "example",
        "alice",
        "item-1.example.0123456789.warc.zst",
    )
    meta = json.loads((rcv.receipts_dir / f"{oid}.meta.json").read_bytes())
    assert meta["downloader"] == "alice"
    assert rcv.get_receipt(oid).body == r.body


def test_a_put_waiting_for_100_continue_gets_it_once_admitted(rcv: InMemoryReceiver) -> None:
    """curl's ``Expect: 100-continue`` is answered after admission, then the 201."""
    connection = rcv.connect()
    headers = [("Content-Length", str(len(DATA))), ("Expect", "100-continue")]
    connection.send_head("PUT", PATH, headers)
    assert connection.written == b"HTTP/1.1 100 Continue\r\n\r\n"
    connection.send(DATA)
    assert connection.answer().status == 201


def test_a_retry_of_the_same_file_answers_the_first_receipt(rcv: InMemoryReceiver) -> None:
    """The same file from the same worker again: 200 with the first object's receipt, and no
    second object, receipt or upload file."""
    first = put(rcv)
    again = put(rcv)
    assert again.status == 200 and again.body == first.body
    assert again.header("Artifact-Receipt") == first.header("Artifact-Receipt")
    assert len(rcv.receipt_ids_on_disk()) == 1 and len(rcv.enqueued) == 1
    assert data_files(rcv) == rcv.receipt_ids_on_disk()
    assert not any(e.endswith(".meta.json") for e in _receipt_entries(rcv)[1:])


def _receipt_entries(rcv: InMemoryReceiver) -> list[str]:
    return sorted(p.name for p in rcv.receipts_dir.iterdir() if p.name.endswith(".meta.json"))


@pytest.mark.parametrize(
    "path",
    [
        "/seesaw/example/bob/item-1.example.0123456789.warc.zst",
        "/seesaw/other/alice/item-1.example.0123456789.warc.zst",
        "/seesaw/example/alice/item-2.example.0123456789.warc.zst",
    ],
    ids=["other-downloader", "other-project", "other-name"],
)
def test_the_same_bytes_from_another_origin_are_a_new_object(
    rcv: InMemoryReceiver, path: str
) -> None:
    """Files of the same name from different workers (or projects) never collide."""
    first = receipt_of(put(rcv))
    second = put(rcv, path=path)
    assert second.status == 201
    assert receipt_of(second)["object_id"] != first["object_id"]
    assert len(rcv.receipt_ids_on_disk()) == 2


def test_other_bytes_under_the_same_name_are_a_new_object(rcv: InMemoryReceiver) -> None:
    """Same origin, different content: a new object (the key includes size and BLAKE3)."""
    put(rcv)
    assert put(rcv, DATA + b"x").status == 201
    assert len(rcv.receipt_ids_on_disk()) == 2


# -- declared digests ------------------------------------------------------------------------


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _sha256(data: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


def test_declared_digests_that_match_are_accepted(rcv: InMemoryReceiver) -> None:
    """Content-MD5 and Content-Digest sha-256 of the stored bytes: 201."""
    r = put(rcv, **{"Content-MD5": _md5(DATA), "Content-Digest": _sha256(DATA)})
    assert r.status == 201, r.body


@pytest.mark.parametrize("header", ["Content-MD5", "Content-Digest"])
def test_a_declared_digest_that_does_not_match_is_422_without_receipt(
    rcv: InMemoryReceiver, header: str
) -> None:
    """A mismatch over the stored bytes: 422 naming it, no receipt, nothing enqueued."""
    value = _md5(b"other") if header == "Content-MD5" else _sha256(b"other")
    r = put(rcv, **{header: value})
    assert r.status == 422, r.body
    assert b"mismatch" in r.body
    assert rcv.receipt_ids_on_disk() == [] and rcv.enqueued == []


def test_declared_digests_parse_strictly() -> None:
    """Only well-formed digests of the right size; other Content-Digest algorithms ignored."""
    md5 = hashlib.md5(b"x").hexdigest()
    headers = Headers({"Content-MD5": [_md5(b"x)")[:-2]]})
    with pytest.raises(HTTPError) as refused:
        declared_digests(headers)
    assert refused.value.status == 400
    assert declared_digests(Headers({"Content-MD5": [_md5(b"x")]})) == {"content-md5": md5}
    sha = hashlib.sha256(b"x").hexdigest()
    both = "sha-512=:AAAA:, " + _sha256(b"x")
    assert declared_digests(Headers({"Content-Digest": [both]})) == {"content-sha256": sha}
    assert declared_digests(Headers({"Content-Digest": ["sha-512=:AAAA:"]})) == {}
    with pytest.raises(HTTPError):
        declared_digests(Headers({"Content-Digest": ["sha-256=abc"]}))


# -- refusals from the head ------------------------------------------------------------------


def assert_refused_before_body(connection: Connection, status: int) -> Response:
    """Answered ``status`` after the head alone: no 100 Continue, the connection closing."""
    responses = connection.responses
    assert [r.status for r in responses] == [status], connection.written[:300]
    assert responses[0].header("Connection") == "close"
    return responses[0]


@pytest.mark.parametrize(
    ("path", "status", "reason"),
    [
        ("/seesaw/nope/alice/a.warc.gz", 404, b"no such project"),
        ("/seesaw/example/alice/a%2Fb.warc.gz", 400, b"path separator"),
        ("/seesaw/example/alice/a%5Cb.warc.gz", 400, b"path separator"),
        ("/seesaw/example/alice/..", 400, b"may not be"),
        ("/seesaw/example/alice/%2E%2E", 400, b"may not be"),
        ("/seesaw/example/alice/a%01.warc.gz", 400, b"control character"),
        ("/seesaw/example/alice/" + "a" * 256, 400, b"longer than 255"),
        ("/seesaw/example/alice/%FF.warc", 400, b"not UTF-8"),
        ("/seesaw/example/%2E/a.warc", 400, b"downloader may not be"),
        ("/seesaw/example/alice/", 400, b"file name is empty"),
        ("/seesaw/example/a.warc", 404, b"/seesaw/{project}"),
    ],
)
@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100"])
def test_a_bad_target_is_refused_before_the_body(
    rcv: InMemoryReceiver, path: str, status: int, reason: bytes, expect: bool
) -> None:
    """Bad names are 400 with the reason, unknown projects 404, before any body byte."""
    connection = rcv.connect()
    headers = [("Content-Length", TWO_GIB)]
    if expect:
        headers.append(("Expect", "100-continue"))
    connection.send_head("PUT", path, headers)
    answer = assert_refused_before_body(connection, status)
    assert reason in answer.body, answer.body
    assert rcv.upload_entries() == set()


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([("Content-Length", str((64 << 20) + 1))], 413),
        ([("Content-Length", "0")], 400),
        ([("Transfer-Encoding", "chunked")], 411),
        ([("Content-Length", str(len(DATA))), ("Content-MD5", "nope")], 400),
    ],
    ids=["over-max", "empty", "no-length", "bad-md5"],
)
def test_a_bad_head_is_refused_before_the_body(
    rcv: InMemoryReceiver, headers: list[tuple[str, str]], status: int
) -> None:
    """Size over max_upload_bytes, an empty or unframed body, a malformed digest."""
    connection = rcv.connect()
    connection.send_head("PUT", PATH, [*headers, ("Expect", "100-continue")])
    if status == 400 and headers[0][1] == "0":
        # An empty body has nothing to wait for: answered as a whole request.
        assert connection.answer().status == 400
    else:
        assert_refused_before_body(connection, status)
    assert rcv.upload_entries() == set()


def test_a_draining_node_refuses_with_retry_after(rcv: InMemoryReceiver) -> None:
    """503 with Retry-After before the body, while the node drains."""
    drain.start_draining(rcv.data_dir, START, "maintenance")
    connection = rcv.connect()
    connection.send_head("PUT", PATH, [("Content-Length", BIG), ("Expect", "100-continue")])
    answer = assert_refused_before_body(connection, 503)
    assert answer.header("Retry-After")
    assert rcv.upload_entries() == set()


def test_a_node_under_its_free_space_floor_refuses_with_retry_after(tmp_path: Path) -> None:
    """429 with Retry-After before the body, under min_free_bytes."""
    rcv = InMemoryReceiver.build(tmp_path, min_free_bytes=1 << 60)
    connection = rcv.connect()
    connection.send_head("PUT", PATH, [("Content-Length", BIG), ("Expect", "100-continue")])
    answer = assert_refused_before_body(connection, 429)
    assert answer.header("Retry-After")
    assert rcv.upload_entries() == set()


def test_other_methods_on_the_target_are_405(rcv: InMemoryReceiver) -> None:
    """GET or POST there: 405, Allow: PUT."""
    r = rcv.exchange("GET", PATH)
    assert r.status == 405 and r.header("Allow") == "PUT"


# -- a body cut short ------------------------------------------------------------------------


def test_a_put_cut_mid_body_leaves_nothing(rcv: InMemoryReceiver) -> None:
    """The connection drops halfway: no object, no receipt, no upload file."""
    connection = rcv.connect()
    connection.send_head("PUT", PATH, [("Content-Length", str(len(DATA)))])
    connection.send(DATA[: len(DATA) // 2])
    assert len(data_files(rcv)) == 1  # streamed as it came
    connection.close()
    assert rcv.upload_entries() == set()
    assert rcv.receipt_ids_on_disk() == [] and rcv.enqueued == []
    # The worker's retry is a new, whole object.
    assert put(rcv).status == 201


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_put_whose_write_fails_mid_body_leaves_nothing_and_promises_nothing(
    rcv: InMemoryReceiver, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The disk refuses a write mid-body (full, or failing): 503 with Retry-After once the body
    is in, no upload file or sidecar stays, nothing is promised to it any more, and the
    worker's retry is accepted."""
    connection = rcv.connect()
    connection.send_head("PUT", PATH, [("Content-Length", str(len(DATA)))])
    connection.send(DATA[: len(DATA) // 2])
    assert len(data_files(rcv)) == 1
    assert rcv.intake.promises.total == len(DATA) - len(DATA) // 2
    real = store_module.os.pwritev

    def failing(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store_module.os, "pwritev", failing)
    connection.send(DATA[len(DATA) // 2 :])
    answer = connection.answer()
    monkeypatch.setattr(store_module.os, "pwritev", real)
    assert answer.status == 503 and answer.header("Retry-After"), answer.body
    assert rcv.upload_entries() == set()
    assert (rcv.intake.promises.total, rcv.intake.promises.uploads) == (0, 0)
    assert rcv.receipt_ids_on_disk() == [] and rcv.enqueued == []
    assert put(rcv).status == 201


def test_a_start_removes_whole_file_uploads_a_crash_left_without_receipt(tmp_path: Path) -> None:
    """What a crash left of PUTs (a partial; a complete file whose receipt never came) is
    removed when the receiver starts and promised nothing; a tus upload in progress and a file
    rsync'd and staged stay, with what they are owed."""
    uploads, receipts = UploadStore(tmp_path / "uploads"), ReceiptStore(tmp_path / "receipts")
    uploads.directory.mkdir()
    receipts.directory.mkdir()
    ids = ObjectIds()
    put_meta = {"project": "example", "downloader": "alice", "filename": "a.warc.zst"}
    cut, complete, tus, staged = (ids.new() for _ in range(4))
    # Laid out as today's receiver leaves them (UploadStore.create, then the bytes written).
    uploads.create(UploadInfo(cut, 1000, put_meta, 1))
    uploads.data_path(cut).write_bytes(b"c" * 400)
    uploads.create(UploadInfo(complete, 3, {**put_meta, "filename": "b.warc.zst"}, 1))
    uploads.data_path(complete).write_bytes(b"abc")
    tus_meta = {"project": "example", "checksum": blake3_hex(b"t" * 1000)}
    uploads.create(UploadInfo(tus, 1000, tus_meta, 1))
    uploads.data_path(tus).write_bytes(b"t" * 250)
    rsync_meta = {
        "project": "example",
        "filename": "s.warc",
        "checksum": blake3_hex(b"s"),
    }
    uploads.create(UploadInfo(staged, 1, rsync_meta, 1))
    uploads.data_path(staged).write_bytes(b"s")
    # The origin record an acceptance writes before its receipt.
    receipts.record_origin(complete, Origin("example", "b.warc.zst", "alice"))

    rcv = InMemoryReceiver.build(tmp_path)
    assert rcv.upload_entries() == {tus, f"{tus}.info", staged, f"{staged}.info"}
    assert receipts.read_origin(complete) is None
    assert (rcv.intake.promises.total, rcv.intake.promises.uploads) == (750, 2)
    assert rcv.receipt_ids_on_disk() == []
    assert rcv.head(tus).header("Upload-Offset") == "250"


# -- pure parts ------------------------------------------------------------------------------


def test_the_route_names_the_seesaw_surface() -> None:
    """PUT under /seesaw/ streams its body; other methods are routed there too (for a 405)."""
    put_route = route(b"PUT", b"/seesaw/p/d/f%20g")
    assert (put_route.kind, put_route.surface, put_route.target) == (
        Kind.PUT,
        Surface.SEESAW,
        "p/d/f%20g",
    )
    assert put_route.streams_body
    assert route(b"GET", b"/seesaw/p/d/f").kind is Kind.OTHER


def test_the_target_is_decoded_per_segment() -> None:
    """Percent-encoding is undone after splitting, so an encoded slash cannot add a segment."""
    target = parse_target("example/al%20ice/it%C3%A9m.warc", {"example"})
    assert (target.downloader, target.filename) == ("al ice", "itém.warc")
    assert len(("é" * 127).encode()) == 254
    parse_target("example/a/" + "%C3%A9" * 127, {"example"})


# -- where is item X (HQ's query by origin) --------------------------------------------------


def test_hq_finds_objects_by_origin_as_it_describes_them_by_id(rcv: InMemoryReceiver) -> None:
    """By project and file name (and downloader), each object as ``GET /api/v1/objects/{id}``
    answers it; an unknown name is an empty list, a missing argument a 400."""
    index = SyncIndex(rcv.data_dir / "delivery.sqlite")
    try:
        put(rcv)
        rcv.advance(1)  # oldest first: alice's is accepted a second before bob's
        put(rcv, path=PATH.replace("/alice/", "/bob/"))
        put(rcv, path=PATH.replace(".warc.zst", ".other.warc.zst"))
        objects = [AcceptedObject.of(receipt, origin) for receipt, origin in rcv.enqueued]
        succeeded(index.run(insert_objects, objects, START))
    finally:
        index.close()
    name = PATH.rsplit("/", 1)[1]
    query = f"/api/v1/objects:by-origin?project=example&filename={name}"
    found = rcv.exchange("GET", query)
    assert found.status == 200 and found.header("Cache-Control") == "no-store"
    doc = found.json()
    assert doc["truncated"] is False
    assert [d["downloader"] for d in doc["results"]] == ["alice", "bob"]
    for result in doc["results"]:
        by_id = rcv.exchange("GET", f"/api/v1/objects/{result['object_id']}").json()
        assert result == by_id and by_id["filename"] == name
    alice = rcv.exchange("GET", query + "&downloader=alice").json()["results"]
    assert [d["object_id"] for d in alice] == [doc["results"][0]["object_id"]]
    assert rcv.exchange("GET", query.replace(name, "nope")).json()["results"] == []
    refused = rcv.exchange("GET", "/api/v1/objects:by-origin?project=example")
    assert refused.status == 400 and refused.json()["error"] == "bad_request"


# -- nothing stays of a file that was not accepted -------------------------------------------


def test_a_put_whose_acceptance_fails_leaves_nothing(
    rcv: InMemoryReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receipt commit's fsync fails: 503 with Retry-After, and no upload, receipt or
    origin record stays (the worker sends the file again)."""
    real = os.fsync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(rcv.receipts_dir):
            raise OSError(errno.EIO, "I/O error")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    r = put(rcv)
    assert r.status == 503 and r.header("Retry-After"), r.body
    assert rcv.upload_entries() == set()
    assert list(rcv.receipts_dir.iterdir()) == []
    monkeypatch.setattr(os, "fsync", real)
    assert put(rcv).status == 201


def test_the_sweep_removes_a_complete_whole_file_upload_left_unaccepted(tmp_path: Path) -> None:
    """A crash between a PUT's last byte and its receipt leaves a complete upload no worker
    will resume: the sweep removes it once idle; a complete tus upload stays for its worker."""
    uploads, receipts = UploadStore(tmp_path / "uploads"), ReceiptStore(tmp_path / "receipts")
    uploads.directory.mkdir()
    receipts.directory.mkdir()
    ids = ObjectIds()
    whole, tus = ids.new(), ids.new()
    meta = {"project": "example", "filename": "a.warc"}
    uploads.create(UploadInfo(whole, 3, {**meta, "downloader": "alice"}, 1))
    uploads.create(UploadInfo(tus, 3, {**meta, "checksum": blake3_hex(b"abc")}, 1))
    for oid in (whole, tus):
        uploads.data_path(oid).write_bytes(b"abc")
    receipts.record_origin(whole, Origin("example", "a.warc", "alice"))
    now = time.time() + 3600
    report = sweep_stale(uploads, receipts, Journal(tmp_path / "journal"), ids, now, 1800)
    assert report.removed == [whole]
    assert uploads.present(tus) and not uploads.present(whole)
    assert receipts.read_origin(whole) is None


def test_tus_uploads_naming_a_downloader_are_never_merged(rcv: InMemoryReceiver) -> None:
    """A tus worker holds its own upload id: two identical tus uploads that name a downloader
    are two objects (the origin keeps the downloader all the same)."""
    meta = metadata_header(
        [
            ("project", "example"),
            ("checksum", blake3_hex(DATA)),
            ("filename", "a.warc"),
            ("downloader", "alice"),
        ]
    )
    headers = [
        ("Tus-Resumable", "1.0.0"),
        ("Upload-Length", str(len(DATA))),
        ("Upload-Metadata", meta),
        ("Content-Type", "application/offset+octet-stream"),
    ]
    first = rcv.exchange("POST", "/files/", headers, DATA)
    second = rcv.exchange("POST", "/files/", headers, DATA)
    assert first.status == second.status == 201
    assert first.header("Artifact-Receipt") != second.header("Artifact-Receipt")
    assert len(rcv.receipt_ids_on_disk()) == 2
    assert [o.downloader for _, o in rcv.enqueued] == ["alice", "alice"]


def test_a_put_over_the_connection_cap_gets_503_with_retry_after(tmp_path: Path) -> None:
    """Past the per-address cap, a worker's PUT connection is answered 503 Retry-After before
    anything is read, and nothing is stored; once a slot frees, the PUT goes through."""
    rcv = InMemoryReceiver.build(tmp_path, connections={"max_per_client": 1})
    held = rcv.connect()
    over = rcv.connect()
    over.send_head("PUT", PATH, [("Content-Length", str(len(DATA))), ("Expect", "100-continue")])
    [answer] = over.responses
    assert answer.status == 503 and answer.header("Retry-After")
    assert rcv.upload_entries() == set()
    held.close()
    assert put(rcv).status == 201
