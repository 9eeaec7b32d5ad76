"""The survey's cheaper sources give what the walks before them gave (issue 37).

The uploads without a receipt come from two names-only listings (or, in a running receiver,
from its promises) instead of a look at each upload's receipt; ``canner show <prefix>`` looks
the prefix up as a range of the index's primary key instead of scanning every row.  Each is
checked here against the code it replaced (kept below as the reference, as it was on main) on
one data directory that holds every kind of entry.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from attrs import evolve

from canner.checksum import parse_checksum
from canner.delivery import index as sql
from canner.ids import ObjectIds
from canner.ops import inventory
from canner.ops.inventory import (
    ActiveUpload,
    InFlightScan,
    UnknownId,
    id_prefix,
    scan_uploads,
    take_survey,
)
from canner.store.promises import Promises, open_uploads
from canner.store.receipts import DeliveryRecord, Origin, Receipt, ReceiptStore
from canner.store.uploads import UploadDoor, UploadInfo, UploadStore

NOW = 1_784_764_800.0
IDS = ObjectIds("n1")
CHECKSUM = parse_checksum("blake3:" + "ab" * 32)


def oid(n: int, prefixed: bool = False) -> str:
    hex_part = f"{n:08x}" + "0" * 24
    return f"n1-{hex_part}" if prefixed else hex_part


# -- the reference: the code as it was before ------------------------------------------------


def old_scan_uploads(
    uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds, now: float
) -> tuple[list[ActiveUpload], int]:
    active, unreadable = [], 0
    for upload_id, info in open_uploads(uploads, receipts, ids):
        if info is None:
            unreadable += 1
            continue
        offset = uploads.offset(upload_id)
        idle = max(0.0, now - uploads.idle_since(upload_id))
        project = info.metadata.get("project", "")
        active.append(ActiveUpload(upload_id, project, offset, info.size, idle))
    active.sort(key=lambda u: (u.idle_s, u.upload_id))
    return active, unreadable


def old_resolve_id(data_dir: Path, ids: ObjectIds, text: str) -> str:
    if ids.is_valid(text):
        return text
    prefix = id_prefix(text)
    found: set[str] = set()
    path = data_dir / inventory.INDEX_NAME
    if path.exists():
        conn = inventory.open_read_only(path)
        try:
            rows = conn.execute(
                "SELECT object_id FROM objects WHERE substr(object_id, 1, ?) = ? LIMIT 10",
                (len(prefix), prefix),
            ).fetchall()
        finally:
            conn.close()
        found.update(row[0] for row in rows)
    for sub in ("receipts", "uploads"):
        try:
            names = os.listdir(data_dir / sub)
        except FileNotFoundError:
            continue
        for name in names:
            candidate = name.split(".", 1)[0]
            if candidate.startswith(prefix) and ids.is_valid(candidate):
                found.add(candidate)
    if not found:
        raise UnknownId(f"no object id starts with {prefix!r}")
    if len(found) > 1:
        shown = ", ".join(sorted(found)[:5])
        raise UnknownId(f"{prefix!r} is ambiguous: it starts {len(found)} object ids ({shown})")
    return found.pop()


# -- a data directory with every kind of entry ------------------------------------------------


def upload(
    uploads: UploadStore,
    upload_id: str,
    size: int,
    stored: int,
    door: UploadDoor = UploadDoor.TUS,
    mtime: float = NOW - 10,
) -> UploadInfo:
    meta = {"project": "example", "filename": "f.warc"}
    if door is UploadDoor.TUS:
        meta["checksum"] = str(CHECKSUM)
    info = UploadInfo(upload_id, size, meta, int(NOW) - 100, door=door)
    uploads.create(info)
    with open(uploads.data_path(upload_id), "r+b") as f:
        f.truncate(stored)
    for path in (uploads.data_path(upload_id), uploads.info_path(upload_id)):
        os.utime(path, (mtime, mtime))
    return info


def receipt(receipts: ReceiptStore, object_id: str, origin: bool = True) -> Receipt:
    r = Receipt(object_id, "https://canner.test", CHECKSUM, 10, int(NOW) - 50)
    receipts.commit(r)
    if origin:
        receipts.write_origin(object_id, Origin("example", "f.warc"))
    return r


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """Uploads in flight of every kind, accepted ones (payload waiting or purged), archived
    receipts, rejected and unreadable uploads, stray names, and index rows in every state."""
    data = tmp_path / "data"
    uploads, receipts = UploadStore(data / "uploads"), ReceiptStore(data / "receipts")
    uploads.directory.mkdir(parents=True)
    receipts.directory.mkdir()
    upload(uploads, oid(1), 100, 40, mtime=NOW - 30)  # partial
    upload(uploads, oid(2), 10, 10, mtime=NOW - 5)  # complete, awaiting acceptance
    upload(uploads, oid(3, prefixed=True), 100, 0, mtime=NOW - 30)  # a node's id, just created
    upload(uploads, oid(4), 50, 20, door=UploadDoor.PUT)  # a PUT (whole file)
    untrusted = upload(uploads, oid(5), 80, 30)
    (uploads.info_path(oid(5))).write_bytes(
        UploadInfo(
            oid(5), 80, dict(untrusted.metadata), untrusted.created_at, untrusted="EIO"
        ).to_json()
    )
    rejected = upload(uploads, oid(6), 10, 0)
    uploads.info_path(oid(6)).write_bytes(
        UploadInfo(
            oid(6), 10, dict(rejected.metadata), rejected.created_at, rejected="mismatch"
        ).to_json()
    )
    for n in (5, 6):
        os.utime(uploads.info_path(oid(n)), (NOW - 10, NOW - 10))
    uploads.info_path(oid(7)).write_text("not json")  # unreadable sidecar (no data file)
    uploads.data_path(oid(8)).write_bytes(b"x")  # a data file whose sidecar never came
    upload(uploads, oid(9), 30, 0)
    uploads.data_path(oid(9)).unlink()  # a sidecar without its data file
    (uploads.directory / "not-an-id.info").write_text("{}")
    (uploads.directory / f".tmp-{oid(10)}.info-abc").write_text("{}")
    (uploads.directory / f".tmp-{oid(11)}.info").write_text("{}")
    upload(uploads, oid(12), 40, 10)  # its origin record written, its receipt not yet
    receipts.write_origin(oid(12), Origin("example", "f.warc"))
    (receipts.directory / f".tmp-{oid(1)}.json").write_bytes(b"{}")  # a receipt not published
    accepted = []
    for n in range(20, 40):  # accepted, payload waiting for delivery
        upload(uploads, oid(n, prefixed=n % 2 == 0), 10, 10)
        accepted.append(receipt(receipts, oid(n, prefixed=n % 2 == 0)))
    for n in range(40, 60):  # delivered and purged: receipt and origin record only
        accepted.append(receipt(receipts, oid(n)))
    for n in range(60, 65):  # released and archived: the receipt is left for the ledger
        receipt(receipts, oid(n), origin=False)
    path = data / inventory.INDEX_NAME
    sql.upgrade_schema(path)
    conn = sqlite3.connect(path)
    # Rows whose receipt went (the ledger deletes an archived object's files, then its row).
    for n in (0x46, 0x4F):
        accepted.append(Receipt(oid(n), "https://canner.test", CHECKSUM, 10, int(NOW) - 50))
    purged = DeliveryRecord("item", "f.warc", "0" * 32, NOW - 900, NOW - 800, NOW - 100, NOW)
    objects = [
        sql.AcceptedObject.of(r, Origin("example", "f.warc"), purged if n >= 40 else None)
        for n, r in enumerate(accepted, start=20)
    ]
    sql.insert_objects(conn.cursor(), objects, NOW - 200)
    conn.execute(
        "UPDATE outbound SET state = 'retry_wait', needs_operator = 1, last_error = '403'"
        " WHERE kind = 'object' AND ref = ?",
        (oid(21),),
    )
    conn.commit()
    conn.close()
    return data


def stores(data_dir: Path) -> tuple[UploadStore, ReceiptStore]:
    return UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")


def test_the_listings_give_the_uploads_the_walk_gave(data_dir: Path) -> None:
    """The names-only set difference finds exactly the uploads without a receipt that the
    walk found, with the same offsets, sizes, idle times and unreadable count."""
    uploads, receipts = stores(data_dir)
    before = old_scan_uploads(uploads, receipts, IDS, NOW)
    assert scan_uploads(uploads, receipts, IDS, NOW) == before
    active, unreadable = before
    # Only these are read further: the uploads in flight, the rejected and the unreadable one.
    assert inventory.uploads_without_receipt(uploads, receipts, IDS) == {
        *(u.upload_id for u in active),
        oid(6),
        oid(7),
    }
    assert [u.upload_id for u in active] == [
        oid(2),
        oid(4),
        oid(5),
        oid(9),
        oid(12),
        oid(1),
        oid(3, prefixed=True),
    ]
    assert unreadable == 1


def test_the_survey_shows_what_it_showed(data_dir: Path) -> None:
    """``canner status --json`` (and the page, which shows the same survey) is unchanged."""
    uploads, receipts = stores(data_dir)
    survey = take_survey(data_dir, IDS, NOW)
    active, unreadable = old_scan_uploads(uploads, receipts, IDS, NOW)
    assert survey.active_uploads == tuple(active) and survey.unreadable_uploads == unreadable
    doc = inventory.survey_json(survey, 1)
    assert (doc["active_uploads"], doc["active_upload_bytes"], doc["awaiting_acceptance"]) == (
        7,
        40 + 10 + 20 + 30 + 10,
        1,
    )
    assert doc["promised_bytes"] == 60 + 0 + 100 + 30 + 50 + 30 + 30


def test_the_receivers_promises_give_the_same_uploads(data_dir: Path) -> None:
    """A receiver's surveys look only at the uploads it holds promises for: the same uploads,
    but for what a receiver removes or does not promise at start (a dead PUT, an unreadable
    sidecar, which the sweep removes)."""
    uploads, receipts = stores(data_dir)
    promises = Promises.from_disk(uploads, receipts, IDS)
    survey = take_survey(data_dir, IDS, NOW, in_flight=promises.upload_ids)
    walked, _ = old_scan_uploads(uploads, receipts, IDS, NOW)
    assert survey.active_uploads == tuple(u for u in walked if u.upload_id != oid(4))
    assert survey.unreadable_uploads == 0
    # An upload accepted since its promise was read is no longer in flight.
    receipt(receipts, oid(1))
    ids = promises.upload_ids()
    assert oid(1) in ids
    after = take_survey(data_dir, IDS, NOW, in_flight=lambda: ids)
    assert oid(1) not in {u.upload_id for u in after.active_uploads}


def test_a_receivers_survey_reads_only_the_uploads_whose_promise_changed(data_dir: Path) -> None:
    """Through an :class:`InFlightScan` the first survey shows what the promises' ids show;
    the next one reads only the uploads written, held or settled since (a sidecar damaged behind
    the receiver's back is not read again until the upload changes), and only the idle times
    of the others grow."""
    uploads, receipts = stores(data_dir)
    promises = Promises.from_disk(uploads, receipts, IDS)
    scan = InFlightScan(promises.versions)
    first = take_survey(data_dir, IDS, NOW, in_flight=scan)
    assert (
        first.active_uploads
        == take_survey(data_dir, IDS, NOW, in_flight=promises.upload_ids).active_uploads
    )
    uploads.info_path(oid(1)).write_text("not json")
    with open(uploads.data_path(oid(12)), "ab") as f:
        f.write(b"y" * 5)
    promises.stored(oid(12), 15)  # a write the receiver made
    promises.release(oid(9))

    later = take_survey(data_dir, IDS, NOW + 60, in_flight=scan)

    before = {u.upload_id: u for u in first.active_uploads}
    after = {u.upload_id: u for u in later.active_uploads}
    assert set(after) == set(before) - {oid(9)}
    assert after[oid(1)] == evolve(before[oid(1)], idle_s=before[oid(1)].idle_s + 60)
    assert after[oid(12)].offset == 15 and after[oid(12)].idle_s < 60
    assert later.unreadable_uploads == 0
    promises.stored(oid(1), 40)  # the upload changes: read again, and found unreadable
    again = take_survey(data_dir, IDS, NOW + 60, in_flight=scan)
    assert oid(1) not in {u.upload_id for u in again.active_uploads}
    assert again.unreadable_uploads == 1


@pytest.mark.parametrize(
    "text",
    [
        oid(1)[:8],  # an upload in flight, only in uploads/
        oid(45)[:8],  # delivered and purged: in the index and receipts/
        oid(61)[:6] + "3d",  # no such object
        oid(62)[:8],  # archived: only its receipt is left
        "n1-" + oid(20)[:8],  # a node's id
        "0000002",  # ambiguous: 20 to 2f
        "0000003f",  # its last character the highest hex digit
        "00000039",  # its last character a 9
        "n1-0",
        "zzzz",
        "00000046",  # in the index only
        "0000004f",  # in the index only, its last character the highest hex digit
        "0000004",  # ambiguous: in receipts/ and in the index only
        "000000",  # ambiguous: more than ten
    ],
)
def test_a_prefix_names_what_it_named(data_dir: Path, text: str) -> None:
    """``canner show <prefix>`` resolves every prefix as before, or refuses it in the same
    words."""

    def resolved(f: object) -> str:
        assert callable(f)
        try:
            return str(f(data_dir, IDS, text))
        except UnknownId as e:
            return f"UnknownId: {e}"

    assert resolved(inventory.resolve_id) == resolved(old_resolve_id)
