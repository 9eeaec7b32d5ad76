"""The delivery-status view of an object, for HQ: ``GET /api/v1/objects/{id}``, the batch, and
the objects of an origin (project, file name, downloader: "where is item X?").

Three independent facts, each its own part of the answer and never merged: ``delivery`` (state,
attempts, where it went, when it was delivered and verified), ``payload`` (present, or when it
was purged) and ``hq`` (when HQ released the receipt).  An archived object (its record moved to
a verified ledger and its local state deleted) answers ``archived`` with the ledger file and line.

:class:`ObjectReader` reads ``delivery.sqlite`` through read-only connections of its own (one per
thread, never a daemon's writer connection), the receipt file and the payload's presence.  It
blocks: call it through the blocking runner.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attrs import define, field

from canner.delivery.index import (
    BUSY_TIMEOUT_MS,
    ORIGIN_MATCHES_MAX,
    UNKNOWN_PROJECT,
    ids_by_origin,
)
from canner.ids import ObjectIds
from canner.ledger.files import ArchivedIds
from canner.packaging.batches import object_package
from canner.store.receipts import Origin, ReceiptStore
from canner.store.recovery import accepted_origin
from canner.store.uploads import UploadStore

MAX_QUERY = 1000

_COLUMNS = (
    "object_id",
    "project",
    "filename",
    "size_bytes",
    "checksum",
    "accepted_at",
    "state",
    "attempts",
    "remote_identifier",
    "remote_name",
    "delivered_at",
    "verified_at",
    "purged_at",
    "released_at",
    "batch_id",
    "downloader",
)
_SELECT = "SELECT " + ", ".join(_COLUMNS) + " FROM object_delivery WHERE object_id = ?"


class IndexUnavailable(Exception):
    """``delivery.sqlite`` cannot be read (missing, locked past the busy timeout, damaged)."""


def describe(
    row: dict[str, Any],
    receipt: dict[str, Any] | None,
    issuer: str,
    present: bool,
    package: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The status document of an indexed object (pure); ``package`` is where a packed object
    went (``packaging.batches.object_package``)."""
    oid = row["object_id"]
    if receipt is None:
        # The receipt file is the truth; this is only for an index row whose file is unreadable.
        receipt = {
            "id": f"receipt:{oid}",
            "issuer": issuer,
            "object_id": oid,
            "checksum": row["checksum"],
            "size_bytes": row["size_bytes"],
            "accepted_at": row["accepted_at"],
        }
    verified = row["state"] == "delivered" and row["verified_at"] is not None
    packed = package or {}
    if package is not None and package["purged_at"] is None and package["sealed_at"] is not None:
        present = True  # the sealed package is the local copy of record
    return {
        **receipt,
        # Nobody recorded one (an adopted Go receipt): null, as for a receipt not indexed yet.
        "project": None if row["project"] == UNKNOWN_PROJECT else row["project"],
        "filename": row["filename"],
        "downloader": row["downloader"],
        "delivery": {
            "state": row["state"],
            "verified": verified,
            "attempts": row["attempts"],
            "identifier": row["remote_identifier"] or packed.get("identifier"),
            "remote_name": row["remote_name"] or packed.get("remote_name"),
            # Megawarc projects: the package and the byte offset in its file; identity: null.
            "package_id": packed.get("package"),
            "package_offset": packed.get("offset"),
            "delivered_at": row["delivered_at"],
            "verified_at": row["verified_at"],
        },
        "payload": {"present": present, "purged_at": row["purged_at"]},
        "hq": {"released_at": row["released_at"]},
        "archived": None,
    }


@define
class ObjectReader:
    """Status documents for object ids (blocking; thread-safe: a connection per thread)."""

    data_dir: Path
    ids: ObjectIds
    issuer: str
    archived: ArchivedIds
    _local: threading.local = field(factory=threading.local)

    def _cursor(self) -> sqlite3.Cursor:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            path = self.data_dir / "delivery.sqlite"
            if not path.exists():
                raise IndexUnavailable(f"{path} does not exist")
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._local.conn = conn
        return conn.cursor()

    def lookup(self, object_id: str) -> dict[str, Any] | None:
        """The status document of ``object_id``, or None when this node knows nothing of it."""
        return self.lookup_many([object_id])[0]

    def lookup_many(self, object_ids: Sequence[str]) -> list[dict[str, Any] | None]:
        """One status document (or None) per id, in order.  Raises :class:`IndexUnavailable`."""
        receipts = ReceiptStore(self.data_dir / "receipts")
        uploads = self.data_dir / "uploads"
        results: list[dict[str, Any] | None] = []
        try:
            cur = self._cursor()
            for oid in object_ids:
                if not self.ids.is_valid(oid):
                    results.append(None)
                    continue
                cur.execute(_SELECT, (oid,))
                found = cur.fetchone()
                if found is None:
                    # A verified ledger owns the record even while its receipt file still
                    # waits for deletion; otherwise an accepted object not indexed yet.
                    results.append(self._archived(oid) or self._not_indexed(receipts, oid))
                    continue
                data = receipts.read_bytes(oid)
                row = dict(zip(_COLUMNS, found, strict=True))
                receipt = json.loads(data) if data is not None else None
                # Only a megawarc member has a batch: the package lookup is for those alone.
                package = object_package(cur, oid) if row["batch_id"] is not None else None
                results.append(
                    describe(row, receipt, self.issuer, (uploads / oid).exists(), package)
                )
        except sqlite3.Error as e:
            self._local.conn = None
            raise IndexUnavailable(str(e)) from None
        return results

    def by_origin(
        self, project: str, filename: str, downloader: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Status documents of the indexed objects of ``project`` named ``filename`` (of
        ``downloader`` only, when given), oldest accepted first: at most
        :data:`~canner.delivery.index.ORIGIN_MATCHES_MAX`, and whether more exist.

        An index search (``objects_origin``), never a scan.  Objects whose records were archived
        to a ledger have no row any more and are not found.  Raises :class:`IndexUnavailable`.
        """
        try:
            found = ids_by_origin(
                self._cursor(),
                project,
                filename,
                downloader,
                downloader is None,
                ORIGIN_MATCHES_MAX + 1,
            )
        except sqlite3.Error as e:
            self._local.conn = None
            raise IndexUnavailable(str(e)) from None
        docs = [d for d in self.lookup_many(found[:ORIGIN_MATCHES_MAX]) if d is not None]
        return docs, len(found) > ORIGIN_MATCHES_MAX

    def origin(self, object_id: str) -> Origin | None:
        """Project, filename and downloader of an indexed object (the tus HEAD of a purged
        upload needs them); None when the index lacks the object or cannot be read."""
        try:
            cur = self._cursor()
            cur.execute(
                "SELECT project, filename, downloader FROM objects WHERE object_id = ?",
                (object_id,),
            )
            found = cur.fetchone()
        except (sqlite3.Error, IndexUnavailable):
            self._local.conn = None
            return None
        return None if found is None else Origin(*found)

    def _not_indexed(self, receipts: ReceiptStore, object_id: str) -> dict[str, Any] | None:
        """An accepted object the index does not hold yet (its insert is best effort and the
        deliver rescan adds it): pending, from its receipt and side files."""
        receipt = receipts.read(object_id)
        if receipt is None:
            return None
        # The sidecar stands in for an origin record a power cut tore (canner.store.recovery).
        origin = accepted_origin(receipts, UploadStore(self.data_dir / "uploads"), object_id)
        row = {
            "object_id": object_id,
            "project": origin.project if origin else None,
            "filename": origin.filename if origin else None,
            "downloader": origin.downloader if origin else None,
            "state": "pending",
            "attempts": 0,
            "remote_identifier": None,
            "remote_name": None,
            "delivered_at": None,
            "verified_at": None,
            "purged_at": None,
            # Only an indexed, verified object can be released: one the index lacks is either
            # new, or waiting for the rescan that brings its release back from the journal.
            "released_at": None,
        }
        present = (self.data_dir / "uploads" / object_id).exists()
        return describe(row, json.loads(receipt.to_json()), self.issuer, present)

    def _archived(self, object_id: str) -> dict[str, Any] | None:
        where = self.archived.find(object_id)
        if where is None:
            return None
        return {
            "id": f"receipt:{object_id}",
            "object_id": object_id,
            "delivery": None,
            "payload": None,
            "hq": {"released_at": where.released_at},
            "archived": where.as_dict(),
        }
