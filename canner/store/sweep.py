"""Removal of abandoned uploads and of temp files orphaned by a crash.

An incomplete upload (or one rejected for its checksum) whose files have not changed for
``partial_upload_retention`` is removed (data and sidecar), under its lock, so an upload being
written is never touched.  A complete tus upload without a receipt stays: it can still be
accepted; a complete whole-file upload (``PUT /seesaw/...``) cannot, and goes like an incomplete
one.  At the receiver's start every whole-file upload without a receipt goes at once
(:func:`remove_whole_files`): none can be in flight then, and none is ever resumed.
An upload without a receipt whose sidecar is unreadable is removed at once: a sidecar is only
ever replaced whole (by rename), so that is a creation a power cut caught before it was durable
(or a damaged disk), never a write in progress, and the intake already answers 404 for it, so
nobody can write or accept it.  Anything with a receipt is left alone: purging accepted payloads
is the deliver process's job.  :func:`sweep_stale` is blocking; :class:`StaleSweep` is the
receiver's periodic job that runs it in a thread and reports what went.
"""

from __future__ import annotations

import os
from pathlib import Path

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner import fs
from canner.blocking import BlockingRunner
from canner.ids import ObjectIds
from canner.observe import UploadObserver
from canner.store.journal import Journal
from canner.store.promises import Promises, open_uploads
from canner.store.receipts import ReceiptStore
from canner.store.uploads import CorruptInfo, UploadGone, UploadInfo, UploadStore

log = Logger()


@define
class SweepReport:
    removed: list[str] = field(factory=list)
    temps_removed: int = 0
    # Of ``removed``: uploads whose sidecar could not be read.
    unreadable: list[str] = field(factory=list)


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
    adopting: Path | None = None,
) -> SweepReport:
    """Remove uploads idle for longer than ``retention`` seconds that have no receipt, and temp
    files a crash left in ``uploads/``, ``receipts/``, ``journal/`` (release segments) and
    ``adopting`` (the rsync adoption area: a claim's temp file).  A temp file goes once it is
    older than :data:`~canner.fs.TEMP_ORPHAN_AGE` (one being written lives for milliseconds);
    claims and claimed files are never touched: the rsync intake finishes them."""
    report = SweepReport()
    for upload_id in sorted(_upload_ids(uploads, ids)):
        if receipts.receipt_path(upload_id).exists():
            continue
        unreadable = None
        try:
            info = uploads.read_info(upload_id)
        except CorruptInfo as e:
            unreadable = str(e)
        else:
            if now - uploads.idle_since(upload_id) <= retention:
                continue
            if (
                info is not None
                and info.rejected is None
                and not info.whole_file
                and uploads.offset(upload_id) >= info.size
            ):
                # Complete but not (yet) accepted, e.g. a crash during acceptance: a HEAD or
                # PATCH from the worker still turns it into a receipt, so it is never swept.
                # A whole-file upload (PUT /seesaw/...) has no such worker: it sends the file
                # again, so its stale copy goes like any other.
                continue
        if not _remove_unlocked(uploads, receipts, upload_id):
            continue
        report.removed.append(upload_id)
        if unreadable is not None:
            log.warn(
                "removed {object_id}, which has no receipt and an unreadable sidecar (a creation"
                " a power cut caught, or a damaged disk): {error} ({path})",
                object_id=upload_id,
                error=unreadable,
                path=str(uploads.info_path(upload_id)),
            )
            report.unreadable.append(upload_id)
    directories = [uploads.directory, receipts.directory, journal.directory]
    if adopting is not None:
        directories.append(adopting)
    for directory in directories:
        if not directory.exists():
            continue
        for temp in list(fs.orphaned_temps(directory, now)):
            temp.unlink(missing_ok=True)
            report.temps_removed += 1
    return report


def remove_whole_files(uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds) -> list[str]:
    """Remove every whole-file upload (``PUT /seesaw/...``) without a receipt found in
    ``uploads/`` at the receiver's start, complete or not (blocking); the ids removed.

    Its request ended with the process that served it, and a whole file is never resumed or
    accepted after its request: the worker, which had no receipt, sends the file again.  That
    holds for a complete one too (a crash between its last byte and its receipt): accepting it
    now would make an object its worker never learns of, from bytes nothing declared a digest
    for and a power cut may have left as zeros.  Only ``receiver.lock`` lets this run at start:
    no other receiver can be writing one of them.  One rejected for a declared digest stays for
    the sweep (its bytes are gone already); files that cannot be removed stay for it too, and
    the promises rebuilt from disk owe them nothing
    (:func:`canner.store.promises.promised_on_disk`).
    """
    removed = []
    for upload_id, info in open_uploads(uploads, receipts, ids):
        if info is None or not info.whole_file:
            continue
        offset = uploads.offset(upload_id)
        try:
            gone = _remove_unlocked(uploads, receipts, upload_id)
        except OSError as e:
            log.warn(
                "{object_id} stays for the sweep: {error}",
                object_id=upload_id,
                error=e.strerror or str(e),
            )
            continue
        if gone:
            removed.append(upload_id)
            log.info(
                "removed {object_id}, a whole-file upload a stop left at {offset} of {size} bytes"
                " without a receipt: its worker sends it again",
                object_id=upload_id,
                offset=offset,
                size=info.size,
                project=info.project,
            )
    return removed


def _remove_unlocked(uploads: UploadStore, receipts: ReceiptStore, upload_id: str) -> bool:
    """Remove an upload's files under its lock, unless someone writes it or it got a receipt
    meanwhile; True when removed."""
    try:
        # The lock is on the data file; the sidecar's content does not matter for it.
        locked = uploads.open_locked(UploadInfo(upload_id, 1, {}, 0))
    except fs.Locked:
        return False
    except UploadGone:
        # A sidecar without data (a crash between the two unlinks of a removal): nobody can
        # write it, since only creation makes a data file.
        locked = None
    try:
        # Re-check under the lock: an acceptance may have committed meanwhile.
        if receipts.receipt_path(upload_id).exists():
            return False
        uploads.remove(upload_id)
        # The origin record an acceptance that never committed may have left.
        receipts.forget_origin(upload_id)
        return True
    finally:
        if locked is not None:
            locked.close()


@define(eq=False, kw_only=True)
class StaleSweep:
    """The receiver's sweep of uploads idle for longer than ``retention`` seconds: runs
    :func:`sweep_stale` on ``run`` and counts and logs the uploads it removed."""

    _uploads: UploadStore
    _receipts: ReceiptStore
    _journal: Journal
    _ids: ObjectIds
    _retention: float
    _run: BlockingRunner
    _clock: IReactorTime
    _observer: UploadObserver
    # The receiver's promises: an upload swept is owed nothing more.
    _promises: Promises | None = None
    # The rsync adoption area, whose temp files are swept too (it may outlive an [rsync] door).
    _adopting: Path | None = None

    @property
    def interval(self) -> float:
        """Seconds between sweeps: a quarter of the retention, within [1 s, 1 min]."""
        return max(1.0, min(60.0, self._retention / 4))

    def sweep(self) -> Deferred[None]:
        d = self._run(
            sweep_stale,
            self._uploads,
            self._receipts,
            self._journal,
            self._ids,
            self._clock.seconds(),
            self._retention,
            self._adopting,
        )
        return d.addCallback(self._report)

    def _report(self, report: SweepReport) -> None:
        if self._promises is not None:
            self._promises.release_all(report.removed)
        if report.removed:
            self._observer.stale_removed(len(report.removed))
            log.info("removed {count} stale uploads", count=len(report.removed), ids=report.removed)
