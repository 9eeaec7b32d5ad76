"""Removal of abandoned uploads and of temp files orphaned by a crash.

An incomplete upload (or one rejected for its checksum) whose files have not changed for
``partial_upload_retention`` is removed (data and sidecar), under its lock, so an upload being
written is never touched.  A complete upload without a receipt stays: it can still be accepted.
Anything with a receipt is left alone: purging accepted payloads is the deliver process's job.
One bad entry is reported and skipped; it never stops the sweep.  Blocking; run it in a thread.
"""

from __future__ import annotations

import os

from attrs import define, field
from twisted.logger import Logger

from canner import fs
from canner.ids import ObjectIds
from canner.journal import Journal
from canner.receipts import ReceiptStore
from canner.tus.store import CorruptInfo, UploadInfo, UploadStore

log = Logger()


@define
class SweepReport:
    removed: list[str] = field(factory=list)
    temps_removed: int = 0
    skipped_corrupt: list[str] = field(factory=list)


def _upload_ids(uploads: UploadStore, ids: ObjectIds) -> set[str]:
    found = set()
    with os.scandir(uploads.directory) as entries:
        for entry in entries:
            name = entry.name.removesuffix(".info")
            if ids.is_valid(name):
                found.add(name)
    return found


def sweep_stale(
    uploads: UploadStore,
    receipts: ReceiptStore,
    journal: Journal,
    ids: ObjectIds,
    now: float,
    retention: float,
) -> SweepReport:
    """Remove uploads idle for longer than ``retention`` seconds that have no receipt, and temp
    files a crash left in ``uploads/``, ``receipts/`` and ``journal/`` (release segments)."""
    report = SweepReport()
    for upload_id in sorted(_upload_ids(uploads, ids)):
        if now - uploads.idle_since(upload_id) <= retention:
            continue
        if receipts.receipt_path(upload_id).exists():
            continue
        try:
            info = uploads.read_info(upload_id)
        except CorruptInfo as e:
            log.error("skipping {object_id} in the sweep: {error}", object_id=upload_id, error=e)
            report.skipped_corrupt.append(upload_id)
            continue
        if info is None:  # data without a sidecar: a crash between the two creates
            info = UploadInfo(upload_id, 1, {}, 0)
        elif info.rejected is None and uploads.offset(upload_id) >= info.size:
            # Complete but not (yet) accepted, e.g. a crash during acceptance: a HEAD or PATCH
            # from the worker still turns it into a receipt, so it is never swept.
            continue
        try:
            locked = uploads.open_locked(info)
        except fs.Locked:
            continue
        try:
            # Re-check under the lock: an acceptance may have committed meanwhile.
            if not receipts.receipt_path(upload_id).exists():
                uploads.remove(upload_id)
                report.removed.append(upload_id)
        finally:
            locked.close()
    for directory in (uploads.directory, receipts.directory, journal.directory):
        if not directory.exists():
            continue
        for temp in list(fs.orphaned_temps(directory, now)):
            temp.unlink(missing_ok=True)
            report.temps_removed += 1
    return report
