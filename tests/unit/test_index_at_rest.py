"""delivery.sqlite at scale (issue 37): what deliver reads every minute and at start-up reads
what changed or what is in flight, never every row; schema v9 upgrades today's index in place.

Real SQLite files throughout; the plans are SQLite's own (``EXPLAIN QUERY PLAN`` of the exact
statements the cursor functions run), so a query that would read every row fails here whatever
the machine's speed.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from canner.delivery import index as sql
from canner.delivery import outbound
from canner.delivery.index import AcceptedObject, _migrations, configure_connection, upgrade_schema
from canner.ledger import store as lstore
from canner.observe import Outbound
from canner.ops.trends import ALL, sample_trends
from canner.store.receipts import DeliveryRecord

NOW = 1_784_764_800.0
CHECKSUM = "blake3:" + "ab" * 32
OBJECT = Outbound.OBJECT
REPO = Path(__file__).resolve().parents[2]

# The trend sample's query before schema v9: a sum over every row of the view.
AGGREGATE = (
    "SELECT project, coalesce(sum(size_bytes), 0),"
    " coalesce(sum(CASE WHEN state = 'delivered' THEN size_bytes END), 0),"
    " coalesce(sum(CASE WHEN state != 'delivered' THEN size_bytes END), 0),"
    " coalesce(sum(state != 'delivered'), 0)"
    " FROM object_delivery GROUP BY project ORDER BY project"
)
TOTALS = (
    "SELECT project, accepted_bytes, delivered_bytes, pending_bytes, pending_objects"
    " FROM object_totals WHERE objects > 0 ORDER BY project"
)


def oid(n: int) -> str:
    return f"{n:032x}"


def accepted(n: int, project: str = "example", delivery: DeliveryRecord | None = None) -> Any:
    return AcceptedObject(oid(n), project, f"f{n}.warc", 100 + n, CHECKSUM, 1, delivery)


def purged(n: int) -> DeliveryRecord:
    return DeliveryRecord(f"item-{n}", f"f{n}.warc", "00" * 16, 10.0, 20.0, 30.0, 40.0)


def transact(conn: sqlite3.Connection, f: Callable[..., Any], *args: Any) -> Any:
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    result = f(cur, *args)
    cur.execute("COMMIT")
    return result


def v8_index(path: Path) -> sqlite3.Connection:
    """A delivery index as today's release leaves it: schema steps 1 to 8."""
    conn = sqlite3.connect(path, isolation_level=None)
    configure_connection(conn)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for number, text in _migrations():
        if number <= 8:
            conn.executescript(text)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
    return conn


def fill(conn: sqlite3.Connection) -> None:
    """Objects of two projects in every state a busy node holds, written with today's cursor
    functions: waiting (one flagged for an operator), mid-attempt, delivered and waiting for
    its purge, purged, released, and a ledger's."""
    transact(conn, sql.insert_objects, [accepted(n) for n in range(1, 6)], NOW - 900)
    transact(conn, sql.insert_objects, [accepted(6, "other")], NOW - 900)
    transact(
        conn,
        sql.insert_objects,
        [accepted(n, delivery=purged(n)) for n in range(7, 10)],
        NOW - 900,
    )
    transact(conn, outbound.hold, OBJECT, [(oid(5), "flagged")], NOW + 3600, NOW - 800)
    [first, _] = transact(conn, sql.claim_due, NOW - 700, 2, ["example", "other"])
    transact(conn, sql.record_delivered, first.object_id, "item-x", "f.warc", NOW - 600, 60.0)
    transact(conn, sql.record_verified, first.object_id, NOW - 500)
    conn.execute("UPDATE objects SET released_at = ? WHERE object_id = ?", (NOW - 400, oid(8)))
    transact(conn, lstore.assign_records, NOW, 0.0, "day", "n", True)


def test_a_version_8_index_upgrades_in_place_keeping_every_row_with_its_totals(
    tmp_path: Path,
) -> None:
    """Today's layout, filled with today's code, upgrades to v9: every row of every table is
    kept as it was, and the totals the trend sample reads are those of a sum over the rows."""
    path = tmp_path / "delivery.sqlite"
    conn = v8_index(path)
    fill(conn)
    tables = ("objects", "outbound", "attempts", "ledgers", "trends")
    before = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in tables}
    aggregate = conn.execute(AGGREGATE).fetchall()
    conn.close()

    assert upgrade_schema(path) == 9
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        after = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in tables}
        assert after == before
        assert len(before["objects"]) == 9 and before["ledgers"]
        assert conn.execute(TOTALS).fetchall() == aggregate
        assert [p for p, *_ in aggregate] == ["example", "other"]
    finally:
        conn.close()


def test_a_kill_during_the_upgrade_leaves_version_8_whole_and_the_next_start_finishes_it(
    tmp_path: Path,
) -> None:
    """SIGKILLed inside the v9 step (after its statements, before its commit), the upgrade
    leaves the index at version 8 with every row; the next opener applies the step whole."""
    path = tmp_path / "delivery.sqlite"
    conn = v8_index(path)
    fill(conn)
    before = conn.execute("SELECT * FROM object_delivery ORDER BY object_id").fetchall()
    aggregate = conn.execute(AGGREGATE).fetchall()
    conn.close()

    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from canner.delivery.index import upgrade_schema;"
            " upgrade_schema(sys.argv[1])",
            str(path),
        ],
        env={**os.environ, "CANNER_CRASH_AT": "index-upgrade-v9"},
        cwd=REPO,
        check=False,
    )

    assert killed.returncode == -signal.SIGKILL
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute("SELECT max(version) FROM schema_version").fetchone()[0] == 8
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        assert "object_totals" not in names and "outbound_delivering" not in names
        assert conn.execute("SELECT * FROM object_delivery ORDER BY object_id").fetchall() == (
            before
        )
    finally:
        conn.close()
    assert upgrade_schema(path) == 9
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute(TOTALS).fetchall() == aggregate
        assert conn.execute("SELECT * FROM object_delivery ORDER BY object_id").fetchall() == (
            before
        )
    finally:
        conn.close()


def test_the_totals_follow_every_change_of_the_rows(tmp_path: Path) -> None:
    """Every way a row changes (inserted, claimed, delivered, sent again, verified, purged,
    rebuilt from a delivery record, deleted by a ledger) keeps the totals equal to a sum over
    the rows, and the trend sample records them; other kinds of outbound rows count nothing."""
    path = tmp_path / "delivery.sqlite"
    upgrade_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    configure_connection(conn)

    def check() -> None:
        assert conn.execute(TOTALS).fetchall() == conn.execute(AGGREGATE).fetchall()

    try:
        check()
        transact(conn, sql.insert_objects, [accepted(n) for n in range(1, 5)], NOW)
        transact(conn, sql.insert_objects, [accepted(1), accepted(5, "other")], NOW)
        check()
        claimed = transact(conn, sql.claim_due, NOW, 3, ["example"])
        check()
        a, b, c = (row.object_id for row in claimed)
        transact(conn, sql.record_delivered, a, "item-a", "f.warc", NOW, 0.0)
        transact(conn, sql.record_delivered, b, "item-b", "f.warc", NOW, 0.0)
        transact(conn, sql.record_failure, c, "503", NOW + 60, False, NOW)
        check()
        transact(conn, sql.redeliver, b, "unlisted", NOW)
        transact(conn, sql.record_verified, a, NOW)
        transact(conn, sql.record_purged, a, NOW)
        transact(conn, sql.reset_delivering, NOW)
        check()
        transact(conn, outbound.add, Outbound.PACKAGE, [("1", "example")], NOW)
        transact(conn, sql.insert_objects, [accepted(6, delivery=purged(6))], NOW)
        check()
        conn.execute(
            "UPDATE objects SET released_at = ? WHERE object_id IN (?, ?)", (NOW, a, oid(6))
        )
        [ledger] = transact(conn, lstore.assign_records, NOW, 0.0, "day", "n", True)
        assert transact(conn, lstore.delete_records, ledger, [a, oid(6)]) == 2
        check()
        transact(conn, lstore.delete_records, ledger, [])
        conn.execute("DELETE FROM outbound WHERE kind = 'object' AND ref = ?", (oid(5),))
        conn.execute("DELETE FROM objects WHERE object_id = ?", (oid(5),))
        check()
        # "other" has no object left: the sample leaves it out, as the sum over rows did.
        assert transact(conn, sample_trends, None, NOW) == 2
        samples = conn.execute(
            "SELECT project, accepted_bytes, delivered_bytes, pending_bytes, pending_objects"
            " FROM trends ORDER BY project"
        ).fetchall()
        [(_, *every)] = [s for s in samples if s[0] == ALL]
        assert [s for s in samples if s[0] != ALL] == conn.execute(AGGREGATE).fetchall()
        assert every == list(conn.execute(AGGREGATE).fetchall()[0][1:])
    finally:
        conn.close()


def _plans(conn: sqlite3.Connection, f: Callable[..., Any], *args: Any) -> list[str]:
    """SQLite's plan of every statement ``f`` runs on ``conn`` (rolled back)."""
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    try:
        f(cur, *args)
    finally:
        conn.set_trace_callback(None)
        cur.execute("ROLLBACK")
    found = [s for s in statements if s.lstrip().upper().startswith(("SELECT", "UPDATE"))]
    return [" ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + s)) for s in found]


def test_what_deliver_asks_every_tick_and_at_start_is_found_through_an_index(
    tmp_path: Path,
) -> None:
    """The claim of the next due rows, the follow-ups due, the release of orphaned attempts
    (every minute) and the reset of interrupted ones (at start) each search an index that holds
    only what is due or in flight, never the rows at rest: their cost is the same at 10^6 rows
    as at 10^4."""
    path = tmp_path / "delivery.sqlite"
    upgrade_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    configure_connection(conn)
    try:
        transact(conn, sql.insert_objects, [accepted(n) for n in range(1, 5)], NOW)
        lanes = {OBJECT: ["example"], Outbound.LEDGER: [""]}
        claim = _plans(conn, outbound.claim_due_any, NOW, 4, lanes)
        # Each kind's due rows through the index, then each claim by its primary key.
        assert sum("USING INDEX outbound_due" in p for p in claim) == len(lanes)
        assert all("outbound_due" in p or "(kind=? AND ref=?)" in p for p in claim), claim
        follow = _plans(conn, outbound.follow_ups_due_any, NOW, 4, lanes, [])
        assert follow and all("USING INDEX outbound_follow_up" in p for p in follow)
        for job in (
            lambda cur: outbound.release_orphans_any(cur, [(OBJECT, oid(1))], NOW),
            lambda cur: outbound.reset_delivering(cur, OBJECT, NOW),
        ):
            plans = _plans(conn, job)
            assert plans and all("USING INDEX outbound_delivering" in p for p in plans), plans
        sample = _plans(conn, sample_trends, None, NOW)
        assert "object_totals" in sample[0] and "objects" not in sample[0].split()
    finally:
        conn.close()


def test_an_upgrade_waits_out_the_other_daemons_step_longer_than_the_busy_timeout(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Both daemons start together and both upgrade: while one applies a step that reads every
    row (schema 9 on a large index takes longer than the busy timeout of queries), the other
    waits for it instead of failing with "database is locked" (deliver would refuse to start,
    the receiver would run without its index feed)."""
    import threading
    import time

    monkeypatch.setattr(sql, "BUSY_TIMEOUT_MS", 50)
    path = tmp_path / "delivery.sqlite"
    v8_index(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the other daemon, mid-step
    outcome: list[object] = []

    def upgrade() -> None:
        try:
            outcome.append(upgrade_schema(path))
        except Exception as e:
            outcome.append(e)

    opener = threading.Thread(target=upgrade)
    opener.start()
    time.sleep(0.5)  # ten busy timeouts
    holder.execute("COMMIT")
    holder.close()
    opener.join(30)
    assert outcome == [9]
