"""``canner retry ID`` and ``canner retry --needs-operator``: a delivery waiting for a retry
is due now, a delivered one not verified (unlisted, mismatched) is delivered again, a packed
object that failed its receipt check joins a batch again, a verified one that was flagged has
its flag cleared (guarded updates).  ``ID`` is a megawarc package id, a ledger name, or an
object id (or a unique prefix of one).  The rows move in :mod:`canner.delivery.outbound`."""

from __future__ import annotations

import sqlite3
from pathlib import Path

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
from canner.delivery import outbound
from canner.delivery.index import UNKNOWN_PROJECT, ObjectRow
from canner.delivery.queue import State
from canner.ledger import store as ledger_store
from canner.packaging import batches as psql

# What an operator names besides objects, tried in this order before an object id (a prefix).
NAMED = (psql.BY_NAME, ledger_store.BY_NAME)


def _retry_one(
    cur: sqlite3.Cursor, oid: str, now: float
) -> tuple[str | None, ObjectRow | None, ObjectRow | None]:
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
) -> tuple[list[ObjectRow], list[tuple[ObjectRow, str]]]:
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
    for row in transact(data_dir, sql.clear_verified_flags, project, io.now()):
        io.out.write(
            f"{row.object_id} ({row.project}) is delivered and verified: its flag is cleared;"
            f" it said: {row.last_error}\n"
        )
    files = transact(data_dir, outbound.retry_flagged, NAMED, project, io.now())
    for file in files:
        _say_file_retried(file, io)
    io.out.write(
        f"{len(rows) + len(files)} deliveries needing an operator are due now: canner-deliver"
        " retries them within a second\n"
    )
    return 0


def _say_file_retried(file: outbound.Retried, io: Io) -> None:
    io.out.write(
        f"{file.kind.value} {file.name} is due now: canner-deliver sends it again within a"
        f" second (last error: {file.last_error or 'none'})\n"
    )


def retry(config_path: Path, object_id: str, io: Io) -> int:
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    named = transact(data_dir, outbound.retry_named, NAMED, object_id, io.now())
    if named is not None:
        if not named.due:
            raise CommandError(
                f"{named.kind.value} {object_id} has nothing to retry: it is delivered and"
                " verified, or on its way (a retry takes one waiting for an attempt, or"
                " delivered and not verified)"
            )
        _say_file_retried(named, io)
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


def _undeliverable(row: ObjectRow, config: Config) -> str | None:
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
