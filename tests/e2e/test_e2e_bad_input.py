"""Hostile and malformed requests against a real receiver process: one check per class of
refusal (a bad object id, a bad tus header, a body past its length, a body on a route that takes
none, broken framing, an oversized head).  Each gets a clear 4xx (never a 5xx), carries
``Tus-Resumable: 1.0.0``, and leaves no file anywhere but ``uploads/`` and ``receipts/``.

The exhaustive cases run in memory against the same Site (``tests/unit/test_receiver_bad_input.py``
and ``tests/unit/test_receiver_seam.py``); refusals before the body, takeover, the receipt window,
head deadlines and connection caps also have real-socket checks in ``test_e2e_real_networks.py``.
Every response here goes through :meth:`Receiver.request` or :meth:`Receiver.raw`, both of which
assert the ``Tus-Resumable`` header.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import (
    OFFSET_TYPE,
    TUS_VERSION,
    Receiver,
    blake3_hex,
    metadata_header,
    raw_exchange,
    snapshot,
)

from tests.upload_checks import bad_framing, check_framing_refusal

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


# -- one real-process check per class of refusal ---------------------------------------------------


def test_a_traversal_id_is_404_on_every_route(rcv: Receiver) -> None:
    """An id that climbs out of uploads/ is 404 on HEAD, PATCH, overridden POST and the receipt
    lookup (the other malformed ids: tests/unit/test_receiver_bad_input.py)."""
    bad_id = "..%2F..%2Fetc"
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


def test_missing_tus_resumable_is_412(rcv: Receiver) -> None:
    """POST, HEAD and PATCH without Tus-Resumable are 412 with Tus-Version and change nothing."""
    oid = rcv.new_upload(DATA)
    before = rcv.upload_entries()
    meta = metadata_header([("project", "example"), ("checksum", CHECKSUM)])
    responses = {
        "POST": rcv.session.post(
            rcv.files_url,
            headers={"Upload-Length": str(len(DATA)), "Upload-Metadata": meta},
            timeout=30,
        ),
        "HEAD": rcv.session.head(rcv.upload_url(oid), headers={}, timeout=30),
        "PATCH": rcv.session.patch(
            rcv.upload_url(oid),
            headers={"Upload-Offset": "0", "Content-Type": OFFSET_TYPE},
            data=DATA,
            timeout=30,
        ),
    }
    for method, r in responses.items():
        r.close()
        assert r.status_code == 412, f"{method} without Tus-Resumable: {r.status_code}"
        assert r.headers.get("Tus-Version") == "1.0.0", f"{method} 412 without Tus-Version"
        assert r.headers.get("Tus-Resumable") == "1.0.0"
    assert rcv.upload_entries() == before
    assert rcv.offset(oid) == 0


def test_patch_past_upload_length_is_413_and_stores_nothing(rcv: Receiver) -> None:
    """A PATCH past Upload-Length is 413, declared or found mid-stream, and stores nothing."""
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


def test_oversize_non_upload_body_is_413(rcv: Receiver) -> None:
    """A body past 64 KiB on a route that takes none is 413, declared or chunked."""
    path = "/healthz"
    r = rcv.request("POST", path, data=b"\0" * 1_000_000)
    assert r.status_code == 413, f"POST {path} with 1 MB: {r.status_code}"

    def chunks() -> Iterator[bytes]:
        for _ in range(16):
            yield b"\0" * 65536

    r = rcv.request("POST", path, data=chunks())
    assert r.status_code == 413, f"chunked POST {path} with 1 MiB: {r.status_code}"
    assert rcv.request("GET", "/healthz").status_code == 200


def test_channel_level_errors_carry_tus_resumable(rcv: Receiver) -> None:
    """Requests refused by the HTTP layer itself (before canner's code) are still responses a
    tus client reads: Tus-Resumable on every response, errors included."""
    oid = rcv.new_upload(DATA)
    for what, request in bad_framing(oid).items():
        check_framing_refusal(what, raw_exchange(rcv.port, request))
    assert rcv.offset(oid) == 0


def _status_line(answer: bytes) -> str:
    return answer.partition(b"\r\n")[0].decode("latin-1")


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


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "a..b"], ids=["64-char-label", "a..b"])
def test_readyz_with_a_host_that_cannot_be_bound_is_400_without_a_traceback(
    rcv: Receiver, host: str
) -> None:
    """A probe whose Host werkzeug cannot bind gets 400 and a one-line reason, not a 500 that
    reads the node as broken, and the receiver logs no traceback for it (anyone could fill the
    log); an ordinary Host, with a port or an IPv6 literal, is still served."""
    logged = len(rcv.log_text())
    for _ in range(3):
        r = rcv.raw("GET", "/readyz", [("Host", host)], skip_host=True)
        assert r.status == 400, (r.status, r.body[:300])
        assert r.body == b"bad Host header: not a host name\n", r.body[:300]
    for good in ("canner.test", f"127.0.0.1:{rcv.port}", "[::1]:8080"):
        r = rcv.raw("GET", "/readyz", [("Host", good)], skip_host=True)
        assert r.status == 200, (good, r.status, r.body[:300])
    new_log = rcv.log_text()[logged:]
    assert "Traceback" not in new_log and "BadHost" not in new_log, new_log[-3000:]


def test_data_dir_holds_only_uploads_receipts_and_index(rcv: Receiver) -> None:
    """After start-up and all the refusals, the data directory holds only what it should (and
    the receiver's lock and its record of the boot it started in)."""
    names = {p.name for p in Path(rcv.data_dir).iterdir()}
    assert names <= {
        "uploads",
        "receipts",
        "delivery.sqlite",
        "delivery.sqlite-wal",
        "delivery.sqlite-shm",
        "delivery.sqlite-journal",
        "receiver.lock",
        "receiver.boot",
    }, names
