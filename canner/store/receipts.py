"""Receipts: the immutable promise handed to the worker, and where it lives on disk.

The value half is pure: :class:`Receipt` is SavewebHQ's six-field ``ArtifactReceipt`` and
:meth:`Receipt.to_json` its exact wire form.  :class:`ReceiptStore` owns ``receipts/``:
``{id}.json`` is the receipt (its existence is the acceptance commit point) and ``{id}.meta.json``
records the project and filename, so the delivery index can be rebuilt from this directory alone.
Before a delivered payload is purged, its origin and a delivery record (where it went) join the
facts journal (:mod:`canner.store.journal`) and ``{id}.meta.json`` goes, so a lost index is rebuilt
with that object delivered, and an archived object leaves one file behind for the ledger to
delete; data directories of version 0.1 hold the delivery record in ``{id}.delivery.json``,
which is still read.  All store methods block; call them through a blocking runner.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attrs import Factory, field, frozen

from canner import fs
from canner.checksum import Checksum, parse_checksum

_RECEIPT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_FIELDS = ("id", "issuer", "object_id", "checksum", "size_bytes", "accepted_at")


@frozen
class Receipt:
    """An ``ArtifactReceipt``: the six fields, in HQ's order."""

    object_id: str
    issuer: str
    checksum: Checksum
    size_bytes: int
    accepted_at: int

    @property
    def receipt_id(self) -> str:
        return f"receipt:{self.object_id}"

    def to_json(self) -> bytes:
        """The compact JSON served to workers; identical bytes for identical receipts."""
        return json.dumps(
            {
                "id": self.receipt_id,
                "issuer": self.issuer,
                "object_id": self.object_id,
                "checksum": str(self.checksum),
                "size_bytes": self.size_bytes,
                "accepted_at": self.accepted_at,
            },
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode("utf-8")

    def header_value(self) -> str:
        """The ``Artifact-Receipt`` header: the JSON as unpadded base64url."""
        return base64.urlsafe_b64encode(self.to_json()).rstrip(b"=").decode("ascii")


def parse_receipt(data: bytes) -> Receipt:
    """Parse and validate receipt JSON against HQ's limits; ``ValueError`` when it is not one."""
    raw = json.loads(data)
    if not isinstance(raw, dict) or tuple(raw) != _FIELDS:
        raise ValueError("a receipt has exactly the fields " + ", ".join(_FIELDS))
    size, accepted = raw["size_bytes"], raw["accepted_at"]
    for value in (size, accepted):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("size_bytes and accepted_at are integers >= 1")
    issuer, object_id = raw["issuer"], raw["object_id"]
    if not isinstance(issuer, str) or not issuer or len(issuer.encode()) > 512:
        raise ValueError("issuer is 1-512 bytes")
    if not isinstance(object_id, str) or raw["id"] != f"receipt:{object_id}":
        raise ValueError("id must be receipt:<object_id>")
    if not _RECEIPT_ID.fullmatch(raw["id"]):
        raise ValueError("id is at most 128 characters of [A-Za-z0-9._:-]")
    return Receipt(object_id, issuer, parse_checksum(raw["checksum"]), size, accepted)


@frozen
class Origin:
    """What the worker declared besides the checksum: kept next to the receipt for rebuilds.

    ``downloader`` names the worker (an Archive Team nickname) when the intake door knows it
    (``PUT /seesaw/<project>/<downloader>/<filename>``); None for tus uploads.  Its JSON form
    carries the key only when set, so records of objects without one stay byte for byte what
    they were, and records written before it existed read as None.
    """

    project: str
    filename: str | None
    downloader: str | None = None

    def fields(self) -> dict[str, str | None]:
        """``project``, ``filename`` and, when set, ``downloader`` (the records' shared part)."""
        found: dict[str, str | None] = {"project": self.project, "filename": self.filename}
        if self.downloader is not None:
            found["downloader"] = self.downloader
        return found

    def to_json(self, object_id: str) -> bytes:
        return json.dumps({"object_id": object_id, **self.fields()}, separators=(",", ":")).encode(
            "utf-8"
        )


@frozen
class DeliveryRecord:
    """Where and when an object was delivered and verified, recorded (in the facts journal)
    before its local payload is purged, so a rebuilt index still knows it was delivered."""

    identifier: str
    remote_name: str
    content_md5: str
    delivered_at: float
    verified_at: float
    purge_after: float
    # None once a rebuild found the payload still on disk (a crash between the record and the
    # unlink): the purge then runs again.
    purged_at: float | None


_DELIVERY_FIELDS = (
    "identifier",
    "remote_name",
    "content_md5",
    "delivered_at",
    "verified_at",
    "purge_after",
    "purged_at",
)


def parse_delivery(data: bytes) -> DeliveryRecord:
    return _delivery(json.loads(data))


def _delivery(raw: Any) -> DeliveryRecord:
    return DeliveryRecord(*(raw[k] for k in _DELIVERY_FIELDS))


DELIVERY = "delivery"


def delivery_journal_record(object_id: str, record: DeliveryRecord) -> dict[str, Any]:
    """The facts journal's copy of a delivery record (:mod:`canner.store.journal`)."""
    return {
        "kind": DELIVERY,
        "object_id": object_id,
        **{k: getattr(record, k) for k in _DELIVERY_FIELDS},
    }


def delivery_of(record: dict[str, Any] | None) -> DeliveryRecord | None:
    """The delivery record a journal record holds (None for none); ``KeyError`` if malformed."""
    return None if record is None else _delivery(record)


ORIGIN = "origin"


def origin_journal_record(object_id: str, origin: Origin) -> dict[str, Any]:
    """The facts journal's copy of an origin record, written before the payload is purged."""
    return {"kind": ORIGIN, "object_id": object_id, **origin.fields()}


def origin_of(record: dict[str, Any] | None) -> Origin | None:
    """The origin a journal record holds (None for none); ``ValueError`` if malformed."""
    return None if record is None else _origin(record)


def parse_origin(data: bytes) -> Origin:
    return _origin(json.loads(data))


def _whole_origin(object_id: str, data: bytes) -> Origin | None:
    """The origin an origin record's bytes hold; None when they are not a whole record of
    ``object_id`` (every record is one JSON object naming its object, so a record cut short,
    emptied or filled with another file's old blocks never parses as one)."""
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("object_id", object_id) != object_id:
            return None
        return _origin(raw)
    except (ValueError, KeyError, TypeError):
        return None


def _origin(raw: Any) -> Origin:
    project, filename, downloader = raw["project"], raw.get("filename"), raw.get("downloader")
    if not isinstance(project, str) or not all(
        v is None or isinstance(v, str) for v in (filename, downloader)
    ):
        raise ValueError(
            "origin record needs a string project, an optional filename and downloader"
        )
    return Origin(project, filename, downloader)


@frozen
class ReceiptStore:
    """``receipts/`` in the data directory."""

    directory: Path
    # Acceptances of this process share their fsyncs of receipts/ (group commit).
    _directory_sync: fs.GroupFsync = field(
        init=False,
        eq=False,
        repr=False,
        default=Factory(lambda self: fs.GroupFsync(self.directory), takes_self=True),
    )

    def sync_directory(self) -> None:
        """fsync ``receipts/`` (the commit point of every receipt published before the call),
        sharing the fsync with concurrent callers (:class:`fs.GroupFsync`); ``OSError``."""
        self._directory_sync.sync()

    def receipt_path(self, object_id: str) -> Path:
        return self.directory / f"{object_id}.json"

    def has_receipt(self, object_id: str) -> bool:
        """Whether ``object_id`` has a receipt: :meth:`receipt_path` exists (one stat, without
        the cost of a ``Path``: the sweep asks it of every upload in flight at each tick)."""
        return os.path.exists(os.path.join(self.directory, object_id + ".json"))

    def origin_path(self, object_id: str) -> Path:
        return self.directory / f"{object_id}.meta.json"

    def read_bytes(self, object_id: str) -> bytes | None:
        """The stored receipt bytes, or None when there is no receipt."""
        try:
            return self.receipt_path(object_id).read_bytes()
        except FileNotFoundError:
            return None

    def read(self, object_id: str) -> Receipt | None:
        data = self.read_bytes(object_id)
        return None if data is None else parse_receipt(data)

    def read_origin(self, object_id: str) -> Origin | None:
        """The origin record; None when there is none *or when it is torn*: empty, cut short or
        not this object's (what a power cut leaves of a record :meth:`write_origin` wrote less
        than a writeback ago).  A reader that needs the origin then reads the upload's sidecar
        (:func:`canner.store.recovery.accepted_origin`), durable before the record was begun,
        or, once the payload was purged, the facts journal."""
        try:
            data = self.origin_path(object_id).read_bytes()
        except FileNotFoundError:
            return None
        return _whole_origin(object_id, data)

    def origin_torn(self, object_id: str) -> bool:
        """Whether ``object_id`` has an origin record that reads as torn (:meth:`read_origin`)."""
        return self.origin_path(object_id).exists() and self.read_origin(object_id) is None

    def write_origin(self, object_id: str, origin: Origin) -> None:
        """Acceptance's origin record, written in place and not fsynced: its name is made durable
        by the ``receipts/`` fsync that commits the receipt, its content by the kernel's
        writeback.  A power cut within that window may leave it empty or short beside a
        committed receipt: readers take such a record as torn (:meth:`read_origin`), and the
        upload's sidecar, fsynced before this call, holds the same origin.  Call it only once the
        data is fsynced (its name then says so to start-up's cut, ``canner.store.recovery``).

        A whole record already there is kept (never overwritten); a torn one (a kill or a power
        cut during an earlier acceptance) is replaced."""
        path = self.origin_path(object_id)
        data = origin.to_json(object_id)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            if self.read_origin(object_id) is None:
                fs.replace_file(self.directory, path.name, data, sync=False)
            return
        try:
            fs.write_all(fd, data)
        finally:
            os.close(fd)

    def record_origin(self, object_id: str, origin: Origin) -> None:
        """Write the origin record with its content fsynced, unless a whole one exists (a torn one
        is replaced); fsync the directory before relying on it.  For records nothing else backs
        (adoption, the rescan's repair from a sidecar that a purge removes later)."""
        name = f"{object_id}.meta.json"
        if not self.origin_path(object_id).exists():
            fs.publish_once(self.directory, name, origin.to_json(object_id))
        elif self.read_origin(object_id) is None:
            fs.replace_file(self.directory, name, origin.to_json(object_id), sync=True)

    def delivery_path(self, object_id: str) -> Path:
        """A delivery record of a version 0.1 data directory (newer ones are in the journal)."""
        return self.directory / f"{object_id}.delivery.json"

    def read_delivery(self, object_id: str) -> DeliveryRecord | None:
        try:
            return parse_delivery(self.delivery_path(object_id).read_bytes())
        except FileNotFoundError:
            return None

    def package_path(self, object_id: str) -> Path:
        return self.directory / f"{object_id}.package.json"

    def record_package(self, object_id: str, record: dict[str, Any]) -> None:
        """Durably name the package holding the object (before its upload is purged); the
        first record stays (idempotent).  The caller fsyncs :attr:`directory` once for many."""
        if not self.package_path(object_id).exists():
            doc = {"object_id": object_id, **record}
            fs.publish_once(
                self.directory, f"{object_id}.package.json", json.dumps(doc).encode("utf-8")
            )

    def read_package(self, object_id: str) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(self.package_path(object_id).read_bytes())
        except FileNotFoundError:
            return None
        return doc

    def forget_origin(self, object_id: str) -> None:
        """Remove the origin record of an upload that will never have a receipt."""
        self.origin_path(object_id).unlink(missing_ok=True)

    def commit(self, receipt: Receipt) -> Receipt:
        """Publish ``receipt`` without overwriting anything.

        Returns the receipt now on disk: ``receipt`` itself, or the one an earlier acceptance
        published.  The caller must fsync :attr:`directory` before answering with it.
        """
        oid = receipt.object_id
        if fs.publish_once(self.directory, f"{oid}.json", receipt.to_json()):
            return receipt
        existing = self.read(oid)
        assert existing is not None, "a published receipt is never removed"
        return existing

    def unpublish(self, object_id: str) -> None:
        """Remove a receipt whose commit failed (its ``receipts/`` fsync did); best effort.

        Only the acceptance that published the receipt, before anyone could have been served
        it, may call this: readers in this process wait while an acceptance runs.
        """
        self.receipt_path(object_id).unlink(missing_ok=True)
        try:
            fs.fsync_dir(self.directory)
        except OSError:
            pass  # the name is gone from every reader's view; the next commit fsyncs again

    def object_ids(self) -> Iterator[str]:
        """Ids of every receipt on disk (in directory order)."""
        with os.scandir(self.directory) as entries:
            for entry in entries:
                name = entry.name
                stem = name.removesuffix(".json")
                if stem != name and "." not in stem and not name.startswith(fs.TEMP_PREFIX):
                    yield stem
