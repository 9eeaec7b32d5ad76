"""Free-space backpressure on a real small filesystem.

The data directory lives on a 64 MiB tmpfs mounted for the test.  The receiver runs with a fixed
``min_free_bytes`` (M, a whole number of pages); the test then moves the filesystem's free space
(``statvfs``: ``f_bavail * f_frsize``, what the receiver compares) to exactly M - 1 page, M and
M + 1 page by growing or shrinking a filler file on the same tmpfs.  tmpfs accounts whole pages and
changes only when something is written, so each request sees exactly the free space set for it.
Below M, POST and PATCH (also PATCH via ``X-HTTP-Method-Override`` and creation-with-upload) get
429 with ``Retry-After: 60``; at exactly M they are allowed; HEAD, receipts and health stay 200.
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

    # -- exactly equal: allowed -------------------------------------------------------------------
    fs.set(MIN_FREE)
    created = rcv.create(len(data), checksum)
    assert created.status_code == 201, f"POST at exactly min_free_bytes: {created.status_code}"
    fs.set(MIN_FREE)
    r = rcv.patch(partial, 5000, data[5000:6000])
    assert r.status_code == 204, f"PATCH at exactly min_free_bytes: {r.status_code}"
    assert r.headers["Upload-Offset"] == "6000"

    # -- above: allowed, and the partial upload completes -----------------------------------------
    fs.set(MIN_FREE + fs.page)
    r = rcv.patch(partial, 6000, data[6000:])
    assert r.status_code == 204, r.status_code
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), partial, data)
    fs.set(MIN_FREE + fs.page)  # completing the upload consumed space (data, receipt, index)
    assert rcv.create(len(data), checksum).status_code == 201


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
