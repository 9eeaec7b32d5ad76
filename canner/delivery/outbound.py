"""The outbound table: one row per thing that leaves the node, whatever its kind.

An object, a megawarc package or a ledger is sent, verified where it went, and handed back to
its owner.  This module is the one state machine for all three (cursor functions, run through
the index's pool or on a plain ``sqlite3`` cursor):

    pending -> delivering -> delivered (verified_at set once the copy is checked)
                   |   ^          |
                   v   |          v  (verify_timeout passed unlisted, or an operator's retry)
               retry_wait <-------+

Every move is a guarded update (it names the state it expects), so two processes, or a crash
between two steps, can never move a row twice.  The owner alone decides what a verified copy
lets it delete, and when: it schedules that through ``next_check_at`` and ends the row's
follow-ups with :func:`settle`.  ``ref`` is the owner's key as text.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from attrs import frozen

from canner.observe import Outbound

OPERATOR_REDELIVERY = "re-delivery requested by an operator"


def _marks(values: list[str]) -> str:
    return ", ".join("?" for _ in values)


@frozen
class OutboundRow:
    """One outbound row's delivery facts (what every owner's follow-up reads)."""

    project: str
    state: str
    attempts: int
    remote_identifier: str | None
    delivered_at: float | None
    verified_at: float | None
    redeliveries: int
    needs_operator: int
    force_upload: int


def row_of(cur: sqlite3.Cursor, kind: Outbound, ref: str) -> OutboundRow | None:
    cur.execute(
        "SELECT project, state, attempts, remote_identifier, delivered_at, verified_at,"
        " redeliveries, needs_operator, force_upload FROM outbound WHERE kind = ? AND ref = ?",
        (kind.value, ref),
    )
    found = cur.fetchone()
    return None if found is None else OutboundRow(*found)


def add(cur: sqlite3.Cursor, kind: Outbound, refs: Iterable[tuple[str, str]], now: float) -> None:
    """Make ``(ref, project)`` rows ready to send, due now (a row already there stays)."""
    cur.executemany(
        "INSERT OR IGNORE INTO outbound (kind, ref, project, next_attempt_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?)",
        [(kind.value, ref, project, now, now) for ref, project in refs],
    )


def add_delivered(
    cur: sqlite3.Cursor,
    kind: Outbound,
    ref: str,
    project: str,
    *,
    identifier: str | None,
    delivered_at: float | None,
    verified_at: float | None,
    next_check_at: float | None,
    now: float,
) -> None:
    """A row rebuilt from a delivery record (the index was lost): delivered, verified or not."""
    cur.execute(
        "INSERT OR IGNORE INTO outbound (kind, ref, project, state, remote_identifier,"
        " delivered_at, verified_at, next_check_at, updated_at)"
        " VALUES (?, ?, ?, 'delivered', ?, ?, ?, ?, ?)",
        (kind.value, ref, project, identifier, delivered_at, verified_at, next_check_at, now),
    )


def flag(cur: sqlite3.Cursor, kind: Outbound, refs: Iterable[tuple[str, str]], now: float) -> None:
    """Mark ``(ref, error)`` rows as needing an operator, with why."""
    cur.executemany(
        "UPDATE outbound SET needs_operator = 1, last_error = ?, updated_at = ?"
        " WHERE kind = ? AND ref = ?",
        [(error, now, kind.value, ref) for ref, error in refs],
    )


def hold(
    cur: sqlite3.Cursor, kind: Outbound, refs: Iterable[tuple[str, str]], until: float, now: float
) -> None:
    """``pending`` rows that cannot be sent as they are (``(ref, why)``): waiting for a retry
    until ``until``, flagged for an operator with why, so an operator's ``canner retry`` is
    what sends them (rows already past ``pending`` stay as they are)."""
    cur.executemany(
        "UPDATE outbound SET state = 'retry_wait', next_attempt_at = ?, needs_operator = 1,"
        " last_error = ?, updated_at = ? WHERE kind = ? AND ref = ? AND state = 'pending'",
        [(until, error, now, kind.value, ref) for ref, error in refs],
    )


def reset_delivering(cur: sqlite3.Cursor, kind: Outbound, now: float) -> int:
    """At start-up: ``delivering`` rows (attempts cut short) become ``retry_wait``, due now."""
    cur.execute(
        "UPDATE outbound SET state = 'retry_wait', next_attempt_at = ?, updated_at = ?"
        " WHERE kind = ? AND state = 'delivering'",
        (now, now, kind.value),
    )
    return cur.rowcount


def claim_due(
    cur: sqlite3.Cursor, kind: Outbound, now: float, limit: int, projects: Iterable[str]
) -> list[str]:
    """Move up to ``limit`` due rows of ``projects`` to ``delivering``, oldest due first, each
    counting an attempt; their refs in that order (:func:`claim_due_any` for one kind)."""
    return [ref for _, ref, _ in claim_due_any(cur, now, limit, {kind: projects})]


def _due(
    cur: sqlite3.Cursor, kind: Outbound, now: float, limit: int, projects: Iterable[str]
) -> list[tuple[float, str]]:
    """The ``limit`` oldest due rows of ``kind`` for ``projects``: ``(next_attempt_at, ref)``."""
    names = sorted(projects)
    if limit <= 0 or not names:
        return []
    cur.execute(
        "SELECT next_attempt_at, ref FROM outbound WHERE kind = ?"
        " AND state IN ('pending', 'retry_wait') AND next_attempt_at <= ?"
        f" AND project IN ({_marks(names)}) ORDER BY next_attempt_at LIMIT ?",
        (kind.value, now, *names, limit),
    )
    return [(at, ref) for at, ref in cur.fetchall()]


def release_orphans(cur: sqlite3.Cursor, kind: Outbound, running: Iterable[str], now: float) -> int:
    """``delivering`` rows with no attempt running (their outcome could not be recorded) become
    ``retry_wait``, due now; returns how many."""
    refs = sorted(running)
    cur.execute(
        "UPDATE outbound SET state = 'retry_wait', next_attempt_at = ?, updated_at = ?,"
        " last_error = 'the outcome of an attempt could not be recorded'"
        f" WHERE kind = ? AND state = 'delivering' AND ref NOT IN ({_marks(refs)})",
        (now, now, kind.value, *refs),
    )
    return cur.rowcount


def record_delivered(
    cur: sqlite3.Cursor, kind: Outbound, ref: str, identifier: str, now: float
) -> bool:
    """``delivering -> delivered`` at ``identifier``, its verification due now (a forced upload
    is done); False when the row was not delivering."""
    cur.execute(
        "UPDATE outbound SET state = 'delivered', remote_identifier = ?, delivered_at = ?,"
        " verified_at = NULL, next_check_at = ?, last_error = NULL, needs_operator = 0,"
        " force_upload = 0, updated_at = ? WHERE kind = ? AND ref = ? AND state = 'delivering'",
        (identifier, now, now, now, kind.value, ref),
    )
    return cur.rowcount == 1


def record_failure(
    cur: sqlite3.Cursor,
    kind: Outbound,
    ref: str,
    error: str,
    next_attempt_at: float,
    needs_operator: bool,
    now: float,
) -> bool:
    """``delivering -> retry_wait``; False when the row was not delivering."""
    cur.execute(
        "UPDATE outbound SET state = 'retry_wait', last_error = ?, next_attempt_at = ?,"
        " needs_operator = ?, updated_at = ? WHERE kind = ? AND ref = ? AND state = 'delivering'",
        (error[:2000], next_attempt_at, int(needs_operator), now, kind.value, ref),
    )
    return cur.rowcount == 1


def follow_ups_due(
    cur: sqlite3.Cursor,
    kind: Outbound,
    now: float,
    limit: int,
    projects: Iterable[str],
    busy: Iterable[str] = (),
) -> list[str]:
    """Refs of delivered rows of ``projects`` whose verification or owner's delete is due,
    oldest due first, leaving out the ``busy`` ones."""
    return [ref for _, ref in _checks_due(cur, kind, now, limit, projects, busy)]


def _checks_due(
    cur: sqlite3.Cursor,
    kind: Outbound,
    now: float,
    limit: int,
    projects: Iterable[str],
    busy: Iterable[str],
) -> list[tuple[float, str]]:
    """``(next_check_at, ref)`` of the rows :func:`follow_ups_due` names.

    Filtering here, before the ``LIMIT``, is what keeps a project without a sink (its delivery
    section removed) from filling every slot with rows nobody can check."""
    names, skip = sorted(projects), sorted(busy)
    if limit <= 0 or not names:
        return []
    cur.execute(
        "SELECT next_check_at, ref FROM outbound WHERE kind = ? AND state = 'delivered'"
        f" AND next_check_at <= ? AND project IN ({_marks(names)})"
        f" AND ref NOT IN ({_marks(skip)}) ORDER BY next_check_at LIMIT ?",
        (kind.value, now, *names, *skip, limit),
    )
    return [(at, ref) for at, ref in cur.fetchall()]


def record_verified(
    cur: sqlite3.Cursor, kind: Outbound, ref: str, now: float, next_check_at: float | None
) -> bool:
    """The copy is verified where it went; the owner's next step is at ``next_check_at`` (None:
    nothing left).  False when the row was not delivered or was already verified."""
    cur.execute(
        "UPDATE outbound SET verified_at = ?, next_check_at = ?, last_error = NULL,"
        " needs_operator = 0, updated_at = ?"
        " WHERE kind = ? AND ref = ? AND state = 'delivered' AND verified_at IS NULL",
        (now, next_check_at, now, kind.value, ref),
    )
    return cur.rowcount == 1


def record_check(
    cur: sqlite3.Cursor,
    kind: Outbound,
    ref: str,
    next_check_at: float,
    error: str | None,
    needs_operator: bool,
    now: float,
    force_upload: bool = False,
) -> None:
    """Postpone a verification or the owner's delete (nothing listed yet, a delete failed).

    ``force_upload`` (a read-back found the remote bytes wrong) makes the next delivery upload
    even when the destination lists a matching file; only a delivery clears it."""
    cur.execute(
        "UPDATE outbound SET next_check_at = ?, last_error = ?, needs_operator = ?,"
        " updated_at = ?, force_upload = max(force_upload, ?)"
        " WHERE kind = ? AND ref = ? AND state = 'delivered'",
        (next_check_at, error, int(needs_operator), now, int(force_upload), kind.value, ref),
    )


def settle(cur: sqlite3.Cursor, kind: Outbound, ref: str, now: float) -> bool:
    """The owner is done with a verified row (its local copy deleted): no follow-ups left."""
    cur.execute(
        "UPDATE outbound SET next_check_at = NULL, last_error = NULL, updated_at = ?"
        " WHERE kind = ? AND ref = ? AND state = 'delivered' AND verified_at IS NOT NULL",
        (now, kind.value, ref),
    )
    return cur.rowcount == 1


def claim(cur: sqlite3.Cursor, kind: Outbound, ref: str, now: float) -> int | None:
    """Move one row that is due to ``delivering``, counting an attempt (guarded): the attempt's
    number, or None when the row was not due."""
    cur.execute(
        "UPDATE outbound SET state = 'delivering', attempts = attempts + 1, updated_at = ?"
        " WHERE kind = ? AND ref = ? AND state IN ('pending', 'retry_wait')"
        " AND next_attempt_at <= ? RETURNING attempts",
        (now, kind.value, ref, now),
    )
    found = cur.fetchone()
    return None if found is None else int(found[0])


def redeliver(
    cur: sqlite3.Cursor,
    kind: Outbound,
    ref: str,
    reason: str,
    now: float,
    *,
    by_operator: bool = False,
    due: float | None = None,
    needs_operator: bool = False,
    force_upload: bool = False,
) -> bool:
    """``delivered -> retry_wait``, due at ``due`` (now by default), for a row not yet verified.

    Called when ``verify_timeout`` passed without the destination listing the copy (a
    re-delivery counted), when a read-back found other bytes there (``force_upload``: the next
    delivery sends even over a matching listing), or by an operator's retry (the count reset).
    The recorded destination stays (it derives from stable values).  False when the row was not
    eligible.
    """
    cur.execute(
        "UPDATE outbound SET state = 'retry_wait', next_attempt_at = ?, last_error = ?,"
        " needs_operator = ?, delivered_at = NULL, next_check_at = NULL,"
        " force_upload = max(force_upload, ?),"
        " redeliveries = CASE WHEN ? THEN 0 ELSE redeliveries + 1 END, updated_at = ?"
        " WHERE kind = ? AND ref = ? AND state = 'delivered' AND verified_at IS NULL",
        (
            now if due is None else due,
            reason[:2000],
            int(needs_operator),
            int(force_upload),
            int(by_operator),
            now,
            kind.value,
            ref,
        ),
    )
    return cur.rowcount == 1


def operator_retry(cur: sqlite3.Cursor, kind: Outbound, ref: str, now: float) -> bool:
    """``canner retry``: a row waiting for a retry is due now, its flag cleared; a delivered
    row not verified (unlisted, a copy served wrong) goes back to be delivered, due now, its
    re-delivery count reset.  False for anything else (pending, delivering, verified)."""
    cur.execute(
        "UPDATE outbound SET next_attempt_at = ?, needs_operator = 0, updated_at = ?"
        " WHERE kind = ? AND ref = ? AND state = 'retry_wait'",
        (now, now, kind.value, ref),
    )
    if cur.rowcount == 1:
        return True
    return redeliver(cur, kind, ref, OPERATOR_REDELIVERY, now, by_operator=True)


def clear_flag(cur: sqlite3.Cursor, kind: Outbound, ref: str, now: float) -> bool:
    """``canner retry`` of a verified row flagged for an operator: nothing is left to send, so
    the retry clears the flag; ``last_error`` stays as the record of why."""
    cur.execute(
        "UPDATE outbound SET needs_operator = 0, updated_at = ?"
        " WHERE kind = ? AND ref = ? AND needs_operator != 0 AND state = 'delivered'"
        " AND verified_at IS NOT NULL",
        (now, kind.value, ref),
    )
    return cur.rowcount == 1


def flagged(cur: sqlite3.Cursor, kind: Outbound, project: str | None = None) -> list[str]:
    """Refs flagged for an operator that a retry can send again (waiting for a retry, or
    delivered and not verified), of ``project`` (all when None), oldest change first."""
    cur.execute(
        "SELECT ref FROM outbound WHERE kind = ? AND needs_operator != 0"
        " AND (state = 'retry_wait' OR (state = 'delivered' AND verified_at IS NULL))"
        " AND (? IS NULL OR project = ?) ORDER BY updated_at, ref",
        (kind.value, project, project),
    )
    return [row[0] for row in cur.fetchall()]


# -- an operator's retry by name (``canner retry``) ----------------------------------------------


class WasFlagged(Protocol):
    """An owner's row as it was before an operator's retry."""

    @property
    def last_error(self) -> str | None: ...


@frozen
class Named:
    """The rows of one owner as an operator names them (a package id, a ledger name), as
    cursor functions over the owner's own table: whether ``name`` is one of its rows; retry it
    (the row as it was before, or None when nothing was retried); the names flagged for an
    operator (of a project, or all when None)."""

    kind: Outbound
    exists: Callable[[sqlite3.Cursor, str], bool]
    retry: Callable[[sqlite3.Cursor, str, float], WasFlagged | None]
    flagged: Callable[[sqlite3.Cursor, str | None], list[str]]


@frozen
class Retried:
    """What an operator's retry of ``name`` did: made it due now, or nothing (``due`` False:
    it is delivered and verified, or on its way); ``last_error`` is the row's before."""

    kind: Outbound
    name: str
    due: bool
    last_error: str | None = None


def retry_named(
    cur: sqlite3.Cursor, owners: Sequence[Named], name: str, now: float
) -> Retried | None:
    """Retry the row called ``name`` by the first of ``owners`` that has one; None when none
    has (see :func:`operator_retry` for what a retry does to the outbound row)."""
    for owner in owners:
        before = owner.retry(cur, name, now)
        if before is not None:
            return Retried(owner.kind, name, True, before.last_error)
        if owner.exists(cur, name):
            return Retried(owner.kind, name, False)
    return None


def retry_flagged(
    cur: sqlite3.Cursor, owners: Sequence[Named], project: str | None, now: float
) -> list[Retried]:
    """Retry every row of ``owners`` flagged for an operator (of ``project``): those made due."""
    done = []
    for owner in owners:
        for name in owner.flagged(cur, project):
            before = owner.retry(cur, name, now)
            if before is not None:
                done.append(Retried(owner.kind, name, True, before.last_error))
    return done


# -- every kind at once (the outbound service) ---------------------------------------------------

Lanes = Mapping[Outbound, Iterable[str]]


def claim_due_any(
    cur: sqlite3.Cursor, now: float, limit: int, lanes: Lanes
) -> list[tuple[Outbound, str, int]]:
    """Move up to ``limit`` due rows of any kind (each for its ``lanes`` projects) to
    ``delivering``, oldest due first, each counting an attempt: ``(kind, ref, attempt)``.

    Each kind's oldest come through its own index, then the oldest of those are claimed (one
    query over every kind would sort every due row of a large backlog)."""
    due = sorted(
        (at, kind.value, ref)
        for kind, projects in lanes.items()
        for at, ref in _due(cur, kind, now, limit, projects)
    )
    claimed = []
    for _, kind_value, ref in due[: max(limit, 0)]:
        kind = Outbound(kind_value)
        if (attempt := claim(cur, kind, ref, now)) is not None:
            claimed.append((kind, ref, attempt))
    return claimed


def release_orphans_any(
    cur: sqlite3.Cursor, running: Iterable[tuple[Outbound, str]], now: float
) -> int:
    """``delivering`` rows of any kind with no attempt ``running`` become ``retry_wait``."""
    keys = list(running)
    return sum(
        release_orphans(cur, kind, [ref for k, ref in keys if k is kind], now) for kind in Outbound
    )


def follow_ups_due_any(
    cur: sqlite3.Cursor,
    now: float,
    limit: int,
    lanes: Lanes,
    busy: Iterable[tuple[Outbound, str]] = (),
) -> list[tuple[Outbound, str]]:
    """Delivered rows of any kind whose verification or owner's delete is due, oldest due
    first, leaving out the ``busy`` ones (see :func:`follow_ups_due`)."""
    keys = list(busy)
    due = sorted(
        (at, kind.value, ref)
        for kind, projects in lanes.items()
        for at, ref in _checks_due(
            cur, kind, now, limit, projects, [r for k, r in keys if k is kind]
        )
    )
    return [(Outbound(kind), ref) for _, kind, ref in due[: max(limit, 0)]]
