"""``canner retry ID`` and ``canner retry --needs-operator``: make waiting or unverified
deliveries due now (guarded updates)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from canner.cli.base import (
    CommandError,
    Io,
    become_data_dir_owner,
    existing_data_dir,
    resolve_object_id,
    transact,
)
from canner.config import Config, load_config
from canner.delivery import index as sql
from canner.delivery.index import UNKNOWN_PROJECT, QueueRow
from canner.delivery.queue import State
from canner.ledger import store as ledger_store
from canner.packaging import batches as psql


def _retry_one(
    cur: sqlite3.Cursor, oid: str, now: float
) -> tuple[str | None, QueueRow | None, QueueRow | None]:
    """("due" | "readmitted" | "cleared" | None, the row before, the row after)."""
    before = sql.get_row(cur, oid)
    if sql.operator_retry(cur, oid, now):
        return "due", before, sql.get_row(cur, oid)
    if psql.readmit(cur, oid, now):
        return "readmitted", before, sql.get_row(cur, oid)
    if sql.clear_flag(cur, oid, now):
        return "cleared", before, sql.get_row(cur, oid)
    return None, before, sql.get_row(cur, oid)


def _retry_flagged(
    cur: sqlite3.Cursor, project: str | None, config: Config, now: float
) -> tuple[list[QueueRow], list[tuple[QueueRow, str]]]:
    """Flagged rows waiting for a retry, and flagged delivered rows not yet verified (a remote
    copy that differs, or one the destination kept losing): both are delivered again (the
    rows before), but for those canner-deliver would never send (each with why, still
    flagged)."""
    done, left = [], []
    for oid in sql.flagged_objects(cur, project):
        before = sql.get_row(cur, oid)
        assert before is not None
        if (why := _undeliverable(before, config)) is not None:
            left.append((before, why))
        elif sql.operator_retry(cur, oid, now):
            done.append(before)
    return done, left


def _clear_verified_flags(cur: sqlite3.Cursor, project: str | None, now: float) -> list[QueueRow]:
    """Flagged rows that are delivered and verified: nothing to send, the flags are cleared."""
    cur.execute(
        "SELECT object_id FROM object_delivery WHERE needs_operator != 0 AND state = 'delivered'"
        " AND verified_at IS NOT NULL AND (? IS NULL OR project = ?)"
        " ORDER BY accepted_at, object_id",
        (project, project),
    )
    cleared = []
    for (oid,) in cur.fetchall():
        before = sql.get_row(cur, oid)
        if sql.clear_flag(cur, oid, now):
            assert before is not None
            cleared.append(before)
    return cleared


def retry_needing_operator(config_path: Path, project: str | None, io: Io) -> int:
    """Every row flagged for an operator (of ``project``) is retried (see :func:`retry`)."""
    config = load_config(config_path)
    if project is not None and project not in config.projects:
        raise CommandError(f"--project {project!r} is not a configured project")
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    rows, left = transact(data_dir, _retry_flagged, project, config, io.now())
    for row in rows:
        io.out.write(f"{row.object_id} ({row.project}) is due now; last error: {row.last_error}\n")
    for row, why in left:
        name = "project unknown" if row.project == UNKNOWN_PROJECT else row.project
        io.out.write(f"{row.object_id} ({name}) is not retried: {why}\n")
    for row in transact(data_dir, _clear_verified_flags, project, io.now()):
        io.out.write(
            f"{row.object_id} ({row.project}) is delivered and verified: its flag is cleared;"
            f" it said: {row.last_error}\n"
        )
    files = transact(data_dir, _retry_flagged_files, project, io.now())
    for kind, name, last_error in files:
        _say_file_retried(kind, name, last_error, io)
    io.out.write(
        f"{len(rows) + len(files)} deliveries needing an operator are due now: canner-deliver"
        " retries them within a second\n"
    )
    return 0


def _retry_file(cur: sqlite3.Cursor, name: str, now: float) -> tuple[str, Any] | None:
    """A megawarc package or a ledger named ``name`` retried: ("package" | "ledger", its row
    before); ("package" | "ledger", None) when it exists but there is nothing to retry; None
    when no package or ledger has that name."""
    before = psql.operator_retry(cur, name, now)
    if before is not None:
        return "package", before
    cur.execute("SELECT 1 FROM packages WHERE package_id = ?", (name,))
    if cur.fetchone() is not None:
        return "package", None
    ledger = ledger_store.operator_retry(cur, name, now)
    if ledger is not None:
        return "ledger", ledger
    cur.execute("SELECT 1 FROM ledgers WHERE name = ?", (name,))
    return ("ledger", None) if cur.fetchone() is not None else None


def _retry_flagged_files(
    cur: sqlite3.Cursor, project: str | None, now: float
) -> list[tuple[str, str, str | None]]:
    """Every flagged package (of ``project``) and, without a project, every flagged ledger,
    retried: (kind, name, last error)."""
    done = []
    for package_id in psql.flagged_packages(cur, project):
        row = psql.operator_retry(cur, package_id, now)
        if row is not None:
            done.append(("package", package_id, row.last_error))
    for name in ledger_store.flagged_ledgers(cur) if project is None else []:
        ledger = ledger_store.operator_retry(cur, name, now)
        if ledger is not None:
            done.append(("ledger", name, ledger.last_error))
    return done


def _say_file_retried(kind: str, name: str, last_error: str | None, io: Io) -> None:
    io.out.write(
        f"{kind} {name} is due now: canner-deliver sends it again within a second"
        f" (last error: {last_error or 'none'})\n"
    )


def retry(config_path: Path, object_id: str, io: Io) -> int:
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    named = transact(data_dir, _retry_file, object_id, io.now())
    if named is not None:
        kind, before = named
        if before is None:
            raise CommandError(
                f"{kind} {object_id} has nothing to retry: it is delivered and verified, or"
                " on its way (a retry takes one waiting for an attempt, or delivered and not"
                " verified)"
            )
        _say_file_retried(kind, object_id, before.last_error, io)
        return 0
    oid = resolve_object_id(config, object_id)
    known = transact(data_dir, sql.get_row, oid)
    if known is not None and (why := _undeliverable(known, config)) is not None:
        raise CommandError(f"{oid} is not retried: {why}")
    made_due, before, row = transact(data_dir, _retry_one, oid, io.now())
    if row is None or before is None:
        raise CommandError(f"{oid} is not in the delivery index")
    if made_due == "cleared":
        io.out.write(
            f"{oid} is delivered and verified at its destination: nothing to send; its flag for"
            f" an operator is cleared (it said: {row.last_error or 'nothing'})\n"
        )
        return 0
    if made_due == "readmitted":
        io.out.write(
            f"{oid} joins a megawarc batch again (its bytes are checked against its receipt"
            f" when packed; last error: {row.last_error or 'none'})\n"
        )
        return 0
    if made_due is None:
        if row.state == State.DELIVERED and row.verified_at is not None:
            raise CommandError(
                f"{oid} is delivered and verified at its destination: nothing to retry"
            )
        raise CommandError(
            f"{oid} is {row.state}: only a waiting retry or a delivered, unverified object can"
            " be retried"
        )
    again = " (delivered again)" if before.state == State.DELIVERED else ""
    io.out.write(
        f"{oid} is due now{again}: canner-deliver starts attempt {row.attempts + 1} within a"
        f" second (last error: {before.last_error or 'none'})\n"
    )
    # An identity object is sent from its payload (a megawarc member was checked when packed).
    identity = not config.projects[row.project].packaging.megawarc
    if identity and row.purged_at is None and not (data_dir / "uploads" / oid).exists():
        io.out.write(
            f"note: its payload uploads/{oid} is missing: the attempt fails and flags it again"
            " unless its bytes (as its receipt describes them) are put there first\n"
        )
    return 0


def _undeliverable(row: QueueRow, config: Config) -> str | None:
    """Why canner-deliver would never send ``row`` whatever a retry does (None: it would): it
    claims only rows of configured projects."""
    if row.project == UNKNOWN_PROJECT:
        return (
            "no project is known for it (adopted from the Go canner without one), so canner"
            " cannot deliver it; its receipt is kept and served"
        )
    if row.project not in config.projects:
        return (
            f"its project {row.project} is not in the config: add [projects.{row.project}]"
            " and restart canner-deliver first"
        )
    return None
