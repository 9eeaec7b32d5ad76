"""Space promised to uploads in flight: what the receiver has admitted and not yet received.

Every open upload (a tus upload with its ``Upload-Length``, a ``PUT /seesaw/...`` with its
``Content-Length``) is promised its declared size minus the bytes stored so far.  A creation is
admitted only while free space minus every promise, its own included, stays at or above
``min_free_bytes`` (:func:`overpromised`), so an upload admitted earlier never dies of ENOSPC
because others were admitted after it.  A promise ends when its upload is accepted or rejected,
when the request of a whole-file upload ends without a receipt (cut short, a failed write or
acceptance: it is never resumed), or when it is swept as abandoned; deferred-length tus uploads
do not exist here (the intake refuses them), so every upload has a size to promise.

:class:`Promises` is the receiver's live account, in memory and safe across threads;
:func:`promised_on_disk` rebuilds it from ``uploads/`` at start: every tus or rsync'd upload
without a receipt that is not rejected owes ``size - stored``.  A whole-file upload found at
start is dead (its request ended with the process before): the receiver removes it first
(:func:`canner.store.sweep.remove_whole_files`) and it owes nothing.  The survey (``canner
status``, the status page, the metrics) counts every upload without a receipt, whole files
included, since it cannot tell a PUT in flight from one a stop cut: the two agree while the
receiver runs, and a stopped receiver's dead PUTs are counted until it starts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from attrs import define, field, frozen
from twisted.logger import Logger

from canner.ids import ObjectIds
from canner.store.receipts import ReceiptStore
from canner.store.uploads import CorruptInfo, UploadInfo, UploadStore

log = Logger()


@frozen
class Overpromised:
    """Why a creation is refused: what it would have brought free space down to."""

    free_bytes: int
    promised_bytes: int
    uploads: int
    size: int
    floor: int

    def describe(self) -> str:
        return (
            f"{self.promised_bytes} bytes are promised to {self.uploads} uploads in flight and"
            f" {self.free_bytes} are free: {self.size} more would leave less than min_free_bytes"
            f" ({self.floor})"
        )


def overpromised(
    free: int, promised: int, uploads: int, size: int, floor: int
) -> Overpromised | None:
    """The refusal of a creation of ``size`` bytes (None: admitted): free space minus the bytes
    already promised and ``size`` must stay at or above ``floor``."""
    if free - promised - size >= floor:
        return None
    return Overpromised(free, promised, uploads, size, floor)


@define(eq=False)
class Promises:
    """The bytes promised to each open upload: ``upload_id -> (size, stored)``.

    Every method may be called from any thread (admission runs in the I/O pool, the count of
    stored bytes on the reactor)."""

    _open: dict[str, tuple[int, int]] = field(factory=dict)
    _lock: threading.Lock = field(factory=threading.Lock)

    @property
    def total(self) -> int:
        """Bytes promised to every open upload."""
        with self._lock:
            return sum(max(size - stored, 0) for size, stored in self._open.values())

    @property
    def uploads(self) -> int:
        """Uploads holding a promise (complete ones awaiting acceptance included)."""
        with self._lock:
            return len(self._open)

    def upload_ids(self) -> list[str]:
        """The uploads holding a promise, now (the survey's uploads in flight)."""
        with self._lock:
            return list(self._open)

    def admit(self, upload_id: str, size: int, free: int, floor: int) -> Overpromised | None:
        """Promise ``size`` bytes to a new upload unless that would overrun free space (the
        refusal is returned, and nothing is promised).  Check and promise are one step, so two
        creations at once cannot both take the last room."""
        with self._lock:
            promised = sum(max(s - stored, 0) for s, stored in self._open.values())
            refusal = overpromised(free, promised, len(self._open), size, floor)
            if refusal is None:
                self._open[upload_id] = (size, 0)
            return refusal

    def hold(self, upload_id: str, size: int, stored: int) -> None:
        """Promise (again) what an upload still lacks: an append admitted after a restart, a
        reset or an acceptance that failed.  Never refused: the upload was admitted before."""
        with self._lock:
            self._open[upload_id] = (size, stored)

    def stored(self, upload_id: str, offset: int) -> None:
        """The upload now has ``offset`` bytes stored (nothing when it holds no promise)."""
        with self._lock:
            entry = self._open.get(upload_id)
            if entry is not None:
                self._open[upload_id] = (entry[0], offset)

    def release(self, upload_id: str) -> None:
        """End the promise of an upload accepted, rejected, discarded or swept."""
        with self._lock:
            self._open.pop(upload_id, None)

    def release_all(self, upload_ids: Iterable[str]) -> None:
        with self._lock:
            for upload_id in upload_ids:
                self._open.pop(upload_id, None)

    @classmethod
    def from_disk(cls, uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds) -> Promises:
        """The promises of the uploads in ``uploads/`` (blocking; start-up)."""
        promises = cls(dict(promised_on_disk(uploads, receipts, ids)))
        if promises.uploads:
            log.info(
                "{promised_bytes} bytes promised to {count} uploads found in uploads/",
                promised_bytes=promises.total,
                count=promises.uploads,
            )
        return promises


def open_uploads(
    uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds
) -> Iterator[tuple[str, UploadInfo | None]]:
    """Every upload in ``uploads/`` without a receipt and not rejected, with its sidecar (None:
    unreadable), blocking: the uploads in flight, as the receiver and the survey both count
    them."""
    for upload_id, _mtime in uploads.entries():
        if not ids.is_valid(upload_id) or receipts.receipt_path(upload_id).exists():
            continue
        try:
            info = uploads.read_info(upload_id)
        except CorruptInfo:
            yield upload_id, None
            continue
        if info is not None and info.rejected is None:
            yield upload_id, info


def promised_on_disk(
    uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds
) -> Iterable[tuple[str, tuple[int, int]]]:
    """``(upload_id, (size, stored))`` of every upload that can still go on after a start
    (blocking).  An unreadable sidecar promises nothing (the sweep removes it), nor does a
    whole-file upload (its request is over); an upload marked untrusted has nothing stored that
    counts."""
    for upload_id, info in open_uploads(uploads, receipts, ids):
        if info is not None and not info.whole_file:
            stored = 0 if info.untrusted is not None else uploads.offset(upload_id)
            yield upload_id, (info.size, stored)
