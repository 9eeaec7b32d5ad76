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

from canner.delivery import outbound
from canner.ledger.files import period_end, period_sql
from canner.observe import Outbound

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
# A ledger's own steps are writing, written, deleting, done; its upload and verification are
# its outbound row's (canner.delivery.outbound).  ``state`` shows a written ledger whose upload went
# through as ``uploaded``, as before the outbound table; ``attempts`` to ``needs_operator``
# are the outbound row's while the ledger is being sent, its own steps' otherwise.
_PHASE = "CASE WHEN l.state = 'written' AND d.state = 'delivered' THEN 'uploaded' ELSE l.state END"


def _either(column: str, sending: str = "") -> str:
    return f"CASE WHEN l.state = 'written' THEN {sending or 'd.' + column} ELSE l.{column} END"


_SENDING_DUE = "CASE WHEN d.state = 'delivered' THEN d.next_check_at ELSE d.next_attempt_at END"
_SELECT = (
    f"SELECT l.ledger_id, l.name, l.period, {_PHASE}, l.records, l.bytes, l.md5, l.blake3,"
    " l.identifier, l.remote_name, l.created_at, l.written_at, d.delivered_at, d.verified_at,"
    f" l.done_at, coalesce({_either('attempts')}, 0),"
    f" coalesce({_either('next_attempt_at', _SENDING_DUE)}, 0), {_either('last_error')},"
    f" coalesce({_either('needs_operator')}, 0), coalesce(d.force_upload, 0)"
    " FROM ledgers l LEFT JOIN outbound d ON d.kind = 'ledger'"
    " AND d.ref = CAST(l.ledger_id AS TEXT)"
)
STATES = ("writing", "written", "uploaded", "verified", "deleting", "done")
LEDGER = Outbound.LEDGER


@frozen
class LedgerRow:
    """One ledger with its delivery facts (``uploaded_at``, ``verified_at``, ``force_upload``
    come from its outbound row)."""

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
    cur.execute(_SELECT + " WHERE l.ledger_id = ?", (ledger_id,))
    row = cur.fetchone()
    return LedgerRow(*row) if row else None


def ledgers(cur: sqlite3.Cursor) -> list[LedgerRow]:
    cur.execute(_SELECT + " ORDER BY l.ledger_id")
    return [LedgerRow(*row) for row in cur.fetchall()]


def due_ledgers(cur: sqlite3.Cursor, now: float) -> list[LedgerRow]:
    """Ledgers with work left whose next step is due, oldest first."""
    cur.execute(
        _SELECT + " WHERE l.state != 'done'"
        f" AND coalesce({_either('next_attempt_at', _SENDING_DUE)}, 0) <= ? ORDER BY l.ledger_id",
        (now,),
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
    """``canner retry LEDGER``: a ledger being sent goes as an object would (a waiting upload
    is due now; an upload not verified is sent again); a ledger stuck in its own step (writing,
    deleting) runs it now.  Its flag is cleared.  The row as it was before, or None (unknown,
    or nothing to retry)."""
    cur.execute(_SELECT + " WHERE l.name = ?", (name,))
    found = cur.fetchone()
    if found is None:
        return None
    row = LedgerRow(*found)
    if row.state in ("written", "uploaded", "verified"):
        retried = outbound.operator_retry(cur, LEDGER, str(row.ledger_id), now)
    else:
        cur.execute(
            "UPDATE ledgers SET next_attempt_at = ?, needs_operator = 0"
            " WHERE ledger_id = ? AND state IN ('writing', 'deleting')",
            (now, row.ledger_id),
        )
        retried = cur.rowcount == 1
    return row if retried else None


def flagged_ledgers(cur: sqlite3.Cursor, project: str | None = None) -> list[str]:
    """Names of the unfinished ledgers flagged for an operator; none of a ``project`` (a
    ledger holds the records of every project)."""
    if project is not None:
        return []
    cur.execute(
        _SELECT + f" WHERE l.state != 'done' AND {_either('needs_operator')} != 0"
        " ORDER BY l.ledger_id"
    )
    return [LedgerRow(*row).name for row in cur.fetchall()]


def ledger_exists(cur: sqlite3.Cursor, name: str) -> bool:
    cur.execute("SELECT 1 FROM ledgers WHERE name = ?", (name,))
    return cur.fetchone() is not None


# ``canner retry LEDGER`` and ``canner retry --needs-operator``.
BY_NAME = outbound.Named(
    LEDGER, exists=ledger_exists, retry=operator_retry, flagged=flagged_ledgers
)


def record_ledger_failure(
    cur: sqlite3.Cursor, ledger_id: int, error: str, retry_at: float, needs_operator: bool
) -> None:
    """The ledger's own step (writing, deleting) failed: try again at ``retry_at``."""
    cur.execute(
        "UPDATE ledgers SET attempts = attempts + 1, last_error = ?, next_attempt_at = ?,"
        " needs_operator = ? WHERE ledger_id = ?",
        (error[:2000], retry_at, int(needs_operator), ledger_id),
    )


# -- sending: the ledger's outbound row ------------------------------------------------------


def record_written(cur: sqlite3.Cursor, ledger_id: int, values: dict[str, Any], now: float) -> bool:
    """``writing -> written`` with ``values``; its upload is due now (guarded)."""
    if not update_ledger(
        cur,
        ledger_id,
        "writing",
        {
            **values,
            "state": "written",
            "attempts": 0,
            "next_attempt_at": 0,
            "last_error": None,
            "needs_operator": 0,
        },
    ):
        return False
    outbound.add(cur, LEDGER, [(str(ledger_id), "")], now)
    return True


def record_uploaded(cur: sqlite3.Cursor, ledger_id: int, identifier: str, now: float) -> bool:
    return outbound.record_delivered(cur, LEDGER, str(ledger_id), identifier, now)


def record_upload_failure(
    cur: sqlite3.Cursor,
    ledger_id: int,
    error: str,
    retry_at: float,
    needs_operator: bool,
    now: float,
) -> bool:
    return outbound.record_failure(
        cur, LEDGER, str(ledger_id), error, retry_at, needs_operator, now
    )


def send_again(
    cur: sqlite3.Cursor,
    ledger_id: int,
    error: str,
    now: float,
    due: float,
    wrong_copy: bool,
) -> bool:
    """Upload the ledger again at ``due``: IA lost it, or (``wrong_copy``) serves other bytes,
    which flags it and makes the next upload go through over a matching listing."""
    return outbound.redeliver(
        cur,
        LEDGER,
        str(ledger_id),
        error,
        now,
        due=due,
        needs_operator=wrong_copy,
        force_upload=wrong_copy,
    )


def record_verified(cur: sqlite3.Cursor, ledger_id: int, now: float) -> bool:
    """The copy at IA is verified (its manifest written): ``written -> deleting``."""
    if not outbound.record_verified(cur, LEDGER, str(ledger_id), now, None):
        return False
    return update_ledger(
        cur,
        ledger_id,
        "written",
        {
            "state": "deleting",
            "attempts": 0,
            "next_attempt_at": 0,
            "last_error": None,
            "needs_operator": 0,
        },
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
            " remote_name, created_at, done_at)"
            " VALUES (:name, :period, :state, :records, :bytes, :md5, :blake3, :identifier,"
            " :remote_name, :verified_at, :done_at)",
            {"name": name, "period": period, "state": state, "records": records, **facts},
        )
        ledger_id = cur.lastrowid
        assert ledger_id is not None
    else:
        ledger_id, current = found
        if STATES.index(current) >= STATES.index(state):
            return False
        cur.execute("UPDATE ledgers SET state = ? WHERE ledger_id = ?", (state, ledger_id))
    # The manifest is the proof of the verified copy: the outbound row says so too.
    cur.execute("DELETE FROM outbound WHERE kind = 'ledger' AND ref = ?", (str(ledger_id),))
    outbound.add_delivered(
        cur,
        LEDGER,
        str(ledger_id),
        "",
        identifier=facts["identifier"],
        delivered_at=facts["verified_at"],
        verified_at=facts["verified_at"],
        next_check_at=None,
        now=facts["verified_at"],
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
        "SELECT " + ", ".join(RECORD_COLUMNS) + " FROM object_delivery"
        " WHERE ledger_id = ? AND object_id > ? ORDER BY object_id LIMIT ?",
        (ledger_id, after, limit),
    )
    return [dict(zip(RECORD_COLUMNS, row, strict=True)) for row in cur.fetchall()]


def delete_records(cur: sqlite3.Cursor, ledger_id: int, object_ids: Sequence[str]) -> int:
    """Delete the index rows (and their attempt history) of archived records of ``ledger_id``."""
    if not object_ids:
        return 0
    marks = ", ".join("?" for _ in object_ids)
    cur.execute(
        f"DELETE FROM objects WHERE ledger_id = ? AND object_id IN ({marks}) RETURNING object_id",
        (ledger_id, *object_ids),
    )
    gone = [row[0] for row in cur.fetchall()]
    marks = ", ".join("?" for _ in gone)
    cur.execute(f"DELETE FROM attempts WHERE object_id IN ({marks})", gone)
    cur.execute(f"DELETE FROM outbound WHERE kind = 'object' AND ref IN ({marks})", gone)
    return len(gone)


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
