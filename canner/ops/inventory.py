"""What an operator wants to know about a data directory: the survey, stuck rows, one object.

:func:`take_survey` looks at the disk (free space, uploads still coming in) and at the delivery
index (objects by project and state, the oldest undelivered object, overdue purges, recent
failures).  The index is read through its own short-lived read-only connection
(:func:`open_read_only`), never through a daemon's writer connection, so a survey never delays a
delivery transaction and works the same in both daemons, the manhole and the ``canner`` command.
Everything here blocks: daemons call it through their blocking runner.  The SQL lives in cursor
functions (:func:`summarize_index`, :func:`stuck_rows`) that unit tests run on a ``sqlite3``
cursor.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from attrs import define, field, frozen

from canner import fs
from canner.delivery import index as sql
from canner.delivery.index import ObjectRow

# The operator's commands open the index through the survey's module (its one opener).
from canner.delivery.index import open_read_only as open_read_only
from canner.delivery.liveness import Heartbeat, judge, read_heartbeat
from canner.delivery.queue import State
from canner.ids import ObjectIds
from canner.ledger import store as ledger_store
from canner.ledger.files import Archived, ArchivedIds, LedgerDir
from canner.ops.trends import TrendPoint, read_trends
from canner.packaging.dictionaries import DictionaryWait, read_waits
from canner.store.drain import (
    DrainMark,
    Retirement,
    count_unindexed,
    count_unsettled,
    read_drain,
    retirement,
)
from canner.store.promises import sidecars_of, unreceipted
from canner.store.receipts import ReceiptStore
from canner.store.uploads import CorruptInfo, UploadInfo, UploadStore

INDEX_NAME = "delivery.sqlite"
# Rows in retry_wait with more attempts than this count as stuck (as do those needing an operator).
STUCK_ATTEMPTS = 5
RECENT_FAILURES = 10
RECENT_DELIVERIES = 10
_SELECT = "SELECT " + ", ".join(sql.COLUMNS) + " FROM object_delivery"


@frozen
class ActiveUpload:
    """An upload on disk that has no receipt yet (still coming in, or awaiting acceptance)."""

    upload_id: str
    project: str
    offset: int
    size: int
    idle_s: float

    @property
    def complete(self) -> bool:
        return self.offset >= self.size


@frozen
class ProjectTotals:
    """Objects and bytes of one project in the index."""

    project: str
    accepted_objects: int = 0
    accepted_bytes: int = 0
    pending_objects: int = 0  # accepted, not yet delivered
    pending_bytes: int = 0
    delivered_objects: int = 0
    delivered_bytes: int = 0


@frozen
class IndexSummary:
    """Counts from ``delivery.sqlite``."""

    states: Mapping[str, int]
    state_bytes: Mapping[str, int]
    projects: tuple[ProjectTotals, ...]
    oldest_undelivered_at: float | None
    needs_operator: int
    purge_overdue: int
    oldest_purge_due: float | None
    # retry_wait rows (their latest attempt failed), newest first
    recent_failures: tuple[ObjectRow, ...] = ()
    recent_deliveries: tuple[ObjectRow, ...] = ()
    heartbeat: Heartbeat | None = None
    # megawarc batches and packages by phase (PACKAGE_PHASES): count, and bytes of members
    packages: Mapping[str, int] = field(factory=dict)
    package_bytes: Mapping[str, int] = field(factory=dict)

    @property
    def pending_objects(self) -> int:
        return sum(n for s, n in self.states.items() if s != State.DELIVERED)

    @property
    def pending_bytes(self) -> int:
        return sum(n for s, n in self.state_bytes.items() if s != State.DELIVERED)

    @property
    def delivered_bytes(self) -> int:
        return self.state_bytes.get(State.DELIVERED, 0)


@frozen
class Survey:
    """One look at a data directory at ``taken_at``; errors are recorded, never raised."""

    taken_at: float
    free_bytes: int | None
    active_uploads: tuple[ActiveUpload, ...]
    index: IndexSummary | None
    free_error: str | None = None
    index_error: str | None = None
    unreadable_uploads: int = 0
    # per project ('' for all), oldest first; only in surveys taken with history=True
    trends: Mapping[str, tuple[TrendPoint, ...]] = field(factory=dict)
    # the node's drain marker, and (only while draining) whether it can be retired
    draining: DrainMark | None = None
    retirement: Retirement | None = None
    # whether a process holds deliver.lock; None: not looked (only ``canner status`` looks)
    deliver_lock_held: bool | None = None
    # zstd dictionaries that members name and that could not be had yet: their batches wait
    dictionary_waits: tuple[DictionaryWait, ...] = ()
    # data directories (uploads/, receipts/) this process cannot write
    unusable: tuple[Path, ...] = ()

    @property
    def active_upload_bytes(self) -> int:
        return sum(u.offset for u in self.active_uploads)

    @property
    def promised_bytes(self) -> int:
        """Bytes promised to uploads in flight: what they declared and have not stored yet
        (the receiver's admission rule, canner.store.promises)."""
        return sum(max(u.size - u.offset, 0) for u in self.active_uploads)

    @property
    def oldest_undelivered_age(self) -> float | None:
        if self.index is None or self.index.oldest_undelivered_at is None:
            return None
        return max(0.0, self.taken_at - self.index.oldest_undelivered_at)

    @property
    def purge_lag(self) -> float:
        """Seconds the most overdue local purge is late (0 when none is)."""
        if self.index is None or self.index.oldest_purge_due is None:
            return 0.0
        return max(0.0, self.taken_at - self.index.oldest_purge_due)


# -- the index ---------------------------------------------------------------------------------


# A package's phase, from its build state and its delivery and local-file facts.
PACKAGE_PHASES = (
    "open",
    "closed",
    "building",
    "sealed",
    "verified",
    "delivering",
    "delivered",
    "verified_at_ia",
    "purged",
)
_PHASE_SQL = (
    "SELECT CASE WHEN state IN ('open', 'closed', 'building', 'sealed') THEN state"
    " WHEN purged_at IS NOT NULL THEN 'purged'"
    " WHEN remote_verified_at IS NOT NULL THEN 'verified_at_ia'"
    " WHEN delivery_state = 'delivered' THEN 'delivered'"
    " WHEN delivery_state = 'delivering' THEN 'delivering'"
    " ELSE 'verified' END AS phase, count(*), coalesce(sum(bytes), 0) FROM package_delivery"
    " GROUP BY phase"
)


def package_phases(cur: sqlite3.Cursor) -> tuple[dict[str, int], dict[str, int], int]:
    """Packages (and batches still filling) by phase: counts and member bytes; and how many
    packages are flagged for an operator."""
    counts = {p: 0 for p in PACKAGE_PHASES}
    sizes = {p: 0 for p in PACKAGE_PHASES}
    try:
        cur.execute(_PHASE_SQL)
    except sqlite3.OperationalError:  # an index from before packaging
        return counts, sizes, 0
    for phase, count, size in cur.fetchall():
        counts[phase], sizes[phase] = count, size
    cur.execute("SELECT count(*) FROM package_delivery WHERE needs_operator != 0")
    return counts, sizes, int(cur.fetchone()[0])


def summarize_index(
    cur: sqlite3.Cursor, now: float, failures: int = RECENT_FAILURES
) -> IndexSummary:
    """Counts by project and state, oldest undelivered object, overdue purges, recent failures.

    Every figure comes from what the index keeps up to date (schema v9): the counts per project
    and state (``object_states``), the first entries of an index over the undelivered objects,
    the overdue purges and the latest deliveries; none reads the rows at rest, so a survey costs
    the same at 10^6 objects as at 10^4 (tests/unit/test_index_summary.py holds the sums over
    every row this replaced, and checks both agree)."""
    cur.execute(
        "SELECT project, state, objects, bytes, flagged FROM object_states WHERE objects > 0"
        " ORDER BY project, state"
    )
    states = {s.value: 0 for s in State}
    state_bytes = {s.value: 0 for s in State}
    totals: dict[str, dict[str, int]] = {}
    needs_operator = 0
    for project, state, count, size, operator in cur.fetchall():
        states[state] = states.get(state, 0) + count
        state_bytes[state] = state_bytes.get(state, 0) + size
        needs_operator += operator
        t = totals.setdefault(project, {"accepted_objects": 0, "accepted_bytes": 0})
        t["accepted_objects"] += count
        t["accepted_bytes"] += size
        kind = "delivered" if state == State.DELIVERED else "pending"
        t[f"{kind}_objects"] = t.get(f"{kind}_objects", 0) + count
        t[f"{kind}_bytes"] = t.get(f"{kind}_bytes", 0) + size
    cur.execute("SELECT min(accepted_at) FROM undelivered")
    [oldest] = cur.fetchone()
    cur.execute(
        # CROSS JOIN: objects first, through objects_purge_due (the rows whose purge is
        # still to come), never outbound's delivered rows first.
        "SELECT count(*), min(o.purge_after) FROM objects o"
        " CROSS JOIN outbound d ON d.kind = 'object' AND d.ref = o.object_id"
        " WHERE o.purged_at IS NULL AND o.purge_after IS NOT NULL AND o.purge_after <= ?"
        " AND d.state = 'delivered'",
        (now,),
    )
    overdue, first_due = cur.fetchone()
    # Only objects whose latest attempt failed: a delivered object is no failure, whatever
    # its verification notes say (needs_operator counts those that need a human).
    cur.execute(
        "SELECT object_id FROM undelivered WHERE state = 'retry_wait'"
        " ORDER BY updated_at DESC LIMIT ?",
        (failures,),
    )
    recent = tuple(_rows_in_order(cur, [r[0] for r in cur.fetchall()]))
    cur.execute(
        "SELECT ref FROM outbound WHERE kind = 'object' AND state = 'delivered'"
        " AND delivered_at IS NOT NULL ORDER BY delivered_at DESC LIMIT ?",
        (RECENT_DELIVERIES,),
    )
    delivered = tuple(_rows_in_order(cur, [r[0] for r in cur.fetchall()]))
    phases, phase_bytes, flagged_packages = package_phases(cur)
    flagged_ledgers = len(ledger_store.flagged_ledgers(cur))
    return IndexSummary(
        states=states,
        state_bytes=state_bytes,
        projects=tuple(ProjectTotals(p, **t) for p, t in sorted(totals.items())),
        oldest_undelivered_at=float(oldest) if oldest is not None else None,
        # A package's or a ledger's delivery is a delivery: its flag counts like an object's.
        needs_operator=needs_operator + flagged_packages + flagged_ledgers,
        purge_overdue=overdue,
        oldest_purge_due=first_due,
        recent_failures=recent,
        recent_deliveries=delivered,
        heartbeat=read_heartbeat(cur),
        packages=phases,
        package_bytes=phase_bytes,
    )


def _rows_in_order(cur: sqlite3.Cursor, object_ids: list[str]) -> list[ObjectRow]:
    """The view's rows of ``object_ids`` (each by its primary key), in that order."""
    if not object_ids:
        return []
    marks = ", ".join("?" * len(object_ids))
    cur.execute(_SELECT + f" WHERE object_id IN ({marks})", object_ids)
    found = {row[0]: ObjectRow(*row) for row in cur.fetchall()}
    return [found[oid] for oid in object_ids if oid in found]


def stuck_rows(cur: sqlite3.Cursor, attempts_over: int = STUCK_ATTEMPTS) -> list[ObjectRow]:
    """Rows in ``retry_wait`` that need an operator or have failed more than ``attempts_over``,
    and delivered rows flagged before verification (lost or altered at the destination)."""
    cur.execute(
        _SELECT + " WHERE (state = 'retry_wait' AND (needs_operator != 0 OR attempts > ?))"
        " OR (state = 'delivered' AND verified_at IS NULL AND needs_operator != 0)"
        " ORDER BY accepted_at, object_id",
        (attempts_over,),
    )
    return [ObjectRow(*row) for row in cur.fetchall()]


def read_index(path: Path, f: Any, *args: Any) -> Any:
    """Run the cursor function ``f`` on a read-only connection to the index at ``path``."""
    conn = open_read_only(path)
    try:
        return f(conn.cursor(), *args)
    finally:
        conn.close()


# -- the disk ----------------------------------------------------------------------------------


def uploads_without_receipt(
    uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds
) -> set[str]:
    """Ids of the uploads in ``uploads/`` with a sidecar and no receipt (blocking), from a
    names-only listing of ``uploads/`` and a look for each one's receipt
    (:func:`canner.store.promises.unreceipted`), nothing read.  Rejected uploads and unreadable
    sidecars are still in:
    :func:`scan_uploads` reads the sidecars of these few."""
    return set(unreceipted(uploads, receipts, ids, with_temps=False, sidecars_only=True).sidecars)


def scan_uploads(
    uploads: UploadStore,
    receipts: ReceiptStore,
    ids: ObjectIds,
    now: float,
    candidates: Iterable[str] | None = None,
) -> tuple[list[ActiveUpload], int]:
    """Uploads without a receipt (not rejected), and how many sidecars could not be read.

    ``candidates``: the ids that may be such uploads (the receiver's promises: the uploads in
    flight it holds in memory); None: every upload in ``uploads/`` without a receipt
    (:func:`uploads_without_receipt`).  Only the candidates' files are read or looked at, by
    :func:`canner.store.promises.sidecars_of` as ``open_uploads`` reads them, so both give the
    same list."""
    if candidates is None:
        candidates = uploads_without_receipt(uploads, receipts, ids)
    active, unreadable = [], 0
    valid = [upload_id for upload_id in candidates if ids.is_valid(upload_id)]
    for upload_id, info in sidecars_of(uploads, receipts, valid):
        if info is None:
            unreadable += 1
            continue
        active.append(_looked_at(uploads, upload_id, info).at(now))
    active.sort(key=lambda u: (u.idle_s, u.upload_id))
    return active, unreadable


@frozen
class _Looked:
    """What a survey read of one upload in flight: an :class:`ActiveUpload` whose idle time is
    kept as the time of its last change (``idle_since``), to be shown at any later ``now``."""

    upload_id: str
    project: str
    offset: int
    size: int
    idle_since: float

    def at(self, now: float) -> ActiveUpload:
        idle = max(0.0, now - self.idle_since)
        return ActiveUpload(self.upload_id, self.project, self.offset, self.size, idle)


def _looked_at(uploads: UploadStore, upload_id: str, info: UploadInfo) -> _Looked:
    """The upload's files as they are now, with its sidecar ``info`` (blocking)."""
    project = info.metadata.get("project", "")
    return _Looked(
        upload_id, project, uploads.offset(upload_id), info.size, uploads.idle_since(upload_id)
    )


@define(eq=False)
class InFlightScan:
    """The uploads in flight of a running receiver as its surveys look at them (safe across
    threads; one per receiver, shared by its metrics and its status page).

    Which they are, and the number of each one's last change, come from its promises
    (:meth:`canner.store.promises.Promises.versions`); an upload whose number is the one the
    last survey saw is not read again: no write, hold or end of a request was promised since,
    so its files are as they were, and only its idle time grows.  So a survey costs what
    changed since the last one, not the uploads in flight: ten thousand idle ones cost no
    read.  What it shows equals :func:`scan_uploads` with the promises' ids as candidates
    (a worker tells its parent of its writes every few seconds and at the end of each request,
    :data:`canner.daemon.node_protocol.STORED_EVERY`, so a write is seen that much later)."""

    _versions: Callable[[], Mapping[str, int]]
    # upload_id -> (the change number read at, what was read): the last survey's, pruned to
    # the uploads still in flight by each survey.
    _seen: dict[str, tuple[int, _Looked]] = field(factory=dict, init=False)
    _lock: threading.Lock = field(factory=threading.Lock, init=False)

    def scan(
        self, uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds, now: float
    ) -> tuple[list[ActiveUpload], int]:
        """:func:`scan_uploads` of the uploads in flight now (blocking), reading only those
        changed since the last scan.  Only what was read whole is kept: an upload without its
        sidecar yet (admitted, not created), rejected or unreadable is read again next time."""
        versions = self._versions()
        with self._lock:
            seen: dict[str, tuple[int, _Looked]] = {}
            changed: dict[str, int] = {}
            for upload_id, version in versions.items():
                kept = self._seen.get(upload_id)
                if kept is not None and kept[0] == version:
                    seen[upload_id] = kept
                elif ids.is_valid(upload_id):
                    changed[upload_id] = version
            unreadable = 0
            for upload_id, info in sidecars_of(uploads, receipts, changed):
                if info is None:
                    unreadable += 1
                else:
                    seen[upload_id] = (changed[upload_id], _looked_at(uploads, upload_id, info))
            self._seen = seen
        active = [looked.at(now) for _, looked in seen.values()]
        active.sort(key=lambda u: (u.idle_s, u.upload_id))
        return active, unreadable


# The ids of the uploads in flight, as a running receiver holds them (or an InFlightScan of them).
UploadsInFlight = Callable[[], Iterable[str]]


def take_survey(
    data_dir: Path,
    ids: ObjectIds,
    now: float,
    history: bool = False,
    in_flight: UploadsInFlight | InFlightScan | None = None,
) -> Survey:
    """Look at ``data_dir`` and its index (blocking); failures become ``*_error`` fields.

    ``history``: also read the last 24 hours of trend samples (for the status page).
    ``in_flight``: the ids of the uploads in flight, as a running receiver holds them (its
    promises, :meth:`canner.store.promises.Promises.upload_ids`): only those are looked at,
    instead of listing ``uploads/`` and ``receipts/`` (with an :class:`InFlightScan`: only those
    changed since its last survey are read).  While the receiver runs the two agree (every
    upload without a receipt holds a promise), except for an unreadable sidecar, which promises
    nothing and which the sweep removes."""
    free: int | None = None
    free_error = index_error = None
    try:
        free = fs.free_bytes(data_dir)
    except OSError as e:
        free_error = e.strerror or str(e)
    uploads, receipts = UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")
    try:
        if isinstance(in_flight, InFlightScan):
            active, unreadable = in_flight.scan(uploads, receipts, ids, now)
        else:
            active, unreadable = scan_uploads(
                uploads, receipts, ids, now, None if in_flight is None else in_flight()
            )
    except OSError:
        active, unreadable = [], 0
    summary = None
    trends: Mapping[str, tuple[TrendPoint, ...]] = {}
    try:
        summary = read_index(data_dir / INDEX_NAME, summarize_index, now)
        if history:
            trends = read_index(data_dir / INDEX_NAME, read_trends, now)
    except (OSError, sqlite3.Error) as e:
        index_error = str(e)
    draining = read_drain(data_dir)
    retire = None
    if draining is not None:
        retire = _retirement(data_dir, receipts, ids, len(active) + unreadable)
    return Survey(
        taken_at=now,
        free_bytes=free,
        active_uploads=tuple(active),
        index=summary,
        free_error=free_error,
        index_error=index_error,
        unreadable_uploads=unreadable,
        trends=trends,
        draining=draining,
        retirement=retire,
        dictionary_waits=read_waits(data_dir / "dictionaries"),
        unusable=unusable_dirs(data_dir),
    )


def unusable_dirs(data_dir: Path) -> tuple[Path, ...]:
    """``uploads/`` and ``receipts/`` of ``data_dir`` when missing or not writable by this
    process (blocking)."""
    paths = (data_dir / "uploads", data_dir / "receipts")
    return tuple(p for p in paths if not os.access(p, os.W_OK | os.X_OK))


def _retirement(data_dir: Path, receipts: ReceiptStore, ids: ObjectIds, active: int) -> Retirement:
    path = data_dir / INDEX_NAME
    try:
        waiting = read_index(path, count_unsettled)
        missing = 0
        if not active and not waiting:
            # Last, and only then: listing every receipt is too slow for each metrics survey.
            receipt_ids = [oid for oid in receipts.object_ids() if ids.is_valid(oid)]
            missing = read_index(path, count_unindexed, receipt_ids)
    except (OSError, sqlite3.Error):
        return retirement(active, None, None)
    return retirement(active, waiting, missing)


def survey_json(survey: Survey, min_free_bytes: int | None = None) -> dict[str, Any]:
    """The survey as the JSON of ``canner status --json`` (and what the status page shows)."""
    index = survey.index
    doc: dict[str, Any] = {
        "taken_at": survey.taken_at,
        "free_bytes": survey.free_bytes,
        "min_free_bytes": min_free_bytes,
        "active_uploads": len(survey.active_uploads),
        "active_upload_bytes": survey.active_upload_bytes,
        "promised_bytes": survey.promised_bytes,
        "awaiting_acceptance": sum(1 for u in survey.active_uploads if u.complete),
        "states": dict(index.states) if index else None,
        "pending_objects": index.pending_objects if index else None,
        "pending_bytes": index.pending_bytes if index else None,
        "delivered_bytes": index.delivered_bytes if index else None,
        "oldest_pending_accepted_at": index.oldest_undelivered_at if index else None,
        "oldest_pending_age_s": survey.oldest_undelivered_age,
        "needs_operator": index.needs_operator if index else None,
        "purge_overdue": index.purge_overdue if index else None,
        "purge_lag_s": survey.purge_lag,
        "projects": (
            {
                p.project: {
                    "accepted_objects": p.accepted_objects,
                    "accepted_bytes": p.accepted_bytes,
                    "pending_objects": p.pending_objects,
                    "pending_bytes": p.pending_bytes,
                    "delivered_objects": p.delivered_objects,
                    "delivered_bytes": p.delivered_bytes,
                }
                for p in index.projects
            }
            if index
            else None
        ),
        "free_error": survey.free_error,
        "index_error": survey.index_error,
        "deliver": (
            deliver_json(index.heartbeat, survey.taken_at, survey.deliver_lock_held)
            if index
            else None
        ),
        "draining": survey.draining.as_dict() if survey.draining else None,
        "retirement": survey.retirement.as_dict() if survey.retirement else None,
        "packages": dict(index.packages) if index else None,
        "dictionary_waits": [w.as_dict() for w in survey.dictionary_waits],
    }
    return doc


def deliver_json(
    beat: Heartbeat | None, now: float, lock_held: bool | None = None
) -> dict[str, Any]:
    """canner-deliver's state from its heartbeat (and whether its lock is held), and its
    attempts in flight while it runs."""
    liveness = judge(beat, now, lock_held=lock_held)
    return {
        "state": liveness.state,
        "text": liveness.text,
        "heartbeat_age_s": liveness.age_s,
        "pid": beat.pid if beat else None,
        "version": beat.version if beat else None,
        "started_at": beat.started_at if beat else None,
        "in_flight": [p.as_dict() for p in beat.in_flight] if beat and liveness.ok else [],
    }


# -- one object --------------------------------------------------------------------------------


@frozen
class LocalRecord:
    """What the data directory holds about one object."""

    object_id: str
    receipt: Mapping[str, Any] | None
    origin: Mapping[str, Any] | None
    upload: Mapping[str, Any] | None
    payload_present: bool
    problems: tuple[str, ...] = field(default=())


def _json_file(path: Path) -> Mapping[str, Any] | None:
    try:
        loaded: Mapping[str, Any] = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    return loaded


def _origin_record(
    receipts: ReceiptStore, object_id: str, info: UploadInfo | None, problems: list[str]
) -> Mapping[str, Any] | None:
    """The origin record as it is on disk; for a torn one (acceptance writes it without an
    fsync of its own, and a power cut may leave it empty: ``canner.store.recovery``) what the
    upload's sidecar says in its place, and a problem naming both."""
    path = receipts.origin_path(object_id)
    if receipts.read_origin(object_id) is not None:
        return _json_file(path)
    if not path.exists():
        return None
    if info is None:
        problems.append(f"unreadable origin record {path}, and no sidecar to read it from")
        return None
    problems.append(
        f"unreadable origin record {path} (torn by an unclean stop): shown from the upload's"
        " sidecar; canner-deliver's rescan rewrites it if the index is rebuilt"
    )
    from_sidecar: Mapping[str, Any] = json.loads(info.origin.to_json(object_id))
    return from_sidecar


def local_record(data_dir: Path, object_id: str) -> LocalRecord:
    """Receipt, origin record, tus sidecar and payload presence of ``object_id`` (blocking).

    ``object_id`` must already be validated (it becomes a file name).
    """
    uploads, receipts = UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")
    problems = []
    receipt = origin = upload = None
    try:
        receipt = _json_file(receipts.receipt_path(object_id))
    except ValueError as e:
        problems.append(f"unreadable receipt: {e}")
    try:
        info = uploads.read_info(object_id)
    except CorruptInfo as e:
        problems.append(str(e))
        info = None
    origin = _origin_record(receipts, object_id, info, problems)
    if info is not None:
        upload = {
            "project": info.metadata.get("project"),
            "filename": info.filename,
            "size": info.size,
            "offset": uploads.offset(object_id),
            "created_at": info.created_at,
            "rejected": info.rejected,
        }
    present = os.path.exists(uploads.data_path(object_id))
    return LocalRecord(object_id, receipt, origin, upload, present, tuple(problems))


def describe_object(
    local: LocalRecord,
    row: ObjectRow | None,
    attempts: list[dict[str, Any]] | None = None,
    archived: Archived | None = None,
) -> dict[str, Any]:
    """``canner show`` and the manhole's ``lookup()``: everything known about one object.

    ``archived`` says which verified ledger holds the record of an object whose local state
    went with archiving (``GET /api/v1/objects/{id}``'s ``archived``, with its ``released_at``)."""
    return {
        "object_id": local.object_id,
        "receipt": local.receipt,
        "origin": local.origin,
        "upload": local.upload,
        "payload_present": local.payload_present,
        "delivery": row.as_dict() if row is not None else None,
        "attempts": attempts or [],
        "archived": (
            {**archived.as_dict(), "released_at": archived.released_at} if archived else None
        ),
        "problems": list(local.problems),
    }


def lookup_object(data_dir: Path, object_id: str) -> dict[str, Any]:
    """:func:`describe_object` for ``object_id`` from the disk and the index (blocking)."""
    local = local_record(data_dir, object_id)
    attempts: list[dict[str, Any]] = []
    try:
        row = read_index(data_dir / INDEX_NAME, sql.get_row, object_id)
        if row is not None:
            attempts = read_index(data_dir / INDEX_NAME, _attempts, object_id)
    except FileNotFoundError:
        row = None
    archived = ArchivedIds(LedgerDir(data_dir / "ledger")).find(object_id)
    return describe_object(local, row, attempts, archived)


def _attempts(cur: sqlite3.Cursor, object_id: str) -> list[dict[str, Any]]:
    try:
        return sql.attempt_history(cur, object_id)
    except sqlite3.OperationalError:  # an index from before the attempts table
        return []


ID_PREFIX_MIN = 4
_PREFIX = re.compile(r"[a-z0-9-]+")


class UnknownId(ValueError):
    """Not an object id, nor the prefix of exactly one known object."""


def id_prefix(text: str) -> str:
    """``text`` as an id prefix to look up (pure); :class:`UnknownId` when it cannot be one."""
    prefix = text.strip().rstrip("…").lower()
    if not _PREFIX.fullmatch(prefix):
        raise UnknownId(f"{text!r} is not an object id of this node (nor a prefix of one)")
    if len(prefix) < ID_PREFIX_MIN:
        raise UnknownId(
            f"{text!r} is too short: give the whole object id or at least its first"
            f" {ID_PREFIX_MIN} characters"
        )
    return prefix


def resolve_id(data_dir: Path, ids: ObjectIds, text: str) -> str:
    """``text`` when it is a whole object id; otherwise the one object id known anywhere (index,
    receipts, uploads) that starts with it (at least 4 characters; a trailing … is ignored, as
    the status page shows ids).  Raises :class:`UnknownId`.  Blocking."""
    if ids.is_valid(text):
        return text
    prefix = id_prefix(text)
    found: set[str] = set()
    path = data_dir / INDEX_NAME
    if path.exists():
        conn = open_read_only(path)
        try:
            # A range over the primary key (a search of its index), not a scan of every row:
            # the ids starting with prefix are those from prefix up to, not including, prefix
            # with its last character one higher (ids are ASCII, compared byte by byte).
            rows = conn.execute(
                "SELECT object_id FROM objects WHERE object_id >= ? AND object_id < ? LIMIT 10",
                (prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)),
            ).fetchall()
        finally:
            conn.close()
        found.update(row[0] for row in rows)
    for sub in ("receipts", "uploads"):
        # One names-only listing each (no stat per entry); only the names that start with the
        # prefix are looked at further.
        try:
            names = [n for n in os.listdir(data_dir / sub) if n.startswith(prefix)]
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


def known(description: Mapping[str, Any]) -> bool:
    """True when anything at all is known about the described object."""
    return any(description[k] is not None for k in ("receipt", "upload", "delivery", "archived"))
