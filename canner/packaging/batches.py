"""Batches and packages in ``delivery.sqlite``: SQL as plain cursor functions.

An accepted object of a megawarc project joins its project's open batch in acceptance order
(:func:`assign_batches`); a batch closes once its members reach ``target_bytes`` or its oldest
member waited ``max_wait``.  A closed batch is built into a package (``building -> sealed ->
verified``), then delivered (``delivery_state``), verified at IA and purged locally.  Every
transition is a guarded update (``WHERE state = :expected``), so a crash or a second writer
can never move a row twice; the package id is derived from the members
(:func:`package_id_of`), so rebuilding a batch always names the same package.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

import blake3
from attrs import define, field, frozen

from canner.config import PackagingConfig

# Objects assigned per project and tick: bounds the transaction whatever the backlog.
ASSIGN_LIMIT = 5000


@frozen
class Member:
    """One object of a batch, as the builder needs it."""

    object_id: str
    project: str
    filename: str | None
    size_bytes: int
    checksum: str
    accepted_at: int


MEMBER_COLUMNS = "object_id, project, filename, size_bytes, checksum, accepted_at"

PACKAGE_COLUMNS = (
    "batch_id",
    "project",
    "state",
    "members",
    "bytes",
    "oldest_accepted_at",
    "opened_at",
    "closed_at",
    "close_reason",
    "package_id",
    "batch_date",
    "build_attempts",
    "next_build_at",
    "build_error",
    "sealed_at",
    "verified_at",
    "sources_purged_at",
    "delivery_state",
    "attempts",
    "next_attempt_at",
    "last_error",
    "needs_operator",
    "remote_identifier",
    "delivered_at",
    "remote_verified_at",
    "next_check_at",
    "purge_after",
    "purged_at",
    "updated_at",
)
_SELECT = "SELECT " + ", ".join(PACKAGE_COLUMNS) + " FROM packages"


@frozen
class PackageRow:
    """One row of ``packages``."""

    batch_id: int
    project: str
    state: str
    members: int
    bytes: int
    oldest_accepted_at: int | None
    opened_at: float
    closed_at: float | None
    close_reason: str | None
    package_id: str | None
    batch_date: str | None
    build_attempts: int
    next_build_at: float
    build_error: str | None
    sealed_at: float | None
    verified_at: float | None
    sources_purged_at: float | None
    delivery_state: str
    attempts: int
    next_attempt_at: float
    last_error: str | None
    needs_operator: int
    remote_identifier: str | None
    delivered_at: float | None
    remote_verified_at: float | None
    next_check_at: float | None
    purge_after: float | None
    purged_at: float | None
    updated_at: float

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PACKAGE_COLUMNS}


@frozen
class PackageFile:
    """One file of a sealed package: ``<basename><suffix>``."""

    suffix: str
    size_bytes: int
    content_md5: str | None
    remote_name: str | None


def _packages(cur: sqlite3.Cursor) -> list[PackageRow]:
    return [PackageRow(*row) for row in cur.fetchall()]


def package_id_of(project: str, members: Iterable[Member]) -> str:
    """The package id: 32 hex digits of BLAKE3 over the project and every member's object id,
    checksum and size, in member order.  The same members always give the same id."""
    h = blake3.blake3(b"canner-package-v1\n" + project.encode() + b"\n")
    for m in members:
        h.update(f"{m.object_id} {m.checksum} {m.size_bytes}\n".encode())
    return h.hexdigest()[:32]


def _open_batch(cur: sqlite3.Cursor, project: str, now: float) -> PackageRow:
    cur.execute(_SELECT + " WHERE project = ? AND state = 'open'", (project,))
    rows = _packages(cur)
    if rows:
        return rows[0]
    cur.execute(
        "INSERT INTO packages (project, state, opened_at, updated_at) VALUES (?, 'open', ?, ?)",
        (project, now, now),
    )
    cur.execute(_SELECT + " WHERE batch_id = ?", (cur.lastrowid,))
    return _packages(cur)[0]


def _close(cur: sqlite3.Cursor, batch_id: int, reason: str, now: float) -> bool:
    cur.execute(
        "UPDATE packages SET state = 'closed', closed_at = ?, close_reason = ?, next_build_at = ?,"
        " updated_at = ? WHERE batch_id = ? AND state = 'open'",
        (now, reason, now, now, batch_id),
    )
    return cur.rowcount == 1


@define
class _Filling:
    """The open batch of one project while objects are assigned to it."""

    batch_id: int
    members: int
    bytes: int
    oldest: int | None
    updates: list[tuple[int, str]] = field(factory=list)

    @classmethod
    def open(cls, cur: sqlite3.Cursor, project: str, now: float) -> _Filling:
        row = _open_batch(cur, project, now)
        return cls(row.batch_id, row.members, row.bytes, row.oldest_accepted_at)

    def add(self, object_id: str, size: int, accepted_at: int) -> None:
        self.updates.append((self.batch_id, object_id))
        self.members += 1
        self.bytes += size
        self.oldest = accepted_at if self.oldest is None else min(self.oldest, accepted_at)

    def flush(self, cur: sqlite3.Cursor, now: float) -> None:
        cur.executemany(
            "UPDATE objects SET batch_id = ? WHERE object_id = ? AND batch_id IS NULL",
            self.updates,
        )
        cur.execute(
            "UPDATE packages SET members = ?, bytes = ?, oldest_accepted_at = ?,"
            " updated_at = ? WHERE batch_id = ? AND state = 'open'",
            (self.members, self.bytes, self.oldest, now, self.batch_id),
        )
        self.updates.clear()


def assign_batches(
    cur: sqlite3.Cursor,
    projects: Mapping[str, PackagingConfig],
    now: float,
    limit: int = ASSIGN_LIMIT,
) -> dict[str, int]:
    """Put unbatched objects of the megawarc ``projects`` into their open batches, oldest
    accepted first, closing batches by size and by wait; returns ``{"assigned": n, "closed": n}``.

    A batch closes once its bytes reach ``target_bytes``; an object at least that large never
    joins a non-empty batch (the batch closes first), so it forms its own.  A non-empty open
    batch whose oldest member was accepted ``max_wait`` ago closes too.  One transaction.
    """
    assigned = closed = 0
    for project in sorted(projects):
        target = projects[project].target_bytes
        cur.execute(
            "SELECT object_id, size_bytes, accepted_at FROM objects"
            " WHERE project = ? AND batch_id IS NULL AND pack_rejected_at IS NULL"
            " AND state IN ('pending', 'retry_wait') AND purged_at IS NULL"
            " ORDER BY accepted_at, object_id LIMIT ?",
            (project, limit),
        )
        batch: _Filling | None = None
        for object_id, size, accepted_at in cur.fetchall():
            if batch is None:
                batch = _Filling.open(cur, project, now)
            if batch.members and size >= target:
                batch.flush(cur, now)
                closed += _close(cur, batch.batch_id, "size", now)
                batch = _Filling.open(cur, project, now)
            batch.add(object_id, size, accepted_at)
            assigned += 1
            if batch.bytes >= target:
                batch.flush(cur, now)
                closed += _close(cur, batch.batch_id, "size", now)
                batch = None
        if batch is not None:
            batch.flush(cur, now)
        cur.execute(
            "SELECT batch_id FROM packages WHERE project = ? AND state = 'open' AND members > 0"
            " AND oldest_accepted_at <= ?",
            (project, now - projects[project].max_wait),
        )
        for (batch_id,) in cur.fetchall():
            closed += _close(cur, batch_id, "max_wait", now)
    return {"assigned": assigned, "closed": closed}


def reset_interrupted(cur: sqlite3.Cursor, now: float) -> dict[str, int]:
    """At start-up: builds cut short go back to ``closed`` (rebuilt from scratch) and package
    deliveries cut short to ``retry_wait``, due now."""
    cur.execute(
        "UPDATE packages SET state = 'closed', package_id = NULL, next_build_at = ?,"
        " updated_at = ? WHERE state = 'building'",
        (now, now),
    )
    builds = cur.rowcount
    cur.execute(
        "UPDATE packages SET delivery_state = 'retry_wait', next_attempt_at = ?, updated_at = ?"
        " WHERE delivery_state = 'delivering'",
        (now, now),
    )
    return {"builds": builds, "deliveries": cur.rowcount}


def claim_builds(cur: sqlite3.Cursor, now: float, limit: int) -> list[PackageRow]:
    """Move up to ``limit`` due ``closed`` batches to ``building``, oldest closed first."""
    if limit <= 0:
        return []
    cur.execute(
        "UPDATE packages SET state = 'building', build_attempts = build_attempts + 1,"
        " updated_at = ? WHERE batch_id IN (SELECT batch_id FROM packages"
        "   WHERE state = 'closed' AND next_build_at <= ? ORDER BY closed_at, batch_id LIMIT ?)"
        " AND state = 'closed' RETURNING " + ", ".join(PACKAGE_COLUMNS),
        (now, now, limit),
    )
    return sorted(_packages(cur), key=lambda r: r.batch_id)


def batch_members(cur: sqlite3.Cursor, batch_id: int) -> list[Member]:
    """The members of a batch in acceptance order (the order they are packed in)."""
    cur.execute(
        f"SELECT {MEMBER_COLUMNS} FROM objects WHERE batch_id = ? ORDER BY accepted_at, object_id",
        (batch_id,),
    )
    return [Member(*row) for row in cur.fetchall()]


def record_building(cur: sqlite3.Cursor, batch_id: int, package_id: str, batch_date: str) -> bool:
    """Name the package being built (guarded: the batch must be ``building``)."""
    cur.execute(
        "UPDATE packages SET package_id = ?, batch_date = ? WHERE batch_id = ?"
        " AND state = 'building'",
        (package_id, batch_date, batch_id),
    )
    return cur.rowcount == 1


def reject_member(
    cur: sqlite3.Cursor, batch_id: int, object_id: str, error: str, now: float
) -> bool:
    """Take a member whose bytes do not match its receipt out of its ``building`` batch and
    flag it for an operator; the batch goes back to ``closed`` to be rebuilt without it."""
    cur.execute(
        "UPDATE objects SET batch_id = NULL, pack_rejected_at = ?, needs_operator = 1,"
        " last_error = ?, updated_at = ? WHERE object_id = ? AND batch_id = ?",
        (now, error[:2000], now, object_id, batch_id),
    )
    if cur.rowcount != 1:
        return False
    cur.execute(
        "UPDATE packages SET state = 'closed', package_id = NULL, next_build_at = ?,"
        " members = members - 1, bytes = bytes - (SELECT size_bytes FROM objects"
        " WHERE object_id = ?), build_error = ?, updated_at = ?"
        " WHERE batch_id = ? AND state = 'building'",
        (now, object_id, error[:2000], now, batch_id),
    )
    return True


def record_build_failure(
    cur: sqlite3.Cursor, batch_id: int, error: str, next_build_at: float, now: float
) -> bool:
    """``building -> closed`` after a failure that a retry may fix (I/O, disk full)."""
    cur.execute(
        "UPDATE packages SET state = 'closed', package_id = NULL, build_error = ?,"
        " next_build_at = ?, updated_at = ? WHERE batch_id = ? AND state = 'building'",
        (error[:2000], next_build_at, now, batch_id),
    )
    return cur.rowcount == 1


def drop_empty(cur: sqlite3.Cursor, batch_id: int) -> None:
    """Forget a batch every member of which was rejected (nothing to build)."""
    cur.execute(
        "DELETE FROM packages WHERE batch_id = ? AND members = 0 AND state IN ('closed',"
        " 'building')",
        (batch_id,),
    )


def record_sealed(
    cur: sqlite3.Cursor,
    batch_id: int,
    files: Iterable[tuple[str, int]],
    placements: Iterable[tuple[str, str, int]],
    now: float,
) -> bool:
    """``building -> sealed``: the package's files (suffix, size) are durable and its index is
    complete; each member's (object id, file suffix, byte offset) is recorded."""
    cur.execute(
        "UPDATE packages SET state = 'sealed', sealed_at = ?, build_error = NULL, updated_at = ?"
        " WHERE batch_id = ? AND state = 'building'",
        (now, now, batch_id),
    )
    if cur.rowcount != 1:
        return False
    cur.execute("DELETE FROM package_files WHERE batch_id = ?", (batch_id,))
    cur.executemany(
        "INSERT INTO package_files (batch_id, suffix, size_bytes) VALUES (?, ?, ?)",
        [(batch_id, suffix, size) for suffix, size in files],
    )
    cur.executemany(
        "UPDATE objects SET packed_file = ?, packed_offset = ? WHERE object_id = ?"
        " AND batch_id = ?",
        [(suffix, offset, object_id, batch_id) for object_id, suffix, offset in placements],
    )
    return True


def record_verified(
    cur: sqlite3.Cursor, batch_id: int, md5s: Mapping[str, str], now: float
) -> bool:
    """``sealed -> verified``: every member re-read from the package matched its receipt; the
    files' MD5s (for delivery) are recorded."""
    cur.execute(
        "UPDATE packages SET state = 'verified', verified_at = ?, next_attempt_at = ?,"
        " updated_at = ? WHERE batch_id = ? AND state = 'sealed'",
        (now, now, now, batch_id),
    )
    if cur.rowcount != 1:
        return False
    cur.executemany(
        "UPDATE package_files SET content_md5 = ? WHERE batch_id = ? AND suffix = ?",
        [(md5, batch_id, suffix) for suffix, md5 in md5s.items()],
    )
    return True


def record_sources_purged(cur: sqlite3.Cursor, batch_id: int, now: float) -> None:
    """The members' uploads are gone: the package is their local copy of record."""
    cur.execute(
        "UPDATE objects SET purged_at = ?, updated_at = ? WHERE batch_id = ? AND purged_at IS NULL",
        (now, now, batch_id),
    )
    cur.execute(
        "UPDATE packages SET sources_purged_at = ?, updated_at = ? WHERE batch_id = ?"
        " AND state = 'verified' AND sources_purged_at IS NULL",
        (now, now, batch_id),
    )


def packages_in(cur: sqlite3.Cursor, states: Iterable[str]) -> list[PackageRow]:
    names = sorted(states)
    cur.execute(
        _SELECT + f" WHERE state IN ({', '.join('?' for _ in names)}) ORDER BY batch_id", names
    )
    return _packages(cur)


def package_files(cur: sqlite3.Cursor, batch_id: int) -> list[PackageFile]:
    cur.execute(
        "SELECT suffix, size_bytes, content_md5, remote_name FROM package_files"
        " WHERE batch_id = ? ORDER BY suffix",
        (batch_id,),
    )
    return [PackageFile(*row) for row in cur.fetchall()]


def get_package(cur: sqlite3.Cursor, batch_id: int) -> PackageRow | None:
    cur.execute(_SELECT + " WHERE batch_id = ?", (batch_id,))
    rows = _packages(cur)
    return rows[0] if rows else None


def all_packages(cur: sqlite3.Cursor) -> list[PackageRow]:
    cur.execute(_SELECT + " ORDER BY batch_id")
    return _packages(cur)
