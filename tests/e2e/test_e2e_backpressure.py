"""Free-space backpressure on a real small filesystem.

The data directory lives on a 64 MiB tmpfs mounted for the test.  The receiver runs with a fixed
``min_free_bytes`` (M, a whole number of pages); the test then moves the filesystem's free space
(``statvfs``: ``f_bavail * f_frsize``, what the receiver compares) to exactly M - 1 page, M and
M + 1 page by growing or shrinking a filler file on the same tmpfs.  tmpfs accounts whole pages and
changes only when something is written, so each request sees exactly the free space set for it.
Below M, POST and PATCH (also PATCH via ``X-HTTP-Method-Override`` and creation-with-upload) get
429 with ``Retry-After: 60``; at exactly M a PATCH is allowed; HEAD, receipts and health stay 200.

A creation is also promised its declared length (canner.store.promises): it is admitted only while
free
space minus the bytes promised to every upload in flight, its own included, stays at or above M,
and refused with 503 and ``Retry-After`` otherwise; the promises are rebuilt from ``uploads/``
when the receiver starts again.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2e_support import OFFSET_TYPE, TUS_VERSION, Receiver, blake3_hex

pytestmark = pytest.mark.e2e

TMPFS_SIZE = "64m"
MIN_FREE = 16 * 1024 * 1024


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "smallfs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"cannot mount a {TMPFS_SIZE} tmpfs at {mount_point} (the backpressure test needs "
            f"root and mount(2)): exit {done.returncode}: {done.stderr.strip()}"
        )
    try:
        yield mount_point
    finally:
        # the receiver (make_receiver) has been stopped by now: fixtures tear down in reverse
        result = subprocess.run(["umount", str(mount_point)], capture_output=True, check=False)
        if result.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


class FreeSpace:
    """Sets the free space of a filesystem exactly, with a filler file on it."""

    def __init__(self, mount_point: Path) -> None:
        self.mount_point = mount_point
        self.filler = mount_point / "filler"
        self.filler.write_bytes(b"")
        self.page = os.statvfs(mount_point).f_frsize

    def settle(self, quiet: float = 0.25, timeout: float = 5.0) -> int:
        """Wait until free space stops changing: the receiver writes its delivery index after
        answering the request that completed an upload."""
        deadline = time.monotonic() + timeout
        last, since = free_bytes(self.mount_point), time.monotonic()
        while time.monotonic() - since < quiet and time.monotonic() < deadline:
            time.sleep(0.02)
            now = free_bytes(self.mount_point)
            if now != last:
                last, since = now, time.monotonic()
        return last

    def set(self, target: int) -> int:
        self.settle()
        for _ in range(5):
            free = free_bytes(self.mount_point)
            if free == target:
                return free
            size = self.filler.stat().st_size
            grow = free - target  # positive: consume more
            new_size = size + grow
            assert new_size >= 0, f"cannot free enough space: free {free}, target {target}"
            if grow > 0:
                with open(self.filler, "ab") as f:
                    f.write(b"\xa5" * grow)
            else:
                os.truncate(self.filler, new_size)
        free = free_bytes(self.mount_point)
        assert free == target, f"could not set free space to {target} (it is {free})"
        return free


@pytest.fixture
def space(
    small_fs: Path, make_receiver: Callable[..., Receiver]
) -> Iterator[tuple[Receiver, FreeSpace]]:
    rcv = make_receiver(data_dir=small_fs / "data", min_free_bytes=MIN_FREE)
    assert MIN_FREE % os.statvfs(small_fs).f_frsize == 0
    yield rcv, FreeSpace(small_fs)
    rcv.stop()


def assert_429(r: object, what: str) -> None:
    status = getattr(r, "status_code", None)
    headers = getattr(r, "headers", {})
    assert status == 429, f"{what} below min_free_bytes: {status}"
    assert headers.get("Retry-After") == "60", f"{what} 429 without Retry-After: 60"
    assert headers.get("Tus-Resumable") == TUS_VERSION


def test_backpressure_below_equal_above(space: tuple[Receiver, FreeSpace]) -> None:
    rcv, fs = space
    data = random.Random(3).randbytes(20_000)
    checksum = blake3_hex(data)
    accepted, receipt = rcv.upload_all(data)
    partial = rcv.new_upload(data)
    assert rcv.patch(partial, 0, data[:5000]).status_code == 204

    # -- below: one page under the threshold ------------------------------------------------------
    below = fs.set(MIN_FREE - fs.page)
    entries = rcv.upload_entries()
    assert_429(rcv.create(len(data), checksum), "POST")
    assert_429(rcv.create(len(data), checksum, body=data), "creation-with-upload POST")
    assert_429(rcv.patch(partial, 5000, data[5000:6000]), "PATCH")
    assert_429(
        rcv.request(
            "POST",
            rcv.upload_url(partial),
            headers={
                "Tus-Resumable": TUS_VERSION,
                "X-HTTP-Method-Override": "PATCH",
                "Upload-Offset": "5000",
                "Content-Type": OFFSET_TYPE,
            },
            data=data[5000:6000],
        ),
        "PATCH via X-HTTP-Method-Override",
    )
    assert_429(rcv.patch(accepted, len(data), b""), "repeated final PATCH")
    assert rcv.upload_entries() == entries, "a refused request created files"
    assert rcv.stored(partial) == data[:5000], "a refused PATCH stored bytes"
    # reading stays available
    head = rcv.head(partial)
    assert head.status_code == 200 and head.headers["Upload-Offset"] == "5000"
    head = rcv.head(accepted)
    assert head.status_code == 200 and head.headers.get("Artifact-Receipt") == receipt
    assert rcv.get_receipt(accepted).status_code == 200
    health = rcv.request("GET", "/healthz")
    assert health.status_code == 200
    assert health.json()["free_bytes"] == below
    assert rcv.request("OPTIONS", rcv.files_url).status_code in (200, 204)

    # -- exactly equal: a PATCH is allowed; a creation is not, it would take free space under M --
    fs.set(MIN_FREE)
    created = rcv.create(len(data), checksum)
    assert created.status_code == 503, f"POST at exactly min_free_bytes: {created.status_code}"
    assert "promised" in created.text and created.headers.get("Retry-After") == "60"
    fs.set(MIN_FREE)
    r = rcv.patch(partial, 5000, data[5000:6000])
    assert r.status_code == 204, f"PATCH at exactly min_free_bytes: {r.status_code}"
    assert r.headers["Upload-Offset"] == "6000"

    # -- above: allowed, and the partial upload completes -----------------------------------------
    fs.set(MIN_FREE + fs.page)
    r = rcv.patch(partial, 6000, data[6000:])
    assert r.status_code == 204, r.status_code
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), partial, data)
    # Completing the upload consumed space (data, receipt, index); nothing is promised now.
    fs.set(MIN_FREE + -(-len(data) // fs.page) * fs.page)
    assert rcv.create(len(data), checksum).status_code == 201
    assert rcv.create(len(data), checksum).status_code == 503, "promised twice over"


PROMISED = 4 << 20  # each upload's declared length: a whole number of pages


def readyz(rcv: Receiver) -> tuple[int, dict[str, object]]:
    r = rcv.request("GET", "/readyz")
    doc: dict[str, object] = r.json()
    return r.status_code, doc


def test_promised_space_refuses_the_third_upload_and_survives_a_restart(
    space: tuple[Receiver, FreeSpace],
) -> None:
    """Room for two and a half uploads over the floor: the third is refused at creation, also
    after a SIGKILL and restart (the promises are rebuilt from uploads/), and the first two
    finish with receipts."""
    rcv, fs = space
    files = [random.Random(n).randbytes(PROMISED) for n in range(3)]
    fs.set(MIN_FREE + 2 * PROMISED + PROMISED // 2)
    first, second = rcv.new_upload(files[0]), rcv.new_upload(files[1])
    refused = rcv.create(PROMISED, blake3_hex(files[2]))
    assert refused.status_code == 503, refused.status_code
    assert refused.headers.get("Retry-After") == "60"
    assert "promised to 2 uploads in flight" in refused.text, refused.text
    half = PROMISED // 2
    assert rcv.patch(first, 0, files[0][:half]).status_code == 204
    code, doc = readyz(rcv)
    assert code == 200 and doc["promised_bytes"] == 2 * PROMISED - half

    rcv.restart()
    code, doc = readyz(rcv)
    assert doc["promised_bytes"] == 2 * PROMISED - half, "promises not rebuilt at start"
    refused = rcv.create(PROMISED, blake3_hex(files[2]))
    assert refused.status_code == 503, f"after a restart: {refused.status_code}"
    # Something else takes space the uploads were promised: /readyz says so.
    free = fs.settle()
    fs.set(free - PROMISED)
    code, doc = readyz(rcv)
    assert code == 503
    reasons = doc["reasons"]
    assert isinstance(reasons, list)
    assert any("promised to uploads in flight" in r for r in reasons), reasons
    fs.set(free)

    done = rcv.patch(first, half, files[0][half:])
    assert done.status_code == 204, done.status_code
    rcv.verify_receipt(done.headers.get("Artifact-Receipt"), first, files[0])
    done = rcv.patch(second, 0, files[1])
    assert done.status_code == 204, done.status_code
    rcv.verify_receipt(done.headers.get("Artifact-Receipt"), second, files[1])
    code, doc = readyz(rcv)
    assert doc["promised_bytes"] == 0


def test_free_space_unknown_is_503(make_receiver: Callable[..., Receiver]) -> None:
    rcv = make_receiver()
    data = b"x" * 1000
    oid = rcv.new_upload(data)
    moved = rcv.data_dir.with_name("moved-away")
    rcv.data_dir.rename(moved)  # statvfs on the data directory now fails
    try:
        for what, r in (
            ("POST", rcv.create(len(data), blake3_hex(data))),
            ("PATCH", rcv.patch(oid, 0, data)),
        ):
            assert r.status_code == 503, f"{what} when free space is unknown: {r.status_code}"
            assert r.headers.get("Retry-After") == "60", f"{what} 503 without Retry-After"
    finally:
        moved.rename(rcv.data_dir)
    r = rcv.patch(oid, 0, data)
    assert r.status_code == 204
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)
