"""Hostile and malformed requests: each gets a clear 4xx (never a 5xx), carries
``Tus-Resumable: 1.0.0``, and leaves no file anywhere but ``uploads/`` and ``receipts/``.

Every response here goes through :meth:`Receiver.request` or :meth:`Receiver.raw`, both of which
assert the ``Tus-Resumable`` header.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2e_support import (
    DEFAULT_MAX_UPLOAD,
    OFFSET_TYPE,
    TUS_VERSION,
    Receiver,
    Trickle,
    b64,
    blake3_hex,
    metadata_header,
    raw_exchange,
    read_http_response,
    snapshot,
)

pytestmark = pytest.mark.e2e

DATA = random.Random(7).randbytes(4096)
CHECKSUM = blake3_hex(DATA)


@pytest.fixture
def rcv(shared_receiver: Receiver) -> Iterator[Receiver]:
    """The module's receiver; after each test, no new file outside uploads/ and receipts/."""
    before = snapshot(shared_receiver.root)
    yield shared_receiver
    assert shared_receiver.proc is not None and shared_receiver.proc.poll() is None, (
        "the receiver died:\n" + shared_receiver.log_tail()
    )
    allowed = (shared_receiver.uploads_dir, shared_receiver.receipts_dir)
    stray = [
        p
        for p in snapshot(shared_receiver.root) - before
        if not any(p.is_relative_to(a) for a in allowed)
        and not p.name.startswith("delivery.sqlite")
    ]
    assert stray == [], f"files appeared outside uploads/ and receipts/: {stray}"


def tus_headers(**extra: str) -> dict[str, str]:
    return {"Tus-Resumable": TUS_VERSION, **extra}


def assert_nothing_created(rcv: Receiver, before: set[str], response: object) -> None:
    after = rcv.upload_entries()
    assert after == before, f"a refused creation left files: {after - before} ({response})"


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
def test_bad_object_ids_are_404_on_every_route(rcv: Receiver, bad_id: str) -> None:
    results = {}
    patch = [
        ("Tus-Resumable", TUS_VERSION),
        ("Upload-Offset", "0"),
        ("Content-Type", OFFSET_TYPE),
    ]
    results["HEAD"] = rcv.raw("HEAD", f"/files/{bad_id}", [("Tus-Resumable", TUS_VERSION)])
    results["PATCH"] = rcv.raw("PATCH", f"/files/{bad_id}", patch, b"abc")
    results["POST-override"] = rcv.raw(
        "POST", f"/files/{bad_id}", [*patch, ("X-HTTP-Method-Override", "PATCH")], b"abc"
    )
    results["GET-receipt"] = rcv.raw("GET", f"/api/v1/receipts/{bad_id}")
    statuses = {name: r.status for name, r in results.items()}
    assert statuses == dict.fromkeys(results, 404), statuses
    assert results["HEAD"].headers.get("Upload-Offset") is None


def test_unknown_valid_id_is_404_without_offset(rcv: Receiver) -> None:
    oid = secrets.token_hex(16)
    head = rcv.head(oid)
    assert head.status_code == 404
    assert "Upload-Offset" not in head.headers, "a HEAD 404 must not carry Upload-Offset"
    assert head.headers.get("Cache-Control") == "no-store"
    assert rcv.patch(oid, 0, b"x").status_code == 404
    assert rcv.get_receipt(oid).status_code == 404


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
def test_bad_metadata_is_400_before_anything_is_created(rcv: Receiver, metadata: str) -> None:
    before = rcv.upload_entries()
    headers = tus_headers(**{"Upload-Length": str(len(DATA))})
    if metadata:
        headers["Upload-Metadata"] = metadata
    r = rcv.request("POST", rcv.files_url, headers=headers)
    assert r.status_code == 400, f"{metadata[:100]!r}: {r.status_code} {r.text}"
    assert "Location" not in r.headers
    assert_nothing_created(rcv, before, r)
    # with a body (creation-with-upload) as well
    r = rcv.request(
        "POST", rcv.files_url, headers={**headers, "Content-Type": OFFSET_TYPE}, data=DATA
    )
    assert r.status_code == 400, f"with body, {metadata[:100]!r}: {r.status_code}"
    assert_nothing_created(rcv, before, r)


@pytest.mark.parametrize(
    "filename", ["f" * 1024, "\u00e9" * 512, "x"], ids=["1024-ascii", "1024-bytes-utf8", "short"]
)
def test_filename_up_to_1024_bytes_is_kept(rcv: Receiver, filename: str) -> None:
    oid, header = rcv.upload_all(DATA, filename=filename)
    rcv.verify_receipt(header, oid, DATA)
    head = rcv.head(oid)
    assert b64(filename) in head.headers["Upload-Metadata"]


def test_second_project_is_accepted(rcv: Receiver) -> None:
    oid, header = rcv.upload_all(DATA, project="other")
    rcv.verify_receipt(header, oid, DATA)


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
    "over-max": (str(DEFAULT_MAX_UPLOAD + 1).encode(), 413),
    "huge": (b"99999999999999999999999999", 400),
}


@pytest.mark.parametrize(("value", "status"), list(BAD_LENGTHS.values()), ids=list(BAD_LENGTHS))
def test_bad_upload_length_is_refused(rcv: Receiver, value: bytes | None, status: int) -> None:
    before = rcv.upload_entries()
    headers: list[tuple[str, str | bytes]] = [
        ("Tus-Resumable", TUS_VERSION),
        ("Upload-Metadata", metadata_header([("project", "example"), ("checksum", CHECKSUM)])),
    ]
    if value is not None:
        headers.append(("Upload-Length", value))
    r = rcv.raw("POST", "/files/", headers)
    if value == b"99999999999999999999999999":
        assert r.status in (400, 413), r.status
    else:
        assert r.status == status, f"Upload-Length {value!r}: {r.status} {r.body!r}"
    assert r.headers.get("Location") is None
    assert_nothing_created(rcv, before, r)


def test_upload_length_exactly_max_is_allowed(rcv: Receiver) -> None:
    r = rcv.create(DEFAULT_MAX_UPLOAD, CHECKSUM)
    assert r.status_code == 201, r.text


def test_deferred_length_is_refused(rcv: Receiver) -> None:
    before = rcv.upload_entries()
    r = rcv.request(
        "POST",
        rcv.files_url,
        headers=tus_headers(
            **{
                "Upload-Defer-Length": "1",
                "Upload-Metadata": metadata_header(
                    [("project", "example"), ("checksum", CHECKSUM)]
                ),
            }
        ),
    )
    assert r.status_code == 400, r.status_code
    assert_nothing_created(rcv, before, r)


def test_creation_body_longer_than_upload_length_is_413(rcv: Receiver) -> None:
    before = rcv.upload_entries()
    r = rcv.create(100, CHECKSUM, body=DATA)
    assert r.status_code == 413, r.status_code
    assert_nothing_created(rcv, before, r)


def test_creation_body_with_wrong_content_type_is_415(rcv: Receiver) -> None:
    before = rcv.upload_entries()
    r = rcv.create(len(DATA), CHECKSUM, body=DATA, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.status_code
    assert_nothing_created(rcv, before, r)


# -- Tus-Resumable --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [None, "0.2.2", "1.0", "1.0.0,1.0.0", "2.0.0"])
def test_missing_or_unsupported_tus_resumable_is_412(rcv: Receiver, version: str | None) -> None:
    oid = rcv.new_upload(DATA)
    before = rcv.upload_entries()

    def headers(**extra: str) -> dict[str, str]:
        h = dict(extra)
        if version is not None:
            h["Tus-Resumable"] = version
        return h

    meta = metadata_header([("project", "example"), ("checksum", CHECKSUM)])
    responses = {
        "POST": rcv.session.post(
            rcv.files_url,
            headers=headers(**{"Upload-Length": str(len(DATA)), "Upload-Metadata": meta}),
            timeout=30,
        ),
        "HEAD": rcv.session.head(rcv.upload_url(oid), headers=headers(), timeout=30),
        "PATCH": rcv.session.patch(
            rcv.upload_url(oid),
            headers=headers(**{"Upload-Offset": "0", "Content-Type": OFFSET_TYPE}),
            data=DATA,
            timeout=30,
        ),
    }
    for method, r in responses.items():
        r.close()
        assert r.status_code == 412, f"{method} with Tus-Resumable {version!r}: {r.status_code}"
        assert r.headers.get("Tus-Version") == "1.0.0", f"{method} 412 without Tus-Version"
        assert r.headers.get("Tus-Resumable") == "1.0.0"
    assert rcv.upload_entries() == before
    assert rcv.offset(oid) == 0


# -- PATCH refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/octet-stream", "application/offset+octet-streamx"],
)
def test_patch_with_wrong_content_type_is_415(rcv: Receiver, content_type: str | None) -> None:
    oid = rcv.new_upload(DATA)
    headers = [("Tus-Resumable", TUS_VERSION), ("Upload-Offset", "0")]
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    r = rcv.raw("PATCH", f"/files/{oid}", headers, DATA[:100])
    assert r.status == 415, f"Content-Type {content_type!r}: {r.status}"
    assert rcv.offset(oid) == 0
    assert rcv.stored(oid) == b""


@pytest.mark.parametrize("offset", ["", "+0", "-0", "0x0", "1_0", "a", None])
def test_patch_with_malformed_offset_is_400(rcv: Receiver, offset: str | None) -> None:
    oid = rcv.new_upload(DATA)
    headers = [("Tus-Resumable", TUS_VERSION), ("Content-Type", OFFSET_TYPE)]
    if offset is not None:
        headers.append(("Upload-Offset", offset))
    r = rcv.raw("PATCH", f"/files/{oid}", headers, DATA[:100])
    assert r.status == 400, f"Upload-Offset {offset!r}: {r.status}"
    assert rcv.stored(oid) == b""


def test_patch_at_wrong_offset_is_409_and_stores_nothing(rcv: Receiver) -> None:
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:1000]).status_code == 204
    for offset in (0, 999, 1001, len(DATA)):
        r = rcv.patch(oid, offset, DATA[offset : offset + 10] or b"z")
        assert r.status_code == 409, f"PATCH at {offset} (stored 1000): {r.status_code}"
        assert rcv.offset(oid) == 1000
        assert rcv.stored(oid) == DATA[:1000]
    r = rcv.patch(oid, 1000, DATA[1000:])
    assert r.status_code == 204
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, DATA)


def test_patch_past_upload_length_is_413_and_stores_nothing(rcv: Receiver) -> None:
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:1000]).status_code == 204
    r = rcv.patch(oid, 1000, DATA[1000:] + b"one byte too many")
    assert r.status_code == 413, r.status_code
    assert rcv.offset(oid) == 1000
    assert rcv.stored(oid) == DATA[:1000]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the overrun shows up mid-stream
        rest = DATA[1000:] + b"!"
        for i in range(0, len(rest), 512):
            yield rest[i : i + 512]

    r = rcv.patch(oid, 1000, chunks())
    assert r.status_code == 413, f"chunked overrun: {r.status_code}"
    assert rcv.wait_offset(oid, 1000) == 1000, "a refused chunked PATCH left bytes behind"
    assert rcv.stored(oid) == DATA[:1000]
    assert rcv.get_receipt(oid).status_code == 404
    r = rcv.patch_retrying_locked(oid, 1000, DATA[1000:])
    assert r.status_code == 204
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, DATA)


def test_chunked_patch_within_length_is_stored(rcv: Receiver) -> None:
    oid = rcv.new_upload(DATA)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(DATA), 999):
            yield DATA[i : i + 999]

    r = rcv.patch(oid, 0, chunks())
    assert r.status_code == 204, r.status_code
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, DATA)


def test_second_patch_while_first_streams_is_refused(rcv: Receiver) -> None:
    oid = rcv.new_upload(DATA)
    with rcv.open_patch(oid, 0, len(DATA), DATA[:100]) as sock:
        assert rcv.wait_offset(oid, 100) == 100
        with Trickle(sock, DATA[100:2000], step=8) as live:
            r = rcv.patch(oid, 100, b"Z" * (len(DATA) - 100))
            assert r.status_code in (409, 423), r.status_code
            sent = 100 + live.stop()
        sock.sendall(DATA[sent:])
        status, headers, _ = read_http_response(sock, "PATCH")
    assert status == 204
    assert rcv.stored(oid) == DATA
    rcv.verify_receipt(headers.get("Artifact-Receipt"), oid, DATA)


# -- everything else ------------------------------------------------------------------------------


def test_head_sends_no_store_and_echoes_metadata(rcv: Receiver) -> None:
    oid = rcv.new_upload(DATA, filename="x.warc")
    head = rcv.head(oid)
    assert head.status_code == 200
    assert head.headers.get("Cache-Control") == "no-store"
    assert head.headers["Upload-Offset"] == "0"
    assert head.headers["Upload-Length"] == str(len(DATA))
    assert "Artifact-Receipt" not in head.headers
    echoed = dict(p.split(" ") for p in head.headers["Upload-Metadata"].split(","))
    assert echoed == {
        "project": b64("example"),
        "checksum": b64(CHECKSUM),
        "filename": b64("x.warc"),
    }


def test_options_advertises_tus(rcv: Receiver) -> None:
    r = rcv.request("OPTIONS", rcv.files_url)
    assert r.status_code in (200, 204)
    assert r.headers.get("Tus-Version") == "1.0.0"
    assert r.headers.get("Tus-Max-Size") == str(DEFAULT_MAX_UPLOAD)
    extensions = {e.strip() for e in r.headers.get("Tus-Extension", "").split(",")}
    assert {"creation", "creation-with-upload"} <= extensions
    assert not extensions & {"termination", "concatenation", "creation-defer-length"}


@pytest.mark.parametrize("path", ["/healthz", "/api/v1/receipts/" + "0" * 32, "/nowhere"])
def test_oversize_non_upload_body_is_413(rcv: Receiver, path: str) -> None:
    r = rcv.request("POST", path, data=b"\0" * 1_000_000)
    assert r.status_code == 413, f"POST {path} with 1 MB: {r.status_code}"

    def chunks() -> Iterator[bytes]:
        for _ in range(16):
            yield b"\0" * 65536

    r = rcv.request("POST", path, data=chunks())
    assert r.status_code == 413, f"chunked POST {path} with 1 MiB: {r.status_code}"
    time.sleep(0.05)
    assert rcv.request("GET", "/healthz").status_code == 200


def test_unknown_routes_and_methods_are_4xx(rcv: Receiver) -> None:
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
        r = rcv.raw(method, path, [("Tus-Resumable", TUS_VERSION)])
        assert 400 <= r.status < 500, f"{method} {path}: {r.status}"
    assert rcv.offset(oid) == 0


def test_health(rcv: Receiver) -> None:
    r = rcv.request("GET", "/healthz")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_data_dir_holds_only_uploads_receipts_and_index(rcv: Receiver) -> None:
    names = {p.name for p in Path(rcv.data_dir).iterdir()}
    assert names <= {
        "uploads",
        "receipts",
        "delivery.sqlite",
        "delivery.sqlite-wal",
        "delivery.sqlite-shm",
        "delivery.sqlite-journal",
    }, names


# -- refusals after creation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "hosts",
    [["bad host"], ["127.0.0.1", "127.0.0.1"]],
    ids=["space-in-host", "host-twice"],
)
@pytest.mark.parametrize("with_body", [False, True], ids=["creation", "creation-with-upload"])
def test_creation_refused_for_its_host_creates_nothing(
    rcv: Receiver, hosts: list[str], with_body: bool
) -> None:
    """A creation answered with a 4xx must leave nothing behind: no upload, and above all no
    receipt the worker never saw (it was told the request failed, so it uploads again)."""
    uploads, receipts = rcv.upload_entries(), rcv.receipt_ids_on_disk()
    headers: list[tuple[str, str | bytes]] = [("Host", h) for h in hosts]
    headers += [
        ("Tus-Resumable", TUS_VERSION),
        ("Upload-Length", str(len(DATA))),
        ("Upload-Metadata", metadata_header([("project", "example"), ("checksum", CHECKSUM)])),
    ]
    if with_body:
        headers.append(("Content-Type", OFFSET_TYPE))
    r = rcv.raw("POST", "/files/", headers, DATA if with_body else None, skip_host=True)
    if r.status == 201:
        location = r.headers.get("Location", "")
        assert location.rsplit("/", 1)[-1] in {e for e in rcv.upload_entries()}, location
        return
    assert 400 <= r.status < 500, r.status
    assert rcv.receipt_ids_on_disk() == receipts, (
        f"POST answered {r.status} ({r.body!r}) yet a receipt was committed"
    )
    assert rcv.upload_entries() == uploads, f"POST answered {r.status} yet an upload was created"


def test_channel_level_errors_carry_tus_resumable(rcv: Receiver) -> None:
    """Requests refused by the HTTP layer itself (before canner's code) are still responses a
    tus client reads: Tus-Resumable on every response, errors included."""
    oid = rcv.new_upload(DATA)
    head = (
        f"PATCH /files/{oid} HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\n"
        "Upload-Offset: 0\r\nContent-Type: application/offset+octet-stream\r\n"
        "Connection: close\r\n"
    ).encode()
    for what, request in {
        "Content-Length +5": head + b"Content-Length: +5\r\n\r\nhello",
        "Content-Length twice": head + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    }.items():
        answer = raw_exchange(rcv.port, request)
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 4"), f"{what}: {answer[:200]!r}"
        header_block = rest.split(b"\r\n\r\n", 1)[0].lower()
        assert b"tus-resumable: 1.0.0" in header_block, (
            f"{what}: {status_line.decode()} without Tus-Resumable: {answer[:200]!r}"
        )
    assert rcv.offset(oid) == 0


def test_refused_requests_log_no_unhandled_errors(receiver: Receiver) -> None:
    """Refusing a hostile request is routine: it must not leave a failed Deferred behind that
    twisted later logs as a critical "Unhandled error in Deferred" with a traceback."""
    patch = [("Tus-Resumable", TUS_VERSION), ("Upload-Offset", "0"), ("Content-Type", OFFSET_TYPE)]
    override = [*patch, ("X-HTTP-Method-Override", "PATCH")]
    for bad_id in ("..%2f", "..%2F..%2Fetc", "%2e%2e%2fx", "0123456789ABCDEF0123456789ABCDEF"):
        for _ in range(5):
            assert receiver.raw("PATCH", f"/files/{bad_id}", patch, b"abc").status == 404
            assert receiver.raw("POST", f"/files/{bad_id}", override, b"abc").status == 404
    # A dropped Deferred is reported when it is garbage-collected: make some garbage.
    for _ in range(30):
        assert receiver.request("GET", "/healthz").status_code == 200
    time.sleep(0.3)
    log = receiver.log_text()
    assert "Unhandled error" not in log and "Traceback" not in log, (
        "refused requests logged errors:\n" + receiver.log_tail(30)
    )


def _status_line(answer: bytes) -> str:
    return answer.partition(b"\r\n")[0].decode("latin-1")


def test_status_lines_name_every_refusal_and_bodiless_answers_have_no_content_type(
    rcv: Receiver,
) -> None:
    """422 says what it is (not "Unknown Status"); HEAD and 201 carry no
    Content-Type since they have no body."""
    created = rcv.create(len(DATA), checksum=blake3_hex(b"something else"))
    assert created.status_code == 201 and "Content-Type" not in created.headers
    oid = rcv.object_id(created)
    head = rcv.head(oid)
    assert head.status_code == 200 and "Content-Type" not in head.headers
    request = (
        f"PATCH /files/{oid} HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\nUpload-Offset: 0\r\n"
        f"Content-Type: application/offset+octet-stream\r\nContent-Length: {len(DATA)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + DATA
    assert _status_line(raw_exchange(rcv.port, request)) == "HTTP/1.1 422 Unprocessable Content"


def test_a_request_head_over_the_limit_gets_431(rcv: Receiver) -> None:
    """A header block or a single line past 16 KiB is answered 431 (with Tus-Resumable), not a
    closed connection."""
    for what, extra in {
        "many headers": "".join(f"X-Pad-{i}: {'a' * 200}\r\n" for i in range(100)),
        "one long line": f"X-Long: {'b' * 20000}\r\n",
    }.items():
        request = (
            f"HEAD /files/{'0' * 32} HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\n{extra}\r\n"
        ).encode()
        answer = raw_exchange(rcv.port, request)
        assert _status_line(answer) == "HTTP/1.1 431 Request Header Fields Too Large", what
        assert b"tus-resumable: 1.0.0" in answer.lower(), what


def test_429_has_its_reason_phrase(make_receiver: Callable[..., Receiver]) -> None:
    """The free-space refusal reads "429 Too Many Requests" on the wire."""
    full = make_receiver("full", min_free_bytes=1 << 62)
    request = (
        "POST /files/ HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\nUpload-Length: 5\r\n"
        f"Upload-Metadata: project ZXhhbXBsZQ==,checksum {b64(blake3_hex(b'hello'))}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    assert _status_line(raw_exchange(full.port, request)) == "HTTP/1.1 429 Too Many Requests"
