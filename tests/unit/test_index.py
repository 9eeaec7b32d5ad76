"""delivery.sqlite: schema upgrades and best-effort inserts."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from canner.delivery.index import (
    AcceptedObject,
    _migrations,
    configure_connection,
    insert_objects,
    upgrade_schema,
)


def obj(oid: str) -> AcceptedObject:
    return AcceptedObject(oid, "example", "a.warc", 10, "blake3:" + "ab" * 32, 1000)


def test_upgrade_creates_the_schema_once(tmp_path: Path) -> None:
    """Upgrading twice is a no-op; WAL is on."""
    path = tmp_path / "delivery.sqlite"
    steps = [number for number, _ in _migrations()]
    assert upgrade_schema(path) == steps[-1]
    assert upgrade_schema(path) == steps[-1]
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone()[0] == len(steps)
    finally:
        conn.close()


def test_inserts_are_idempotent_and_pending(tmp_path: Path) -> None:
    """Inserting the same object twice keeps one pending row."""
    path = tmp_path / "delivery.sqlite"
    upgrade_schema(path)
    conn = sqlite3.connect(path)
    try:
        configure_connection(conn)
        cur = conn.cursor()
        assert insert_objects(cur, [obj("a" * 32), obj("b" * 32)], 5.0) == 2
        assert insert_objects(cur, [obj("a" * 32)], 6.0) == 0
        conn.commit()
        rows = conn.execute("SELECT object_id, state, attempts FROM objects ORDER BY 1").fetchall()
        assert rows == [("a" * 32, "pending", 0), ("b" * 32, "pending", 0)]
    finally:
        conn.close()


class FlakyPool:
    """An adbapi-shaped pool whose first ``failures`` interactions raise 'database is locked'."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def runInteraction(self, f: object, *args: object) -> object:
        from twisted.internet.defer import fail, succeed

        self.calls += 1
        if self.calls <= self.failures:
            return fail(sqlite3.OperationalError("database is locked"))
        return succeed("done")


def test_transient_sqlite_errors_are_retried_then_reported() -> None:
    """Busy errors are retried with pauses; past the last pause the error reaches the caller."""
    from twisted.internet.task import Clock

    from canner.delivery.index import RETRY_PAUSES, DeliveryIndex

    clock = Clock()
    results: list[object] = []
    index = DeliveryIndex(FlakyPool(2), clock)  # type: ignore[arg-type]
    index.run(lambda cur: None).addBoth(results.append)
    assert results == []
    clock.advance(RETRY_PAUSES[0])
    clock.advance(RETRY_PAUSES[1])
    assert results == ["done"]

    failing: list[object] = []
    index = DeliveryIndex(FlakyPool(100), clock)  # type: ignore[arg-type]
    index.run(lambda cur: None).addErrback(failing.append)
    for pause in RETRY_PAUSES:
        clock.advance(pause)
    assert len(failing) == 1
    assert clock.getDelayedCalls() == []
