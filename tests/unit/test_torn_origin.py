"""The origin record without an fsync of its own, as a power cut leaves it.

Acceptance writes ``receipts/{id}.meta.json`` in place and does not fsync it: its name is made
durable by the ``receipts/`` fsync that commits the receipt, its content by the kernel's
writeback.  A power cut within that window leaves the record empty or cut short beside a committed
receipt.  Each test builds those files as the disk would hold them and checks what every reader of
the record answers: the rescan (``canner rebuild-index``, canner-deliver's hourly pass), HQ's
object lookup, ``canner show``, the start-up cut; plus the layout today's code writes (records
published from an fsynced temp file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from twisted.internet.task import Clock

from canner import fs
from canner.accept.acceptance import Acceptance
from canner.blocking import run_inline
from canner.checksum import parse_checksum
from canner.delivery import index as sql
from canner.delivery.rescan import ReceiptRescan
from canner.hq.objects import ObjectReader
from canner.ids import ObjectIds
from canner.ledger.files import ArchivedIds, LedgerDir
from canner.ops.inventory import lookup_object
from canner.store.journal import Journal
from canner.store.receipts import Origin, Receipt, ReceiptStore, origin_journal_record
from canner.store.recovery import accepted_origin, cut_after_restart
from canner.store.uploads import UploadInfo, UploadStore
from tests.fakes import SyncIndex, succeeded

OID = "0123456789abcdef0123456789abcdef"
ISSUER = "https://canner.example"
DATA = b"the payload, 31 bytes long....."
ORIGIN = Origin("example", "a.warc.zst")
# What a power cut can leave of the record: nothing written back, or a part of it.
TORN = {"empty": b"", "short": ORIGIN.to_json(OID)[:20]}


class DataDir:
    """A receiver's data directory, with the acceptance that writes it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("uploads", "receipts"):
            (root / sub).mkdir()
        self.uploads = UploadStore(root / "uploads")
        self.receipts = ReceiptStore(root / "receipts")
        clock = Clock()
        clock.advance(1_784_764_800.0)
        self.acceptance = Acceptance(
            uploads=self.uploads,
            receipts=self.receipts,
            run=run_inline,
            hash=run_inline,
            clock=clock,
            issuer=ISSUER,
            enqueue=lambda receipt, origin: None,
        )

    def complete(self) -> UploadInfo:
        """An upload with every byte written, not yet accepted."""
        digest = blake3.blake3(DATA).hexdigest()
        metadata = {"project": "example", "filename": "a.warc.zst", "checksum": f"blake3:{digest}"}
        info = UploadInfo(OID, len(DATA), metadata, 1, durable=0)
        self.uploads.create(info)
        upload = self.uploads.open_locked(info)
        upload.write([DATA])
        upload.close()
        return info

    def accept(self) -> Receipt:
        info = self.uploads.read_info(OID)
        assert info is not None
        return succeeded(self.acceptance.accept(self.uploads.open_locked(info)))

    def tear(self, content: bytes) -> None:
        """The record as a power cut before its writeback leaves it."""
        self.receipts.origin_path(OID).write_bytes(content)

    def rebuild_index(self) -> dict[str, sql.ObjectRow]:
        """``canner rebuild-index`` over a fresh index: the rows it builds from the disk."""
        index = SyncIndex(self.root / "delivery.sqlite")
        try:
            rescan = ReceiptRescan(
                index=index,
                receipts=self.receipts,
                uploads=self.uploads,
                journal=Journal(self.root / "journal"),
                archived=lambda object_id: False,
                object_ids=ObjectIds(),
                run=run_inline,
                now=lambda: 1_784_765_000.0,
            )
            succeeded(rescan.run())
            rows: list[sql.ObjectRow] = succeeded(index.run(lambda cur: list(sql.all_rows(cur))))
        finally:
            index.close()
        return {row.object_id: row for row in rows}

    def hq_lookup(self) -> dict[str, object]:
        """HQ's ``GET /api/v1/objects/{id}`` of an object the index does not hold yet."""
        SyncIndex(self.root / "delivery.sqlite").close()  # an index without its row
        reader = ObjectReader(
            self.root, ObjectIds(), ISSUER, ArchivedIds(LedgerDir(self.root / "ledger"))
        )
        doc = reader.lookup(OID)
        assert doc is not None
        return doc


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DataDir]:
    yield DataDir(tmp_path)


def test_acceptance_writes_a_whole_record_without_an_fsync_of_its_own(
    disk: DataDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record holds the origin, no temp file is left, and of everything acceptance fsyncs
    only the receipt's content is in receipts/ (the record's name rides on the directory's)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    disk.complete()
    monkeypatch.setattr(os, "fsync", fsync)
    receipt = disk.accept()
    assert disk.receipts.read_origin(OID) == ORIGIN
    assert json.loads(disk.receipts.origin_path(OID).read_bytes()) == {
        "object_id": OID,
        "project": "example",
        "filename": "a.warc.zst",
    }
    assert sorted(p.name for p in disk.receipts.directory.iterdir()) == [
        f"{OID}.json",
        f"{OID}.meta.json",
    ]
    in_receipts = [os.path.basename(p) for p in synced if "/receipts" in p]
    assert len(in_receipts) == 2 and in_receipts[1] == "receipts"
    assert in_receipts[0].startswith(fs.TEMP_PREFIX + f"{OID}.json-")
    assert disk.receipts.read(OID) == receipt


@pytest.mark.parametrize("torn", TORN)
def test_a_torn_record_beside_a_committed_receipt_is_read_from_the_sidecar(
    disk: DataDir, torn: str
) -> None:
    """Every reader takes the origin from the upload's sidecar (fsynced before the record was
    begun); the rebuilt index has the object's project and filename, and the rescan rewrites
    the record whole."""
    disk.complete()
    receipt = disk.accept()
    disk.tear(TORN[torn])

    assert disk.receipts.read_origin(OID) is None and disk.receipts.origin_torn(OID)
    assert accepted_origin(disk.receipts, disk.uploads, OID) == ORIGIN
    doc = disk.hq_lookup()
    assert json.dumps(doc).count('"example"') >= 1 and "a.warc.zst" in json.dumps(doc)
    shown = lookup_object(disk.root, OID)
    assert shown["origin"] == {"object_id": OID, "project": "example", "filename": "a.warc.zst"}
    assert any("torn" in problem for problem in shown["problems"])

    rows = disk.rebuild_index()
    row = rows[OID]
    assert (row.project, row.filename, row.size_bytes) == ("example", "a.warc.zst", len(DATA))
    assert disk.receipts.read_origin(OID) == ORIGIN, "the rescan rewrote it"
    assert not disk.receipts.origin_torn(OID)
    assert lookup_object(disk.root, OID)["problems"] == []
    assert disk.receipts.read(OID) == receipt


@pytest.mark.parametrize("torn", TORN)
def test_a_torn_record_of_a_purged_payload_is_read_from_the_journal(
    disk: DataDir, torn: str
) -> None:
    """A purge journals the origin (from the object's index row) durably before it removes the
    payload and its sidecar, then unlinks the record without fsyncing receipts/: a power cut
    may bring the record back, torn.  The rebuilt index takes the journal's origin, and
    ``canner show`` names the record it cannot read."""
    disk.complete()
    disk.accept()
    Journal(disk.root / "journal").append([origin_journal_record(OID, ORIGIN)])
    disk.uploads.remove(OID)
    disk.tear(TORN[torn])

    assert accepted_origin(disk.receipts, disk.uploads, OID) is None
    row = disk.rebuild_index()[OID]
    assert (row.project, row.filename) == ("example", "a.warc.zst")
    shown = lookup_object(disk.root, OID)
    assert shown["origin"] is None
    assert any(str(disk.receipts.origin_path(OID)) in p for p in shown["problems"])


def test_a_torn_record_before_the_receipt_is_replaced_by_the_next_acceptance(
    disk: DataDir,
) -> None:
    """A kill between the record's creation and its write (or a power cut that made its name
    durable through another upload's receipts/ fsync) leaves an empty record and no receipt;
    the next acceptance replaces it and commits."""
    disk.complete()
    disk.tear(b"")
    receipt = disk.accept()
    assert disk.receipts.read_origin(OID) == ORIGIN
    assert disk.receipts.read(OID) == receipt


def test_a_whole_record_is_never_overwritten(disk: DataDir) -> None:
    """Written once: a later write (another acceptance of the same id) keeps the first."""
    disk.receipts.write_origin(OID, ORIGIN)
    disk.receipts.write_origin(OID, Origin("other", None))
    disk.receipts.record_origin(OID, Origin("other", None))
    assert disk.receipts.read_origin(OID) == ORIGIN


def test_the_start_up_cut_keeps_a_complete_upload_whose_record_is_empty(disk: DataDir) -> None:
    """The record's name appears only after acceptance fsynced the data, so after a power cut
    its name alone says the whole length is durable, whatever its content: the cut keeps every
    byte, and the acceptance that HEAD or the final PATCH resumes commits it."""
    disk.complete()
    disk.tear(b"")
    info = disk.uploads.read_info(OID)
    assert info is not None and info.durable == 0, "without the record, the cut would go to 0"
    cut = cut_after_restart(disk.uploads, disk.receipts, ObjectIds(), disk.root, "another-boot")
    assert cut == 0
    assert disk.uploads.offset(OID) == len(DATA)
    disk.accept()
    assert disk.receipts.read_origin(OID) == ORIGIN


def test_records_in_the_layout_today_s_code_writes_are_read_unchanged(disk: DataDir) -> None:
    """Records published from an fsynced temp file (today's code), with and without a
    downloader, read as they were through every reader, and are never rewritten."""
    other = "fedcba9876543210fedcba9876543210"
    checksum = parse_checksum("blake3:" + blake3.blake3(DATA).hexdigest())
    for object_id, origin in ((OID, ORIGIN), (other, Origin("example", "b.warc", "alice"))):
        name, record = f"{object_id}.meta.json", origin.to_json(object_id)
        fs.publish_once(disk.receipts.directory, name, record)
        disk.receipts.commit(Receipt(object_id, ISSUER, checksum, len(DATA), 1))
    fs.fsync_dir(disk.receipts.directory)
    before = {p.name: p.read_bytes() for p in disk.receipts.directory.iterdir()}

    assert disk.receipts.read_origin(other) == Origin("example", "b.warc", "alice")
    assert accepted_origin(disk.receipts, disk.uploads, OID) == ORIGIN
    shown = lookup_object(disk.root, other)
    assert shown["origin"] == {
        "object_id": other,
        "project": "example",
        "filename": "b.warc",
        "downloader": "alice",
    }
    assert shown["problems"] == []
    rows = disk.rebuild_index()
    assert (rows[other].project, rows[other].filename, rows[other].downloader) == (
        "example",
        "b.warc",
        "alice",
    )
    assert (rows[OID].project, rows[OID].filename) == ("example", "a.warc.zst")
    assert {p.name: p.read_bytes() for p in disk.receipts.directory.iterdir()} == before


@pytest.mark.parametrize("torn", TORN)
def test_a_tus_head_of_an_accepted_upload_with_a_torn_record_names_its_project(
    tmp_path: Path, torn: str
) -> None:
    """A worker resuming after a power cut asks HEAD of an upload it finished: the answer is the
    whole upload with its receipt and the metadata it sent (project, filename), read from the
    sidecar in place of the torn record."""
    from tests.unit.receiver_harness import InMemoryReceiver, metadata_header

    rcv = InMemoryReceiver.build(tmp_path)
    data = b"a finished upload, its record torn"
    oid = rcv.new_upload(data, filename="a.warc.zst")
    done = rcv.patch(oid, 0, data)
    assert done.status == 204
    ReceiptStore(tmp_path / "receipts").origin_path(oid).write_bytes(TORN[torn])
    head = rcv.head(oid)
    assert head.status == 200 and head.header("Upload-Offset") == str(len(data))
    checksum = f"blake3:{blake3.blake3(data).hexdigest()}"
    expected = {"checksum": checksum, "project": "example", "filename": "a.warc.zst"}
    sent = dict(pair.split(" ") for pair in (head.header("Upload-Metadata") or "").split(","))
    assert sent == dict(pair.split(" ") for pair in metadata_header(expected.items()).split(","))
