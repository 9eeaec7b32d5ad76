"""delivery.sqlite: schema upgrades and best-effort inserts."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from canner.delivery.index import (
    AcceptedObject,
    _migrations,
    configure_connection,
    index_damage,
    insert_objects,
    is_damaged,
    move_aside,
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
        rows = conn.execute(
            "SELECT object_id, state, attempts FROM object_delivery ORDER BY 1"
        ).fetchall()
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


def _upgrade_at(path: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        upgrade_schema(Path(path))
        results.put(None)
    except Exception as e:
        results.put(repr(e))


def test_receiver_and_deliver_can_open_a_new_index_at_the_same_moment(tmp_path: Path) -> None:
    """Two processes creating delivery.sqlite at once (both daemons starting on a fresh data
    directory) both get the schema: neither dies of "database is locked" while the other
    switches the file to WAL (one in nine such starts did)."""
    context = multiprocessing.get_context("fork")
    failures = []
    for trial in range(30):
        path = str(tmp_path / f"delivery-{trial}.sqlite")
        barrier, results = context.Barrier(2), context.Queue()
        openers = [
            context.Process(target=_upgrade_at, args=(path, barrier, results)) for _ in range(2)
        ]
        for opener in openers:
            opener.start()
        for opener in openers:
            opener.join(30)
        failures += [r for r in (results.get(timeout=5), results.get(timeout=5)) if r]
    assert failures == []


def test_a_connection_waits_out_another_switching_to_wal() -> None:
    """ "database is locked" from the WAL switch (which SQLite gives at once, without its busy
    handler) is tried again until it passes; any other error is raised at once."""

    class Connection:
        def __init__(self, errors: list[str]) -> None:
            self.errors, self.statements = errors, []

        def execute(self, statement: str) -> None:
            self.statements.append(statement)
            if statement == "PRAGMA journal_mode=WAL" and self.errors:
                raise sqlite3.OperationalError(self.errors.pop(0))

    locked = Connection(["database is locked", "database is locked"])
    configure_connection(locked)  # type: ignore[arg-type]
    assert locked.statements.count("PRAGMA journal_mode=WAL") == 3
    assert locked.statements[0].startswith("PRAGMA busy_timeout=")
    broken = Connection(["disk I/O error"])
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        configure_connection(broken)  # type: ignore[arg-type]
    assert broken.statements.count("PRAGMA journal_mode=WAL") == 1


def test_a_version_5_index_keeps_every_package_through_the_upgrade(tmp_path: Path) -> None:
    """An index written by the previous release (schema 5, the steps it shipped) with packages
    in every delivery state, one of them mid-attempt, and a ledger mid-upload, upgrades in
    place: every row and value is kept, the new counters start at zero, and the pipelines'
    queries read them."""
    from canner.ledger import store as lstore
    from canner.packaging import batches as psql

    path = tmp_path / "delivery.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    configure_connection(conn)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for number, text in _migrations():
        if number <= 5:
            conn.executescript(text)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
    states = ["pending", "delivering", "retry_wait", "delivered", "delivered"]
    for n, state in enumerate(states):
        verified = 1000.0 + n if n == 4 else None
        conn.execute(
            "INSERT INTO packages (project, state, opened_at, package_id, delivery_state,"
            " attempts, next_attempt_at, last_error, needs_operator, remote_identifier,"
            " delivered_at, remote_verified_at, next_check_at, updated_at)"
            " VALUES ('example', 'verified', 1.0, ?, ?, ?, 5.0, ?, ?, ?, ?, ?, ?, 7.0)",
            (
                f"{n:032x}",
                state,
                n,
                "503" if state == "retry_wait" else None,
                int(state == "retry_wait"),
                "item" if state == "delivered" else None,
                900.0 if state == "delivered" else None,
                verified,
                950.0 if state == "delivered" else None,
            ),
        )
    conn.execute(
        "INSERT INTO ledgers (name, period, state, records, bytes, md5, created_at, attempts,"
        " next_attempt_at, last_error, needs_operator) VALUES ('n-2026-11-30', '2026-11-30',"
        " 'written', 3, 300, ?, 1.0, 2, 5.0, 'upload: 503', 0)",
        ("ab" * 16,),
    )
    before = [tuple(r) for r in conn.execute("SELECT * FROM packages ORDER BY batch_id")]
    ledger_before = conn.execute("SELECT * FROM ledgers").fetchall()
    conn.close()

    assert upgrade_schema(path) == _migrations()[-1][0]
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        rows = conn.execute("SELECT * FROM package_delivery ORDER BY batch_id").fetchall()
        assert [r[: len(before[0])] for r in rows] == before
        cur = conn.cursor()
        packages = psql.all_packages(cur)
        assert [p.delivery_state for p in packages] == states
        assert all(p.redeliveries == 0 and p.force_upload == 0 for p in packages)
        # The mid-attempt one is due again after a restart, as before the upgrade.
        psql.reset_interrupted(cur, 10.0)
        claimed = psql.claim_deliveries(cur, 10.0, 10, ["example"])
        assert {p.package_id for p in claimed} == {f"{n:032x}" for n in (0, 1, 2)}
        due = psql.follow_ups_due(cur, 1000.0, 10, ["example"], [])
        assert {p.package_id for p in due} == {f"{n:032x}" for n in (3, 4)}
        assert len(ledger_before) == 1
        [ledger] = lstore.due_ledgers(cur, 10.0)
        assert (ledger.state, ledger.attempts, ledger.next_attempt_at, ledger.last_error) == (
            "written",
            2,
            5.0,
            "upload: 503",
        )
        assert ledger.force_upload == 0
    finally:
        conn.close()


def _v6_index(path: Path) -> sqlite3.Connection:
    """A delivery index as the previous release left it: schema steps 1 to 6."""
    conn = sqlite3.connect(path, isolation_level=None)
    configure_connection(conn)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for number, text in _migrations():
        if number <= 6:
            conn.executescript(text)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
    return conn


def test_a_version_6_index_keeps_every_object_and_ledger_through_the_upgrade(
    tmp_path: Path,
) -> None:
    """Objects in every delivery state (one mid-attempt, one flagged, one purged) and ledgers
    in every state, written with the previous release's layout (delivery columns on each
    owner's table), read the same through the outbound table after the upgrade; the
    pipelines' queries pick up where they were."""
    from canner.delivery import index as sql
    from canner.delivery import outbound
    from canner.ledger import store as lstore
    from canner.observe import Outbound

    path = tmp_path / "delivery.sqlite"
    conn = _v6_index(path)
    # What the previous release's objects table had (the downloader came with version 7).
    previous = [c for c in sql.COLUMNS if c != "downloader"]
    columns = ", ".join(previous)
    objects = [
        # state, attempts, next_attempt_at, error, flag, delivered, verified, purged, check
        ("pending", 0, 1.0, None, 0, None, None, None, None),
        ("delivering", 2, 2.0, "503", 0, None, None, None, None),
        ("retry_wait", 5, 99.0, "403 Forbidden", 1, None, None, None, None),
        ("delivered", 1, 3.0, None, 0, 500.0, None, None, 600.0),
        ("delivered", 1, 3.0, "read-back: other bytes", 1, 500.0, None, None, 700.0),
        ("delivered", 1, 3.0, None, 0, 500.0, 510.0, None, 800.0),
        ("delivered", 1, 3.0, None, 0, 500.0, 510.0, 900.0, None),
    ]
    for n, (state, tries, due, error, flag, delivered, verified, purged, check) in enumerate(
        objects
    ):
        conn.execute(
            f"INSERT INTO objects ({columns}) VALUES ({', '.join('?' for _ in previous)})",
            (
                f"{n:032x}",
                "example",
                f"f{n}.warc.gz",
                10 + n,
                "blake3:" + "ab" * 32,
                100 + n,
                state,
                tries,
                due,
                error,
                flag,
                "cd" * 16 if delivered else None,
                "item" if delivered else None,
                f"f{n}.warc.gz" if delivered else None,
                delivered,
                verified,
                550.0 if delivered else None,
                purged,
                check,
                42.0 + n,
                n % 2,
                n % 3 == 1,
                1000.0 if purged else None,
            ),
        )
    ledgers = [
        ("writing", None, None, None),
        ("written", None, None, None),
        ("uploaded", 300.0, None, None),
        ("deleting", 300.0, 310.0, None),
        ("done", 300.0, 310.0, 320.0),
    ]
    for n, (state, uploaded, verified, done) in enumerate(ledgers):
        conn.execute(
            "INSERT INTO ledgers (name, period, state, records, bytes, md5, identifier,"
            " remote_name, created_at, written_at, uploaded_at, verified_at, done_at, attempts,"
            " next_attempt_at, last_error, needs_operator) VALUES (?, '2026-11-30', ?, 3, 300,"
            " ?, 'ledgers-item', ?, 1.0, 2.0, ?, ?, ?, ?, 50.0, ?, 0)",
            (
                f"n-{n}",
                state,
                "ab" * 16,
                f"n-{n}.jsonl.zst",
                uploaded,
                verified,
                done,
                n,
                "upload: 503" if state == "written" else None,
            ),
        )
    before = conn.execute(f"SELECT {columns} FROM objects ORDER BY object_id").fetchall()
    conn.close()

    assert upgrade_schema(path) == _migrations()[-1][0]
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        cur = conn.cursor()
        after = [tuple(row.as_dict().values()) for row in sql.all_rows(cur)]
        assert after == [(*row, None) for row in before]
        # The attempt a crash cut short is due again; the flagged one waits for its retry.
        assert sql.reset_delivering(cur, 10.0) == 1
        claimed = sql.claim_due(cur, 10.0, 10, ["example"])
        assert [r.object_id for r in claimed] == [f"{0:032x}", f"{1:032x}"]
        assert claimed[1].attempts == 3
        checks = sql.follow_ups_due(cur, 1000.0, 10, ["example"])
        assert [r.object_id for r in checks] == [f"{n:032x}" for n in (3, 4, 5)]
        assert sql.flagged_objects(cur) == [f"{n:032x}" for n in (2, 4)]
        rows = {row.name: row for row in lstore.ledgers(cur)}
        assert [(r.state, r.uploaded_at, r.verified_at, r.done_at) for r in rows.values()] == [
            (state, uploaded, verified, done) for state, uploaded, verified, done in ledgers
        ]
        assert rows["n-1"].attempts == 1 and rows["n-1"].last_error == "upload: 503"
        # Written: its upload is due (at its old time); uploaded: its verification is.
        assert [r.name for r in lstore.due_ledgers(cur, 60.0)] == ["n-0", "n-1", "n-2", "n-3"]
        assert outbound.claim(cur, Outbound.LEDGER, str(rows["n-1"].ledger_id), 60.0)
        assert lstore.record_uploaded(cur, rows["n-1"].ledger_id, "ledgers-item", 61.0)
        again = lstore.get_ledger(cur, rows["n-1"].ledger_id)
        assert again is not None and (again.state, again.uploaded_at) == ("uploaded", 61.0)
    finally:
        conn.close()


def test_index_damage_tells_a_damaged_file_from_a_sound_or_missing_one(tmp_path: Path) -> None:
    """Random bytes and a database with a malformed page are damaged (and left as they were); a
    sound index and a missing one are not."""
    path = tmp_path / "delivery.sqlite"
    assert index_damage(path) is None
    upgrade_schema(path)
    assert index_damage(path) is None
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    assert index_damage(path) == "file is not a database"
    assert path.read_bytes() == garbage
    upgrade_schema(sound := tmp_path / "sound.sqlite")
    data = bytearray(sound.read_bytes())
    page = 4096
    data[2 * page : 3 * page] = os.urandom(page)  # a table's page, past the header
    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(bytes(data))
    assert index_damage(broken) is not None


def test_errors_that_may_pass_are_no_damage() -> None:
    """A busy database or an I/O error is not damage: only corruption and "not a database"."""
    assert not is_damaged(sqlite3.OperationalError("database is locked"))
    assert not is_damaged(ValueError("file is not a database"))
    assert not is_damaged(None)


def test_move_aside_keeps_every_file_and_never_overwrites(tmp_path: Path) -> None:
    """The index and its WAL and SHM get one timestamped name each, bytes unchanged; a name
    already taken refuses the whole move."""
    path = tmp_path / "delivery.sqlite"
    contents = {"": b"db", "-wal": b"wal", "-shm": b"shm"}
    for suffix, data in contents.items():
        (tmp_path / f"delivery.sqlite{suffix}").write_bytes(data)
    moves = move_aside(path, 1_800_000_000.0)
    assert [new.name for _, new in moves] == [
        "delivery-damaged-20270115T080000Z.sqlite-wal",
        "delivery-damaged-20270115T080000Z.sqlite-shm",
        "delivery-damaged-20270115T080000Z.sqlite",
    ]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {
        f"delivery-damaged-20270115T080000Z.sqlite{s}": d for s, d in contents.items()
    }
    path.write_bytes(b"again")
    with pytest.raises(FileExistsError):
        move_aside(path, 1_800_000_000.0)
    assert path.read_bytes() == b"again"
