"""The index summary behind the status page, the metrics and ``canner status`` (issue 37): read
from what the index keeps up to date, it equals the sums over every row it replaced, on an index
holding every kind of row, after every kind of change; and none of its statements reads the rows
at rest (SQLite's own ``EXPLAIN QUERY PLAN``).

Real SQLite files throughout, written with the cursor functions the daemons use.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from canner.delivery import index as sql
from canner.delivery import outbound
from canner.delivery.index import ObjectRow, configure_connection, upgrade_schema
from canner.delivery.liveness import read_heartbeat
from canner.delivery.queue import State
from canner.ledger import store as lstore
from canner.observe import Outbound
from canner.ops import inventory
from canner.ops.inventory import IndexSummary, ProjectTotals, summarize_index
from tests.unit.test_index_at_rest import NOW, accepted, oid, purged, transact, v8_index

OBJECT = Outbound.OBJECT
_SELECT = "SELECT " + ", ".join(sql.COLUMNS) + " FROM object_delivery"


def reference_summary(cur: sqlite3.Cursor, now: float, failures: int = 10) -> IndexSummary:
    """The summary as it was computed before schema v9: four passes over every row of the view
    (kept here as the reference the new one must equal)."""
    cur.execute(
        "SELECT project, state, count(*), coalesce(sum(size_bytes), 0), min(accepted_at),"
        " coalesce(sum(needs_operator), 0) FROM object_delivery GROUP BY project, state"
    )
    states = {s.value: 0 for s in State}
    state_bytes = {s.value: 0 for s in State}
    totals: dict[str, dict[str, int]] = {}
    oldest: float | None = None
    needs_operator = 0
    for project, state, count, size, first, operator in cur.fetchall():
        states[state] = states.get(state, 0) + count
        state_bytes[state] = state_bytes.get(state, 0) + size
        needs_operator += operator
        t = totals.setdefault(project, {"accepted_objects": 0, "accepted_bytes": 0})
        t["accepted_objects"] += count
        t["accepted_bytes"] += size
        kind = "delivered" if state == State.DELIVERED else "pending"
        t[f"{kind}_objects"] = t.get(f"{kind}_objects", 0) + count
        t[f"{kind}_bytes"] = t.get(f"{kind}_bytes", 0) + size
        if state != State.DELIVERED and first is not None:
            oldest = first if oldest is None else min(oldest, first)
    cur.execute(
        "SELECT count(*), min(purge_after) FROM object_delivery WHERE state = 'delivered'"
        " AND purged_at IS NULL AND purge_after IS NOT NULL AND purge_after <= ?",
        (now,),
    )
    overdue, first_due = cur.fetchone()
    cur.execute(
        _SELECT + " WHERE state = 'retry_wait' ORDER BY updated_at DESC LIMIT ?", (failures,)
    )
    recent = tuple(ObjectRow(*row) for row in cur.fetchall())
    cur.execute(
        _SELECT + " WHERE state = 'delivered' AND delivered_at IS NOT NULL"
        " ORDER BY delivered_at DESC LIMIT ?",
        (inventory.RECENT_DELIVERIES,),
    )
    delivered = tuple(ObjectRow(*row) for row in cur.fetchall())
    phases, phase_bytes, flagged_packages = inventory.package_phases(cur)
    flagged_ledgers = len(lstore.flagged_ledgers(cur))
    return IndexSummary(
        states=states,
        state_bytes=state_bytes,
        projects=tuple(ProjectTotals(p, **t) for p, t in sorted(totals.items())),
        oldest_undelivered_at=float(oldest) if oldest is not None else None,
        needs_operator=needs_operator + flagged_packages + flagged_ledgers,
        purge_overdue=overdue,
        oldest_purge_due=first_due,
        recent_failures=recent,
        recent_deliveries=delivered,
        heartbeat=read_heartbeat(cur),
        packages=phases,
        package_bytes=phase_bytes,
    )


# What the triggers keep, recounted from the rows.
STATES = (
    "SELECT project, state, objects, bytes, flagged FROM object_states WHERE objects > 0"
    " ORDER BY project, state"
)
STATES_RECOUNTED = (
    "SELECT project, state, count(*), sum(size_bytes), sum(needs_operator) FROM object_delivery"
    " GROUP BY project, state ORDER BY project, state"
)
UNDELIVERED = "SELECT object_id, accepted_at, state, updated_at FROM undelivered ORDER BY 1"
UNDELIVERED_RECOUNTED = (
    "SELECT object_id, accepted_at, state, updated_at FROM object_delivery"
    " WHERE state != 'delivered' ORDER BY 1"
)


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    path = tmp_path / "delivery.sqlite"
    upgrade_schema(path)
    c = sqlite3.connect(path, isolation_level=None)
    configure_connection(c)
    yield c
    c.close()


def agrees(conn: sqlite3.Connection) -> None:
    """The kept counts equal a recount, and the summary equals the reference at times before,
    among and after every purge due."""
    assert conn.execute(STATES).fetchall() == conn.execute(STATES_RECOUNTED).fetchall()
    assert conn.execute(UNDELIVERED).fetchall() == conn.execute(UNDELIVERED_RECOUNTED).fetchall()
    cur = conn.cursor()
    for now in (NOW - 10_000, NOW, NOW + 50, NOW + 10**6):
        assert summarize_index(cur, now) == reference_summary(cur, now)
        assert summarize_index(cur, now, 3) == reference_summary(cur, now, 3)


def every_change(conn: sqlite3.Connection, check: Callable[[sqlite3.Connection], None]) -> None:
    """Rows of three projects through every change the daemons make, ``check`` after each:
    accepted, rebuilt from delivery records (purged and not), claimed, failed (more failures
    than the summary lists, one needing an operator), delivered, verified, purged, sent again,
    held, reset at start (one row: rows of equal times list in no defined order), released,
    assigned to a ledger and deleted by it, an object row changed after its last attempt, and a
    row of another kind."""
    check(conn)
    transact(conn, sql.insert_objects, [accepted(n) for n in range(1, 31)], NOW - 900)
    transact(conn, sql.insert_objects, [accepted(n, "other") for n in range(31, 36)], NOW - 800)
    rebuilt = purged(40)
    waiting_purge = attrs.evolve(purged(41), purged_at=None)
    transact(
        conn,
        sql.insert_objects,
        [accepted(40, "third", rebuilt), accepted(41, "third", waiting_purge)],
        NOW - 700,
    )
    check(conn)
    claimed = transact(conn, sql.claim_due, NOW - 600, 19, ["example", "other"])
    check(conn)
    ids = [row.object_id for row in claimed]
    for i, object_id in enumerate(ids[:12]):
        transact(conn, sql.record_failure, object_id, f"503 #{i}", NOW + 60, i == 3, NOW - 500 + i)
    check(conn)
    for i, object_id in enumerate(ids[12:18]):
        transact(conn, sql.record_delivered, object_id, f"item-{i}", "f.warc", NOW - 400 + i, 30.0)
    check(conn)
    transact(conn, sql.record_verified, ids[12], NOW - 300)
    transact(conn, sql.record_verified, ids[13], NOW - 299)
    transact(conn, sql.record_purged, ids[12], NOW - 298)
    transact(conn, sql.redeliver, ids[14], "unlisted", NOW - 297)
    transact(conn, outbound.hold, OBJECT, [(oid(25), "flagged")], NOW + 3600, NOW - 296)
    check(conn)
    transact(conn, sql.reset_delivering, NOW - 200)
    check(conn)
    assert len(transact(conn, sql.claim_due, NOW - 150, 1, ["example"])) == 1
    check(conn)
    # An object row changed after its failure: the view's updated_at is the later of the two.
    conn.execute("UPDATE objects SET updated_at = ? WHERE object_id = ?", (NOW - 100, ids[0]))
    check(conn)
    transact(conn, outbound.add, Outbound.PACKAGE, [("1", "example")], NOW)
    check(conn)
    conn.execute(
        "UPDATE objects SET released_at = ? WHERE object_id IN (?, ?)", (NOW, ids[12], oid(40))
    )
    [ledger] = transact(conn, lstore.assign_records, NOW, 0.0, "day", "n", True)
    assert transact(conn, lstore.delete_records, ledger, [ids[12], oid(40)]) == 2
    check(conn)
    conn.execute("DELETE FROM outbound WHERE kind = 'object' AND ref = ?", (oid(31),))
    conn.execute("DELETE FROM objects WHERE object_id = ?", (oid(32),))
    check(conn)


def test_the_summary_equals_the_sums_over_every_row_after_every_change(
    conn: sqlite3.Connection,
) -> None:
    every_change(conn, agrees)
    summary = summarize_index(conn.cursor(), NOW + 10**6)
    # The index above holds every state, more failures than are listed, and overdue purges.
    assert all(summary.states[s.value] for s in State), summary.states
    assert len(summary.recent_failures) == inventory.RECENT_FAILURES
    assert summary.purge_overdue and summary.needs_operator
    assert summary.recent_failures[0].object_id == claimed_first(conn)


def claimed_first(conn: sqlite3.Connection) -> str:
    """The failed object whose objects row changed last (it leads the failures)."""
    [(object_id,)] = conn.execute(
        "SELECT object_id FROM objects WHERE updated_at = ?", (NOW - 100,)
    ).fetchall()
    return str(object_id)


def test_a_version_8_index_upgrades_to_the_same_summary(tmp_path: Path) -> None:
    """Today's index, filled with today's code, gives the same summary after the v9 step as
    the sums over its rows gave before it."""
    path = tmp_path / "delivery.sqlite"
    conn = v8_index(path)
    try:
        every_change(conn, lambda _: None)
        before = {now: reference_summary(conn.cursor(), now) for now in (NOW, NOW + 10**6)}
    finally:
        conn.close()
    assert upgrade_schema(path) == 9
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        agrees(conn)
        for now, summary in before.items():
            assert summarize_index(conn.cursor(), now) == summary
    finally:
        conn.close()


def _plans(conn: sqlite3.Connection, f: Callable[..., Any], *args: Any) -> list[str]:
    """SQLite's plan of every SELECT ``f`` runs on ``conn``."""
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    try:
        f(conn.cursor(), *args)
    finally:
        conn.set_trace_callback(None)
    found = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    return [" | ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + s)) for s in found]


# Tables whose rows are few whatever the node holds: a scan of them costs nothing at scale.
SMALL = ("object_states", "packages", "package_files", "ledgers", "deliver_heartbeat", "p", "l")


def test_no_statement_of_the_summary_reads_the_rows_at_rest(conn: sqlite3.Connection) -> None:
    """Counts from object_states, the oldest undelivered object and the latest failures from
    the first entries of the undelivered index, overdue purges and the latest deliveries from
    their own indexes, the rows shown by their primary keys: no scan of objects or outbound."""
    every_change(conn, lambda _: None)
    plans = _plans(conn, summarize_index, NOW)
    steps = [step for plan in plans for step in plan.split(" | ")]
    # The latest failures: undelivered_failed read newest first, stopped by the LIMIT.
    scans = [
        s
        for s in steps
        if s.startswith("SCAN") and s != "SCAN undelivered USING INDEX undelivered_failed"
    ]
    # package_delivery's rows (p) are packages, ledgers' (l) ledgers: a few whatever the node
    # holds, each joined to its outbound row by its key.
    assert all(s.split()[1] in SMALL for s in scans), plans
    joined = " ".join(plans)
    for index in ("undelivered_oldest", "undelivered_failed", "objects_purge_due"):
        assert index in joined, plans
    assert "outbound_delivered" in joined, plans
