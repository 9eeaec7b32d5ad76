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

Which uploads have no receipt is found by name (:func:`unreceipted`): a listing of ``uploads/``
and a look for each name's receipt, a batch of names at a time, so its cost follows the number of
names, not the bytes or sidecars at rest, and it holds only what is left; only the uploads left
over have their sidecars read (:func:`sidecars_of`).  A node holding a million accepted payloads
reads ten thousand sidecars of uploads in flight, not a million.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

from attrs import define, field, frozen
from twisted.logger import Logger

from canner import fs
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
    stored bytes on the reactor).  The bytes promised are kept as a running total, equal after
    every change to the sum of what each open upload still owes (``max(size - stored, 0)``),
    so an admission costs the same with ten thousand uploads in flight as with one."""

    _open: dict[str, tuple[int, int]] = field(factory=dict)
    _lock: threading.Lock = field(factory=threading.Lock)
    # Ids admitted or held since the sweep last took them (None: nobody asked to record them,
    # e.g. a worker's stand-in, whose parent sweeps): how the sweep learns of new uploads
    # without listing uploads/ (canner.store.sweep).
    _admitted: set[str] | None = field(default=None)
    # The sum of _owed over _open, kept with every change to it (under _lock).
    _promised: int = field(init=False, default=0)
    # Of every entry of _open, the number of its last change (0: as found at start), counted
    # by _changes: what lets a survey re-read only the uploads that changed (versions).
    _changed: dict[str, int] = field(init=False, factory=dict)
    _changes: int = field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._promised = sum(_owed(entry) for entry in self._open.values())
        self._changed = dict.fromkeys(self._open, 0)

    def _put(self, upload_id: str, entry: tuple[int, int]) -> None:
        """Set the entry of ``upload_id`` and the running total with it (under the lock)."""
        old = self._open.get(upload_id)
        self._promised += _owed(entry) - (0 if old is None else _owed(old))
        self._open[upload_id] = entry
        self._changes += 1
        self._changed[upload_id] = self._changes

    def _drop(self, upload_id: str) -> None:
        """End the entry of ``upload_id``, if any, and its share of the total (under the lock)."""
        old = self._open.pop(upload_id, None)
        if old is not None:
            self._promised -= _owed(old)
            del self._changed[upload_id]

    @property
    def total(self) -> int:
        """Bytes promised to every open upload."""
        with self._lock:
            return self._promised

    @property
    def uploads(self) -> int:
        """Uploads holding a promise (complete ones awaiting acceptance included)."""
        with self._lock:
            return len(self._open)

    def upload_ids(self) -> list[str]:
        """The uploads holding a promise, now (the survey's uploads in flight)."""
        with self._lock:
            return list(self._open)

    def versions(self) -> dict[str, int]:
        """The uploads holding a promise, now, each with the number of its last change (the
        survey's uploads in flight, :class:`canner.ops.inventory.InFlightScan`): an upload
        whose number is the one a survey saw before has not been written, held or settled
        since, so its files are as that survey found them."""
        with self._lock:
            return dict(self._changed)

    def admit(self, upload_id: str, size: int, free: int, floor: int) -> Overpromised | None:
        """Promise ``size`` bytes to a new upload unless that would overrun free space (the
        refusal is returned, and nothing is promised).  Check and promise are one step, so two
        creations at once cannot both take the last room."""
        with self._lock:
            refusal = overpromised(free, self._promised, len(self._open), size, floor)
            if refusal is None:
                self._put(upload_id, (size, 0))
                if self._admitted is not None:
                    self._admitted.add(upload_id)
            return refusal

    def hold(self, upload_id: str, size: int, stored: int) -> None:
        """Promise (again) what an upload still lacks: an append admitted after a restart, a
        reset or an acceptance that failed.  Never refused: the upload was admitted before."""
        with self._lock:
            self._put(upload_id, (size, stored))
            if self._admitted is not None:
                self._admitted.add(upload_id)

    def stored(self, upload_id: str, offset: int) -> None:
        """The upload now has ``offset`` bytes stored (nothing when it holds no promise)."""
        with self._lock:
            entry = self._open.get(upload_id)
            if entry is not None:
                self._put(upload_id, (entry[0], offset))

    def settled(self, upload_id: str, offset: int) -> None:
        """The request writing the upload ended with ``offset`` bytes stored and durable (a
        worker's stand-in tells its parent this one whatever it told before)."""
        self.stored(upload_id, offset)

    def release(self, upload_id: str) -> None:
        """End the promise of an upload accepted, rejected, discarded or swept."""
        with self._lock:
            self._drop(upload_id)

    def release_all(self, upload_ids: Iterable[str]) -> None:
        with self._lock:
            for upload_id in upload_ids:
                self._drop(upload_id)

    def holds(self, upload_id: str) -> bool:
        """Whether ``upload_id`` holds a promise now."""
        with self._lock:
            return upload_id in self._open

    def record_admissions(self) -> None:
        """From now on, remember every upload admitted or held until :meth:`take_admitted`
        (the sweep's call, once: whoever calls it must take them, or they pile up)."""
        with self._lock:
            if self._admitted is None:
                self._admitted = set()

    def take_admitted(self) -> set[str]:
        """The uploads holding a promise now, and every upload admitted or held since the last
        call (once :meth:`record_admissions` was called), released since or not: the uploads in
        flight that the receiver knows of, which the sweep watches (blocking nothing)."""
        with self._lock:
            taken = set(self._open)
            if self._admitted is not None:
                taken |= self._admitted
                self._admitted = set()
            return taken

    @classmethod
    def from_disk(
        cls,
        uploads: UploadStore,
        receipts: ReceiptStore,
        ids: ObjectIds,
        found: Iterable[tuple[str, UploadInfo | None]] | None = None,
    ) -> Promises:
        """The promises of the uploads in ``uploads/`` (blocking; start-up); ``found`` as
        :func:`promised_on_disk`'s."""
        promises = cls(dict(promised_on_disk(uploads, receipts, ids, found)))
        if promises.uploads:
            log.info(
                "{promised_bytes} bytes promised to {count} uploads found in uploads/",
                promised_bytes=promises.total,
                count=promises.uploads,
            )
        return promises


def _owed(entry: tuple[int, int]) -> int:
    """What an open upload's ``(size, stored)`` still owes of its promise."""
    size, stored = entry
    return max(size - stored, 0)


# Entries listed between two calls of a listing's ``pace`` (the sweep's hourly pass sleeps there).
PACE_ENTRIES = 2000


@frozen
class Unreceipted:
    """What one names-only listing of ``uploads/`` and ``receipts/`` found (:func:`unreceipted`)."""

    # Every valid id with a data file or a sidecar in uploads/ and no receipt in receipts/.
    ids: frozenset[str]
    # Of ``ids``, those with a sidecar (an upload whose data file alone is left, a creation a
    # power cut caught or a removal a crash cut, has none).
    sidecars: frozenset[str]
    # Temp files (fs.TEMP_PREFIX) listed in uploads/ and receipts/: what a crash may orphan.
    temps: tuple[Path, ...] = ()
    # With ``with_origins``: every valid id with an origin record (``{id}.meta.json``) listed in
    # receipts/, receipted or not, in no order, or those ``keep_origins`` kept (start-up's: the
    # objects that may lack their index row after a crash, canner.accept.origins.index_at_start).
    # Empty without it.
    recorded: tuple[str, ...] = ()


def no_pace() -> None:
    """A listing's ``pace`` that never waits."""


def _names(
    directory: Path, pace: Callable[[], None], missing_ok: bool = False
) -> Iterator[list[str]]:
    """The names in ``directory``, :data:`PACE_ENTRIES` at a time, ``pace`` called after each
    full batch: a listing held a batch at a time, never whole.  A directory that does not exist
    has no names with ``missing_ok``."""
    try:
        entries = os.scandir(directory)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    with entries:
        while batch := [entry.name for entry in islice(entries, PACE_ENTRIES)]:
            yield batch
            if len(batch) == PACE_ENTRIES:
                pace()


_ORIGIN_SUFFIX = ".meta.json"


def unreceipted(
    uploads: UploadStore,
    receipts: ReceiptStore,
    ids: ObjectIds,
    pace: Callable[[], None] = no_pace,
    *,
    with_origins: bool = False,
    keep_origins: Callable[[list[str]], Iterable[str]] | None = None,
    with_temps: bool = True,
    sidecars_only: bool = False,
) -> Unreceipted:
    """The uploads in ``uploads/`` without a receipt (blocking): one names-only listing of
    ``uploads/``, a look for ``receipts/{id}.json`` per id listed, then a look for the sidecar
    of each upload left; then, for the temp files (``with_temps``) and the origin records
    (``with_origins``), one names-only listing of ``receipts/``.  ``pace`` is called every
    :data:`PACE_ENTRIES` entries listed.  ``recorded``: the ids of every origin record, or, with
    ``keep_origins``, what it keeps of each batch of them (start-up's: those the index lacks).
    ``sidecars_only``: only the uploads with a sidecar are looked for (``ids`` is ``sidecars``),
    one look per upload where the names of both its files cost two (their names are listed far
    apart, so a batch seldom holds both).

    Nothing is held but a batch of names and what is left (the uploads in flight), whatever
    the objects at rest: a node of a million objects lists their names and looks up a receipt
    per waiting payload, but never holds them.  A receipt committed after its upload was
    looked at is missed: a caller that races acceptances checks again per upload
    (:func:`sidecars_of` does)."""
    left: set[str] = set()
    temps: list[Path] = []
    with fs.names_in(receipts.directory) as in_receipts:
        for batch in _names(uploads.directory, pace):
            if sidecars_only:
                stems = {name[:-5] for name in batch if name.endswith(".info")}
            else:
                stems = {name[:-5] if name.endswith(".info") else name for name in batch}
            left.update(stem for stem in stems if not in_receipts(f"{stem}.json"))
            if with_temps:
                temps += [uploads.directory / n for n in batch if n.startswith(fs.TEMP_PREFIX)]
    found = frozenset(stem for stem in left if ids.is_valid(stem))
    sidecars = found
    if not sidecars_only:
        with fs.names_in(uploads.directory) as in_uploads:
            sidecars = frozenset(
                upload_id for upload_id in found if in_uploads(f"{upload_id}.info")
            )
    recorded: list[str] = []
    if with_temps or with_origins:
        # No receipts/ (a data directory a receiver never started in): nothing is in it.
        for batch in _names(receipts.directory, pace, missing_ok=True):
            if with_temps:
                temps += [receipts.directory / n for n in batch if n.startswith(fs.TEMP_PREFIX)]
            if with_origins:
                origins = [
                    object_id
                    for object_id in (n[:-10] for n in batch if n.endswith(_ORIGIN_SUFFIX))
                    if ids.is_valid(object_id)
                ]
                recorded += origins if keep_origins is None else keep_origins(origins)
    return Unreceipted(found, sidecars, tuple(temps), tuple(recorded))


def sidecars_of(
    uploads: UploadStore, receipts: ReceiptStore, upload_ids: Iterable[str]
) -> Iterator[tuple[str, UploadInfo | None]]:
    """Of ``upload_ids``, every upload without a receipt and not rejected, with its sidecar
    (None: unreadable), blocking: its receipt is looked for again just before its sidecar is
    read (an acceptance may have committed since the ids were listed)."""
    for upload_id in upload_ids:
        if receipts.has_receipt(upload_id):
            continue
        try:
            info = uploads.read_info(upload_id)
        except CorruptInfo:
            yield upload_id, None
            continue
        if info is not None and info.rejected is None:
            yield upload_id, info


def open_uploads(
    uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds
) -> Iterator[tuple[str, UploadInfo | None]]:
    """Every upload in ``uploads/`` without a receipt and not rejected, with its sidecar (None:
    unreadable), blocking: the uploads in flight, as the receiver and the survey both count
    them.  By name first (:func:`unreceipted`), so only the uploads without a receipt have
    their sidecars read (:func:`sidecars_of`), in the order of their ids."""
    yield from sidecars_of(uploads, receipts, sorted(unreceipted(uploads, receipts, ids).sidecars))


def promised_on_disk(
    uploads: UploadStore,
    receipts: ReceiptStore,
    ids: ObjectIds,
    found: Iterable[tuple[str, UploadInfo | None]] | None = None,
) -> Iterable[tuple[str, tuple[int, int]]]:
    """``(upload_id, (size, stored))`` of every upload that can still go on after a start
    (blocking).  An unreadable sidecar promises nothing (the sweep removes it), nor does a
    whole-file upload (its request is over); an upload marked untrusted has nothing stored that
    counts.  ``found``: what :func:`open_uploads` yields, read already by the caller (start-up's
    one pass); None reads it now."""
    if found is None:
        found = open_uploads(uploads, receipts, ids)
    for upload_id, info in found:
        if info is not None and not info.whole_file:
            stored = 0 if info.untrusted is not None else uploads.offset(upload_id)
            yield upload_id, (info.size, stored)
