"""``delivery.sqlite``: the operational index of accepted objects and their delivery state.

SQL lives in plain functions over a cursor (production runs them with ``runInteraction``, unit tests
against a ``sqlite3`` cursor).  :func:`open_index` upgrades the schema (numbered ``schema/*.sql``
files and a version table) and returns a :class:`DeliveryIndex` over an adbapi pool with one
connection.  The index is never the only copy of a fact: it can be rebuilt from ``receipts/``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from attrs import define, field, frozen
from twisted.enterprise.adbapi import ConnectionPool
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner.receipts import Origin, Receipt

log = Logger()

BUSY_TIMEOUT_MS = 10_000


@frozen
class AcceptedObject:
    """What the index needs to know about a new object (from its receipt and origin record)."""

    object_id: str
    project: str
    filename: str | None
    size_bytes: int
    checksum: str
    accepted_at: int

    @classmethod
    def of(cls, receipt: Receipt, origin: Origin) -> AcceptedObject:
        return cls(
            receipt.object_id,
            origin.project,
            origin.filename,
            receipt.size_bytes,
            str(receipt.checksum),
            receipt.accepted_at,
        )


def configure_connection(conn: sqlite3.Connection) -> None:
    """PRAGMAs every connection needs: WAL, full sync, busy timeout, foreign keys."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA foreign_keys=ON")


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
    deliver) never apply a step twice.  Raises ``RuntimeError`` for a database newer than us.
    """
    steps = _migrations()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        for number, sql in steps:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
                current = row[0] or 0
                if current < number:
                    for statement in _statements(sql):
                        conn.execute(statement)
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
    """Insert rows for objects not yet in the index (state ``pending``); return how many."""
    before = cur.connection.total_changes
    cur.executemany(
        "INSERT OR IGNORE INTO objects (object_id, project, filename, size_bytes, checksum,"
        " accepted_at, state, next_attempt_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
        [
            (o.object_id, o.project, o.filename, o.size_bytes, o.checksum, o.accepted_at, now, now)
            for o in objects
        ],
    )
    return cur.connection.total_changes - before


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


@define(eq=False)
class DeliveryIndex:
    """``delivery.sqlite`` behind an adbapi pool."""

    _pool: ConnectionPool
    _clock: IReactorTime

    def insert(self, objects: list[AcceptedObject]) -> Deferred[int]:
        d: Deferred[int] = self._pool.runInteraction(insert_objects, objects, self._clock.seconds())
        return d

    def run(self, f: Any, *args: Any) -> Deferred[Any]:
        """Run a cursor function in a transaction."""
        d: Deferred[Any] = self._pool.runInteraction(f, *args)
        return d

    def close(self) -> None:
        self._pool.close()


@define(eq=False)
class IndexFeed:
    """Best-effort, batched inserts of newly accepted objects (acceptance step 5).

    Acceptances that finish while an insert runs are written together in the next transaction, so
    one WAL fsync serves many.  A failure is logged and never reaches the worker: the deliver
    process rescans ``receipts/`` and inserts whatever is missing.
    """

    _index: DeliveryIndex
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
            log.error(
                "delivery index insert of {count} objects failed (the deliver rescan will add"
                " them): {error}",
                count=len(batch),
                error=str(failure.value),
            )

        # Assign before adding callbacks: an index that answers synchronously calls done() at once.
        running = self._running = self._index.insert(batch)
        running.addCallbacks(lambda _: None, failed).addBoth(done)
