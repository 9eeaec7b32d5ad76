"""A Go canner's data directory, read (never written): what ``canner adopt-go`` takes over.

The layout and ``delivery.sqlite``'s schema are those of ``docs/reference/go-canner.md`` (§1.6,
§1.7).  Every path is derived from an object id, never from a ``.info`` file's ``Storage``
(absolute paths that point where the directory was written, not where it is now).  Blocking.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attrs import frozen

# Temp files and markers the Go canner leaves behind (a crash, a stop): never data.
LEFTOVER_PREFIXES = {
    "uploads": (".attempt-",),
    "receipts": (".receipt-",),
    "packages": (".package-",),
    "package-manifests": (".manifest-",),
}
LEFTOVER_SUFFIXES = (".lock", ".stop", ".attempt")
INDEX = "delivery.sqlite"
LOCK = "delivery.lock"


@frozen
class GoArtifact:
    """A row of ``artifacts``: an accepted object."""

    object_id: str
    project: str
    filename: str
    checksum: str
    size_bytes: int
    accepted_at: int
    package_id: str | None
    packaging_error: str | None
    source_purged_at: int | None


@frozen
class GoMember:
    """A row of ``package_members``."""

    object_id: str
    offset_bytes: int
    size_bytes: int
    checksum: str


@frozen
class GoPackage:
    """A row of ``packages`` with its members and its (only) delivery row, if any."""

    package_id: str
    project: str
    packager: str  # identity | mergewarc
    filename: str
    manifest_filename: str
    state: str  # building | sealed | blocked
    purge_after: int | None
    purged_at: int | None
    members: tuple[GoMember, ...]
    delivery_state: str | None  # pending | delivering | retry_wait | delivered
    remote_id: str | None
    delivered_at: int | None
    plan: dict[str, Any] | None

    @property
    def delivered(self) -> bool:
        return self.delivery_state == "delivered"

    @property
    def remote_name(self) -> str:
        """The payload's name at the remote item (the plan's file that is not the manifest)."""
        files = (self.plan or {}).get("files") or {}
        for remote, local in files.items():
            if local == self.filename:
                return str(remote)
        return self.filename


@frozen
class GoDataDir:
    """``root``, a Go canner's ``data_dir``."""

    root: Path

    @property
    def uploads(self) -> Path:
        return self.root / "uploads"

    @property
    def receipts(self) -> Path:
        return self.root / "receipts"

    @property
    def packages(self) -> Path:
        return self.root / "packages"

    @property
    def manifests(self) -> Path:
        return self.root / "package-manifests"

    def receipt_path(self, object_id: str) -> Path:
        return self.receipts / f"{object_id}.json"

    def data_path(self, object_id: str) -> Path:
        return self.uploads / object_id

    def info_path(self, object_id: str) -> Path:
        return self.uploads / f"{object_id}.info"

    def looks_like_one(self) -> bool:
        return self.uploads.is_dir() or self.receipts.is_dir() or (self.root / INDEX).exists()

    def receipt_ids(self) -> list[str]:
        return sorted(
            name[: -len(".json")]
            for name in _names(self.receipts)
            if name.endswith(".json") and not name.startswith(".")
        )

    def upload_ids(self) -> list[str]:
        """Ids of every ``.info`` in ``uploads/``."""
        return sorted(
            name[: -len(".info")]
            for name in _names(self.uploads)
            if name.endswith(".info") and not name.startswith(".")
        )

    def read_info(self, object_id: str) -> dict[str, Any] | None:
        """A tusd ``.info`` as JSON (None when missing); ``ValueError`` when unreadable."""
        try:
            raw = json.loads(self.info_path(object_id).read_bytes())
        except FileNotFoundError:
            return None
        if not isinstance(raw, dict) or not isinstance(raw.get("MetaData"), dict):
            raise ValueError(f"{self.info_path(object_id)} is not a tusd FileInfo")
        return raw

    def leftovers(self) -> list[Path]:
        """Temp files and stale markers (``.receipt-*``, ``.package-*``, ``.manifest-*``,
        ``.attempt-*``; ``<oid>.lock``, ``.stop``, ``.attempt``; ``delivery.lock``)."""
        found = []
        for sub, prefixes in LEFTOVER_PREFIXES.items():
            for name in _names(self.root / sub):
                if name.startswith(prefixes) or (
                    sub == "uploads" and name.endswith(LEFTOVER_SUFFIXES)
                ):
                    found.append(self.root / sub / name)
        if (self.root / LOCK).exists():
            found.append(self.root / LOCK)
        return sorted(found)

    def upload_lock_holders(self) -> Iterator[tuple[Path, int]]:
        """``(uploads/<oid>.lock, pid)`` for every upload lock naming a live process."""
        for name in _names(self.uploads):
            if not name.endswith(".lock"):
                continue
            path = self.uploads / name
            try:
                pid = int(path.read_text().strip() or "0")
            except (OSError, ValueError):
                continue
            if pid > 0 and _alive(pid):
                yield path, pid

    def read_index(self) -> tuple[dict[str, GoArtifact], dict[str, GoPackage]]:
        """Artifacts by object id and packages by package id (empty when there is no index)."""
        path = self.root / INDEX
        if not path.exists():
            return {}, {}
        conn = sqlite3.connect(path)
        try:
            conn.execute("PRAGMA busy_timeout=5000")
            return _artifacts(conn), _packages(conn)
        finally:
            conn.close()


def _artifacts(conn: sqlite3.Connection) -> dict[str, GoArtifact]:
    rows = conn.execute(
        "SELECT object_id, project, filename, checksum, size_bytes, accepted_at, package_id,"
        " packaging_error, source_purged_at FROM artifacts"
    ).fetchall()
    return {row[0]: GoArtifact(*row) for row in rows}


def _packages(conn: sqlite3.Connection) -> dict[str, GoPackage]:
    members: dict[str, list[GoMember]] = {}
    for pid, oid, offset, size, checksum in conn.execute(
        "SELECT package_id, object_id, offset_bytes, size_bytes, checksum FROM package_members"
        " ORDER BY package_id, ordinal"
    ):
        members.setdefault(pid, []).append(GoMember(oid, offset, size, checksum))
    deliveries = {
        row[0]: row[1:]
        for row in conn.execute(
            "SELECT package_id, state, remote_id, delivered_at, plan FROM deliveries"
            " WHERE sink_id = 'internet_archive'"
        )
    }
    found = {}
    for pid, project, packager, filename, manifest, state, purge_after, purged_at in conn.execute(
        "SELECT package_id, project, packager, filename, manifest_filename, state, purge_after,"
        " purged_at FROM packages"
    ):
        d_state, remote_id, delivered_at, plan = deliveries.get(pid, (None, None, None, None))
        found[pid] = GoPackage(
            pid,
            project,
            packager,
            filename,
            manifest,
            state,
            purge_after,
            purged_at,
            tuple(members.get(pid, ())),
            d_state,
            remote_id,
            delivered_at,
            json.loads(plan) if plan else None,
        )
    return found


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
