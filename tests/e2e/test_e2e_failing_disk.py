"""Receipts on a disk that fails: a real receiver on ext4 over a loop device whose backing store
runs out (see ``failing_disk.py``).  Afterwards the filesystem is unmounted and mounted again and
every receipt is checked against the bytes on disk: none may disagree, and every upload ends with
a correct receipt once the disk is healthy again.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
import requests
from e2e_support import (
    OFFSET_TYPE,
    TUS_VERSION,
    Receiver,
    blake3_hex,
    decode_receipt_header,
    upload_metadata,
)
from failing_disk import FailingDisk

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounts a loop-device filesystem: needs root"),
]

WORKER_DEADLINE = 120.0


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[FailingDisk]:
    failing = FailingDisk(tmp_path / "disk")
    try:
        failing.create(["data/uploads", "data/receipts"])
        yield failing
    finally:
        failing.close()


@pytest.fixture
def receiver(tmp_path: Path, disk: FailingDisk) -> Iterator[Receiver]:
    rcv = Receiver.in_dir(
        tmp_path / "receiver", data_dir=disk.mount / "data", max_upload_bytes=256 << 20
    )
    try:
        rcv.start()
        yield rcv
    finally:
        rcv.close()


def _headers(**extra: str) -> dict[str, str]:
    return {"Tus-Resumable": TUS_VERSION, **extra}


def create(rcv: Receiver, data: bytes) -> str:
    r = rcv.session.post(
        rcv.files_url,
        headers=_headers(
            **{
                "Upload-Length": str(len(data)),
                "Upload-Metadata": upload_metadata(blake3_hex(data)),
            }
        ),
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return r.headers["Location"].rsplit("/", 1)[1]


def patch(rcv: Receiver, oid: str, offset: int, body: object) -> requests.Response:
    return rcv.session.patch(
        rcv.upload_url(oid),
        data=body,
        timeout=120,
        headers=_headers(**{"Upload-Offset": str(offset), "Content-Type": OFFSET_TYPE}),
    )


def worker_finishes(rcv: Receiver, oid: str, data: bytes) -> bytes:
    """What a worker does after an error: HEAD, send the rest from the server's offset, until
    a receipt comes back.  Returns the receipt JSON."""
    deadline = time.monotonic() + WORKER_DEADLINE
    while time.monotonic() < deadline:
        head = rcv.session.head(rcv.upload_url(oid), headers=_headers(), timeout=60)
        if head.status_code == 200:
            if "Artifact-Receipt" in head.headers:
                return decode_receipt_header(head.headers["Artifact-Receipt"])
            offset = int(head.headers["Upload-Offset"])
            r = patch(rcv, oid, offset, data[offset:])
            if r.status_code == 204 and "Artifact-Receipt" in r.headers:
                return decode_receipt_header(r.headers["Artifact-Receipt"])
            # 423: the request that failed still holds the upload (on a loaded machine it can
            # take the takeover wait to let go); a worker retries like after a 503.
            assert r.status_code in (204, 409, 423, 503), (r.status_code, r.text)
        else:
            assert head.status_code == 503, (head.status_code, head.text)
        time.sleep(0.3)
    raise AssertionError(f"no receipt for {oid} within {WORKER_DEADLINE}s")


def check_disk_after_remount(rcv: Receiver, disk: FailingDisk, served: dict[str, bytes]) -> None:
    """Stop the receiver, remount, and compare every receipt with the bytes on disk."""
    rcv.stop()
    disk.remount()
    on_disk = {p.stem: p.read_bytes() for p in rcv.receipts_dir.glob("*.json") if "." not in p.stem}
    for oid, receipt in served.items():
        assert on_disk.get(oid) == receipt, f"served receipt of {oid} is not on disk"
    for oid, receipt in on_disk.items():
        doc = json.loads(receipt)
        stored = (rcv.uploads_dir / oid).read_bytes()
        assert len(stored) == doc["size_bytes"], oid
        assert "blake3:" + blake3.blake3(stored).hexdigest() == doc["checksum"], (
            f"receipt of {oid} does not match the bytes on disk"
        )


# 256 MiB: hashed while it is written (canner.store.uploads.TRAILING_HASH_MIN), reading back pages
# whose writeback failed.
@pytest.mark.parametrize("size", [100 << 20, 256 << 20], ids=["100MiB", "256MiB-trailing-hash"])
def test_writeback_error_early_in_a_large_upload_resets_it(
    receiver: Receiver, disk: FailingDisk, size: int
) -> None:
    """Writeback of the first 32 MiB of a large PATCH fails, space comes back before the end:
    the PATCH gets 503 with Retry-After, HEAD says offset 0, and the re-sent upload's receipt
    matches the disk after a remount."""
    data = os.urandom(size)
    oid = create(receiver, data)
    disk.fill()

    def body() -> Iterator[bytes]:
        for start in range(0, len(data), 1 << 20):
            if start == 50 << 20:
                disk.free()
            yield data[start : start + (1 << 20)]

    r = patch(receiver, oid, 0, body())
    assert r.status_code == 503, (r.status_code, r.text)
    assert "Retry-After" in r.headers
    assert "Artifact-Receipt" not in r.headers
    head = receiver.session.head(receiver.upload_url(oid), headers=_headers(), timeout=30)
    assert head.status_code == 200 and head.headers["Upload-Offset"] == "0"
    receipt = worker_finishes(receiver, oid, data)
    check_disk_after_remount(receiver, disk, {oid: receipt})


def test_failed_final_fsync_then_retry_after_space_is_freed(
    receiver: Receiver, disk: FailingDisk
) -> None:
    """A 2 MiB upload whose acceptance fsync fails gets 503 and is reset; its retry after the
    space came back gets a receipt that matches the disk."""
    data = os.urandom(2 << 20)
    oid = create(receiver, data)
    disk.fill()
    r = patch(receiver, oid, 0, data)
    assert r.status_code == 503, (r.status_code, r.text)
    assert "Retry-After" in r.headers and "Artifact-Receipt" not in r.headers
    head = receiver.session.head(receiver.upload_url(oid), headers=_headers(), timeout=30)
    assert head.headers["Upload-Offset"] == "0", "the suspect bytes do not count"
    again = patch(receiver, oid, 0, data)
    assert again.status_code == 503, "still failing while the disk is full"
    disk.free()
    receipt = worker_finishes(receiver, oid, data)
    check_disk_after_remount(receiver, disk, {oid: receipt})


def test_receipt_that_cannot_be_committed_is_never_served_to_pollers(
    receiver: Receiver, disk: FailingDisk
) -> None:
    """Uploads whose bytes are durable but whose receipt files cannot be written (the disk fills
    between the last byte and acceptance), while clients poll HEAD and GET: nothing serves a
    receipt that is not on disk after a remount, and every upload gets its receipt once the
    space is back."""
    uploads = {}
    for _ in range(4):
        data = os.urandom(256 << 10)
        oid = create(receiver, data)
        r = patch(receiver, oid, 0, data[:-1])
        assert r.status_code == 204
        uploads[oid] = data
    os.sync()  # everything but the last byte of each upload is on disk now
    disk.fill()
    served: dict[str, bytes] = {}
    stop = threading.Event()

    def poll(oid: str) -> None:
        session = requests.Session()
        while not stop.is_set():
            head = session.head(receiver.upload_url(oid), headers=_headers(), timeout=60)
            if "Artifact-Receipt" in head.headers:
                served.setdefault(oid, decode_receipt_header(head.headers["Artifact-Receipt"]))
            got = session.get(f"{receiver.base_url}/api/v1/receipts/{oid}", timeout=60)
            if got.status_code == 200:
                served.setdefault(oid, got.content)
            else:
                assert got.status_code in (404, 503), got.status_code
            time.sleep(0.02)

    pollers = [threading.Thread(target=poll, args=(oid,)) for oid in uploads]
    for t in pollers:
        t.start()
    try:
        failures = 0
        for oid, data in uploads.items():
            r = patch(receiver, oid, len(data) - 1, data[-1:])
            if r.status_code == 503:
                failures += 1
                assert "Retry-After" in r.headers
            else:
                assert r.status_code == 204, (r.status_code, r.text)
        assert failures == len(uploads), "every commit failed while the disk was full"
        time.sleep(1.0)  # pollers keep asking while nothing can be committed
        assert served == {}, "no receipt is served while none could be committed"
        disk.free()
        receipts = {oid: worker_finishes(receiver, oid, data) for oid, data in uploads.items()}
    finally:
        stop.set()
        for t in pollers:
            t.join()
    for oid, receipt in served.items():
        assert receipts[oid] == receipt
    check_disk_after_remount(receiver, disk, receipts)
