"""Hostile and malformed requests against the in-memory receiver: each gets a clear 4xx (never a
5xx), carries ``Tus-Resumable: 1.0.0``, and leaves no file anywhere but ``uploads/`` and
``receipts/``.

Moved from the end-to-end suite (``tests/e2e/test_e2e_bad_input.py`` keeps one real-process check
per class of refusal).  Every response goes through :meth:`InMemoryReceiver.exchange`, which
asserts ``Tus-Resumable``; the ``rcv`` fixture checks after each test that no file appeared
outside ``uploads/`` and ``receipts/`` and that nothing was logged as a failure.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher
from werkzeug.exceptions import BadHost
from werkzeug.routing import Map
from zope.interface import provider

from canner.accept.intake import TAKEOVER_QUIET, TAKEOVER_WAIT
from canner.web.routing import bindable_host
from tests.unit.receiver_harness import (
    MAX_UPLOAD,
    OFFSET_TYPE,
    START,
    TUS_VERSION,
    Header,
    InMemoryReceiver,
    Response,
    b64,
    blake3_hex,
    chunked,
    metadata_header,
)
from tests.upload_checks import bad_framing, check_framing_refusal, snapshot

DATA = random.Random(7).randbytes(4096)
CHECKSUM = blake3_hex(DATA)


@pytest.fixture
def failures() -> Iterator[list[dict[str, Any]]]:
    """Log events that carry a failure (``log.failure``, an unhandled error in a Deferred)."""
    seen: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            seen.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield seen
    finally:
        globalLogPublisher.removeObserver(observe)


@pytest.fixture
def rcv(tmp_path: Path, failures: list[dict[str, Any]]) -> Iterator[InMemoryReceiver]:
    """A receiver; after each test, no new file outside uploads/ and receipts/ and no failure
    logged."""
    # Nested, so that a path traversal from uploads/ (../../x) still lands inside tmp_path.
    data_dir = tmp_path / "srv" / "canner" / "data"
    data_dir.mkdir(parents=True)
    receiver = InMemoryReceiver.build(data_dir)
    before = snapshot(tmp_path)
    yield receiver
    allowed = (receiver.uploads_dir, receiver.receipts_dir)
    stray = [
        p for p in snapshot(tmp_path) - before if not any(p.is_relative_to(a) for a in allowed)
    ]
    assert stray == [], f"files appeared outside uploads/ and receipts/: {stray}"
    gc.collect()  # a dropped failed Deferred is logged when it is collected
    assert failures == [], f"failures logged: {failures}"


def tus_headers(**extra: str) -> list[Header]:
    return [("Tus-Resumable", TUS_VERSION), *extra.items()]


def chunked_patch(rcv: InMemoryReceiver, oid: str, offset: int, pieces: list[bytes]) -> Response:
    """A PATCH whose body is sent chunked (no Content-Length), one chunk per piece."""
    return rcv.exchange(
        "PATCH", f"/files/{oid}", rcv.patch_head(offset, None), chunked(pieces), length=False
    )


def assert_nothing_created(rcv: InMemoryReceiver, before: set[str], response: object) -> None:
    after = rcv.upload_entries()
    assert after == before, f"a refused creation left files: {after - before} ({response})"


PATCH_HEADERS: list[Header] = [
    ("Tus-Resumable", TUS_VERSION),
    ("Upload-Offset", "0"),
    ("Content-Type", OFFSET_TYPE),
]
CREATION_METADATA = metadata_header([("project", "example"), ("checksum", CHECKSUM)])


# -- object ids -----------------------------------------------------------------------------------

BAD_IDS = {
    "dotdot-slash": "..%2f",
    "dotdot-etc": "..%2F..%2Fetc",
    "encoded-dots": "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "nul": "%00",
    "nul-in-id": "0123456789abcdef%000123456789abcde",
    "10kB": "a" * 10_000,
    "uppercase-hex": "0123456789ABCDEF0123456789ABCDEF",
    "31-hex": "0123456789abcdef0123456789abcde",
    "33-hex": "0123456789abcdef0123456789abcdef0",
    "id-with-suffix": "0123456789abcdef0123456789abcdef.info",
    "non-ascii": "%C3%A9" * 16,
}


@pytest.mark.parametrize("bad_id", list(BAD_IDS.values()), ids=list(BAD_IDS))
def test_bad_object_ids_are_404_on_every_route(rcv: InMemoryReceiver, bad_id: str) -> None:
    """An id that is not 32 lowercase hex digits is 404 on HEAD, PATCH, overridden POST and
    the receipt lookup, and HEAD carries no offset."""
    results = {
        "HEAD": rcv.exchange("HEAD", f"/files/{bad_id}", tus_headers()),
        "PATCH": rcv.exchange("PATCH", f"/files/{bad_id}", PATCH_HEADERS, b"abc"),
        "POST-override": rcv.exchange(
            "POST",
            f"/files/{bad_id}",
            [*PATCH_HEADERS, ("X-HTTP-Method-Override", "PATCH")],
            b"abc",
        ),
        "GET-receipt": rcv.exchange("GET", f"/api/v1/receipts/{bad_id}"),
    }
    statuses = {name: r.status for name, r in results.items()}
    assert statuses == dict.fromkeys(results, 404), statuses
    assert results["HEAD"].header("Upload-Offset") is None


def test_unknown_valid_id_is_404_without_offset(rcv: InMemoryReceiver) -> None:
    """A well-formed id nobody created is 404 on HEAD (no offset, no-store), PATCH and lookup."""
    oid = random.Random(1).randbytes(16).hex()
    head = rcv.head(oid)
    assert head.status == 404
    assert head.header("Upload-Offset") is None, "a HEAD 404 must not carry Upload-Offset"
    assert head.header("Cache-Control") == "no-store"
    assert rcv.patch(oid, 0, b"x").status == 404
    assert rcv.get_receipt(oid).status == 404


# -- creation: metadata ---------------------------------------------------------------------------

HEX64 = "0123456789abcdef" * 4
BAD_METADATA = {
    "bad-base64": f"project !!!,checksum {b64(CHECKSUM)}",
    "bad-base64-padding": f"project ZXhhbXBsZQ=x,checksum {b64(CHECKSUM)}",
    "not-utf8": metadata_header([("project", b"\xff\xfe"), ("checksum", CHECKSUM)]),
    "duplicate-key": metadata_header(
        [("project", "example"), ("checksum", CHECKSUM), ("project", "example")]
    ),
    "duplicate-checksum": metadata_header(
        [("project", "example"), ("checksum", CHECKSUM), ("checksum", CHECKSUM)]
    ),
    "unknown-project": metadata_header([("project", "nope"), ("checksum", CHECKSUM)]),
    "empty-project": metadata_header([("project", None), ("checksum", CHECKSUM)]),
    "missing-project": metadata_header([("checksum", CHECKSUM)]),
    "missing-checksum": metadata_header([("project", "example")]),
    "empty-checksum": metadata_header([("project", "example"), ("checksum", None)]),
    "checksum-uppercase": metadata_header(
        [("project", "example"), ("checksum", "blake3:" + HEX64.upper())]
    ),
    "checksum-63-hex": metadata_header(
        [("project", "example"), ("checksum", "blake3:" + HEX64[:63])]
    ),
    "checksum-65-hex": metadata_header(
        [("project", "example"), ("checksum", "blake3:" + HEX64 + "0")]
    ),
    "checksum-sha256": metadata_header([("project", "example"), ("checksum", "sha256:" + HEX64)]),
    "checksum-no-prefix": metadata_header([("project", "example"), ("checksum", HEX64)]),
    "checksum-newline": metadata_header(
        [("project", "example"), ("checksum", "blake3:" + HEX64 + "\n")]
    ),
    "filename-1025-bytes": metadata_header(
        [("project", "example"), ("checksum", CHECKSUM), ("filename", "f" * 1025)]
    ),
    "filename-1026-bytes-in-342-chars": metadata_header(
        [("project", "example"), ("checksum", CHECKSUM), ("filename", "\u20ac" * 342)]
    ),
    "no-metadata": "",
}


@pytest.mark.parametrize("metadata", list(BAD_METADATA.values()), ids=list(BAD_METADATA))
def test_bad_metadata_is_400_before_anything_is_created(
    rcv: InMemoryReceiver, metadata: str
) -> None:
    """Malformed or unacceptable Upload-Metadata is 400 without a Location, with or without a
    creation body, and creates nothing."""
    before = rcv.upload_entries()
    headers = tus_headers(**{"Upload-Length": str(len(DATA))})
    if metadata:
        headers.append(("Upload-Metadata", metadata))
    r = rcv.exchange("POST", "/files/", headers)
    assert r.status == 400, f"{metadata[:100]!r}: {r.status} {r.body!r}"
    assert r.header("Location") is None
    assert_nothing_created(rcv, before, r)
    # with a body (creation-with-upload) as well
    r = rcv.exchange("POST", "/files/", [*headers, ("Content-Type", OFFSET_TYPE)], DATA)
    assert r.status == 400, f"with body, {metadata[:100]!r}: {r.status}"
    assert_nothing_created(rcv, before, r)


@pytest.mark.parametrize(
    "filename", ["f" * 1024, "\u00e9" * 512, "x"], ids=["1024-ascii", "1024-bytes-utf8", "short"]
)
def test_filename_up_to_1024_bytes_is_kept(rcv: InMemoryReceiver, filename: str) -> None:
    """A filename of up to 1024 UTF-8 bytes is accepted and echoed by HEAD."""
    oid = rcv.new_upload(DATA, filename=filename)
    r = rcv.patch(oid, 0, DATA)
    assert r.status == 204, r.status
    rcv.verify_receipt(r.header("Artifact-Receipt"), oid, DATA)
    assert b64(filename) in (rcv.head(oid).header("Upload-Metadata") or "")


def test_second_project_is_accepted(rcv: InMemoryReceiver) -> None:
    """An upload to the second configured project gets its receipt."""
    oid = rcv.new_upload(DATA, project="other")
    r = rcv.patch(oid, 0, DATA)
    assert r.status == 204, r.status
    rcv.verify_receipt(r.header("Artifact-Receipt"), oid, DATA)


# -- creation: Upload-Length ----------------------------------------------------------------------

BAD_LENGTHS: dict[str, tuple[bytes | None, int]] = {
    "plus-sign": (b"+10", 400),
    "underscore": (b"1_0", 400),
    "inner-space": (b"1 0", 400),
    "vertical-tab": (b"\x0b10", 400),
    "arabic-indic-digits": ("\u0661\u0660".encode(), 400),
    "minus-one": (b"-1", 400),
    "zero": (b"0", 400),
    "float": (b"10.0", 400),
    "hex": (b"0x10", 400),
    "empty": (b"", 400),
    "missing": (None, 400),
    "over-max": (str(MAX_UPLOAD + 1).encode(), 413),
    "huge": (b"99999999999999999999999999", 400),
}


@pytest.mark.parametrize(("value", "status"), list(BAD_LENGTHS.values()), ids=list(BAD_LENGTHS))
def test_bad_upload_length_is_refused(
    rcv: InMemoryReceiver, value: bytes | None, status: int
) -> None:
    """A malformed Upload-Length is 400 and one over the maximum 413, without a Location and
    without creating anything."""
    before = rcv.upload_entries()
    headers = tus_headers(**{"Upload-Metadata": CREATION_METADATA})
    if value is not None:
        headers.append(("Upload-Length", value))
    r = rcv.exchange("POST", "/files/", headers)
    if value == b"99999999999999999999999999":
        assert r.status in (400, 413), r.status
    else:
        assert r.status == status, f"Upload-Length {value!r}: {r.status} {r.body!r}"
    assert r.header("Location") is None
    assert_nothing_created(rcv, before, r)


def test_upload_length_exactly_max_is_allowed(rcv: InMemoryReceiver) -> None:
    """An Upload-Length equal to max_upload_bytes is created."""
    r = rcv.create(MAX_UPLOAD, CHECKSUM)
    assert r.status == 201, r.body


def test_deferred_length_is_refused(rcv: InMemoryReceiver) -> None:
    """Upload-Defer-Length is not supported: 400, nothing created."""
    before = rcv.upload_entries()
    headers = tus_headers(**{"Upload-Defer-Length": "1", "Upload-Metadata": CREATION_METADATA})
    r = rcv.exchange("POST", "/files/", headers)
    assert r.status == 400, r.status
    assert_nothing_created(rcv, before, r)


def test_creation_body_longer_than_upload_length_is_413(rcv: InMemoryReceiver) -> None:
    """A creation body longer than its Upload-Length is 413 and creates nothing."""
    before = rcv.upload_entries()
    r = rcv.create(100, CHECKSUM, body=DATA)
    assert r.status == 413, r.status
    assert_nothing_created(rcv, before, r)


def test_creation_body_with_wrong_content_type_is_415(rcv: InMemoryReceiver) -> None:
    """A creation body that is not application/offset+octet-stream is 415, nothing created."""
    before = rcv.upload_entries()
    r = rcv.create(len(DATA), CHECKSUM, body=DATA, headers=[("Content-Type", "text/plain")])
    assert r.status == 415, r.status
    assert_nothing_created(rcv, before, r)


# -- Tus-Resumable --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [None, "0.2.2", "1.0", "1.0.0,1.0.0", "2.0.0"])
def test_missing_or_unsupported_tus_resumable_is_412(
    rcv: InMemoryReceiver, version: str | None
) -> None:
    """POST, HEAD and PATCH without Tus-Resumable 1.0.0 are 412 with Tus-Version, and change
    nothing."""
    oid = rcv.new_upload(DATA)
    before = rcv.upload_entries()

    def headers(**extra: str) -> list[Header]:
        return [*extra.items(), *([("Tus-Resumable", version)] if version is not None else [])]

    responses = {
        "POST": rcv.exchange(
            "POST",
            "/files/",
            headers(**{"Upload-Length": str(len(DATA)), "Upload-Metadata": CREATION_METADATA}),
        ),
        "HEAD": rcv.exchange("HEAD", f"/files/{oid}", headers()),
        "PATCH": rcv.exchange(
            "PATCH",
            f"/files/{oid}",
            headers(**{"Upload-Offset": "0", "Content-Type": OFFSET_TYPE}),
            DATA,
        ),
    }
    for method, r in responses.items():
        assert r.status == 412, f"{method} with Tus-Resumable {version!r}: {r.status}"
        assert r.header("Tus-Version") == "1.0.0", f"{method} 412 without Tus-Version"
        assert r.header("Tus-Resumable") == "1.0.0"
    assert rcv.upload_entries() == before
    assert rcv.offset(oid) == 0


# -- PATCH refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/octet-stream", "application/offset+octet-streamx"],
)
def test_patch_with_wrong_content_type_is_415(
    rcv: InMemoryReceiver, content_type: str | None
) -> None:
    """A PATCH whose Content-Type is not exactly application/offset+octet-stream is 415 and
    stores nothing."""
    oid = rcv.new_upload(DATA)
    headers: list[Header] = [("Tus-Resumable", TUS_VERSION), ("Upload-Offset", "0")]
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    r = rcv.exchange("PATCH", f"/files/{oid}", headers, DATA[:100])
    assert r.status == 415, f"Content-Type {content_type!r}: {r.status}"
    assert rcv.offset(oid) == 0
    assert rcv.stored(oid) == b""


@pytest.mark.parametrize("offset", ["", "+0", "-0", "0x0", "1_0", "a", None])
def test_patch_with_malformed_offset_is_400(rcv: InMemoryReceiver, offset: str | None) -> None:
    """A missing or malformed Upload-Offset is 400 and stores nothing."""
    oid = rcv.new_upload(DATA)
    headers: list[Header] = [("Tus-Resumable", TUS_VERSION), ("Content-Type", OFFSET_TYPE)]
    if offset is not None:
        headers.append(("Upload-Offset", offset))
    r = rcv.exchange("PATCH", f"/files/{oid}", headers, DATA[:100])
    assert r.status == 400, f"Upload-Offset {offset!r}: {r.status}"
    assert rcv.stored(oid) == b""


def test_patch_at_wrong_offset_is_409_and_stores_nothing(rcv: InMemoryReceiver) -> None:
    """A PATCH at any offset but the stored one is 409 and changes nothing; the right one then
    completes the upload."""
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:1000]).status == 204
    for offset in (0, 999, 1001, len(DATA)):
        r = rcv.patch(oid, offset, DATA[offset : offset + 10] or b"z")
        assert r.status == 409, f"PATCH at {offset} (stored 1000): {r.status}"
        assert rcv.offset(oid) == 1000
        assert rcv.stored(oid) == DATA[:1000]
    r = rcv.patch(oid, 1000, DATA[1000:])
    assert r.status == 204
    rcv.verify_receipt(r.header("Artifact-Receipt"), oid, DATA)


def test_patch_past_upload_length_is_413_and_stores_nothing(rcv: InMemoryReceiver) -> None:
    """A PATCH past Upload-Length is 413 whether its length is declared or shows mid-stream
    (chunked), stores nothing of it, and the upload still completes."""
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:1000]).status == 204
    r = rcv.patch(oid, 1000, DATA[1000:] + b"one byte too many")
    assert r.status == 413, r.status
    assert rcv.offset(oid) == 1000
    assert rcv.stored(oid) == DATA[:1000]
    # No Content-Length: the overrun shows up mid-stream.
    rest = DATA[1000:] + b"!"
    r = chunked_patch(rcv, oid, 1000, [rest[i : i + 512] for i in range(0, len(rest), 512)])
    assert r.status == 413, f"chunked overrun: {r.status}"
    assert rcv.offset(oid) == 1000, "a refused chunked PATCH left bytes behind"
    assert rcv.stored(oid) == DATA[:1000]
    assert rcv.get_receipt(oid).status == 404
    r = rcv.patch(oid, 1000, DATA[1000:])
    assert r.status == 204, r.status
    rcv.verify_receipt(r.header("Artifact-Receipt"), oid, DATA)


def test_chunked_patch_within_length_is_stored(rcv: InMemoryReceiver) -> None:
    """A chunked PATCH that ends at Upload-Length completes the upload."""
    oid = rcv.new_upload(DATA)
    r = chunked_patch(rcv, oid, 0, [DATA[i : i + 999] for i in range(0, len(DATA), 999)])
    assert r.status == 204, r.status
    rcv.verify_receipt(r.header("Artifact-Receipt"), oid, DATA)


def test_second_patch_while_first_streams_is_refused(rcv: InMemoryReceiver) -> None:
    """A second PATCH of an upload whose first PATCH is still sending gets 423 after
    TAKEOVER_WAIT; the first then completes the upload."""
    oid = rcv.new_upload(DATA)
    first = rcv.open_patch(oid, 0, len(DATA))
    first.send(DATA[:100])
    assert rcv.offset(oid) == 100
    second = rcv.open_patch(oid, 100, len(DATA) - 100)
    sent = 100
    while not second.answers and rcv.clock.seconds() - START < 2 * TAKEOVER_WAIT:
        rcv.advance(0.125)
        first.send(DATA[sent : sent + 8])
        sent += 8
    assert second.answer().status == 423, second.written[:200]
    assert TAKEOVER_WAIT - TAKEOVER_QUIET < rcv.clock.seconds() - START <= TAKEOVER_WAIT
    second.send(b"Z" * (len(DATA) - 100))
    first.send(DATA[sent:])
    assert first.answer().status == 204
    assert rcv.stored(oid) == DATA
    rcv.verify_receipt(first.answer().header("Artifact-Receipt"), oid, DATA)


# -- everything else ------------------------------------------------------------------------------


def test_head_sends_no_store_and_echoes_metadata(rcv: InMemoryReceiver) -> None:
    """HEAD of a new upload: no-store, offset 0, its length, no receipt, and the metadata as
    created."""
    oid = rcv.new_upload(DATA, filename="x.warc")
    head = rcv.head(oid)
    assert head.status == 200
    assert head.header("Cache-Control") == "no-store"
    assert head.header("Upload-Offset") == "0"
    assert head.header("Upload-Length") == str(len(DATA))
    assert head.header("Artifact-Receipt") is None
    echoed = dict(p.split(" ") for p in (head.header("Upload-Metadata") or "").split(","))
    assert echoed == {
        "project": b64("example"),
        "checksum": b64(CHECKSUM),
        "filename": b64("x.warc"),
    }


def test_options_advertises_tus(rcv: InMemoryReceiver) -> None:
    """OPTIONS names tus 1.0.0, the maximum size and only the extensions canner implements."""
    r = rcv.exchange("OPTIONS", "/files/")
    assert r.status in (200, 204)
    assert r.header("Tus-Version") == "1.0.0"
    assert r.header("Tus-Max-Size") == str(MAX_UPLOAD)
    extensions = {e.strip() for e in (r.header("Tus-Extension") or "").split(",")}
    assert {"creation", "creation-with-upload"} <= extensions
    assert not extensions & {"termination", "concatenation", "creation-defer-length"}


@pytest.mark.parametrize("path", ["/healthz", "/api/v1/receipts/" + "0" * 32, "/nowhere"])
def test_oversize_non_upload_body_is_413(rcv: InMemoryReceiver, path: str) -> None:
    """A body past 64 KiB on a route that takes none is 413, declared or chunked, and the
    receiver goes on serving."""
    r = rcv.exchange("POST", path, [], b"\0" * 1_000_000)
    assert r.status == 413, f"POST {path} with 1 MB: {r.status}"
    body = chunked([b"\0" * 65536] * 16)
    r = rcv.exchange("POST", path, [("Transfer-Encoding", "chunked")], body, length=False)
    assert r.status == 413, f"chunked POST {path} with 1 MiB: {r.status}"
    assert rcv.exchange("GET", "/healthz").status == 200


def test_unknown_routes_and_methods_are_4xx(rcv: InMemoryReceiver) -> None:
    """Routes and methods canner does not serve (download, termination, ...) are 4xx and leave
    the upload alone."""
    oid = rcv.new_upload(DATA)
    cases = [
        ("GET", "/nowhere"),
        ("GET", f"/files/{oid}"),  # no download extension
        ("DELETE", f"/files/{oid}"),  # no termination extension
        ("PUT", f"/files/{oid}"),
        ("DELETE", "/api/v1/receipts/" + oid),
        ("GET", "/api/v1/receipts/"),
    ]
    for method, path in cases:
        r = rcv.exchange(method, path, tus_headers())
        assert 400 <= r.status < 500, f"{method} {path}: {r.status}"
    assert rcv.offset(oid) == 0


def test_health(rcv: InMemoryReceiver) -> None:
    """/healthz answers 200 with status ok."""
    r = rcv.exchange("GET", "/healthz")
    assert r.status == 200
    assert r.json()["status"] == "ok"


# -- refusals after creation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "hosts",
    [["bad host"], ["127.0.0.1", "127.0.0.1"]],
    ids=["space-in-host", "host-twice"],
)
@pytest.mark.parametrize("with_body", [False, True], ids=["creation", "creation-with-upload"])
def test_creation_refused_for_its_host_creates_nothing(
    rcv: InMemoryReceiver, hosts: list[str], with_body: bool
) -> None:
    """A creation answered with a 4xx leaves nothing behind: no upload and no receipt."""
    uploads, receipts = rcv.upload_entries(), rcv.receipt_ids_on_disk()
    headers: list[Header] = [("Host", h) for h in hosts]
    headers += tus_headers(**{"Upload-Length": str(len(DATA))})
    headers.append(("Upload-Metadata", CREATION_METADATA))
    if with_body:
        headers.append(("Content-Type", OFFSET_TYPE))
    r = rcv.exchange("POST", "/files/", headers, DATA if with_body else None, host=False)
    if r.status == 201:
        location = r.header("Location") or ""
        assert location.rsplit("/", 1)[-1] in rcv.upload_entries(), location
        return
    assert 400 <= r.status < 500, r.status
    assert rcv.receipt_ids_on_disk() == receipts, (
        f"POST answered {r.status} ({r.body!r}) yet a receipt was committed"
    )
    assert rcv.upload_entries() == uploads, f"POST answered {r.status} yet an upload was created"


def test_channel_level_errors_carry_tus_resumable(rcv: InMemoryReceiver) -> None:
    """Requests refused by the HTTP layer itself (bad framing) get a 4xx with Tus-Resumable."""
    oid = rcv.new_upload(DATA)
    for what, request in bad_framing(oid).items():
        connection = rcv.connect()
        connection.send(request)
        check_framing_refusal(what, connection.written)
        assert connection.closed, what
    assert rcv.offset(oid) == 0


def test_refused_requests_log_no_unhandled_errors(
    rcv: InMemoryReceiver, failures: list[dict[str, Any]]
) -> None:
    """Refusing hostile requests leaves no failed Deferred behind to be logged as an unhandled
    error."""
    override = [*PATCH_HEADERS, ("X-HTTP-Method-Override", "PATCH")]
    for bad_id in ("..%2f", "..%2F..%2Fetc", "%2e%2e%2fx", "0123456789ABCDEF0123456789ABCDEF"):
        for _ in range(5):
            assert rcv.exchange("PATCH", f"/files/{bad_id}", PATCH_HEADERS, b"abc").status == 404
            assert rcv.exchange("POST", f"/files/{bad_id}", override, b"abc").status == 404
    # A dropped Deferred is reported when it is garbage-collected.
    gc.collect()
    assert failures == [], failures


def test_status_lines_name_every_refusal_and_bodiless_answers_have_no_content_type(
    rcv: InMemoryReceiver,
) -> None:
    """422 reads "Unprocessable Content" (not "Unknown Status"); HEAD and 201 carry no
    Content-Type since they have no body."""
    created = rcv.create(len(DATA), checksum=blake3_hex(b"something else"))
    assert created.status == 201 and created.header("Content-Type") is None
    oid = rcv.object_id(created)
    head = rcv.head(oid)
    assert head.status == 200 and head.header("Content-Type") is None
    r = rcv.patch(oid, 0, DATA)
    assert r.status_line == "HTTP/1.1 422 Unprocessable Content"


def test_a_request_head_over_the_limit_gets_431(rcv: InMemoryReceiver) -> None:
    """A header block or a single line past 16 KiB is answered 431 with Tus-Resumable and the
    connection closed."""
    for what, extra in {
        "many headers": "".join(f"X-Pad-{i}: {'a' * 200}\r\n" for i in range(100)),
        "one long line": f"X-Long: {'b' * 20000}\r\n",
    }.items():
        connection = rcv.connect()
        head = f"HEAD /files/{'0' * 32} HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\n"
        connection.send(f"{head}{extra}\r\n".encode())
        answer = connection.answer()
        assert answer.status_line == "HTTP/1.1 431 Request Header Fields Too Large", what
        assert answer.header("Tus-Resumable") == TUS_VERSION, what
        assert connection.closed, what


def test_429_has_its_reason_phrase(tmp_path: Path) -> None:
    """The free-space refusal reads "429 Too Many Requests" on the wire."""
    full = InMemoryReceiver.build(tmp_path, min_free_bytes=1 << 62)
    r = full.create(5, blake3_hex(b"hello"))
    assert r.status_line == "HTTP/1.1 429 Too Many Requests"
    assert full.upload_entries() == set()


# -- the Host header -------------------------------------------------------------------------------

# Hosts werkzeug cannot bind (Klein binds its URL map with the request's host name): a label over
# 63 characters, an empty label, bytes that are not UTF-8.
BAD_HOSTS: dict[str, bytes] = {
    "64-char-label": b"a" * 64 + b".example",
    "empty-label": b"a..b",
    "leading-dot": b".example:8080",
    "not-utf-8": b"\xff\xfe.example",
}
OID = "0123456789abcdef" * 2
# One request per surface: receiver routes, HQ's API, tus (with and without a body), seesaw.
HOST_ROUTES: dict[str, tuple[str, str, list[Header], bytes | None]] = {
    "healthz": ("GET", "/healthz", [], None),
    "readyz": ("GET", "/readyz", [], None),
    "metrics": ("GET", "/metrics", [], None),
    "status-page": ("GET", "/", [], None),
    "receipt": ("GET", f"/api/v1/receipts/{OID}", [], None),
    "hq-object": ("GET", f"/api/v1/objects/{OID}", [], None),
    "hq-by-origin": ("GET", "/api/v1/objects:by-origin?project=example&filename=x", [], None),
    "tus-head": ("HEAD", f"/files/{OID}", tus_headers(), None),
    "tus-options": ("OPTIONS", "/files/", [], None),
    "tus-creation": (
        "POST",
        "/files/",
        [
            *tus_headers(**{"Upload-Length": str(len(DATA))}),
            ("Upload-Metadata", CREATION_METADATA),
            ("Content-Type", OFFSET_TYPE),
        ],
        DATA,
    ),
    "seesaw-put": ("PUT", "/seesaw/example/alice/item.warc.zst", [], DATA),
}


@pytest.fixture
def warnings() -> Iterator[list[dict[str, Any]]]:
    """Log events at warn level or above."""
    seen: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        level = event.get("log_level")
        if level is not None and level >= LogLevel.warn:
            seen.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield seen
    finally:
        globalLogPublisher.removeObserver(observe)


@pytest.mark.parametrize("host", list(BAD_HOSTS.values()), ids=list(BAD_HOSTS))
def test_a_host_that_cannot_be_bound_is_400_on_every_route(
    rcv: InMemoryReceiver, warnings: list[dict[str, Any]], host: bytes
) -> None:
    """Every route answers a Host werkzeug cannot bind with 400 and a short body naming the Host
    header (not 500 and a traceback per request: anyone could fill the log, and a probe would
    read the node as broken); nothing is created and nothing above info is logged."""
    uploads = rcv.upload_entries()
    for name, (method, path, headers, body) in HOST_ROUTES.items():
        r = rcv.exchange(method, path, [("Host", host), *headers], body, host=False)
        assert r.status == 400, f"{name}: {r.status} {r.body[:200]!r}"
        if method != "HEAD":
            assert r.body == b"bad Host header: not a host name\n", f"{name}: {r.body!r}"
    assert rcv.upload_entries() == uploads
    assert rcv.receipt_ids_on_disk() == []
    assert warnings == [], [e.get("log_format") for e in warnings]
    # The receiver goes on serving.
    assert rcv.exchange("GET", "/healthz").status == 200


@pytest.mark.parametrize(
    "host",
    [
        b"canner.test",
        b"canner.test:8080",
        b"127.0.0.1:8080",
        b"[::1]:8080",
        b"[::1]",
        b"CANNER.test.",
    ],
)
def test_ordinary_hosts_are_served(rcv: InMemoryReceiver, host: bytes) -> None:
    """A host name, with or without a port, an IPv4 or IPv6 literal are served as usual."""
    expected = {"/healthz": 200, "/readyz": 200, "/metrics": 200, "/": 200}
    expected[f"/api/v1/receipts/{OID}"] = 404
    for path, status in expected.items():
        r = rcv.exchange("GET", path, [("Host", host)], host=False)
        assert r.status == status, f"{path} with Host {host!r}: {r.status} {r.body[:200]!r}"
    method, path, headers, body = HOST_ROUTES["tus-creation"]
    r = rcv.exchange(method, path, [("Host", host), *headers], body, host=False)
    assert r.status == 204 or r.status == 201, r.status
    assert rcv.offset(rcv.object_id(r)) == len(DATA)


@pytest.mark.parametrize(
    "hostname",
    [
        *BAD_HOSTS.values(),
        b"canner.test",
        b"CANNER.test.",
        b"::1",
        b"127.0.0.1",
        b"b\xc3\xbccher.example",  # UTF-8 for an IDN
        b"a" * 63 + b".example",
        b"",
    ],
)
def test_bindable_host_is_what_werkzeug_can_bind(hostname: bytes) -> None:
    """``bindable_host`` refuses exactly the host names Klein's bind fails for (Klein binds
    werkzeug's map with the request's host name and the listening port): a werkzeug release
    that changes what it binds fails here."""
    try:
        Map().bind(hostname.decode("utf-8") + ":8080")
    except (UnicodeDecodeError, BadHost):
        werkzeug_binds = False
    else:
        werkzeug_binds = True
    assert bindable_host(hostname) is werkzeug_binds
