"""``delivery.sqlite``: the operational index of accepted objects and their delivery state.

SQL lives in plain functions over a cursor (production runs them with ``runInteraction``, unit tests
against a ``sqlite3`` cursor).  :func:`open_index` upgrades the schema (numbered ``schema/*.sql``
files and a version table) and returns a :class:`DeliveryIndex` over an adbapi pool with one
connection.  The index is never the only copy of a fact: it can be rebuilt from ``receipts/``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from attrs import define, field, frozen
from twisted.enterprise.adbapi import ConnectionPool
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from canner import fs
from canner.crashpoints import crash_point
from canner.delivery import outbound
from canner.observe import Outbound
from canner.store.receipts import DeliveryRecord, Origin, Receipt

log = Logger()

BUSY_TIMEOUT_MS = 10_000
# How long a schema upgrade waits for another process's (receiver and deliver start together):
# a step that reads every row (schema 9) takes seconds per million objects.
UPGRADE_WAIT_MS = 600_000
RETRY_PAUSES = (0.1, 0.5, 2.0, 5.0)
OBJECT = Outbound.OBJECT
# The project of an object nobody recorded one for (a Go canner receipt without its artifacts
# row and .info, adopted): not a project id (PROJECT_ID has no parentheses), so no config
# names it and canner-deliver never claims its row.
UNKNOWN_PROJECT = "(unknown)"


@frozen
class AcceptedObject:
    """What the index needs to know about a new object (from its receipt and origin record)."""

    object_id: str
    project: str
    filename: str | None
    size_bytes: int
    checksum: str
    accepted_at: int
    # Set when the payload was purged after a verified delivery (rebuilding a lost index).
    delivery: DeliveryRecord | None = None
    # Set when HQ released the receipt (its record in the facts journal, canner/store/journal.py).
    released_at: float | None = None
    # Set when a rebuild could not restore all of it (a damaged journal line held a record of
    # it): the row comes flagged for an operator, with this as its error.
    problem: str | None = None
    # The worker that uploaded it, when its intake door names one (schema v7).
    downloader: str | None = None

    @classmethod
    def of(
        cls,
        receipt: Receipt,
        origin: Origin,
        delivery: DeliveryRecord | None = None,
        released_at: float | None = None,
        problem: str | None = None,
    ) -> AcceptedObject:
        return cls(
            receipt.object_id,
            origin.project,
            origin.filename,
            receipt.size_bytes,
            str(receipt.checksum),
            receipt.accepted_at,
            delivery,
            released_at,
            problem,
            origin.downloader,
        )


def configure_connection(conn: sqlite3.Connection) -> None:
    """PRAGMAs every connection needs: busy timeout, WAL, full sync, foreign keys."""
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    _use_wal(conn)
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")


def _use_wal(conn: sqlite3.Connection) -> None:
    """Switch to WAL, waiting out another connection's switch (blocking, bounded by the busy
    timeout).  Two connections switching a new database at once (the receiver and deliver
    starting on a fresh data directory) deadlock on its lock, and SQLite answers one of them
    "database is locked" at once, without its busy handler: that one tries again."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


# What to do about a damaged index (docs/operator-guide.md, "Recover"), in the words of every
# daemon and command that meets one: the index is rebuilt from receipts, never repaired.
RECOVERY = (
    "stop both daemons, run canner rebuild-index --replace-damaged (it moves delivery.sqlite*"
    " aside and rebuilds the index from receipts), start both (docs/operator-guide.md, Recover)"
)
_DAMAGE_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def is_damaged(error: BaseException | None) -> bool:
    """True when ``error`` says the index file is no sound SQLite database ("file is not a
    database", "database disk image is malformed"): it will not heal, as "database is locked",
    a full disk or an I/O error may."""
    code = getattr(error, "sqlite_errorcode", None)
    return (
        isinstance(error, sqlite3.DatabaseError)
        and code is not None
        and code & 0xFF in (_DAMAGE_CODES)
    )


def damaged_index(path: Path, error: object) -> str:
    """The one line that says the index at ``path`` is damaged and what to do."""
    return f"delivery index {path} is damaged ({error}): {RECOVERY}"


def open_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection to the delivery index; FileNotFoundError when there is none."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (has canner run on this data directory?)")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


def index_damage(path: Path) -> str | None:
    """What is wrong with the index at ``path`` when it is no readable database (SQLite's error,
    or the first finding of ``PRAGMA quick_check``); None when it is sound or missing.  Reads it
    read-only (blocking; the whole file), so a damaged file stays exactly as it was.  Errors
    that do not say the file is damaged (a lock, an unreadable file) propagate."""
    if not path.exists():
        return None
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        findings = [row[0] for row in conn.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as e:
        if is_damaged(e):
            return str(e)
        raise
    finally:
        conn.close()
    return None if findings == ["ok"] else str(findings[0])


def move_aside(path: Path, now: float) -> list[tuple[Path, Path]]:
    """Rename the index at ``path`` and its ``-wal`` and ``-shm`` files (those present) to
    ``delivery-damaged-YYYYmmddTHHMMSSZ.sqlite[-wal|-shm]`` beside it (blocking, durable); return
    each ``(old, new)``.  Nothing is deleted: ``FileExistsError`` when a new name is taken.

    The WAL goes first: a cut before the database moves leaves the damaged database without its
    WAL (still damaged, moved by the next run), never a new database beside a stale WAL that
    SQLite would replay into it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    base = path.with_name(f"delivery-damaged-{stamp}.sqlite")
    moves = [
        (path.with_name(path.name + suffix), base.with_name(base.name + suffix))
        for suffix in ("-wal", "-shm", "")
    ]
    moves = [(old, new) for old, new in moves if old.exists()]
    for _old, new in moves:
        if new.exists():
            raise FileExistsError(f"{new} exists already: move it away first")
    for old, new in moves:
        old.rename(new)
    fs.fsync_dir(path.parent)
    return moves


def _migrations() -> list[tuple[int, str]]:
    folder = resources.files("canner.delivery") / "schema"
    found = []
    for entry in folder.iterdir():
        name = entry.name
        if name.startswith("v") and name.endswith(".sql"):
            found.append((int(name[1:-4]), entry.read_text(encoding="utf-8")))
    return sorted(found)


def _statements(sql: str) -> list[str]:
    """Split a schema file into statements (``executescript`` would commit our transaction)."""
    statements, current = [], ""
    for line in sql.splitlines(keepends=True):
        if not current and (not line.strip() or line.lstrip().startswith("--")):
            continue
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current)
            current = ""
    if current.strip():
        raise ValueError("schema file ends inside a statement")
    return statements


def upgrade_schema(path: Path) -> int:
    """Bring the database at ``path`` to the newest schema (blocking); return its version.

    Each step runs in one ``BEGIN IMMEDIATE`` transaction, so concurrent openers (receiver and
    deliver) never apply a step twice; one waits up to :data:`UPGRADE_WAIT_MS` for the other's
    step to end.  Raises ``RuntimeError`` for a database newer than us.
    """
    steps = _migrations()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        conn.execute(f"PRAGMA busy_timeout={UPGRADE_WAIT_MS}")
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        for number, sql in steps:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
                current = row[0] or 0
                if current < number:
                    for statement in _statements(sql):
                        conn.execute(statement)
                    # A kill here rolls the whole step back: the next opener applies it again.
                    crash_point(f"index-upgrade-v{number}")
                    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        current = conn.execute("SELECT max(version) FROM schema_version").fetchone()[0] or 0
        newest = steps[-1][0]
        if current > newest:
            raise RuntimeError(f"{path} has schema version {current}; this canner knows {newest}")
        return int(current)
    finally:
        conn.close()


def insert_objects(cur: sqlite3.Cursor, objects: Iterable[AcceptedObject], now: float) -> int:
    """Insert rows for objects not yet in the index; return how many.

    New objects are ``pending``; an object with a delivery record (its payload was purged after
    a verified delivery) comes back ``delivered``, with where, when and ``purged_at``; without
    ``purged_at`` (the payload is still on disk) its purge is due at ``purge_after``.  An object
    with a ``problem`` comes flagged for an operator (``needs_operator``, ``last_error``).
    """
    objects = list(objects)
    fresh = []
    for o in objects:
        d = o.delivery
        cur.execute(
            "INSERT OR IGNORE INTO objects (object_id, project, filename, downloader, size_bytes,"
            " checksum, accepted_at, content_md5, remote_name, purge_after, purged_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                o.object_id,
                o.project,
                o.filename,
                o.downloader,
                o.size_bytes,
                o.checksum,
                o.accepted_at,
                *(
                    (None,) * 4
                    if d is None
                    else (d.content_md5, d.remote_name, d.purge_after, d.purged_at)
                ),
                now,
            ),
        )
        if cur.rowcount == 1:
            fresh.append(o)
    outbound.add(cur, OBJECT, [(o.object_id, o.project) for o in fresh if not o.delivery], now)
    for o in fresh:
        if (d := o.delivery) is not None:
            outbound.add_delivered(
                cur,
                OBJECT,
                o.object_id,
                o.project,
                identifier=d.identifier,
                delivered_at=d.delivered_at,
                verified_at=d.verified_at,
                next_check_at=d.purge_after if d.purged_at is None else None,
                now=now,
            )
    problems = [(o.object_id, o.problem) for o in fresh if o.problem is not None]
    outbound.flag(cur, OBJECT, problems, now)
    # A release is its own fact: it comes back with the row, whatever the delivery state says.
    cur.executemany(
        "UPDATE objects SET released_at = ? WHERE object_id = ? AND released_at IS NULL",
        [(o.released_at, o.object_id) for o in objects if o.released_at is not None],
    )
    return len(fresh)


def open_pool(path: Path) -> ConnectionPool:
    """An adbapi pool with one connection to ``path`` (created lazily, from the reactor thread)."""
    return ConnectionPool(
        "sqlite3",
        str(path),
        cp_min=1,
        cp_max=1,
        cp_openfun=configure_connection,
        check_same_thread=False,
    )


P = ParamSpec("P")
T = TypeVar("T")
# A cursor function: one transaction's statements, over a cursor and the caller's arguments.
CursorFunction = Callable[Concatenate[sqlite3.Cursor, P], T]


class Index(Protocol):
    """What the services need of the index: cursor functions run in a transaction."""

    def run(self, f: CursorFunction[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]: ...


@define(eq=False)
class DeliveryIndex:
    """``delivery.sqlite`` behind an adbapi pool."""

    _pool: ConnectionPool
    _clock: IReactorTime

    def insert(self, objects: list[AcceptedObject]) -> Deferred[int]:
        return self.run(insert_objects, objects, self._clock.seconds())

    def run(self, f: CursorFunction[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        """Run a cursor function in a transaction, retrying transient SQLite errors.

        "database is locked", "disk I/O error" and the like are retried with growing pauses
        (:data:`RETRY_PAUSES`); after the last one the error is returned to the caller, which logs
        it and tries again on its next tick.
        """
        return Deferred.fromCoroutine(self._run_with_retries(f, args, kwargs))

    async def _run_with_retries(
        self, f: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> T:
        for pause in (*RETRY_PAUSES, None):
            try:
                result: T = await self._pool.runInteraction(f, *args, **kwargs)
                return result
            except sqlite3.OperationalError as e:
                if pause is None:
                    raise
                log.warn("delivery index busy, retrying: {error}", error=str(e))
                await deferLater(self._clock, pause, lambda: None)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._pool.close()


@define(eq=False)
class ConnectionIndex:
    """The index over one open ``sqlite3`` connection, used synchronously (the ``canner``
    command's): each cursor function runs at once in its own ``BEGIN IMMEDIATE`` transaction."""

    _conn: sqlite3.Connection

    def transact(self, f: CursorFunction[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run the cursor function ``f`` in one write transaction; rolled back if it raises."""
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            result = f(cur, *args, **kwargs)
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")
        return result

    def run(self, f: CursorFunction[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        """:meth:`transact` as an :class:`Index`: the Deferred has already fired."""
        try:
            return succeed(self.transact(f, *args, **kwargs))
        except Exception:
            return fail()


@define(eq=False)
class IndexFeed:
    """Best-effort, batched inserts of newly accepted objects (acceptance step 5).

    Acceptances that finish while an insert runs are written together in the next transaction, so
    one WAL fsync serves many.  A failure is logged and never reaches the worker: the receiver's
    next start (:func:`canner.accept.origins.index_at_start`) and the deliver process's rescans
    insert
    whatever is missing (a damaged index first needs an operator: the log line says what to do).
    """

    _index: DeliveryIndex
    _path: Path  # the index's file, for the operator
    _pending: list[AcceptedObject] = field(factory=list)
    _running: Deferred[int] | None = None

    def enqueue(self, receipt: Receipt, origin: Origin) -> None:
        self._pending.append(AcceptedObject.of(receipt, origin))
        if self._running is None:
            self._flush()

    def _flush(self) -> None:
        batch, self._pending = self._pending, []

        def done(result: object) -> None:
            self._running = None
            if self._pending:
                self._flush()

        def failed(failure: Any) -> None:
            if is_damaged(failure.value):
                log.error(
                    "delivery index insert of {count} objects failed: {damage}",
                    count=len(batch),
                    damage=damaged_index(self._path, failure.value),
                    error=str(failure.value),
                )
                return
            log.error(
                "delivery index insert of {count} objects failed (the receiver's next start or"
                " the deliver rescan will add them): {error}",
                count=len(batch),
                error=str(failure.value),
            )

        # Assign before adding callbacks: an index that answers synchronously calls done() at once.
        running = self._running = self._index.insert(batch)
        running.addCallbacks(lambda _: None, failed).addBoth(done)


def receiver_feed(
    path: Path, reactor: IReactorTime
) -> tuple[Callable[[Receipt, Origin], None], ConnectionPool | None, DeliveryIndex | None]:
    """The receiver's best-effort enqueue for acceptance into the index at ``path``, with the
    pool and the index behind it.  An index whose schema cannot be brought up to date is logged,
    never fatal: the enqueue then does nothing (and pool and index are None), and canner-deliver's
    rescan picks the receipts up (once an operator has rebuilt a damaged index: canner-deliver
    refuses to start on one, and the line logged says so)."""
    try:
        upgrade_schema(path)
    except Exception as e:
        if is_damaged(e):
            # Receipts are the commit point and the index is rebuilt from them: uploads go on.
            log.error(
                "{damage}; meanwhile uploads are accepted and receipted, and nothing is delivered",
                damage=damaged_index(path, e),
                path=str(path),
                error=str(e),
            )
            return (lambda receipt, origin: None), None, None
        log.error(
            "delivery index {path} unusable, receipts will be picked up by the deliver rescan:"
            " {error}",
            path=str(path),
            error=str(e),
        )
        return (lambda receipt, origin: None), None, None
    pool = open_pool(path)
    index = DeliveryIndex(pool, reactor)
    return IndexFeed(index, path).enqueue, pool, index


# -- objects with their outbound rows --------------------------------------------------------

COLUMNS = (
    "object_id",
    "project",
    "filename",
    "size_bytes",
    "checksum",
    "accepted_at",
    "state",
    "attempts",
    "next_attempt_at",
    "last_error",
    "needs_operator",
    "content_md5",
    "remote_identifier",
    "remote_name",
    "delivered_at",
    "verified_at",
    "purge_after",
    "purged_at",
    "next_check_at",
    "updated_at",
    "redeliveries",
    "force_upload",
    "released_at",
    "downloader",
)
# Objects with their outbound row (schema v8's view).
_SELECT = "SELECT " + ", ".join(COLUMNS) + " FROM object_delivery"


@frozen
class ObjectRow:
    """One object with its delivery facts (a row of the ``object_delivery`` view)."""

    object_id: str
    project: str
    filename: str | None
    size_bytes: int
    checksum: str
    accepted_at: int
    state: str
    attempts: int
    next_attempt_at: float
    last_error: str | None
    needs_operator: int
    content_md5: str | None
    remote_identifier: str | None
    remote_name: str | None
    delivered_at: float | None
    verified_at: float | None
    purge_after: float | None
    purged_at: float | None
    next_check_at: float | None
    updated_at: float
    # Times verify_timeout passed unlisted and the object was delivered again.
    redeliveries: int = 0
    # 1: a read-back found the remote bytes wrong; the next delivery must PUT.
    force_upload: int = 0
    released_at: float | None = None
    # The worker that uploaded it, when its intake door names one (schema v7).
    downloader: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COLUMNS}


def _rows(cur: sqlite3.Cursor) -> list[ObjectRow]:
    return [ObjectRow(*row) for row in cur.fetchall()]


def _rows_of(cur: sqlite3.Cursor, object_ids: list[str]) -> list[ObjectRow]:
    """The rows of ``object_ids``, in that order."""
    if not object_ids:
        return []
    cur.execute(_SELECT + f" WHERE object_id IN ({_marks(object_ids)})", object_ids)
    found = {row.object_id: row for row in _rows(cur)}
    return [found[oid] for oid in object_ids if oid in found]


def reset_delivering(cur: sqlite3.Cursor, now: float) -> int:
    """At start-up: ``delivering`` objects (attempts cut short) become ``retry_wait``, due now."""
    return outbound.reset_delivering(cur, OBJECT, now)


def claim_due(
    cur: sqlite3.Cursor, now: float, limit: int, projects: Iterable[str]
) -> list[ObjectRow]:
    """Move up to ``limit`` due objects of ``projects`` to ``delivering``, oldest due first;
    each claim counts an attempt."""
    return _rows_of(cur, outbound.claim_due(cur, OBJECT, now, limit, projects))


def release_orphans(cur: sqlite3.Cursor, running: Iterable[str], now: float) -> int:
    """``delivering`` objects with no attempt running become ``retry_wait``, due now."""
    return outbound.release_orphans(cur, OBJECT, running, now)


def set_content_md5(cur: sqlite3.Cursor, object_id: str, md5_hex: str) -> None:
    cur.execute("UPDATE objects SET content_md5 = ? WHERE object_id = ?", (md5_hex, object_id))


def record_delivered(
    cur: sqlite3.Cursor,
    object_id: str,
    identifier: str,
    remote_name: str,
    now: float,
    retention: float,
) -> bool:
    """``delivering -> delivered`` with where and when; the payload may go ``retention`` after
    its verification.  False when the row was not delivering."""
    remember_attempt(cur, object_id, "delivered", None, now)
    if not outbound.record_delivered(cur, OBJECT, object_id, identifier, now):
        return False
    cur.execute(
        "UPDATE objects SET remote_name = ?, purge_after = ?, updated_at = ? WHERE object_id = ?",
        (remote_name, now + retention, now, object_id),
    )
    return True


def record_failure(
    cur: sqlite3.Cursor,
    object_id: str,
    error: str,
    next_attempt_at: float,
    needs_operator: bool,
    now: float,
) -> bool:
    """``delivering -> retry_wait``; False when the row was not delivering."""
    remember_attempt(cur, object_id, "failed", error[:2000], now)
    return outbound.record_failure(
        cur, OBJECT, object_id, error, next_attempt_at, needs_operator, now
    )


ATTEMPTS_KEPT = 50


def remember_attempt(
    cur: sqlite3.Cursor, object_id: str, outcome: str, error: str | None, now: float
) -> None:
    """Add the attempt ending now to ``attempts`` (call before the row leaves ``delivering``:
    its ``updated_at`` is still the claim time).  Keeps the latest :data:`ATTEMPTS_KEPT`."""
    cur.execute(
        "INSERT OR REPLACE INTO attempts (object_id, attempt, started_at, ended_at, outcome, error)"
        " SELECT ref, attempts, updated_at, ?, ?, ? FROM outbound"
        " WHERE kind = 'object' AND ref = ? AND state = 'delivering'",
        (now, outcome, error, object_id),
    )
    cur.execute(
        "DELETE FROM attempts WHERE object_id = ? AND attempt <= "
        " (SELECT attempts FROM outbound WHERE kind = 'object' AND ref = ?) - ?",
        (object_id, object_id, ATTEMPTS_KEPT),
    )


def attempt_history(cur: sqlite3.Cursor, object_id: str) -> list[dict[str, Any]]:
    """The recorded attempts of ``object_id``, oldest first."""
    cur.execute(
        "SELECT attempt, started_at, ended_at, outcome, error FROM attempts"
        " WHERE object_id = ? ORDER BY attempt",
        (object_id,),
    )
    names = ("attempt", "started_at", "ended_at", "outcome", "error")
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def follow_ups_due(
    cur: sqlite3.Cursor,
    now: float,
    limit: int,
    projects: Iterable[str],
    busy: Iterable[str] = (),
) -> list[ObjectRow]:
    """Delivered objects of ``projects`` whose next verification or purge is due, oldest due
    first, leaving out the ``busy`` ones (being checked now)."""
    return _rows_of(cur, outbound.follow_ups_due(cur, OBJECT, now, limit, projects, busy))


def _marks(values: list[str]) -> str:
    return ", ".join("?" for _ in values)


def record_verified(cur: sqlite3.Cursor, object_id: str, now: float) -> None:
    """The copy is verified: the payload's purge is next, once its retention has passed."""
    cur.execute("SELECT purge_after FROM objects WHERE object_id = ?", (object_id,))
    found = cur.fetchone()
    purge_after = found[0] if found is not None and found[0] is not None else now
    outbound.record_verified(cur, OBJECT, object_id, now, max(now, purge_after))


def redeliver(
    cur: sqlite3.Cursor, object_id: str, reason: str, now: float, *, by_operator: bool = False
) -> bool:
    """``delivered -> retry_wait``, due now, for an object not yet verified; its purge_after
    goes, so nothing purges the payload before the next delivery is verified."""
    if not outbound.redeliver(cur, OBJECT, object_id, reason, now, by_operator=by_operator):
        return False
    cur.execute("UPDATE objects SET purge_after = NULL WHERE object_id = ?", (object_id,))
    return True


def record_purged(cur: sqlite3.Cursor, object_id: str, now: float) -> None:
    """The payload is deleted (guarded: only after a verified delivery)."""
    if outbound.settle(cur, OBJECT, object_id, now):
        cur.execute(
            "UPDATE objects SET purged_at = ?, updated_at = ? WHERE object_id = ?",
            (now, now, object_id),
        )


def operator_retry(cur: sqlite3.Cursor, object_id: str, now: float) -> bool:
    """``canner retry``: see :func:`canner.delivery.outbound.operator_retry`."""
    if not outbound.operator_retry(cur, OBJECT, object_id, now):
        return False
    # Sent again: nothing purges the payload before that delivery is verified.
    cur.execute("UPDATE objects SET purge_after = NULL WHERE object_id = ?", (object_id,))
    return True


def clear_flag(cur: sqlite3.Cursor, object_id: str, now: float) -> bool:
    """``canner retry`` of a delivered, verified object flagged for an operator (a rebuild
    could not read one of its journal records): see :func:`canner.delivery.outbound.clear_flag`."""
    return outbound.clear_flag(cur, OBJECT, object_id, now)


def flagged_objects(cur: sqlite3.Cursor, project: str | None = None) -> list[str]:
    """Objects flagged for an operator that a retry can send again."""
    return outbound.flagged(cur, OBJECT, project)


def clear_verified_flags(cur: sqlite3.Cursor, project: str | None, now: float) -> list[ObjectRow]:
    """Flagged objects (of ``project``) that are delivered and verified: nothing to send, so
    their flags are cleared (see :func:`clear_flag`); the rows before."""
    cur.execute(
        "SELECT object_id FROM object_delivery WHERE needs_operator != 0 AND state = 'delivered'"
        " AND verified_at IS NOT NULL AND (? IS NULL OR project = ?)"
        " ORDER BY accepted_at, object_id",
        (project, project),
    )
    cleared = []
    for (oid,) in cur.fetchall():
        before = get_row(cur, oid)
        if clear_flag(cur, oid, now):
            assert before is not None
            cleared.append(before)
    return cleared


def known_among(cur: sqlite3.Cursor, object_ids: list[str]) -> set[str]:
    """The ids of ``object_ids`` (a bounded batch) that the index already holds."""
    if not object_ids:
        return set()
    cur.execute(
        f"SELECT object_id FROM objects WHERE object_id IN ({_marks(object_ids)})", object_ids
    )
    return {row[0] for row in cur.fetchall()}


def count_objects(cur: sqlite3.Cursor) -> int:
    cur.execute("SELECT count(*) FROM objects")
    return int(cur.fetchone()[0])


def rows_page(cur: sqlite3.Cursor, after: tuple[int, str] | None, limit: int) -> list[ObjectRow]:
    """Up to ``limit`` rows in acceptance order, after the ``(accepted_at, object_id)`` key of
    the previous page: listings stream in bounded pages instead of loading every row."""
    if after is None:
        cur.execute(_SELECT + " ORDER BY accepted_at, object_id LIMIT ?", (limit,))
    else:
        cur.execute(
            _SELECT + " WHERE (accepted_at, object_id) > (?, ?)"
            " ORDER BY accepted_at, object_id LIMIT ?",
            (*after, limit),
        )
    return _rows(cur)


def all_rows(cur: sqlite3.Cursor, page: int = 1000) -> Iterator[ObjectRow]:
    """Every row in acceptance order, read a page at a time."""
    after: tuple[int, str] | None = None
    while rows := rows_page(cur, after, page):
        yield from rows
        after = (rows[-1].accepted_at, rows[-1].object_id)


def get_row(cur: sqlite3.Cursor, object_id: str) -> ObjectRow | None:
    cur.execute(_SELECT + " WHERE object_id = ?", (object_id,))
    rows = _rows(cur)
    return rows[0] if rows else None


# -- objects by origin (schema v7's objects_origin) -------------------------------------------

# A bound on what one origin query returns: a file name is one item, sent a few times at most.
ORIGIN_MATCHES_MAX = 100


def ids_by_origin(
    cur: sqlite3.Cursor,
    project: str,
    filename: str,
    downloader: str | None = None,
    any_downloader: bool = False,
    limit: int = ORIGIN_MATCHES_MAX,
) -> list[str]:
    """Ids of the objects of ``project`` named ``filename`` (oldest accepted first): those of
    ``downloader`` (None matches objects without one), or of every downloader with
    ``any_downloader``.  At most ``limit``; served by the ``objects_origin`` index."""
    query = "SELECT object_id FROM objects WHERE project = ? AND filename = ?"
    args: list[Any] = [project, filename]
    if not any_downloader:
        query += " AND downloader IS ?"
        args.append(downloader)
    cur.execute(query + " ORDER BY accepted_at, object_id LIMIT ?", (*args, limit))
    return [row[0] for row in cur.fetchall()]
