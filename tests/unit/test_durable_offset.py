"""The durable offset of a tus upload: what HEAD answers after an unclean stop (issue 34, item 3).

A power cut can leave an upload's data file at the length the kernel had reached while the
bytes past the last fsync read as zeros (ext4 commits the size before the data).  The receiver
keeps the offset whose bytes are durable in the sidecar (the data is fsynced first) at the end of
every PATCH that does not complete the upload and every ``CHECKPOINT_BYTES`` of a long one, and
cuts every upload in flight back to it at start.  Each test here builds the state the disk is
left in, starts a receiver over it (``receiver_harness``, the daemon's own objects) and checks
what a worker sees: HEAD, the file, the receipt after resuming.
"""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import pytest

from canner import fs
from canner.accept.intake import TAKEOVER_QUIET
from canner.store.receipts import Origin, ReceiptStore
from canner.store.recovery import BOOT_RECORD, current_boot_id
from canner.store.uploads import CHECKPOINT_BYTES, UploadInfo, UploadStore, parse_info
from tests.unit.receiver_harness import (
    ISSUER,
    InMemoryReceiver,
    blake3_hex,
)

SIZE = 300_000
DATA = random.Random(34).randbytes(SIZE)
FIRST = 100_000  # the PATCH answered 204 before the cut


def durable_offset(rcv: InMemoryReceiver, oid: str) -> int | None:
    info = parse_info(oid, (rcv.uploads_dir / f"{oid}.info").read_bytes())
    return info.durable


def power_cut(rcv: InMemoryReceiver, oid: str, length: int) -> InMemoryReceiver:
    """The disk as a power cut leaves it while a PATCH past the durable offset was streaming:
    the data file at ``length`` bytes, all past the answered offset zeros; the sidecar as the
    receiver last wrote it, and the receiver's record of its last boot another boot's.  Returns a
    receiver started on it (nothing of the old one runs)."""
    path = rcv.uploads_dir / oid
    with open(path, "r+b") as f:
        answered = os.fstat(f.fileno()).st_size
        f.truncate(length)
        f.seek(answered)
        f.write(b"\0" * (length - answered))
    for connection in rcv.connections:
        connection.close()
    # The machine restarted: the record of the boot the receiver last started in names another.
    (rcv.data_dir / BOOT_RECORD).write_text("an-earlier-boot\n")
    return InMemoryReceiver.build(rcv.data_dir)


@pytest.mark.parametrize("cut_at", [FIRST + 50_000, SIZE], ids=["mid-patch", "at-full-length"])
def test_head_after_a_power_cut_answers_the_durable_offset(tmp_path: Path, cut_at: int) -> None:
    """A PATCH answered 204 at FIRST, then a second one streaming when the power went: the file
    came back ``cut_at`` bytes long with zeros past FIRST (at full length: what a finished PATCH
    whose acceptance had not fsynced yet leaves).  HEAD answers FIRST, the zeros are gone, and
    the worker resumes from there to the right receipt."""
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    answered = rcv.patch(oid, 0, DATA[:FIRST])
    assert answered.status == 204 and answered.header("Upload-Offset") == str(FIRST)

    rcv = power_cut(rcv, oid, cut_at)
    assert rcv.offset(oid) == FIRST, "HEAD answered bytes that are not durable"
    assert rcv.stored(oid) == DATA[:FIRST], "the zeroed tail stayed on disk"
    done = rcv.patch(oid, FIRST, DATA[FIRST:])
    assert done.status == 204, done.body
    receipt = rcv.verify_receipt(done.header("Artifact-Receipt"), oid, DATA)
    assert receipt["checksum"] == blake3_hex(DATA)


def test_the_promise_after_a_power_cut_counts_the_durable_bytes_only(tmp_path: Path) -> None:
    """The space promised to an upload cut back at start is what it lacks after the cut."""
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:FIRST]).status == 204
    rcv = power_cut(rcv, oid, SIZE - 1)
    assert rcv.intake.promises.total == SIZE - FIRST


def test_every_patch_that_ends_short_records_its_offset_durably(tmp_path: Path) -> None:
    """A PATCH answered 204 at a partial offset, and one whose connection is lost, leave that
    offset in the sidecar: the offset answered is the offset a restart keeps."""
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    assert durable_offset(rcv, oid) == 0
    assert rcv.patch(oid, 0, DATA[:FIRST]).status == 204
    assert durable_offset(rcv, oid) == FIRST

    lost = rcv.open_patch(oid, FIRST, SIZE - FIRST)
    lost.send(DATA[FIRST : FIRST + 12_345])
    lost.close()
    rcv.settle()
    assert durable_offset(rcv, oid) == FIRST + 12_345
    assert rcv.offset(oid) == FIRST + 12_345


def test_a_stalled_writer_taken_over_records_what_it_wrote(tmp_path: Path) -> None:
    """HEAD from a worker whose old connection went quiet drops it; the offset HEAD then
    answers is durable."""
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    stalled = rcv.open_patch(oid, 0, SIZE)
    stalled.send(DATA[:7777])
    rcv.advance(TAKEOVER_QUIET + 0.5)
    assert rcv.offset(oid) == 7777
    assert durable_offset(rcv, oid) == 7777


def test_a_patch_cut_by_shutdown_records_what_it_wrote(tmp_path: Path) -> None:
    """The receiver stopping drops the connection of a PATCH still streaming and records its
    offset durably before the thread pools stop (the intake's stop fires after)."""
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    streaming = rcv.open_patch(oid, 0, SIZE)
    streaming.send(DATA[:54_321])
    stopped = rcv.intake.stop()
    rcv.settle()
    assert stopped.called, "the stop waits for nothing left"
    assert streaming.closed
    assert durable_offset(rcv, oid) == 54_321


def test_no_space_for_the_record_answers_503_and_keeps_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk refusing the sidecar at the end of a PATCH: the offset is not durable, so
    no 204; a 503 the worker retries, the bytes stay, and the next PATCH records them."""
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    real = fs.replace_file

    def full(directory: Path, name: str, data: bytes, *, sync: bool) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "replace_file", full)
    refused = rcv.patch(oid, 0, DATA[:FIRST])
    monkeypatch.setattr(fs, "replace_file", real)
    assert refused.status == 503 and refused.header("Retry-After")
    assert durable_offset(rcv, oid) == 0
    assert rcv.offset(oid) == FIRST, "the bytes written stay"
    done = rcv.patch(oid, FIRST, DATA[FIRST:])
    assert done.status == 204
    rcv.verify_receipt(done.header("Artifact-Receipt"), oid, DATA)


def test_a_long_patch_records_a_durable_offset_every_checkpoint(tmp_path: Path) -> None:
    """While one PATCH streams, every CHECKPOINT_BYTES written are fsynced and recorded: a
    power cut in the middle of a long PATCH costs at most that much."""
    size = 2 * CHECKPOINT_BYTES + 1000
    meta = {"project": "example", "checksum": "blake3:" + "0" * 64}
    info = UploadInfo("a" * 32, size, meta, 1, durable=0)
    uploads = UploadStore(tmp_path)
    uploads.create(info)
    upload = uploads.open_locked(info)
    chunk = b"\x5a" * (1 << 20)
    for _ in range(CHECKPOINT_BYTES // len(chunk) - 1):
        uploads.append(upload, [chunk])
    recorded = uploads.read_info(info.upload_id)
    assert recorded is not None and recorded.durable == 0
    uploads.append(upload, [chunk])
    recorded = uploads.read_info(info.upload_id)
    assert recorded is not None and recorded.durable == CHECKPOINT_BYTES
    upload.close()


def test_an_upload_whose_acceptance_fsynced_is_not_cut_at_start(tmp_path: Path) -> None:
    """A complete upload whose acceptance got past its fsyncs (its origin record, written right
    after them, exists) but not to the receipt is kept whole at start, and HEAD finishes its
    acceptance; without the origin record the same file is cut back to the durable offset."""
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:FIRST]).status == 204
    # The final PATCH wrote every byte, acceptance fsynced them and recorded the origin, and
    # the receiver was gone before the receipt.
    with open(rcv.uploads_dir / oid, "ab") as f:
        f.write(DATA[FIRST:])
    ReceiptStore(rcv.receipts_dir).record_origin(oid, Origin("example", None, None))
    rcv = InMemoryReceiver.build(tmp_path)
    assert rcv.stored(oid) == DATA
    assert rcv.offset(oid) == SIZE
    head = rcv.head(oid)
    rcv.verify_receipt(head.header("Artifact-Receipt"), oid, DATA)


# -- sidecars written by the previous version ---------------------------------------------------


def todays_sidecar(oid: str, size: int, checksum: str) -> bytes:
    """A sidecar byte for byte as canner before the durable offset wrote it (``Offset`` 0
    whatever is stored)."""
    doc = {
        "ID": oid,
        "Size": size,
        "SizeIsDeferred": False,
        "Offset": 0,
        "MetaData": {"project": "example", "checksum": checksum, "filename": "a.warc.gz"},
        "IsPartial": False,
        "IsFinal": False,
        "PartialUploads": None,
        "CreatedAt": 1784764000,
    }
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def test_an_upload_in_flight_from_the_previous_version_keeps_every_stored_byte(
    tmp_path: Path,
) -> None:
    """uploads/ as the previous version leaves it mid-upload (data file with bytes, sidecar
    with ``Offset: 0``): after the upgrade nothing is cut, HEAD answers the stored length, and
    the worker's resume ends in the right receipt."""
    oid = "0123456789abcdef0123456789abcdef"
    (tmp_path / "uploads").mkdir()
    (tmp_path / "receipts").mkdir()
    (tmp_path / "uploads" / oid).write_bytes(DATA[:FIRST])
    (tmp_path / "uploads" / f"{oid}.info").write_bytes(todays_sidecar(oid, SIZE, blake3_hex(DATA)))
    rcv = InMemoryReceiver.build(tmp_path)
    assert rcv.stored(oid) == DATA[:FIRST], "bytes of an upgraded upload were cut"
    assert rcv.offset(oid) == FIRST
    assert rcv.intake.promises.total == SIZE - FIRST
    done = rcv.patch(oid, FIRST, DATA[FIRST:])
    assert done.status == 204, done.body
    doc = rcv.verify_receipt(done.header("Artifact-Receipt"), oid, DATA)
    assert doc["issuer"] == ISSUER


def test_a_receiver_killed_and_started_in_the_same_boot_keeps_every_stored_byte(
    tmp_path: Path,
) -> None:
    """A kill (no power cut: the page cache kept the bytes) of a receiver whose PATCH streamed
    past the durable offset: started again in the same boot it cuts nothing, HEAD answers every
    byte stored, and the worker resumes from there to the right receipt; after a reboot the same
    files are cut back."""
    assert current_boot_id() is not None, "this kernel names its boot"
    rcv = InMemoryReceiver.build(tmp_path)
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:FIRST]).status == 204
    streamed = FIRST + 50_000
    with open(rcv.uploads_dir / oid, "r+b") as f:  # what the killed PATCH had written
        f.seek(FIRST)
        f.write(DATA[FIRST:streamed])
    for connection in rcv.connections:
        connection.close()
    rcv = InMemoryReceiver.build(tmp_path)
    assert durable_offset(rcv, oid) == FIRST
    assert rcv.offset(oid) == streamed, "a kill within one boot cost the worker stored bytes"
    done = rcv.patch(oid, streamed, DATA[streamed:])
    assert done.status == 204, done.body
    rcv.verify_receipt(done.header("Artifact-Receipt"), oid, DATA)


def test_a_start_after_a_reboot_cuts_and_records_the_boot(tmp_path: Path) -> None:
    """With no record of a boot (a data directory from before it existed, or a lost record) or
    another boot's, the start cuts; it then records its own boot, so a second start in this boot
    cuts nothing it has not cut already."""
    rcv = InMemoryReceiver.build(tmp_path)
    record = tmp_path / BOOT_RECORD
    assert record.read_text().strip() == current_boot_id()
    oid = rcv.new_upload(DATA)
    assert rcv.patch(oid, 0, DATA[:FIRST]).status == 204
    for connection in rcv.connections:
        connection.close()
    with open(rcv.uploads_dir / oid, "r+b") as f:
        f.seek(FIRST)
        f.write(b"\0" * 1000)
    record.unlink()
    rcv = InMemoryReceiver.build(tmp_path)
    assert rcv.offset(oid) == FIRST, "a start without a record of its boot kept undurable bytes"
    assert record.read_text().strip() == current_boot_id()
