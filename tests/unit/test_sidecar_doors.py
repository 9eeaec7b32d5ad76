"""Sidecars written before canner recorded each upload's door: a data directory laid out by
the code of 667451d (tus, PUT, rsync and adopt-go uploads, in flight and complete) is read with
nothing lost, each upload as the door it was then inferred to be, and treated as it was.

The sidecars are built by :func:`legacy_sidecar`, the JSON that 667451d's ``UploadInfo.to_json``
wrote (key order and separators included; checked byte for byte against that code when this
test was written), with the metadata each door of that code recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from canner.checksum import parse_checksum
from canner.doors.rsync.adoption import Claim
from canner.go_canner.adopt import _sidecar as adopt_sidecar
from canner.go_canner.plan import IN_FLIGHT, Step
from canner.ids import ObjectIds
from canner.store.promises import promised_on_disk
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import UploadDoor, UploadStore, parse_info
from tests.unit.receiver_harness import InMemoryReceiver, blake3_hex, metadata_header
from tests.unit.test_rsync import Node

CREATED = 1_700_000_000
IDS = ObjectIds()


def legacy_sidecar(oid: str, size: int, metadata: dict[str, str], **extra: Any) -> bytes:
    """The sidecar 667451d wrote: ``offset`` with ``durable=True`` for a tus upload's durable
    offset (``OffsetIsDurable``), ``Rejected`` and ``Untrusted`` when given."""
    doc: dict[str, Any] = {
        "ID": oid,
        "Size": size,
        "SizeIsDeferred": False,
        "Offset": extra.get("offset", 0),
        "MetaData": metadata,
        "IsPartial": False,
        "IsFinal": False,
        "PartialUploads": None,
        "CreatedAt": CREATED,
    }
    for key in ("Rejected", "Untrusted"):
        if key in extra:
            doc[key] = extra[key]
    if extra.get("durable"):
        doc["OffsetIsDurable"] = True
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


# What each door of 667451d put in MetaData, and the door that upload is read as now.
TUS_DATA, PUT_DATA, RSYNC_DATA, GO_DATA = b"0123456789", b"putdata", b"rsync", b"ABCDEFGHIJ"
TUS_META = {"project": "example", "checksum": blake3_hex(TUS_DATA), "filename": "a.warc.gz"}
PUT_META = {
    "project": "example",
    "downloader": "alice",
    "filename": "b.warc.gz",
    "content-md5": "00" * 16,
}
RSYNC_META = {
    "project": "example",
    "filename": "c.warc.gz",
    "checksum": blake3_hex(RSYNC_DATA),
    "downloader": "alice",
    "door": "rsync",
}
RSYNC_BARE_META = {k: v for k, v in RSYNC_META.items() if k != "downloader"}
# adopt-go's _sidecar: project, checksum (when Go had one), filename.
GO_META = {"project": "example", "checksum": blake3_hex(GO_DATA), "filename": "d.warc.gz"}
GO_BARE_META = {"project": "example", "filename": "d.warc.gz"}

OID = "ab" * 16
LEGACY: dict[str, tuple[bytes, UploadDoor]] = {
    "tus created": (legacy_sidecar(OID, 10, TUS_META, durable=True), UploadDoor.TUS),
    "tus checkpointed": (legacy_sidecar(OID, 10, TUS_META, offset=4, durable=True), UploadDoor.TUS),
    "tus rejected": (
        legacy_sidecar(OID, 10, TUS_META, offset=10, durable=True, Rejected="checksum mismatch"),
        UploadDoor.TUS,
    ),
    "tus untrusted": (
        legacy_sidecar(OID, 10, TUS_META, durable=True, Untrusted="fsync failed: EIO"),
        UploadDoor.TUS,
    ),
    "tus before durable offsets": (legacy_sidecar(OID, 10, TUS_META), UploadDoor.TUS),
    "put": (legacy_sidecar(OID, 7, PUT_META), UploadDoor.PUT),
    "put without a digest": (
        legacy_sidecar(OID, 7, {k: v for k, v in PUT_META.items() if k != "content-md5"}),
        UploadDoor.PUT,
    ),
    "rsync": (legacy_sidecar(OID, 5, RSYNC_META), UploadDoor.RSYNC),
    "rsync without a downloader": (legacy_sidecar(OID, 5, RSYNC_BARE_META), UploadDoor.RSYNC),
    # adopt-go wrote tus sidecars: read as tus, as they were (or as a PUT without a checksum).
    "go-adopted": (legacy_sidecar(OID, 10, GO_META), UploadDoor.TUS),
    "go-adopted without a checksum": (legacy_sidecar(OID, 10, GO_BARE_META), UploadDoor.PUT),
}


@pytest.mark.parametrize("name", list(LEGACY))
def test_a_sidecar_from_before_the_door_reads_as_its_inferred_door(name: str) -> None:
    """Every field is read as before, the metadata whole (rsync's ``door`` key too); the door
    is the one the checksum (or rsync's key) implied, and so is ``whole_file``; written again,
    the sidecar is the old one plus ``Door``, and reads back the same."""
    data, door = LEGACY[name]
    old = json.loads(data)
    info = parse_info(OID, data)
    assert info.door is door
    assert info.whole_file == ("checksum" not in old["MetaData"])  # the inference of 667451d
    assert dict(info.metadata) == old["MetaData"]
    assert (info.size, info.created_at, info.rejected, info.untrusted) == (
        old["Size"],
        old["CreatedAt"],
        old.get("Rejected"),
        old.get("Untrusted"),
    )
    assert info.durable == (old["Offset"] if old.get("OffsetIsDurable") else None)
    rewritten = json.loads(info.to_json())
    assert rewritten.pop("Door") == door.value
    assert rewritten == old
    assert parse_info(OID, info.to_json()) == info


def test_a_sidecar_names_its_door_and_a_client_cannot() -> None:
    """New sidecars carry ``Door``; a tus client's ``door`` metadata key is only metadata."""
    info = parse_info(OID, legacy_sidecar(OID, 10, {**TUS_META, "door": "put"}, durable=True))
    assert info.door is UploadDoor.TUS and info.metadata["door"] == "put"
    doc = json.loads(info.to_json())
    assert doc["Door"] == "tus" and doc["MetaData"]["door"] == "put"


def test_an_unknown_door_is_an_unreadable_sidecar() -> None:
    doc = json.loads(legacy_sidecar(OID, 10, TUS_META))
    doc["Door"] = "carrier-pigeon"
    with pytest.raises(Exception, match="unreadable"):
        parse_info(OID, json.dumps(doc).encode())


def test_every_door_records_itself_at_creation(tmp_path: Path) -> None:
    """tus and PUT through the receiver, rsync's claim, adopt-go's sidecar."""
    rcv = InMemoryReceiver.build(tmp_path)
    tus = rcv.new_upload(TUS_DATA[:4] + b"x" * 6)
    put = rcv.exchange("PUT", "/seesaw/example/alice/b.warc.gz", body=PUT_DATA)
    assert put.status == 201, put.body
    put_id = json.loads(put.body)["object_id"]
    uploads = UploadStore(rcv.uploads_dir)
    doors = {oid: json.loads(uploads.info_path(oid).read_bytes())["Door"] for oid in (tus, put_id)}
    assert doors == {tus: "tus", put_id: "put"}
    claim = Claim(OID, "example", "alice", "c.warc.gz")
    rsync_sidecar = json.loads(claim.upload_info(5, blake3_hex(RSYNC_DATA), CREATED).to_json())
    assert rsync_sidecar["Door"] == "rsync"
    step = Step(OID, IN_FLIGHT, "", project="example", checksum=blake3_hex(GO_DATA), size_bytes=10)
    assert json.loads(adopt_sidecar(step, CREATED))["Door"] == "go-adopted"


# -- a data directory from before, at the receiver's start ---------------------------------------


def lay_out(data_dir: Path) -> dict[str, str]:
    """uploads/ and receipts/ as 667451d left them: uploads in flight of every door, and
    complete ones with their receipts; their ids by name."""
    uploads, receipts = data_dir / "uploads", data_dir / "receipts"
    uploads.mkdir(parents=True)
    receipts.mkdir()
    store = ReceiptStore(receipts)
    ids: dict[str, str] = {}

    def upload(name: str, size: int, meta: dict[str, str], stored: bytes, **extra: Any) -> str:
        oid = ids[name] = IDS.new()
        (uploads / oid).write_bytes(stored)
        (uploads / f"{oid}.info").write_bytes(legacy_sidecar(oid, size, meta, **extra))
        return oid

    def accepted(name: str, meta: dict[str, str], data: bytes) -> None:
        oid = upload(name, len(data), meta, data, offset=len(data), durable="checksum" in meta)
        origin = Origin(meta["project"], meta.get("filename"), meta.get("downloader"))
        store.record_origin(oid, origin)
        digest = parse_checksum(blake3_hex(data))
        store.commit(Receipt(oid, "https://canner.test", digest, len(data), CREATED))

    # In flight (a tus upload at its durable offset: the first start after a reboot cuts there).
    upload("tus", 10, TUS_META, TUS_DATA[:4], offset=4, durable=True)
    upload("tus before durable offsets", 10, TUS_META, TUS_DATA[:3])
    upload("put", 7, PUT_META, PUT_DATA[:3])
    upload("go-adopted", 10, GO_META, GO_DATA[:4])
    # Complete, with their receipts.
    accepted("tus done", TUS_META, TUS_DATA)
    accepted("put done", PUT_META, PUT_DATA)
    accepted("rsync done", RSYNC_META, RSYNC_DATA)
    accepted("go-adopted done", GO_META, GO_DATA)
    return ids


def test_a_data_directory_from_before_starts_as_it_did(tmp_path: Path) -> None:
    """At the start the unreceipted PUT goes (a whole file is never resumed) and every other
    upload stays, promised; tus and adopt-go uploads resume through HEAD and PATCH to a receipt,
    their metadata echoed unchanged; complete ones answer with their receipts."""
    data_dir = tmp_path / "data"
    ids = lay_out(data_dir)
    rcv = InMemoryReceiver.build(data_dir)
    gone = {ids["put"], f"{ids['put']}.info"}
    kept = {oid for name, oid in ids.items() if name != "put"}
    assert gone.isdisjoint(rcv.upload_entries()) and kept <= rcv.upload_entries()
    uploads, receipts = UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")
    promised = dict(promised_on_disk(uploads, receipts, IDS))
    assert promised == {
        ids["tus"]: (10, 4),
        ids["tus before durable offsets"]: (10, 3),
        ids["go-adopted"]: (10, 4),
    }
    for name, data, meta, offset in (
        ("tus", TUS_DATA, TUS_META, 4),
        ("tus before durable offsets", TUS_DATA, TUS_META, 3),
        ("go-adopted", GO_DATA, GO_META, 4),
    ):
        oid = ids[name]
        head = rcv.head(oid)
        assert head.status == 200 and head.header("Upload-Offset") == str(offset), name
        assert head.header("Upload-Metadata") == metadata_header(meta.items()), name
        done = rcv.patch(oid, offset, data[offset:])
        assert done.status == 204, (name, done.status, done.body)
        rcv.verify_receipt(done.header("Artifact-Receipt"), oid, data)
        info = uploads.read_info(oid)  # completing rewrites no sidecar: still the old one
        assert info is not None and info.door is UploadDoor.TUS, name
    for name, door in (
        ("tus done", UploadDoor.TUS),
        ("put done", UploadDoor.PUT),
        ("rsync done", UploadDoor.RSYNC),
        ("go-adopted done", UploadDoor.TUS),
    ):
        oid = ids[name]
        assert rcv.get_receipt(oid).status == 200, name
        done_info = uploads.read_info(oid)
        assert done_info is not None and done_info.door is door, name
        assert done_info.size == os.path.getsize(uploads.data_path(oid)), name


def test_an_rsync_upload_a_crash_left_staged_is_finished_as_rsync(tmp_path: Path) -> None:
    """A claim whose upload 667451d's rsync door had staged (its sidecar with ``door`` in the
    metadata) is accepted as that door's, with its origin, and the claim goes."""
    node = Node(tmp_path)
    claim = Claim(IDS.new(), "example", "alice", "c.warc.gz")
    node.area.claim_path(claim.object_id).write_bytes(claim.to_json())
    (node.data / "uploads" / claim.object_id).write_bytes(RSYNC_DATA)
    sidecar = legacy_sidecar(claim.object_id, len(RSYNC_DATA), RSYNC_META)
    node.uploads.info_path(claim.object_id).write_bytes(sidecar)
    info = node.uploads.read_info(claim.object_id)
    assert info is not None and info.door is UploadDoor.RSYNC and not info.whole_file
    node.round()
    ((oid, (receipt, origin)),) = node.objects().items()
    assert oid == claim.object_id and str(receipt.checksum) == blake3_hex(RSYNC_DATA)
    assert origin == Origin("example", "c.warc.gz", "alice")
    assert [r.object_id for r, _ in node.enqueued] == [oid]
    assert node.leftovers() == []
