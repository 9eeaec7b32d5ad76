"""Storage errors on the acceptance path: a fault injected at every fsync, write and writeback.

The fault layer wraps ``os.fsync`` (and ``sync_file_range``) for one test: it records which file
each call synced and fails the chosen one, as a failing disk would.  The rules checked: a failed
fsync of an upload's data, sidecar or ``uploads/`` resets the upload (no receipt can come from its
bytes, HEAD-visible offset 0, the worker re-sends); a failed receipt commit leaves no receipt
behind and a retry commits; every receipt that exists matches the bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from canner import fs
from canner.accept.acceptance import AcceptanceFailed
from canner.store import uploads as store_module
from canner.store.uploads import (
    WRITE_BEHIND_WINDOW,
    OutOfSpace,
    StorageFault,
    UploadInfo,
    UploadStore,
    parse_info,
)
from tests.fakes import succeeded
from tests.unit.test_acceptance import OID, Env


class FsyncFaults:
    """Stands in for ``os.fsync``: records the path of every call, fails call number ``fail_at``."""

    def __init__(self, real: Callable[[int], None]) -> None:
        self.real = real
        self.calls: list[str] = []
        self.fail_at: int | None = None
        self.code = errno.EIO

    def __call__(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        self.calls.append(path)
        if self.fail_at is not None and len(self.calls) - 1 == self.fail_at:
            raise OSError(self.code, os.strerror(self.code))
        self.real(fd)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[FsyncFaults]:
    fake = FsyncFaults(os.fsync)
    monkeypatch.setattr(os, "fsync", fake)
    yield fake


def _role(path: str, tmp_path: Path) -> str:
    """Which file of the data directory a synced path is (temp names folded)."""
    rel = os.path.relpath(path, tmp_path)
    if rel in ("uploads", "receipts"):
        return rel + "/"
    name = os.path.basename(rel)
    if name.startswith(fs.TEMP_PREFIX):
        kind = "receipt" if name.endswith(".json") or ".json-" in name else "sidecar"
        if ".meta.json" in name:
            kind = "origin"
        return f"{os.path.dirname(rel)}/temp {kind}"
    return rel.replace(OID, "{id}")


def _sequence(tmp_path: Path, faults: FsyncFaults, size: int) -> list[str]:
    env = Env(tmp_path / "probe")
    faults.calls.clear()
    succeeded(env.acceptance.accept(env.complete_upload(os.urandom(size))))
    return [_role(p, tmp_path / "probe") for p in faults.calls]


@pytest.mark.parametrize("size", [7, (4 << 20) + 1], ids=["inline", "hash-pool"])
def test_the_fsync_order_of_one_acceptance(tmp_path: Path, faults: FsyncFaults, size: int) -> None:
    """Data, sidecar and uploads/ are durable before the receipt; receipts/ is synced last.
    The origin record has no fsync of its own (the sidecar backs it until its writeback)."""
    (tmp_path / "probe").mkdir()
    order = _sequence(tmp_path, faults, size)
    assert order == [
        "uploads/{id}",
        "uploads/{id}.info",
        "uploads/",
        "receipts/temp receipt",
        "receipts/",
    ]


UPLOAD_SIDE = {"uploads/{id}", "uploads/{id}.info", "uploads/"}


@pytest.mark.parametrize("size", [7, (4 << 20) + 1], ids=["inline", "hash-pool"])
@pytest.mark.parametrize("step", range(5))
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failed_fsync_never_leaves_a_receipt_for_untrusted_bytes(
    tmp_path: Path, faults: FsyncFaults, size: int, step: int, code: int
) -> None:
    """Whichever fsync fails, acceptance fails with no receipt on disk; an upload-side failure
    resets the upload to offset 0 (re-sent, then receipted), a receipt-side one is retryable."""
    (tmp_path / "probe").mkdir()
    role = _sequence(tmp_path, faults, size)[step]
    (tmp_path / "real").mkdir()
    env = Env(tmp_path / "real")
    data = os.urandom(size)
    upload = env.complete_upload(data)
    faults.calls.clear()
    faults.fail_at, faults.code = step, code
    with pytest.raises(AcceptanceFailed) as caught:
        succeeded(env.acceptance.accept(upload))
    faults.fail_at = None
    assert caught.value.no_space is (code == errno.ENOSPC)
    assert env.receipts.read_bytes(OID) is None, "no receipt after a failed commit"
    assert upload.fd == -1, "the lock is released"
    info = env.uploads.read_info(OID)
    assert info is not None and info.rejected is None and info.untrusted is None
    if role in UPLOAD_SIDE:
        assert env.uploads.offset(OID) == 0, "the suspect bytes are gone"
        again = env.uploads.open_locked(info)
        assert again.offset == 0
        again.write([data])
    else:
        assert env.uploads.offset(OID) == size, "durable bytes are kept"
        again = env.uploads.open_locked(info)
    receipt = succeeded(env.acceptance.accept(again))
    assert receipt.checksum.hex_digest == blake3.blake3(data).hexdigest()
    assert (
        blake3.blake3(env.uploads.data_path(OID).read_bytes()).hexdigest()
        == receipt.checksum.hex_digest
    )


def test_a_reset_that_cannot_finish_is_marked_durably_and_done_on_next_open(
    tmp_path: Path, faults: FsyncFaults
) -> None:
    """If the data fsync fails and so does the fsync after truncation, the sidecar keeps the
    Untrusted mark; the next open resets the upload before anyone may write or accept it."""
    env = Env(tmp_path)
    upload = env.complete_upload(b"x" * 100)
    real_reset = UploadStore._reset

    def failing_reset(self: UploadStore, locked: Any) -> None:
        raise OSError(errno.EIO, "still failing")

    UploadStore._reset = failing_reset  # type: ignore[method-assign]
    try:
        faults.fail_at = 0
        with pytest.raises(StorageFault):
            env.uploads.sync_upload(upload)
    finally:
        UploadStore._reset = real_reset  # type: ignore[method-assign]
        faults.fail_at = None
    upload.close()
    marked = parse_info(OID, env.uploads.info_path(OID).read_bytes())
    assert marked.untrusted is not None and "fsync failed" in marked.untrusted
    fresh = UploadStore(env.uploads.directory)  # a restarted receiver knows only the disk
    assert fresh.is_untrusted(marked)
    reopened = fresh.open_locked(marked)
    assert reopened.offset == 0 and os.path.getsize(fresh.data_path(OID)) == 0
    cleared = fresh.read_info(OID)
    assert cleared is not None and cleared.untrusted is None
    reopened.close()


def test_a_writeback_error_during_streaming_resets_the_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error from sync_file_range (write-behind) is not swallowed: the upload is reset and
    the later fsync cannot report success over lost pages."""
    env = Env(tmp_path)
    info = UploadInfo(
        OID, 3 * WRITE_BEHIND_WINDOW, {"project": "example", "checksum": "blake3:" + "0" * 64}, 1
    )
    env.uploads.create(info)
    upload = env.uploads.open_locked(info)

    def failing(fd: int, start: int, length: int, flags: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(fs, "_sync_file_range", failing)
    chunk = b"\xa5" * (1 << 20)
    with pytest.raises(StorageFault):
        for _ in range(2 * WRITE_BEHIND_WINDOW // len(chunk)):
            env.uploads.append(upload, [chunk])
    assert upload.offset == 0 and os.path.getsize(env.uploads.data_path(OID)) == 0
    stored = env.uploads.read_info(OID)
    assert stored is not None and stored.untrusted is None
    upload.close()


def test_a_full_disk_at_write_time_keeps_the_bytes_written_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from pwritev itself means the kernel took nothing: earlier bytes stay, the offset
    says how many, and nothing is marked untrusted."""
    env = Env(tmp_path)
    info = UploadInfo(OID, 100, {"project": "example", "checksum": "blake3:" + "0" * 64}, 1)
    env.uploads.create(info)
    upload = env.uploads.open_locked(info)
    env.uploads.append(upload, [b"a" * 40])
    real = os.pwritev

    def full(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.os, "pwritev", full)
    with pytest.raises(OutOfSpace):
        env.uploads.append(upload, [b"b" * 40])
    monkeypatch.setattr(store_module.os, "pwritev", real)
    assert upload.offset == 40 and env.uploads.offset(OID) == 40
    assert not env.uploads.is_untrusted(info)
    upload.close()
