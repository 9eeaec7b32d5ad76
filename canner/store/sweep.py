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
is the deliver process's job.  :func:`sweep_stale` (a full pass) and :func:`sweep_watched` (the
uploads the receiver knows to be in flight) are blocking; :class:`StaleSweep` is the receiver's
periodic job that runs them in a thread and reports what went.

What a tick costs follows the uploads in flight, not what is at rest: ``uploads/`` also holds
every accepted payload waiting for delivery, a million on a busy node.  A tick looks only at the
uploads the receiver knows of (:func:`sweep_watched`): those start-up found without a receipt,
and every one admitted or held since (:meth:`Promises.take_admitted`), each dropped once it has
its receipt or its files are gone, and each looked at only once it could be stale: one seen last
changed at ``t`` is looked at again from ``t`` plus the retention (:class:`StaleSweep`), so a tick
costs the uploads admitted since the last one and those whose time came.  An upload found idle
(its mtimes) has its sidecar read; one not yet idle costs three stats.  What only a listing
finds (a temp file a crash of canner-deliver left in ``receipts/``, an rsync adoption's rejected
upload, files put there by hand) waits for the full pass (:func:`sweep_stale`, names only,
:func:`canner.store.promises.unreceipted`), which runs once an hour with its I/O paced
(:data:`PACE_PAUSE` every :data:`~canner.store.promises.PACE_ENTRIES` entries) so that uploads
keep their latency; a temp file is an hour old before it goes (:data:`~canner.fs.TEMP_ORPHAN_AGE`),
so it goes within two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
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
from canner.store.promises import PACE_ENTRIES, Promises, no_pace, open_uploads, unreceipted
from canner.store.receipts import ReceiptStore
from canner.store.uploads import CorruptInfo, UploadGone, UploadInfo, UploadStore

log = Logger()


# The full pass runs this often (seconds); a tick between two looks only at uploads in flight.
FULL_PASS_EVERY = 3600.0
# The full pass sleeps this long (seconds) every PACE_ENTRIES entries it lists or reads: at a
# million objects its two listings take some 900 pauses, about ten seconds spread over a second's
# work, so the reactor and the disk serve uploads in between.
PACE_PAUSE = 0.01


@define
class SweepReport:
    removed: list[str] = field(factory=list)
    temps_removed: int = 0
    # Of ``removed``: uploads whose sidecar could not be read.
    unreadable: list[str] = field(factory=list)
    # The uploads without a receipt that are still there (or still promised): the next tick's.
    left: set[str] = field(factory=set)
    # Of ``left``, when each was seen to have last changed (its newest mtime): none can be
    # stale before that plus the retention, which is when the receiver's sweep looks again.
    idle_since: dict[str, float] = field(factory=dict)


def sweep_stale(
    uploads: UploadStore,
    receipts: ReceiptStore,
    journal: Journal,
    ids: ObjectIds,
    now: float,
    retention: float,
    adopting: Path | None = None,
    pace: Callable[[], None] = no_pace,
) -> SweepReport:
    """Remove uploads idle for longer than ``retention`` seconds that have no receipt, and temp
    files a crash left in ``uploads/``, ``receipts/``, ``journal/`` (release segments) and
    ``adopting`` (the rsync adoption area: a claim's temp file).  A temp file goes once it is
    older than :data:`~canner.fs.TEMP_ORPHAN_AGE` (one being written lives for milliseconds);
    claims and claimed files are never touched: the rsync intake finishes them.

    The full pass: every upload without a receipt, found by name
    (:func:`~canner.store.promises.unreceipted`: no stat or read of the payloads waiting for
    delivery), has its sidecar read; ``pace`` is called every
    :data:`~canner.store.promises.PACE_ENTRIES` entries listed or uploads looked at."""
    found = unreceipted(uploads, receipts, ids, pace)
    report = _sweep_uploads(uploads, receipts, sorted(found.ids), now, retention, True, pace)
    report.temps_removed = _remove_orphaned_temps(found.temps, journal, adopting, now)
    return report


def _remove_orphaned_temps(
    temps: Iterable[Path], journal: Journal, adopting: Path | None, now: float
) -> int:
    """Remove ``temps`` and the temp files in ``journal/`` and ``adopting`` that are older than
    :data:`~canner.fs.TEMP_ORPHAN_AGE`; how many went."""
    found = list(temps)
    for directory in [journal.directory] + ([adopting] if adopting is not None else []):
        if directory.exists():
            found += fs.orphaned_temps(directory, now)
    removed = 0
    for temp in found:
        try:
            if now - temp.stat().st_mtime <= fs.TEMP_ORPHAN_AGE:
                continue
        except FileNotFoundError:
            continue
        temp.unlink(missing_ok=True)
        removed += 1
    return removed


def first_watched_tick(
    uploads: UploadStore,
    receipts: ReceiptStore,
    journal: Journal,
    upload_ids: Iterable[str],
    promised: Callable[[str], bool],
    now: float,
    retention: float,
    adopting: Path | None,
    unreadable: Iterable[str] | None = None,
) -> SweepReport:
    """The first tick after start-up, whose listing was the first full pass: :func:`sweep_watched`
    reading the sidecars start-up could not read (``unreadable``; None: not known, every
    sidecar is read), so that those go at once, plus the orphaned temp files of ``journal/`` and
    ``adopting`` (small directories: a claim a crash cut is finished at once, as before the pass
    became hourly).  Temp files in ``uploads/`` and ``receipts/`` wait for the hourly pass
    (listing those is what start-up's pass spared)."""
    if unreadable is None:
        report = sweep_watched(uploads, receipts, upload_ids, promised, now, retention, True)
    else:
        damaged = set(unreadable)
        rest = [upload_id for upload_id in upload_ids if upload_id not in damaged]
        report = sweep_watched(uploads, receipts, rest, promised, now, retention)
        read = sweep_watched(uploads, receipts, damaged, promised, now, retention, True)
        report.removed += read.removed
        report.unreadable += read.unreadable
        report.left |= read.left
        report.idle_since.update(read.idle_since)
    report.temps_removed = _remove_orphaned_temps((), journal, adopting, now)
    return report


def sweep_watched(
    uploads: UploadStore,
    receipts: ReceiptStore,
    upload_ids: Iterable[str],
    promised: Callable[[str], bool],
    now: float,
    retention: float,
    read_all: bool = False,
) -> SweepReport:
    """A tick between two full passes: of ``upload_ids`` (the uploads the receiver knows to be
    in flight), remove what :func:`sweep_stale` would remove, blocking, reading only the
    sidecars of those idle for longer than ``retention`` (all of them with ``read_all``: the
    first tick after start-up, so that an unreadable sidecar start-up found goes at once).

    An id with a receipt is dropped, as is one whose files are both gone unless it is
    ``promised`` (admitted, its files not created yet); every other one stays in
    :attr:`SweepReport.left`.  Temp files wait for the full pass."""
    return _sweep_uploads(
        uploads, receipts, sorted(upload_ids), now, retention, read_all, None, promised
    )


def _sweep_uploads(
    uploads: UploadStore,
    receipts: ReceiptStore,
    upload_ids: list[str],
    now: float,
    retention: float,
    read_all: bool,
    pace: Callable[[], None] | None,
    promised: Callable[[str], bool] | None = None,
) -> SweepReport:
    report = SweepReport()
    for count, upload_id in enumerate(upload_ids, 1):
        if pace is not None and count % PACE_ENTRIES == 0:
            pace()
        if receipts.has_receipt(upload_id):
            continue
        idle = uploads.idle_since(upload_id)
        if promised is not None and idle == 0.0 and not uploads.present(upload_id):
            if promised(upload_id):
                report.left.add(upload_id)
            continue
        if (read_all or now - idle > retention) and _sweep_one(
            uploads, receipts, upload_id, now, idle, retention, report
        ):
            continue
        report.left.add(upload_id)
        report.idle_since[upload_id] = idle
    return report


def _sweep_one(
    uploads: UploadStore,
    receipts: ReceiptStore,
    upload_id: str,
    now: float,
    idle: float,
    retention: float,
    report: SweepReport,
) -> bool:
    """Remove ``upload_id`` (no receipt when looked at; idle since ``idle``) if it is stale or
    its sidecar unreadable; True when it went."""
    unreadable = None
    try:
        info = uploads.read_info(upload_id)
    except CorruptInfo as e:
        unreadable = str(e)
    else:
        if now - idle <= retention:
            return False
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
            return False
    if not _remove_unlocked(uploads, receipts, upload_id):
        return False
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
    return True


def remove_whole_files(
    uploads: UploadStore,
    receipts: ReceiptStore,
    ids: ObjectIds,
    found: Iterable[tuple[str, UploadInfo | None]] | None = None,
) -> list[str]:
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
    (:func:`canner.store.promises.promised_on_disk`).  ``found``: what
    :func:`~canner.store.promises.open_uploads` yields, read already by the caller (start-up's
    one pass); None reads it now.
    """
    if found is None:
        found = open_uploads(uploads, receipts, ids)
    removed = []
    for upload_id, info in found:
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


def paced(pause: float = PACE_PAUSE) -> None:
    """The full pass's ``pace`` in the daemon: a sleep of its thread (blocking)."""
    time.sleep(pause)


@define(eq=False, kw_only=True)
class StaleSweep:
    """The receiver's sweep of uploads idle for longer than ``retention`` seconds: runs
    :func:`sweep_watched` on ``run`` every tick and :func:`sweep_stale` (paced) every
    :data:`FULL_PASS_EVERY`, and counts and logs the uploads they removed.

    ``watched``: the uploads without a receipt start-up found
    (:class:`~canner.store.promises.Unreceipted`), which makes start-up's pass the first full
    one; without it the first tick is a full pass.  Without ``promises`` every tick is one.

    A tick looks at what changed: the uploads admitted or held since the last one, and those
    whose time has come, an upload seen last changed at ``t`` being looked at again only from
    ``t + retention`` (no upload can become stale sooner: a write only makes it younger), so a
    tick over ten thousand uploads in flight that were written in the last hours reads
    nothing.  One kept though due (complete and awaiting acceptance, or locked) is looked at
    every tick, as one not found yet (admitted, its files not created)."""

    _uploads: UploadStore
    _receipts: ReceiptStore
    _journal: Journal
    _ids: ObjectIds
    _retention: float
    _run: BlockingRunner
    _clock: IReactorTime
    _observer: UploadObserver
    # The receiver's promises: an upload swept is owed nothing more, and one admitted is watched.
    _promises: Promises | None = None
    # The rsync adoption area, whose temp files are swept too (it may outlive an [rsync] door).
    _adopting: Path | None = None
    _watched: Iterable[str] | None = None
    # Of ``watched``, the uploads whose sidecar start-up could not read (None: not known, and
    # the first tick reads every sidecar): the first tick reads only these.
    _unreadable: Iterable[str] | None = None
    # Every upload watched, and from when on it could be stale (set from _watched, then by
    # every report): the ticks' schedule.
    _due: dict[str, float] = field(factory=dict, init=False)
    _pace: Callable[[], None] = paced
    # When the last full pass ran (start-up's, when ``watched`` came from it); None: never.
    _full_at: float | None = field(default=None, init=False)
    _ticks: int = field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if self._promises is not None:
            self._promises.record_admissions()
        if self._watched is not None:
            self._due = dict.fromkeys(self._watched, 0.0)
            self._full_at = self._clock.seconds()

    @property
    def interval(self) -> float:
        """Seconds between sweeps: a quarter of the retention, within [1 s, 1 min]."""
        return max(1.0, min(60.0, self._retention / 4))

    def sweep(self) -> Deferred[None]:
        """One tick: a full pass when one is due, else the uploads in flight."""
        now = self._clock.seconds()
        self._ticks += 1
        promises = self._promises
        if promises is None or self._full_at is None or now - self._full_at >= FULL_PASS_EVERY:
            self._full_at = now
            if promises is not None:
                promises.take_admitted()  # the pass lists them all
            d = self._run(
                sweep_stale,
                self._uploads,
                self._receipts,
                self._journal,
                self._ids,
                now,
                self._retention,
                self._adopting,
                self._pace,
            )
            return d.addCallback(self._report)
        due = self._due
        watched = {upload_id for upload_id, at in due.items() if at <= now}
        watched.update(upload_id for upload_id in promises.take_admitted() if upload_id not in due)
        if self._ticks == 1:  # every upload start-up found is due (at 0.0)
            d = self._run(
                first_watched_tick,
                self._uploads,
                self._receipts,
                self._journal,
                watched,
                promises.holds,
                now,
                self._retention,
                self._adopting,
                self._unreadable,
            )
            self._unreadable = None
        else:
            d = self._run(
                sweep_watched,
                self._uploads,
                self._receipts,
                watched,
                promises.holds,
                now,
                self._retention,
            )
        return d.addCallback(self._report, watched)

    def _report(self, report: SweepReport, looked: set[str] | None = None) -> None:
        """Count and log what went; schedule what is left (``looked``: the ids the tick was
        given, None: a full pass, which was given every upload)."""
        retention, seen = self._retention, report.idle_since
        if looked is None:
            self._due = {}
        else:
            for upload_id in looked:
                self._due.pop(upload_id, None)
        for upload_id in report.left:
            self._due[upload_id] = seen.get(upload_id, 0.0) + retention
        if self._promises is not None:
            self._promises.release_all(report.removed)
        if report.removed:
            self._observer.stale_removed(len(report.removed))
            log.info("removed {count} stale uploads", count=len(report.removed), ids=report.removed)
