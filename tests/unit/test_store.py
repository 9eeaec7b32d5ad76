"""Uploads on disk, and the stale-upload sweep."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from canner import fs
from canner.checksum import Checksum
from canner.ids import ObjectIds
from canner.store.journal import Journal
from canner.store.receipts import Receipt, ReceiptStore
from canner.store.sweep import sweep_stale
from canner.store.uploads import CorruptInfo, UploadGone, UploadInfo, UploadStore

IDS = ObjectIds()
CHECKSUM = "blake3:" + "cd" * 32


def stores(tmp_path: Path) -> tuple[UploadStore, ReceiptStore]:
    (tmp_path / "uploads").mkdir()
    (tmp_path / "receipts").mkdir()
    return UploadStore(tmp_path / "uploads"), ReceiptStore(tmp_path / "receipts")


def info(upload_id: str, size: int = 10) -> UploadInfo:
    return UploadInfo(upload_id, size, {"project": "example", "checksum": CHECKSUM}, 5)


def test_sidecar_has_the_tusd_shape(tmp_path: Path) -> None:
    """The info sidecar carries tusd's field names and no storage path."""
    uploads, _ = stores(tmp_path)
    oid = IDS.new()
    uploads.create(info(oid))
    doc = json.loads(uploads.info_path(oid).read_bytes())
    assert doc["ID"] == oid and doc["Size"] == 10 and doc["Offset"] == 0
    assert doc["MetaData"] == {"project": "example", "checksum": CHECKSUM}
    assert "Storage" not in doc
    assert uploads.read_info(oid) == info(oid)


def test_a_creation_whose_sidecar_cannot_be_written_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage error while creating an upload propagates and leaves no file in uploads/."""
    uploads, _ = stores(tmp_path)

    def failing_replace(src: object, dst: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="Input/output error"):
        uploads.create(info(IDS.new()))
    assert os.listdir(uploads.directory) == []


def test_offset_is_the_data_file_size_and_writes_go_at_it(tmp_path: Path) -> None:
    """Writes land at the current offset; the offset survives reopening."""
    uploads, _ = stores(tmp_path)
    oid = IDS.new()
    uploads.create(info(oid))
    upload = uploads.open_locked(info(oid))
    assert upload.write([b"abc", b"de"]) == 5
    upload.close()
    again = uploads.open_locked(info(oid))
    assert again.offset == 5 == uploads.offset(oid)
    again.write([b"fgh"])
    again.close()
    assert uploads.data_path(oid).read_bytes() == b"abcdefgh"


def test_one_writer_per_upload(tmp_path: Path) -> None:
    """A second open_locked of the same upload is refused until the first closes."""
    uploads, _ = stores(tmp_path)
    oid = IDS.new()
    uploads.create(info(oid))
    first = uploads.open_locked(info(oid))
    with pytest.raises(fs.Locked):
        uploads.open_locked(info(oid))
    first.close()
    uploads.open_locked(info(oid)).close()


@pytest.mark.parametrize("content", [b"", b"{", b'{"ID": "other"}', b"[]", b'{"ID": 1}'])
def test_corrupt_sidecars_raise(tmp_path: Path, content: bytes) -> None:
    """Unreadable sidecars are CorruptInfo, not crashes."""
    uploads, _ = stores(tmp_path)
    oid = IDS.new()
    uploads.info_path(oid).write_bytes(content)
    with pytest.raises(CorruptInfo):
        uploads.read_info(oid)


def _age(uploads: UploadStore, oid: str, mtime: float) -> None:
    for path in (uploads.data_path(oid), uploads.info_path(oid)):
        if path.exists():
            os.utime(path, (mtime, mtime))


def test_sweep_removes_the_claim_temps_a_crash_left_in_the_adoption_area(tmp_path: Path) -> None:
    """adopting/: a claim's temp file an hour old goes (a crash between its write and its
    rename); a fresh one may be a live adoption's and stays; claims and the files they hold
    are the rsync intake's to finish, however old."""
    uploads, receipts = stores(tmp_path)
    adopting = tmp_path / "adopting"
    adopting.mkdir()
    now = 100_000.0
    crashed, live, claimed = IDS.new(), IDS.new(), IDS.new()
    stale = fs.write_temp(adopting, f"{crashed}.claim", b'{"object_id":', sync=False)
    fresh = fs.write_temp(adopting, f"{live}.claim", b"{}", sync=False)
    (adopting / f"{claimed}.claim").write_bytes(b"{}")
    (adopting / claimed).write_bytes(b"payload")
    for path, age in (
        (stale, 7200),
        (fresh, 60),
        (adopting / f"{claimed}.claim", 7200),
        (adopting / claimed, 7200),
    ):
        os.utime(path, (now - age, now - age))

    report = sweep_stale(
        uploads, receipts, Journal(tmp_path / "journal"), IDS, now, 1800, adopting=adopting
    )

    assert report.temps_removed == 1
    assert sorted(p.name for p in adopting.iterdir()) == sorted(
        [fresh.name, f"{claimed}.claim", claimed]
    )


def test_sweep_removes_only_idle_unreceipted_unlocked_uploads(tmp_path: Path) -> None:
    """Idle partial uploads go; fresh, receipted and locked ones stay."""
    uploads, receipts = stores(tmp_path)
    idle, fresh, accepted, busy, corrupt, orphan = (IDS.new() for _ in range(6))
    for oid in (idle, fresh, accepted, busy):
        uploads.create(info(oid))
    uploads.info_path(corrupt).write_bytes(b"garbage")
    uploads.data_path(orphan).write_bytes(b"data without sidecar")
    receipts.commit(Receipt(accepted, "https://i", Checksum("cd" * 32), 10, 7))
    lock = uploads.open_locked(info(busy))
    now = 100_000.0
    for oid in (idle, accepted, busy, corrupt, orphan):
        _age(uploads, oid, now - 3600)
    _age(uploads, fresh, now - 60)
    temp = fs.write_temp(uploads.directory, "x", b"", sync=False)
    os.utime(temp, (now - 7200, now - 7200))
    # A journal segment's temp file left by a crash goes too; a fresh one and a segment stay.
    journal = receipts.directory.parent / "journal"
    journal.mkdir()
    stale_segment = fs.write_temp(journal, "000000000001.jsonl", b"{}", sync=False)
    os.utime(stale_segment, (now - 7200, now - 7200))
    fresh_segment = fs.write_temp(journal, "000000000002.jsonl", b"{}", sync=False)
    os.utime(fresh_segment, (now - 60, now - 60))
    (journal / "000000000001.jsonl").write_bytes(b"{}\n")

    report = sweep_stale(uploads, receipts, Journal(journal), IDS, now, retention=1800)
    lock.close()

    assert sorted(report.removed) == sorted([idle, orphan, corrupt])
    assert report.unreadable == [corrupt]
    assert report.temps_removed == 2
    assert sorted(p.name for p in journal.iterdir()) == sorted(
        ["000000000001.jsonl", fresh_segment.name]
    )
    remaining = {p.name for p in uploads.directory.iterdir()}
    assert idle not in remaining and f"{idle}.info" not in remaining and orphan not in remaining
    for oid in (fresh, accepted, busy):
        assert oid in remaining and f"{oid}.info" in remaining
    assert f"{corrupt}.info" not in remaining


@pytest.mark.parametrize("content", [b"", b'{"ID": "', b"\0" * 300])
def test_sweep_removes_an_upload_whose_creation_was_never_durable_at_once(
    tmp_path: Path, content: bytes
) -> None:
    """An unreadable sidecar without a receipt goes at once with its data (nobody can write or
    accept that upload); with a receipt, data and sidecar stay."""
    uploads, receipts = stores(tmp_path)
    lost, accepted = IDS.new(), IDS.new()
    for oid in (lost, accepted):
        uploads.create(info(oid))
        uploads.data_path(oid).write_bytes(b"0123456789")
        uploads.info_path(oid).write_bytes(content)  # what a power cut left
    receipts.commit(Receipt(accepted, "https://i", Checksum("cd" * 32), 10, 7))
    now = os.stat(uploads.info_path(lost)).st_mtime + 1

    report = sweep_stale(uploads, receipts, Journal(tmp_path / "journal"), IDS, now, 1800)

    assert report.removed == report.unreadable == [lost]
    assert sorted(p.name for p in uploads.directory.iterdir()) == sorted(
        [accepted, f"{accepted}.info"]
    )


def test_open_locked_never_recreates_a_purged_upload(tmp_path: Path) -> None:
    """A writer that looked the upload up just before a purge removed it gets UploadGone, and
    no empty data file appears beside the receipt."""
    uploads, _ = stores(tmp_path)
    oid = IDS.new()
    uploads.create(info(oid))
    uploads.remove(oid)
    with pytest.raises(UploadGone):
        uploads.open_locked(info(oid))
    assert not uploads.data_path(oid).exists()


def test_open_locked_refuses_a_file_replaced_before_the_lock(tmp_path: Path) -> None:
    """The inode is checked under the lock: a file unlinked and created anew meanwhile (a sweep
    then a new file of the same name) is not the upload that was opened."""
    uploads, _ = stores(tmp_path)
    oid = IDS.new()
    uploads.create(info(oid))
    real_lock = fs.lock_fd

    def lock_after_replacement(fd: int) -> None:
        uploads.data_path(oid).unlink()
        uploads.data_path(oid).write_bytes(b"other")
        real_lock(fd)

    fs.lock_fd = lock_after_replacement  # type: ignore[assignment]
    try:
        with pytest.raises(UploadGone):
            uploads.open_locked(info(oid))
    finally:
        fs.lock_fd = real_lock  # type: ignore[assignment]


def test_sweep_removes_an_idle_sidecar_whose_data_file_is_gone(tmp_path: Path) -> None:
    """A sidecar left without its data file (a crash between the two unlinks of a removal) is
    removed after the retention, and the sweep goes on to the next upload."""
    uploads, receipts = stores(tmp_path)
    left, idle = sorted(IDS.new() for _ in range(2))
    for oid in (left, idle):
        uploads.create(info(oid))
        _age(uploads, oid, 1000.0)
    uploads.data_path(left).unlink()

    report = sweep_stale(uploads, receipts, Journal(tmp_path / "journal"), IDS, 5000.0, 1800)

    assert report.removed == [left, idle]
    assert list(uploads.directory.iterdir()) == []
