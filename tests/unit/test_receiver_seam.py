"""The receiver's upload seam, in memory: admission refusals answered before the body, the grace
after an early answer, takeover of a quiet writer, the receipt window while acceptance runs,
request-head deadlines and connection caps.

Every test drives the real Site at the HTTP byte level (``receiver_harness``) with a fake clock
and held-or-inline runners, so each time limit is checked at its edge without waiting for it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from canner.accept.acceptance import INLINE_HASH_MAX
from canner.accept.intake import ACCEPTANCE_RETRY_AFTER, ACCEPTANCE_WAIT, TAKEOVER_QUIET
from canner.web.channel import LINGER_BYTES, LINGER_SECONDS
from tests.unit.receiver_harness import (
    OFFSET_TYPE,
    TUS_VERSION,
    Connection,
    InMemoryReceiver,
    blake3_hex,
    metadata_header,
)

DATA = random.Random(11).randbytes(256 * 1024)
TWO_GIB = str(2 << 30)
# A step of clock time that adds exactly to the clock's value (a power of two).
TICK = 1 / 64


@pytest.fixture
def rcv(tmp_path: Path) -> InMemoryReceiver:
    return InMemoryReceiver.build(tmp_path)


def patch_headers(offset: str = "0", **extra: str) -> dict[str, str]:
    return {
        "Tus-Resumable": TUS_VERSION,
        "Content-Type": OFFSET_TYPE,
        "Upload-Offset": offset,
        **extra,
    }


def assert_refused_early(connection: Connection, status: int) -> None:
    """Answered ``status`` with no 100 Continue, Connection: close and Tus-Resumable, its write
    side closed while it still reads (the grace)."""
    responses = connection.responses
    assert [r.status for r in responses] == [status], connection.written[:300]
    answer = responses[0]
    assert answer.header("Connection") == "close"
    assert answer.header("Tus-Resumable") == TUS_VERSION
    assert connection.transport.write_closed
    assert not connection.closed, "cut before the grace"


# -- admission refusals come from the head --------------------------------------------------------

REFUSALS = {
    "409-wrong-offset": (409, None, patch_headers("5")),
    "404-unknown-upload": (404, "f" * 32, patch_headers()),
    "415-content-type": (415, None, patch_headers(**{"Content-Type": "text/plain"})),
    "412-tus-version": (412, None, patch_headers(**{"Tus-Resumable": "0.2.2"})),
    "413-past-its-length": (413, None, patch_headers()),
}


@pytest.mark.parametrize("expect_continue", [False, True], ids=["plain", "expect-100"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_patch_refusal_is_answered_before_any_body_byte(
    rcv: InMemoryReceiver, case: str, expect_continue: bool
) -> None:
    """A 2 GiB PATCH refused at admission is answered after its head alone, never after a
    100 Continue, and nothing is stored."""
    oid = rcv.new_upload(DATA)
    status, target, headers = REFUSALS[case]
    headers = {**headers, "Content-Length": TWO_GIB}
    if expect_continue:
        headers["Expect"] = "100-continue"
    connection = rcv.connect()
    connection.send_head("PATCH", f"/files/{target or oid}", headers.items())
    assert_refused_early(connection, status)
    assert rcv.offset(oid) == 0, "a refused PATCH stored bytes"


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (413, {"Upload-Length": "100"}),
        (415, {"Content-Type": "text/plain"}),
        (400, {"Upload-Metadata": metadata_header([("project", "nope")])}),
    ],
    ids=["413-body-past-length", "415-content-type", "400-metadata"],
)
def test_a_creation_refusal_is_answered_before_its_body(
    rcv: InMemoryReceiver, status: int, headers: dict[str, str]
) -> None:
    """A creation-with-upload refused from its head is answered before its body and creates
    nothing."""
    sent = {
        "Tus-Resumable": TUS_VERSION,
        "Upload-Length": str(len(DATA)),
        "Upload-Metadata": metadata_header(
            [("project", "example"), ("checksum", blake3_hex(DATA))]
        ),
        "Content-Type": OFFSET_TYPE,
        "Content-Length": str(len(DATA)),
        **headers,
    }
    connection = rcv.connect()
    connection.send_head("POST", "/files/", sent.items())
    assert_refused_early(connection, status)
    assert rcv.upload_entries() == set()


def test_an_admitted_body_gets_100_continue_then_its_answer(rcv: InMemoryReceiver) -> None:
    """A PATCH that asks for 100 Continue gets it once admitted, then its 204 and receipt."""
    oid = rcv.new_upload(DATA)
    headers = patch_headers(**{"Content-Length": str(len(DATA)), "Expect": "100-continue"})
    connection = rcv.connect()
    connection.send_head("PATCH", f"/files/{oid}", headers.items())
    assert connection.written == b"HTTP/1.1 100 Continue\r\n\r\n"
    connection.send(DATA)
    assert [r.status for r in connection.responses] == [100, 204]
    rcv.verify_receipt(connection.answer().header("Artifact-Receipt"), oid, DATA)


def test_100_continue_waits_for_admission(rcv: InMemoryReceiver) -> None:
    """While admission (a thread hop) runs, a client waiting for 100 Continue gets nothing;
    once admitted it gets 100 Continue."""
    oid = rcv.new_upload(DATA)
    headers = patch_headers(**{"Content-Length": str(len(DATA)), "Expect": "100-continue"})
    rcv.io.held = True
    connection = rcv.connect()
    connection.send_head("PATCH", f"/files/{oid}", headers.items())
    assert rcv.io.waiting, "admission did not go to the I/O runner"
    assert connection.written == b""
    rcv.release(rcv.io)
    assert connection.written == b"HTTP/1.1 100 Continue\r\n\r\n"


# -- the grace after an early answer --------------------------------------------------------------


def refused_patch(rcv: InMemoryReceiver) -> tuple[str, Connection]:
    oid = rcv.new_upload(DATA)
    connection = rcv.connect()
    connection.send_head(
        "PATCH", f"/files/{oid}", patch_headers("7", **{"Content-Length": TWO_GIB}).items()
    )
    assert_refused_early(connection, 409)
    return oid, connection


def test_a_refused_client_that_goes_quiet_is_cut_after_the_grace(rcv: InMemoryReceiver) -> None:
    """After an early answer the connection stays open LINGER_SECONDS for the client to read
    it, then is aborted."""
    _, connection = refused_patch(rcv)
    rcv.advance(LINGER_SECONDS - TICK)
    assert not connection.closed
    rcv.advance(TICK)
    assert connection.closed and connection.transport.aborted


def test_a_refused_client_that_keeps_sending_is_cut_after_linger_bytes(
    rcv: InMemoryReceiver,
) -> None:
    """After an early answer the server discards at most LINGER_BYTES of the unwanted body,
    then aborts the connection; nothing of it is stored."""
    oid, connection = refused_patch(rcv)
    block = b"x" * (64 * 1024)
    for _ in range(LINGER_BYTES // len(block)):
        connection.send(block)
    assert not connection.closed, "cut before LINGER_BYTES"
    connection.send(b"x")
    assert connection.closed and connection.transport.aborted
    assert rcv.offset(oid) == 0


# -- takeover of a quiet writer -------------------------------------------------------------------


@pytest.mark.parametrize("resume", ["head-then-patch", "patch"])
def test_a_quiet_writer_is_taken_over_and_its_bytes_are_kept(
    rcv: InMemoryReceiver, resume: str
) -> None:
    """A PATCH silent for TAKEOVER_QUIET (a half-open connection) is dropped without an answer
    when the upload is resumed; what it wrote counts and the resume completes the upload."""
    oid = rcv.new_upload(DATA)
    first = 100_001
    stalled = rcv.open_patch(oid, 0, len(DATA))
    stalled.send(DATA[:first])
    rcv.advance(TAKEOVER_QUIET)
    if resume == "head-then-patch":
        assert rcv.offset(oid) == first
    r = rcv.patch(oid, first, DATA[first:])
    assert r.status == 204, (r.status, r.body)
    assert stalled.closed and stalled.transport.aborted
    assert stalled.written == b"", "the stalled request got an answer"
    rcv.verify_receipt(r.header("Artifact-Receipt"), oid, DATA)
    # The intake counts what it stored, the unanswered request's bytes too, exactly once.
    assert rcv.metric("canner_received_bytes_total") == len(DATA)
    assert rcv.metric("canner_uploads_created_total", project="example") == 1
    assert rcv.metric("canner_uploads_accepted_total", project="example") == 1


def test_a_writer_not_yet_quiet_is_waited_for_then_taken_over(rcv: InMemoryReceiver) -> None:
    """A resume that arrives just after the old PATCH's last byte waits until it has been
    quiet for TAKEOVER_QUIET, then takes over (no 423)."""
    oid = rcv.new_upload(DATA)
    stalled = rcv.open_patch(oid, 0, len(DATA))
    stalled.send(DATA[:1000])
    resume = rcv.open_patch(oid, 1000, len(DATA) - 1000)
    rcv.advance(TAKEOVER_QUIET - TICK)
    assert resume.written == b"" and not stalled.closed
    rcv.advance(TICK)
    assert stalled.closed
    resume.send(DATA[1000:])
    assert resume.answer().status == 204
    rcv.verify_receipt(resume.answer().header("Artifact-Receipt"), oid, DATA)


def test_head_reports_the_live_offset_without_waiting_for_a_live_writer(
    rcv: InMemoryReceiver,
) -> None:
    """HEAD while a PATCH is still sending answers at once with the bytes written so far, and
    the PATCH goes on."""
    oid = rcv.new_upload(DATA)
    writer = rcv.open_patch(oid, 0, len(DATA))
    writer.send(DATA[:5000])
    assert rcv.offset(oid) == 5000
    writer.send(DATA[5000:])
    assert writer.answer().status == 204


# -- the receipt window ---------------------------------------------------------------------------

BIG = random.Random(12).randbytes(INLINE_HASH_MAX + 1)  # hashed in the hash pool


def accepting(rcv: InMemoryReceiver) -> tuple[str, Connection]:
    """An upload whose last byte has arrived and whose acceptance is hashing (held)."""
    oid = rcv.new_upload(BIG)
    rcv.hashing.held = True
    writer = rcv.open_patch(oid, 0, len(BIG))
    writer.send(BIG)
    assert rcv.hashing.waiting == 1, "acceptance is not hashing"
    assert writer.written == b""
    return oid, writer


@pytest.mark.parametrize("lookup", ["HEAD", "GET-receipt"])
def test_a_lookup_while_acceptance_runs_waits_for_the_receipt(
    rcv: InMemoryReceiver, lookup: str
) -> None:
    """HEAD and the receipt lookup during acceptance wait, then carry the receipt the PATCH
    gets: never a 404, never a complete upload without its receipt."""
    oid, writer = accepting(rcv)
    connection = rcv.connect()
    if lookup == "HEAD":
        connection.send_head("HEAD", f"/files/{oid}", [("Tus-Resumable", TUS_VERSION)])
    else:
        connection.send_head("GET", f"/api/v1/receipts/{oid}")
    rcv.advance(ACCEPTANCE_WAIT - TICK)
    assert connection.written == b"", "answered while acceptance runs"
    rcv.release(rcv.hashing)
    header = writer.answer().header("Artifact-Receipt")
    rcv.verify_receipt(header, oid, BIG)
    answer = connection.answer()
    assert answer.status == 200
    if lookup == "HEAD":
        assert answer.header("Artifact-Receipt") == header
        assert answer.header("Upload-Offset") == str(len(BIG))
    else:
        assert answer.body == rcv.get_receipt(oid).body


@pytest.mark.parametrize("lookup", ["HEAD", "GET-receipt"])
def test_a_lookup_waits_at_most_acceptance_wait_then_gets_503(
    rcv: InMemoryReceiver, lookup: str
) -> None:
    """A lookup whose acceptance outlasts ACCEPTANCE_WAIT gets 503 with Retry-After, and the
    receipt once acceptance ends."""
    oid, writer = accepting(rcv)
    connection = rcv.connect()
    if lookup == "HEAD":
        connection.send_head("HEAD", f"/files/{oid}", [("Tus-Resumable", TUS_VERSION)])
    else:
        connection.send_head("GET", f"/api/v1/receipts/{oid}")
    rcv.advance(ACCEPTANCE_WAIT)
    answer = connection.answer()
    assert answer.status == 503
    assert answer.header("Retry-After") == str(ACCEPTANCE_RETRY_AFTER)
    assert answer.header("Artifact-Receipt") is None
    assert writer.written == b""
    rcv.release(rcv.hashing)
    assert writer.answer().status == 204
    rcv.verify_receipt(writer.answer().header("Artifact-Receipt"), oid, BIG)


def test_a_lookup_waits_for_a_resumed_acceptance_at_most_acceptance_wait(
    rcv: InMemoryReceiver,
) -> None:
    """A complete upload found without a receipt (as after a restart) gets acceptance resumed
    by HEAD; a receipt lookup meanwhile waits, gets 503 at ACCEPTANCE_WAIT, and the receipt
    once acceptance ends."""
    oid = rcv.new_upload(BIG)
    (rcv.uploads_dir / oid).write_bytes(BIG)
    rcv.hashing.held = True
    head = rcv.head(oid)
    assert (head.status, head.header("Artifact-Receipt")) == (200, None)
    assert rcv.hashing.waiting == 1, "HEAD did not resume acceptance"
    lookup = rcv.connect()
    lookup.send_head("GET", f"/api/v1/receipts/{oid}")
    rcv.advance(ACCEPTANCE_WAIT - TICK)
    assert lookup.written == b"", "answered while acceptance runs"
    rcv.advance(TICK)
    answer = lookup.answer()
    assert answer.status == 503
    assert answer.header("Retry-After") == str(ACCEPTANCE_RETRY_AFTER)
    rcv.release(rcv.hashing)
    receipt = rcv.get_receipt(oid)
    assert receipt.status == 200
    assert receipt.json()["size_bytes"] == len(BIG)
    assert [r.object_id for r, _ in rcv.enqueued] == [oid]


# -- request-head deadlines -----------------------------------------------------------------------


def test_a_trickled_head_gets_408_at_the_deadline(tmp_path: Path) -> None:
    """A head still incomplete header_timeout after its first byte is answered 408 with
    Tus-Resumable and closed, however many bytes trickled in; others are served meanwhile."""
    rcv = InMemoryReceiver.build(tmp_path, connections={"header_timeout": "2s"})
    trickling = rcv.connect()
    trickling.send(b"PATCH /files/" + b"a" * 32 + b" HTTP/1.1\r\n")
    for _ in range(7):
        rcv.advance(0.25)
        trickling.send(b"X")
    rcv.advance(0.25 - TICK)
    assert trickling.written == b""
    assert rcv.exchange("GET", "/healthz").status == 200
    rcv.advance(TICK)
    answer = trickling.answer()
    assert answer.status_line == "HTTP/1.1 408 Request Timeout"
    assert answer.header("Tus-Resumable") == TUS_VERSION
    assert trickling.closed


def test_a_silent_connection_is_aborted_at_the_head_deadline(tmp_path: Path) -> None:
    """A connection that never sends a byte is aborted at header_timeout, without an answer."""
    rcv = InMemoryReceiver.build(tmp_path, connections={"header_timeout": "2s"})
    silent = rcv.connect()
    rcv.advance(2 - TICK)
    assert not silent.closed
    rcv.advance(TICK)
    assert silent.closed and silent.transport.aborted
    assert silent.written == b""


def test_the_head_deadline_applies_to_each_request_of_a_kept_alive_connection(
    tmp_path: Path,
) -> None:
    """An idle kept-alive connection is not cut by the head deadline, but its next head has
    one from its first byte."""
    rcv = InMemoryReceiver.build(tmp_path, connections={"header_timeout": "2s"})
    connection = rcv.connect()
    connection.send_head("GET", "/healthz")
    assert connection.answer().status == 200
    rcv.advance(10)
    assert not connection.closed
    connection.send(b"GET /healthz HTTP/1.1\r\n")
    rcv.advance(2)
    assert [r.status for r in connection.answers] == [200, 408]
    assert connection.closed


# -- connection caps ------------------------------------------------------------------------------


def assert_over_cap(connection: Connection) -> None:
    answer = connection.answer()
    assert answer.status_line == "HTTP/1.1 503 Service Unavailable"
    assert answer.header("Retry-After") == "5"
    assert connection.closed


def test_connections_over_the_per_address_cap_get_503(tmp_path: Path) -> None:
    """Past max_per_client open connections from one address, a new one gets a bare 503 and
    is closed; other addresses still connect, and a closed connection frees its slot."""
    rcv = InMemoryReceiver.build(tmp_path, connections={"max_per_client": 2})
    held = [rcv.connect("10.0.0.2") for _ in range(2)]
    assert_over_cap(rcv.connect("10.0.0.2"))
    other = rcv.connect("10.0.0.3")
    other.send_head("GET", "/healthz")
    assert other.answer().status == 200
    held[0].close()
    again = rcv.connect("10.0.0.2")
    again.send_head("GET", "/healthz")
    assert again.answer().status == 200


def test_connections_over_the_total_cap_get_503(tmp_path: Path) -> None:
    """Past connections.max open connections in all, any address gets a bare 503 until one
    closes."""
    rcv = InMemoryReceiver.build(tmp_path, connections={"max": 3, "max_per_client": 0})
    held = [rcv.connect(f"10.0.0.{i}") for i in range(3)]
    assert_over_cap(rcv.connect("10.0.0.9"))
    held[1].close()
    admitted = rcv.connect("10.0.0.9")
    admitted.send_head("GET", "/healthz")
    assert admitted.answer().status == 200


def test_a_refused_connection_does_not_use_a_slot(tmp_path: Path) -> None:
    """Connections refused over the cap free nothing they never held: the count stays exact."""
    rcv = InMemoryReceiver.build(tmp_path, connections={"max_per_client": 1})
    first = rcv.connect("10.0.0.2")
    for _ in range(5):
        assert_over_cap(rcv.connect("10.0.0.2"))
    assert_over_cap(rcv.connect("10.0.0.2"))
    first.close()
    second = rcv.connect("10.0.0.2")
    assert not second.closed
    assert_over_cap(rcv.connect("10.0.0.2"))


def test_a_pipelined_patch_gets_100_continue_and_no_head_deadline(rcv: InMemoryReceiver) -> None:
    """A PATCH pipelined behind another request on a kept-alive connection is a request, not an
    idle connection: it gets its 100 Continue, and its body is not cut by a head deadline."""
    oid = rcv.new_upload(DATA)
    headers = patch_headers(**{"Content-Length": str(len(DATA)), "Expect": "100-continue"})
    connection = rcv.connect()
    pipelined = (
        f"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nPATCH /files/{oid} HTTP/1.1\r\nHost: x\r\n"
    )
    pipelined += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    rcv.io.held = True  # the first request is still being answered when the second is in
    connection.send(pipelined.encode())
    assert connection.responses == []
    rcv.release(rcv.io)
    assert [r.status for r in connection.responses] == [200, 100]
    # The body comes slowly, over longer than a head may take: no head deadline applies.
    connection.send(DATA[:1000])
    rcv.advance(rcv.config.connections.header_timeout + 1)
    assert not connection.closed, connection.responses
    connection.send(DATA[1000:])
    assert [r.status for r in connection.responses] == [200, 100, 204]
