"""The ledger's rows in ``delivery.sqlite``: cursor functions (production runs them through the
index's pool, the ``canner`` command and unit tests on a ``sqlite3`` cursor).

A record is assigned to a ledger once, in the transaction that creates the ledger row
(``objects.ledger_id``), so no record can ever be written into two ledgers.  A record is
archivable once released, its payload purged, and ``delay`` passed since the release; its period
is that of the later of release and purge.  A period's ledger is made once the period has closed
and ``delay`` has passed since (all its records are then archivable), or at once on a flush.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from attrs import frozen

from canner.ledger.files import period_end, period_sql

LEDGER_COLUMNS = (
    "ledger_id",
    "name",
    "period",
    "state",
    "records",
    "bytes",
    "md5",
    "blake3",
    "identifier",
    "remote_name",
    "created_at",
    "written_at",
    "uploaded_at",
    "verified_at",
    "done_at",
    "attempts",
    "next_attempt_at",
    "last_error",
    "needs_operator",
    "force_upload",
)
_SELECT = "SELECT " + ", ".join(LEDGER_COLUMNS) + " FROM ledgers"
STATES = ("writing", "written", "uploaded", "verified", "deleting", "done")


@frozen
class LedgerRow:
    """One row of ``ledgers``."""

    ledger_id: int
    name: str
    period: str
    state: str
    records: int
    bytes: int | None
    md5: str | None
    blake3: str | None
    identifier: str | None
    remote_name: str | None
    created_at: float
    written_at: float | None
    uploaded_at: float | None
    verified_at: float | None
    done_at: float | None
    attempts: int
    next_attempt_at: float
    last_error: str | None
    needs_operator: int
    force_upload: int = 0  # IA served other bytes: the next upload ignores a matching listing

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in LEDGER_COLUMNS}


def _eligible(delay: float) -> tuple[str, tuple[float, ...]]:
    return (
        "released_at IS NOT NULL AND ledger_id IS NULL AND purged_at IS NOT NULL"
        " AND released_at <= ?",
        (delay,),
    )


def ledger_name(node: str, period: str, n: int) -> str:
    return f"{node}-{period}" if n == 1 else f"{node}-{period}-{n}"


def assign_records(
    cur: sqlite3.Cursor,
    now: float,
    delay: float,
    period: str,
    node: str,
    flush: bool,
    taken: Iterable[str] = (),
) -> list[int]:
    """Create a ledger for each period whose records are due and assign them to it; returns
    the new ledger ids.  ``taken`` are names no ledger may use again (verified ledgers on disk
    that the index lost)."""
    where, _ = _eligible(delay)
    cutoff = now - delay
    key = period_sql(period)
    cur.execute(f"SELECT DISTINCT {key} FROM objects WHERE {where} ORDER BY 1", (cutoff,))
    periods = [row[0] for row in cur.fetchall()]
    used = set(taken)
    cur.execute("SELECT name FROM ledgers")
    used.update(row[0] for row in cur.fetchall())
    made = []
    for p in periods:
        if not flush and period_end(p) + delay > now:
            continue
        n = 1
        while ledger_name(node, p, n) in used:
            n += 1
        name = ledger_name(node, p, n)
        used.add(name)
        cur.execute(
            "INSERT INTO ledgers (name, period, state, created_at) VALUES (?, ?, 'writing', ?)",
            (name, p, now),
        )
        ledger_id = cur.lastrowid
        assert ledger_id is not None
        cur.execute(
            f"UPDATE objects SET ledger_id = ? WHERE {where} AND {key} = ?",
            (ledger_id, cutoff, p),
        )
        cur.execute("UPDATE ledgers SET records = ? WHERE ledger_id = ?", (cur.rowcount, ledger_id))
        made.append(ledger_id)
    return made


def get_ledger(cur: sqlite3.Cursor, ledger_id: int) -> LedgerRow | None:
    cur.execute(_SELECT + " WHERE ledger_id = ?", (ledger_id,))
    row = cur.fetchone()
    return LedgerRow(*row) if row else None


def ledgers(cur: sqlite3.Cursor) -> list[LedgerRow]:
    cur.execute(_SELECT + " ORDER BY ledger_id")
    return [LedgerRow(*row) for row in cur.fetchall()]


def due_ledgers(cur: sqlite3.Cursor, now: float) -> list[LedgerRow]:
    """Ledgers with work left whose next step is due, oldest first."""
    cur.execute(
        _SELECT + " WHERE state != 'done' AND next_attempt_at <= ? ORDER BY ledger_id", (now,)
    )
    return [LedgerRow(*row) for row in cur.fetchall()]


def unfinished(cur: sqlite3.Cursor) -> int:
    cur.execute("SELECT count(*) FROM ledgers WHERE state != 'done'")
    return int(cur.fetchone()[0])


def update_ledger(cur: sqlite3.Cursor, ledger_id: int, expect: str, values: dict[str, Any]) -> bool:
    """Set ``values`` on the ledger if it is still in state ``expect`` (guarded)."""
    names = sorted(values)
    sets = ", ".join(f"{n} = ?" for n in names)
    cur.execute(
        f"UPDATE ledgers SET {sets} WHERE ledger_id = ? AND state = ?",
        (*(values[n] for n in names), ledger_id, expect),
    )
    return cur.rowcount == 1


def operator_retry(cur: sqlite3.Cursor, name: str, now: float) -> LedgerRow | None:
    """``canner retry LEDGER``: an unfinished ledger's next step is due now, its flag cleared.
    The row as it was before, or None (unknown, or done)."""
    cur.execute(_SELECT + " WHERE name = ?", (name,))
    row = cur.fetchone()
    if row is None:
        return None
    cur.execute(
        "UPDATE ledgers SET next_attempt_at = ?, needs_operator = 0"
        " WHERE name = ? AND state != 'done'",
        (now, name),
    )
    return LedgerRow(*row) if cur.rowcount == 1 else None


def flagged_ledgers(cur: sqlite3.Cursor) -> list[str]:
    """Names of the unfinished ledgers flagged for an operator."""
    cur.execute(
        "SELECT name FROM ledgers WHERE needs_operator != 0 AND state != 'done' ORDER BY ledger_id"
    )
    return [row[0] for row in cur.fetchall()]


def record_ledger_failure(
    cur: sqlite3.Cursor, ledger_id: int, error: str, retry_at: float, needs_operator: bool
) -> None:
    cur.execute(
        "UPDATE ledgers SET attempts = attempts + 1, last_error = ?, next_attempt_at = ?,"
        " needs_operator = ? WHERE ledger_id = ?",
        (error[:2000], retry_at, int(needs_operator), ledger_id),
    )


def adopt_manifest(
    cur: sqlite3.Cursor, name: str, period: str, records: int, facts: dict[str, Any], done: bool
) -> bool:
    """Make the index agree with a verified ledger's manifest (the index was lost or is behind):
    its row exists and is at least ``deleting`` (``done`` when the manifest says so).  Returns
    True when anything changed."""
    state = "done" if done else "deleting"
    cur.execute("SELECT ledger_id, state FROM ledgers WHERE name = ?", (name,))
    found = cur.fetchone()
    if found is None:
        cur.execute(
            "INSERT INTO ledgers (name, period, state, records, bytes, md5, blake3, identifier,"
            " remote_name, created_at, verified_at, done_at)"
            " VALUES (:name, :period, :state, :records, :bytes, :md5, :blake3, :identifier,"
            " :remote_name, :verified_at, :verified_at, :done_at)",
            {"name": name, "period": period, "state": state, "records": records, **facts},
        )
        return True
    ledger_id, current = found
    if STATES.index(current) >= STATES.index(state):
        return False
    cur.execute(
        "UPDATE ledgers SET state = ?, verified_at = coalesce(verified_at, ?) WHERE ledger_id = ?",
        (state, facts["verified_at"], ledger_id),
    )
    return True


# -- records ---------------------------------------------------------------------------------

RECORD_COLUMNS = (
    "object_id",
    "project",
    "filename",
    "remote_identifier",
    "remote_name",
    "delivered_at",
    "verified_at",
    "purged_at",
    "released_at",
)


def records_page(
    cur: sqlite3.Cursor, ledger_id: int, after: str, limit: int
) -> list[dict[str, Any]]:
    """Up to ``limit`` records of a ledger after object id ``after``, in object id order."""
    cur.execute(
        "SELECT " + ", ".join(RECORD_COLUMNS) + " FROM objects"
        " WHERE ledger_id = ? AND object_id > ? ORDER BY object_id LIMIT ?",
        (ledger_id, after, limit),
    )
    return [dict(zip(RECORD_COLUMNS, row, strict=True)) for row in cur.fetchall()]


def delete_records(cur: sqlite3.Cursor, ledger_id: int, object_ids: Sequence[str]) -> int:
    """Delete the index rows (and their attempt history) of archived records of ``ledger_id``."""
    if not object_ids:
        return 0
    marks = ", ".join("?" for _ in object_ids)
    cur.execute(f"DELETE FROM attempts WHERE object_id IN ({marks})", list(object_ids))
    cur.execute(
        f"DELETE FROM objects WHERE ledger_id = ? AND object_id IN ({marks})",
        (ledger_id, *object_ids),
    )
    return cur.rowcount


# -- flush requests --------------------------------------------------------------------------


def request_flush(cur: sqlite3.Cursor, now: float) -> None:
    cur.execute(
        "INSERT INTO ledger_flush (id, requested_at, handled_at) VALUES (1, ?, NULL)"
        " ON CONFLICT (id) DO UPDATE SET requested_at = excluded.requested_at, handled_at = NULL",
        (now,),
    )


def pending_flush(cur: sqlite3.Cursor) -> float | None:
    cur.execute("SELECT requested_at FROM ledger_flush WHERE id = 1 AND handled_at IS NULL")
    row = cur.fetchone()
    return float(row[0]) if row else None


def flush_state(cur: sqlite3.Cursor) -> tuple[float, float | None] | None:
    cur.execute("SELECT requested_at, handled_at FROM ledger_flush WHERE id = 1")
    row = cur.fetchone()
    return (row[0], row[1]) if row else None


def flush_handled(cur: sqlite3.Cursor, requested_at: float, now: float) -> None:
    cur.execute(
        "UPDATE ledger_flush SET handled_at = ? WHERE id = 1 AND requested_at = ?",
        (now, requested_at),
    )
