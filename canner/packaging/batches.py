"""Batches and packages in ``delivery.sqlite``: SQL as plain cursor functions.

An accepted object of a megawarc project joins its project's open batch in acceptance order
(:func:`assign_batches`); a batch closes once its members reach ``target_bytes`` or its oldest
member waited ``max_wait``.  A closed batch is built into a package (``building -> sealed ->
verified``), then delivered (its outbound row, :mod:`canner.delivery.outbound`), verified at IA and
purged locally.  Every
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
from canner.delivery import outbound
from canner.observe import Outbound

# Objects assigned per project and tick: bounds the transaction whatever the backlog.
ASSIGN_LIMIT = 2000


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
    "redeliveries",
    "force_upload",
)
# Packages with their outbound row (schema v8's view).
_SELECT = "SELECT " + ", ".join(PACKAGE_COLUMNS) + " FROM package_delivery"
PACKAGE = Outbound.PACKAGE


@frozen
class PackageRow:
    """One package with its delivery facts (a row of the ``package_delivery`` view)."""

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
    redeliveries: int = 0
    force_upload: int = 0

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
            "SELECT object_id, size_bytes, accepted_at FROM object_delivery"
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
    return {"builds": builds, "deliveries": outbound.reset_delivering(cur, PACKAGE, now)}


def claim_builds(cur: sqlite3.Cursor, now: float, limit: int) -> list[PackageRow]:
    """Move up to ``limit`` due ``closed`` batches to ``building``, oldest closed first."""
    if limit <= 0:
        return []
    cur.execute(
        "UPDATE packages SET state = 'building', build_attempts = build_attempts + 1,"
        " updated_at = ? WHERE batch_id IN (SELECT batch_id FROM packages"
        "   WHERE state = 'closed' AND next_build_at <= ? ORDER BY closed_at, batch_id LIMIT ?)"
        " AND state = 'closed' RETURNING batch_id",
        (now, now, limit),
    )
    return _packages_of(cur, sorted(row[0] for row in cur.fetchall()))


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
        "UPDATE objects SET batch_id = NULL, pack_rejected_at = ?, updated_at = ?"
        " WHERE object_id = ? AND batch_id = ?",
        (now, now, object_id, batch_id),
    )
    if cur.rowcount != 1:
        return False
    outbound.flag(cur, Outbound.OBJECT, [(object_id, error[:2000])], now)
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
        "UPDATE packages SET state = 'verified', verified_at = ?, updated_at = ?"
        " WHERE batch_id = ? AND state = 'sealed' RETURNING project",
        (now, now, batch_id),
    )
    verified = cur.fetchall()
    if not verified:
        return False
    # Ready to send: its outbound row, due now.
    outbound.add(cur, PACKAGE, [(str(batch_id), verified[0][0])], now)
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


def unseal(cur: sqlite3.Cursor, batch_id: int, error: str, now: float) -> bool:
    """``sealed -> closed``: the verification pass found the package damaged; rebuild it."""
    cur.execute(
        "UPDATE packages SET state = 'closed', package_id = NULL, sealed_at = NULL,"
        " build_error = ?, next_build_at = ?, updated_at = ?"
        " WHERE batch_id = ? AND state = 'sealed'",
        (error[:2000], now, now, batch_id),
    )
    return cur.rowcount == 1


def _packages_of(cur: sqlite3.Cursor, batch_ids: list[int]) -> list[PackageRow]:
    """The packages of ``batch_ids``, in that order."""
    if not batch_ids:
        return []
    cur.execute(_SELECT + f" WHERE batch_id IN ({', '.join('?' for _ in batch_ids)})", batch_ids)
    found = {row.batch_id: row for row in _packages(cur)}
    return [found[b] for b in batch_ids if b in found]


def _ids(refs: list[str]) -> list[int]:
    return [int(ref) for ref in refs]


def claim_deliveries(
    cur: sqlite3.Cursor, now: float, limit: int, projects: Iterable[str]
) -> list[PackageRow]:
    """Move up to ``limit`` packages of ``projects`` whose delivery is due to ``delivering``
    (a guarded update that counts an attempt), oldest due first."""
    return _packages_of(cur, _ids(outbound.claim_due(cur, PACKAGE, now, limit, projects)))


def record_delivered(
    cur: sqlite3.Cursor,
    batch_id: int,
    identifier: str,
    remote_names: Mapping[str, str],
    now: float,
    retention: float,
) -> bool:
    """``delivering -> delivered``: every file of the package is at ``identifier`` (a forced
    upload is done); its local files may go ``retention`` after the copy is verified."""
    if not outbound.record_delivered(cur, PACKAGE, str(batch_id), identifier, now):
        return False
    cur.execute(
        "UPDATE packages SET purge_after = ?, updated_at = ? WHERE batch_id = ?",
        (now + retention, now, batch_id),
    )
    cur.executemany(
        "UPDATE package_files SET remote_name = ? WHERE batch_id = ? AND suffix = ?",
        [(name, batch_id, suffix) for suffix, name in remote_names.items()],
    )
    return True


def record_delivery_failure(
    cur: sqlite3.Cursor,
    batch_id: int,
    error: str,
    next_attempt_at: float,
    needs_operator: bool,
    now: float,
) -> bool:
    """``delivering -> retry_wait``."""
    return outbound.record_failure(
        cur, PACKAGE, str(batch_id), error, next_attempt_at, needs_operator, now
    )


def follow_ups_due(
    cur: sqlite3.Cursor, now: float, limit: int, projects: Iterable[str], busy: Iterable[int]
) -> list[PackageRow]:
    """Delivered packages whose remote verification, or whose purge, is due."""
    refs = outbound.follow_ups_due(cur, PACKAGE, now, limit, projects, map(str, busy))
    return _packages_of(cur, _ids(refs))


def record_remote_verified(cur: sqlite3.Cursor, batch_id: int, now: float) -> None:
    """Every file is listed at IA with its size and MD5: the package and each member are
    delivered and verified (the members' delivery fact; their payload fact is apart).  The
    package's local files go next, once their retention has passed."""
    cur.execute("SELECT purge_after FROM packages WHERE batch_id = ?", (batch_id,))
    found = cur.fetchone()
    purge_after = found[0] if found is not None and found[0] is not None else now
    if outbound.record_verified(cur, PACKAGE, str(batch_id), now, max(now, purge_after)):
        record_remote_verified_members(cur, batch_id, now, now)


def redeliver(
    cur: sqlite3.Cursor, batch_id: int, reason: str, now: float, *, by_operator: bool = False
) -> bool:
    """``delivered -> retry_wait``, due now, for a package not yet verified at IA.

    verify_timeout passed with a file still unlisted (a re-delivery counted), or an operator's
    retry (the count reset).  purge_after goes; the members stay as they are (a package's
    members are marked delivered only once it is verified).  False when not eligible."""
    if not outbound.redeliver(cur, PACKAGE, str(batch_id), reason, now, by_operator=by_operator):
        return False
    cur.execute("UPDATE packages SET purge_after = NULL WHERE batch_id = ?", (batch_id,))
    return True


def operator_retry(cur: sqlite3.Cursor, package_id: str, now: float) -> PackageRow | None:
    """``canner retry PACKAGE``: a package waiting for a retry is due now (its flag cleared); a
    delivered one not yet verified (unlisted, or a copy IA serves wrong) is delivered again, due
    now.  The row as it was before, or None when nothing could be retried."""
    cur.execute(_SELECT + " WHERE package_id = ?", (package_id,))
    found = _packages(cur)
    if not found:
        return None
    before = found[0]
    if not outbound.operator_retry(cur, PACKAGE, str(before.batch_id), now):
        return None
    cur.execute("UPDATE packages SET purge_after = NULL WHERE batch_id = ?", (before.batch_id,))
    return before


def flagged_packages(cur: sqlite3.Cursor, project: str | None) -> list[str]:
    """Package ids flagged for an operator that a retry can act on (waiting for a retry, or
    delivered and not verified), of ``project`` (all when None)."""
    rows = _packages_of(cur, sorted(_ids(outbound.flagged(cur, PACKAGE, project))))
    return [row.package_id for row in rows if row.package_id is not None]


def package_exists(cur: sqlite3.Cursor, package_id: str) -> bool:
    cur.execute("SELECT 1 FROM packages WHERE package_id = ?", (package_id,))
    return cur.fetchone() is not None


# ``canner retry PACKAGE`` and ``canner retry --needs-operator``.
BY_NAME = outbound.Named(
    PACKAGE, exists=package_exists, retry=operator_retry, flagged=flagged_packages
)


def record_purged(cur: sqlite3.Cursor, batch_id: int, now: float) -> bool:
    """The package's local files are deleted (guarded: verified at IA first)."""
    if not outbound.settle(cur, PACKAGE, str(batch_id), now):
        return False
    cur.execute(
        "UPDATE packages SET purged_at = ?, updated_at = ?"
        " WHERE batch_id = ? AND purged_at IS NULL",
        (now, now, batch_id),
    )
    return cur.rowcount == 1


def known_packages(cur: sqlite3.Cursor) -> set[str]:
    cur.execute("SELECT package_id FROM packages WHERE package_id IS NOT NULL")
    return {row[0] for row in cur.fetchall()}


@frozen
class RestoredPackage:
    """A package found on disk with no row (a lost or deleted ``delivery.sqlite``).

    ``members`` are all of its members; ``archived`` the ids among them whose records a verified
    ledger owns (they count in the package, but never come back as objects)."""

    package_id: str
    project: str
    batch_date: str
    members: list[Member]
    archived: frozenset[str]
    placements: list[tuple[str, str, int]]
    files: list[tuple[str, int]]
    delivery: Mapping[str, Any] | None
    found_at: float


def restore_package(cur: sqlite3.Cursor, p: RestoredPackage) -> bool:
    """Bring back a package row and its members from the package's own index.

    Members missing from ``objects`` are inserted from the index lines, except archived ones
    (their records belong to a verified ledger; they still count in the package's members and
    bytes); members that another batch already holds leave the package alone (False).  Without
    a delivery record the package comes back ``sealed`` (the verification pass runs again, then
    delivery, which finds files already at IA and skips them); with one, as delivered and
    verified, purged when it says so.
    """
    now = p.found_at
    cur.execute("SELECT 1 FROM packages WHERE package_id = ?", (p.package_id,))
    if cur.fetchone() is not None:
        return False
    restored = [m for m in p.members if m.object_id not in p.archived]
    cur.executemany(
        "INSERT OR IGNORE INTO objects (object_id, project, filename, size_bytes, checksum,"
        " accepted_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [
            (m.object_id, m.project, m.filename, m.size_bytes, m.checksum, m.accepted_at, now)
            for m in restored
        ],
    )
    outbound.add(cur, Outbound.OBJECT, [(m.object_id, m.project) for m in restored], now)
    ids = [m.object_id for m in p.members]
    held = 0
    for start in range(0, len(ids), 500):
        part = ids[start : start + 500]
        cur.execute(
            f"SELECT count(*) FROM objects WHERE object_id IN ({', '.join('?' for _ in part)})"
            " AND batch_id IS NOT NULL",
            part,
        )
        held += cur.fetchone()[0]
    if held:
        return False
    d = p.delivery or {}
    delivered = bool(d.get("remote_verified_at"))
    cur.execute(
        "INSERT INTO packages (project, state, members, bytes, oldest_accepted_at, opened_at,"
        " closed_at, close_reason, package_id, batch_date, sealed_at, verified_at,"
        " sources_purged_at, purge_after, purged_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, 'rebuilt', ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            p.project,
            "verified" if delivered else "sealed",
            len(p.members),
            sum(m.size_bytes for m in p.members),
            min(m.accepted_at for m in p.members),
            now,
            now,
            p.package_id,
            p.batch_date,
            now,
            now if delivered else None,
            d.get("sources_purged_at"),
            d.get("purge_after"),
            d.get("purged_at"),
            now,
        ),
    )
    batch_id = cur.lastrowid
    assert batch_id is not None
    if delivered:
        outbound.add_delivered(
            cur,
            PACKAGE,
            str(batch_id),
            p.project,
            identifier=d.get("identifier"),
            delivered_at=d.get("delivered_at"),
            verified_at=d.get("remote_verified_at"),
            next_check_at=None if d.get("purged_at") else now,
            now=now,
        )
    cur.executemany(
        "INSERT OR REPLACE INTO package_files (batch_id, suffix, size_bytes, content_md5,"
        " remote_name) VALUES (?, ?, ?, ?, ?)",
        [
            (
                batch_id,
                suffix,
                size,
                (d.get("md5") or {}).get(suffix),
                (d.get("remote_names") or {}).get(suffix),
            )
            for suffix, size in p.files
        ],
    )
    cur.executemany(
        "UPDATE objects SET batch_id = ?, packed_file = ?, packed_offset = ? WHERE object_id = ?",
        [(batch_id, suffix, offset, oid) for oid, suffix, offset in p.placements],
    )
    if d.get("sources_purged_at"):
        cur.execute(
            "UPDATE objects SET purged_at = coalesce(purged_at, ?) WHERE batch_id = ?",
            (d["sources_purged_at"], batch_id),
        )
    if delivered:
        record_remote_verified_members(cur, batch_id, float(d["remote_verified_at"]), now)
    return True


def record_remote_verified_members(
    cur: sqlite3.Cursor, batch_id: int, verified_at: float, now: float
) -> None:
    """The members of a package verified at IA are delivered and verified there too (in the
    package's item, in its file that holds them)."""
    cur.execute(
        "UPDATE outbound SET state = 'delivered',"
        " remote_identifier = (SELECT remote_identifier FROM outbound p"
        "   WHERE p.kind = 'package' AND p.ref = CAST(? AS TEXT)),"
        " delivered_at = (SELECT delivered_at FROM outbound p"
        "   WHERE p.kind = 'package' AND p.ref = CAST(? AS TEXT)),"
        " verified_at = ?, last_error = NULL, needs_operator = 0, updated_at = ?"
        " WHERE kind = 'object' AND state IN ('pending', 'retry_wait')"
        " AND ref IN (SELECT object_id FROM objects WHERE batch_id = ?)",
        (batch_id, batch_id, verified_at, now, batch_id),
    )
    cur.execute(
        "UPDATE objects SET remote_name = (SELECT remote_name FROM package_files f"
        "   WHERE f.batch_id = ? AND f.suffix = objects.packed_file), updated_at = ?"
        " WHERE batch_id = ?",
        (batch_id, now, batch_id),
    )


def unfinished_builds(cur: sqlite3.Cursor, busy: Iterable[int], limit: int) -> list[PackageRow]:
    """Sealed packages not yet verified, and verified ones whose sources are not yet purged
    (work a crash or a failure interrupted), leaving out the ``busy`` ones."""
    skip = sorted(busy)
    if limit <= 0:
        return []
    cur.execute(
        _SELECT + " WHERE (state = 'sealed' OR (state = 'verified' AND sources_purged_at IS NULL))"
        f" AND batch_id NOT IN ({', '.join('?' for _ in skip)}) ORDER BY batch_id LIMIT ?",
        (*skip, limit),
    )
    return _packages(cur)


def member_placements(cur: sqlite3.Cursor, batch_id: int) -> list[tuple[str, str, int]]:
    """``(object id, file suffix, offset)`` of every packed member of a batch."""
    cur.execute(
        "SELECT object_id, packed_file, packed_offset FROM objects WHERE batch_id = ?"
        " AND packed_file IS NOT NULL ORDER BY accepted_at, object_id",
        (batch_id,),
    )
    return [(oid, suffix, offset) for oid, suffix, offset in cur.fetchall()]


def package_listing(cur: sqlite3.Cursor, row: PackageRow) -> dict[str, Any]:
    """A package row with its files, as ``canner packages`` prints it."""
    doc = row.as_dict()
    doc["files"] = [
        {
            "suffix": f.suffix,
            "size_bytes": f.size_bytes,
            "content_md5": f.content_md5,
            "remote_name": f.remote_name,
        }
        for f in package_files(cur, row.batch_id)
    ]
    return doc


def object_package(cur: sqlite3.Cursor, object_id: str) -> dict[str, Any] | None:
    """Where a packed object is: its batch and package, the IA item, the file and the byte
    offset of its bytes in that file; None for an object in no batch."""
    try:
        cur.execute(
            "SELECT batch_id, packed_file, packed_offset, size_bytes FROM objects"
            " WHERE object_id = ?",
            (object_id,),
        )
    except sqlite3.OperationalError:  # an index from before packaging
        return None
    found = cur.fetchone()
    if found is None or found[0] is None:
        return None
    batch_id, suffix, offset, size = found
    row = get_package(cur, batch_id)
    if row is None:
        return None
    remote_name = None
    for f in package_files(cur, batch_id):
        if f.suffix == suffix:
            remote_name = f.remote_name
    return {
        "batch_id": batch_id,
        "package": row.package_id,
        "state": row.state,
        "delivery_state": row.delivery_state,
        "identifier": row.remote_identifier,
        "remote_name": remote_name,
        "local_file": None if row.package_id is None or suffix is None else row.package_id + suffix,
        "offset": offset,
        "size_bytes": size,
        "sealed_at": row.sealed_at,
        "verified_at": row.verified_at,
        "delivered_at": row.delivered_at,
        "remote_verified_at": row.remote_verified_at,
        "purged_at": row.purged_at,
    }


def readmit(cur: sqlite3.Cursor, object_id: str, now: float) -> bool:
    """Operator retry of a member taken out of its batch (its bytes did not match its receipt):
    it joins a batch again at the next tick, and is checked again when packed (guarded)."""
    cur.execute(
        "UPDATE objects SET pack_rejected_at = NULL, updated_at = ?"
        " WHERE object_id = ? AND pack_rejected_at IS NOT NULL AND batch_id IS NULL",
        (now, object_id),
    )
    if cur.rowcount != 1:
        return False
    cur.execute(
        "UPDATE outbound SET needs_operator = 0, updated_at = ? WHERE kind = 'object' AND ref = ?",
        (now, object_id),
    )
    return True
