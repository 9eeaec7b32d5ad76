"""End to end: a ``PUT /seesaw/...`` whose body never made it whole leaves neither bytes nor a
space promise behind, against real ``twistd canner-receiver`` processes.

A whole-file upload can never be resumed (seesaw sends the file again), so:

* a receiver SIGKILLed mid-body and started again finds the partial in ``uploads/``, removes it
  and promises it nothing (``/readyz`` ``promised_bytes``); a complete PUT left without a receipt
  (a crash between its last byte and its receipt, laid out as today's receiver leaves it) goes
  the same way; a tus upload cut at the same moment stays, resumable, with its promise;
* on a small tmpfs filled mid-body, the PUT is answered 503 with ``Retry-After``, its partial and
  its promise go at once, and once the space is freed the next PUT is accepted (201) instead of
  ``503 free space is promised to uploads in flight`` until the sweep.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from e2e_support import Receiver, blake3_hex, read_http_response

pytestmark = pytest.mark.e2e

MiB = 1 << 20
PUT_PATH = "/seesaw/example/alice/item-1.example.0123456789.warc.zst"


def open_put(rcv: Receiver, size: int, first: bytes, path: str = PUT_PATH) -> socket.socket:
    """A raw ``PUT`` of ``size`` bytes whose head and ``first`` bytes of body are sent."""
    sock = socket.create_connection(("127.0.0.1", rcv.port), timeout=30)
    head = (
        f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1:{rcv.port}\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    sock.sendall(head + first)
    return sock


def data_files(rcv: Receiver) -> list[Path]:
    return [rcv.uploads_dir / n for n in rcv.upload_entries() if not n.endswith(".info")]


def wait_stored(
    rcv: Receiver, size: int, exclude: frozenset[str] = frozenset(), timeout: float = 20.0
) -> Path:
    """The one new data file in ``uploads/`` once it holds ``size`` bytes."""
    deadline = time.monotonic() + timeout
    while True:
        found = [p for p in data_files(rcv) if p.name not in exclude]
        if len(found) == 1 and found[0].stat().st_size >= size:
            return found[0]
        assert time.monotonic() < deadline, f"no upload of {size} bytes in uploads/: {found}"
        time.sleep(0.02)


def readyz(rcv: Receiver) -> dict[str, object]:
    doc: dict[str, object] = requests.get(f"{rcv.base_url}/readyz", timeout=10).json()
    return doc


def put(rcv: Receiver, data: bytes, path: str = PUT_PATH) -> requests.Response:
    return requests.put(f"{rcv.base_url}{path}", data=data, timeout=60)


# -- a SIGKILL mid-body ------------------------------------------------------------------------


def plant_complete_put_without_receipt(rcv: Receiver, data: bytes) -> str:
    """A whole-file upload complete on disk without a receipt, as today's receiver leaves one
    SIGKILLed between the last byte and the receipt: the data file and its sidecar (no
    ``checksum``: the PUT door declares none)."""
    oid = os.urandom(16).hex()
    (rcv.uploads_dir / oid).write_bytes(data)
    info = {
        "ID": oid,
        "Size": len(data),
        "SizeIsDeferred": False,
        "Offset": 0,
        "MetaData": {"project": "example", "downloader": "bob", "filename": "item-2.warc.zst"},
        "IsPartial": False,
        "IsFinal": False,
        "PartialUploads": None,
        "CreatedAt": int(time.time()),
    }
    (rcv.uploads_dir / f"{oid}.info").write_text(json.dumps(info))
    return oid


def test_a_put_cut_by_sigkill_is_gone_with_its_promise_after_restart(
    make_receiver: Callable[..., Receiver],
) -> None:
    """SIGKILL mid-PUT, restart: the partial is gone from ``uploads/`` and nothing is promised to
    it, a complete PUT without a receipt is gone too; a tus upload cut at the same moment keeps
    its bytes and its promise and finishes; the PUT sent again is accepted."""
    rcv = make_receiver()
    rng = random.Random(34)
    size, sent = 8 * MiB, 3 * MiB
    data = rng.randbytes(size)
    tus_data = rng.randbytes(2 * MiB)
    tus_id = rcv.new_upload(tus_data)
    assert rcv.patch(tus_id, 0, tus_data[:MiB]).status_code == 204
    sock = open_put(rcv, size, data[:sent])
    try:
        partial = wait_stored(rcv, sent, exclude=frozenset({tus_id}))
        # While the PUT runs, what it lacks is promised (the sanity check of the measure).
        assert readyz(rcv)["promised_bytes"] == (size - sent) + MiB
        complete = plant_complete_put_without_receipt(rcv, rng.randbytes(MiB))
        rcv.kill()
    finally:
        sock.close()
    assert partial.exists() and partial.stat().st_size == sent  # what the crash left

    rcv.start()
    # Only the tus upload, which its worker resumes, is promised what it lacks.
    assert readyz(rcv)["promised_bytes"] == len(tus_data) - MiB
    assert not partial.exists(), "the cut PUT's partial is still in uploads/ after the restart"
    assert not (rcv.uploads_dir / f"{partial.name}.info").exists()
    assert complete not in rcv.upload_entries() and f"{complete}.info" not in rcv.upload_entries()
    assert rcv.upload_entries() == {tus_id, f"{tus_id}.info"}
    assert rcv.offset(tus_id) == MiB
    r = rcv.patch(tus_id, MiB, tus_data[MiB:])
    assert r.status_code == 204
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), tus_id, tus_data)
    assert readyz(rcv)["promised_bytes"] == 0
    again = put(rcv, data)
    assert again.status_code == 201, again.text
    assert again.json()["checksum"] == blake3_hex(data)
    assert "Traceback" not in rcv.log_text(), rcv.log_tail()


# -- a full disk mid-body ----------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs for the data directory."""
    mount_point = tmp_path / "smallfs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        # The receiver (make_receiver) has stopped by now: fixtures tear down in reverse.
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(mount_point: Path) -> Path:
    """Take every free byte of the filesystem with a filler file."""
    filler = mount_point / "filler"
    with open(filler, "wb") as f:
        free = os.statvfs(mount_point).f_bavail * os.statvfs(mount_point).f_frsize
        while free > 0:
            try:
                os.posix_fallocate(f.fileno(), 0, free)
                break
            except OSError:
                free -= 4096
    stat = os.statvfs(mount_point)
    assert stat.f_bavail == 0, f"{stat.f_bavail} blocks still free"
    return filler


def test_a_put_cut_by_a_full_disk_frees_its_promise_at_once(
    small_fs: Path, make_receiver: Callable[..., Receiver]
) -> None:
    """The disk fills mid-PUT: 503 with Retry-After after the body, nothing of it stays in
    ``uploads/`` and nothing is promised to it; once the space is freed, the next PUT gets 201
    (not "free space is promised to uploads in flight")."""
    rcv = make_receiver(data_dir=small_fs / "data", min_free_bytes=MiB)
    rng = random.Random(35)
    size, sent = 30 * MiB, 4 * MiB
    data = rng.randbytes(size)
    sock = open_put(rcv, size, data[:sent])
    try:
        partial = wait_stored(rcv, sent)
        filler = fill(small_fs)
        sock.sendall(data[sent:])
        status, headers, body = read_http_response(sock, "PUT")
    finally:
        sock.close()
    assert status == 503 and headers.get("Retry-After"), (status, body)
    filler.unlink()

    # The answer comes once the partial is gone: nothing is promised to it any more.
    assert readyz(rcv)["promised_bytes"] == 0
    following = rng.randbytes(40 * MiB)
    r = put(rcv, following, PUT_PATH.replace("item-1", "item-2"))
    assert r.status_code == 201, f"{r.status_code} {r.text}"
    assert r.json()["size_bytes"] == len(following)
    assert not partial.exists(), "the PUT cut by ENOSPC left its partial in uploads/"
    assert data_files(rcv) == [rcv.uploads_dir / r.json()["object_id"]]
    assert "Traceback" not in rcv.log_text(), rcv.log_tail()
