"""Digests of stored files: the read-ahead read and the trailing hash of an upload."""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import blake3
import pytest

from canner import checksum
from canner.checksum import HashCancelled, TrailingHash, blake3_file
from canner.store import uploads as store
from canner.store.uploads import TRAILING_HASH_MIN, LockedUpload, UploadInfo, UploadStore

OID = "0123456789abcdef0123456789abcdef"
MiB = 1 << 20


def _b3(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def _upload(tmp_path: Path, stored: bytes = b"") -> tuple[UploadStore, LockedUpload]:
    """A big upload (only those are hashed as they are written) with ``stored`` bytes so far;
    the tests write a few MiB of it."""
    uploads = UploadStore(tmp_path)
    declared = "blake3:" + "0" * 64
    info = UploadInfo(OID, TRAILING_HASH_MIN, {"project": "example", "checksum": declared}, 1)
    uploads.create(info)
    uploads.data_path(OID).write_bytes(stored)
    upload = uploads.open_locked(info)
    assert isinstance(upload.digest, TrailingHash)
    return uploads, upload


def _digest(upload: LockedUpload) -> TrailingHash:
    assert upload.digest is not None
    return upload.digest


@pytest.mark.parametrize("size", [0, 1, 4 * MiB, 9 * MiB + 7], ids=["0", "1", "4M", "9M+7"])
def test_a_file_is_hashed_whole_in_one_buffer_or_many(tmp_path: Path, size: int) -> None:
    """Files of one read buffer and of several (read ahead in a helper thread) hash alike."""
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    digest, count = blake3_file(path, size)
    assert (str(digest), count) == (_b3(data), size)


def test_a_read_error_is_raised_and_the_read_ahead_thread_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EIO in the middle of a long file is raised as such, never taken for its end."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(10 * MiB))
    real = os.preadv
    calls = 0

    def failing(fd: int, buffers: Any, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(checksum.os, "preadv", failing)
    before = threading.active_count()
    with pytest.raises(OSError) as raised:
        blake3_file(path, 10 * MiB)
    assert raised.value.errno == errno.EIO
    assert threading.active_count() == before


def test_a_stop_cancels_a_long_read_and_the_thread_ends(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(10 * MiB))
    stop = threading.Event()
    stop.set()
    before = threading.active_count()
    with pytest.raises(HashCancelled):
        blake3_file(path, 10 * MiB, stop)
    assert threading.active_count() == before


def test_small_uploads_are_hashed_at_acceptance_only(tmp_path: Path) -> None:
    uploads = UploadStore(tmp_path)
    info = UploadInfo(
        OID, TRAILING_HASH_MIN - 1, {"project": "p", "checksum": "blake3:" + "0" * 64}, 1
    )
    uploads.create(info)
    upload = uploads.open_locked(info)
    upload.write([b"abc"])
    assert upload.digest is None


def test_the_trailing_hash_covers_what_was_written(tmp_path: Path) -> None:
    """An upload written from its first byte is hashed as it is written: acceptance reads
    nothing more, and the digest is the whole file's."""
    data = os.urandom(3 * MiB + 5)
    _, upload = _upload(tmp_path)
    for start in range(0, len(data), 300_000):
        upload.write([data[start : start + 100_000], data[start + 100_000 : start + 300_000]])
    assert _digest(upload).hashed == len(data)
    digest, count = _digest(upload).finish(upload.fd)
    assert (str(digest), count) == (_b3(data), len(data))
    assert str(_digest(upload).finish(upload.fd)[0]) == _b3(data), "finishing twice is harmless"


def test_the_trailing_hash_reads_the_file_not_the_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes that reach the file differently from what was sent (a storage or write-path fault)
    are what the digest covers, so such an upload can never get a receipt for the sent bytes."""
    sent = b"A" * MiB
    _, upload = _upload(tmp_path)
    real = os.pwritev

    def garbling(fd: int, buffers: Any, offset: int) -> int:
        total = sum(len(b) for b in buffers)
        return real(fd, [b"B" * total], offset)

    monkeypatch.setattr(os, "pwritev", garbling)
    upload.write([sent])
    digest, _ = _digest(upload).finish(upload.fd)
    assert str(digest) == _b3(b"B" * MiB) != _b3(sent)


def test_a_resumed_upload_catches_up_with_its_older_bytes(tmp_path: Path) -> None:
    """A lock taken on a partly stored upload hashes the old bytes too, as much again as each
    write brings, so the rest is read only at acceptance."""
    old, new = os.urandom(2 * MiB), os.urandom(MiB)
    _, upload = _upload(tmp_path, stored=old)
    upload.write([new])
    assert _digest(upload).hashed == 2 * MiB, "one write catches up twice its size"
    tail = os.urandom(MiB)
    upload.write([tail])
    assert _digest(upload).hashed == 4 * MiB
    assert str(_digest(upload).finish(upload.fd)[0]) == _b3(old + new + tail)


def test_truncating_below_the_hashed_bytes_starts_over(tmp_path: Path) -> None:
    data = os.urandom(MiB)
    _, upload = _upload(tmp_path)
    upload.write([data])
    upload.truncate(1000)
    assert _digest(upload).hashed == 0
    rest = os.urandom(2 * MiB - 1000)
    upload.write([rest])
    assert str(_digest(upload).finish(upload.fd)[0]) == _b3(data[:1000] + rest)


def test_a_file_shorter_than_what_was_hashed_is_a_storage_error(tmp_path: Path) -> None:
    data = os.urandom(MiB)
    uploads, upload = _upload(tmp_path)
    upload.write([data])
    os.truncate(uploads.data_path(OID), 10)
    with pytest.raises(OSError) as raised:
        _digest(upload).finish(upload.fd)
    assert raised.value.errno == errno.EIO


def test_a_read_back_failure_leaves_acceptance_to_read_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write itself succeeded; the digest starts over and acceptance reads everything."""
    data = os.urandom(MiB)
    _, upload = _upload(tmp_path)

    def failing(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checksum.os, "preadv", failing)
    assert upload.write([data]) == MiB
    assert _digest(upload).hashed == 0
    monkeypatch.undo()
    assert str(_digest(upload).finish(upload.fd)[0]) == _b3(data)


def _reopen(uploads: UploadStore) -> LockedUpload:
    info = uploads.read_info(OID)
    assert info is not None
    return uploads.open_locked(info)


def test_the_digest_is_kept_between_two_locks_of_an_upload(tmp_path: Path) -> None:
    """A worker resuming after a dropped connection: the next lock takes over the digest, so
    nothing is read again from the first byte."""
    first, second = os.urandom(MiB), os.urandom(MiB)
    uploads, upload = _upload(tmp_path)
    upload.write([first])
    upload.close()
    again = _reopen(uploads)
    assert _digest(again).hashed == MiB
    again.write([second])
    assert str(_digest(again).finish(again.fd)[0]) == _b3(first + second)


@pytest.mark.parametrize("change", ["appended", "rewritten"])
def test_a_kept_digest_is_dropped_when_the_file_changed_meanwhile(
    tmp_path: Path, change: str
) -> None:
    """Written by anything but the lock's holder between two locks (size or mtime differ), the
    file is hashed again from its first byte."""
    uploads, upload = _upload(tmp_path)
    upload.write([os.urandom(MiB)])
    upload.close()
    time.sleep(0.05)  # past the filesystem's timestamp granularity
    path = uploads.data_path(OID)
    if change == "appended":
        with path.open("ab") as f:
            f.write(b"x")
    else:
        path.write_bytes(os.urandom(MiB))
    again = _reopen(uploads)
    assert _digest(again).hashed == 0
    assert str(_digest(again).finish(again.fd)[0]) == _b3(path.read_bytes())


def test_a_digest_is_not_kept_after_a_truncation(tmp_path: Path) -> None:
    uploads, upload = _upload(tmp_path)
    upload.write([os.urandom(MiB)])
    upload.truncate(0)
    upload.close()
    assert _digest(_reopen(uploads)).hashed == 0


def test_kept_digests_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "KEPT_DIGESTS_MAX", 2)
    uploads = UploadStore(tmp_path)
    ids = [f"{n:032x}" for n in range(3)]
    for oid in ids:
        info = UploadInfo(
            oid, TRAILING_HASH_MIN, {"project": "p", "checksum": "blake3:" + "0" * 64}, 1
        )
        uploads.create(info)
        upload = uploads.open_locked(info)
        upload.write([b"abc"])
        upload.close()
    hashed = []
    for oid in ids:
        info = uploads.read_info(oid)
        assert info is not None
        hashed.append(_digest(uploads.open_locked(info)).hashed)
    assert hashed == [0, 3, 3], "the oldest was dropped"


def test_only_bytes_hashed_and_written_back_leave_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big upload streaming: the receiver asks the kernel to forget a range only once the
    trailing hash has read it back and writeback has written it, and the digest is still the
    stored bytes' (also after a truncation undid part of them)."""
    monkeypatch.setattr(store, "WRITE_BEHIND_WINDOW", MiB)
    dropped: list[tuple[int, int]] = []
    settled: list[int] = []
    real_fadvise, real_behind = os.posix_fadvise, store.fs.write_behind

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        dropped.append((offset, offset + length))
        real_fadvise(fd, offset, length, advice)

    def behind(fd: int, start: int, end: int, settle_before: int) -> None:
        real_behind(fd, start, end, settle_before)
        settled.append(settle_before)

    monkeypatch.setattr(store.os, "posix_fadvise", fadvise)
    monkeypatch.setattr(store.fs, "write_behind", behind)
    _, upload = _upload(tmp_path)
    data = os.urandom(8 * MiB)
    for at in range(0, 6 * MiB, MiB // 2):
        upload.write([data[at : at + MiB // 2]])
        for _, end in dropped:
            assert end <= _digest(upload).hashed, "dropped before it was hashed"
            assert end <= max(settled), "dropped before it was written back"
    assert dropped and dropped[-1][1] >= 3 * MiB, "nothing left the page cache"
    assert all(a[1] == b[0] for a, b in itertools.pairwise(dropped))
    upload.truncate(2 * MiB)
    for at in range(2 * MiB, 8 * MiB, MiB // 2):
        upload.write([data[at : at + MiB // 2]])
    assert str(_digest(upload).finish(upload.fd)[0]) == _b3(data)
