"""A Go canner's data directory, read (never written): what ``canner adopt-go`` takes over.

The layout and ``delivery.sqlite``'s schema are those of ``docs/reference/go-canner.md`` (§1.6,
§1.7).  Every path is derived from an object id, never from a ``.info`` file's ``Storage``
(absolute paths that point where the directory was written, not where it is now).  Blocking.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

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
        with read_only(path) as conn:
            return _artifacts(conn), _packages(conn)


@contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection that reads the Go index with every commit in its WAL and writes nothing
    next to it: not a byte of the database, its ``-wal`` or its ``-shm`` (a dry run changes
    nothing; a plain connection would fold the WAL in and delete both when it closes).

    - ``-wal`` and ``-shm`` there (a Go daemon running, or killed): ``mode=ro`` with the unix
      VFS's ``readonly_shm=1``, which opens the ``-shm`` read-only.  ``mode=ro`` alone still
      writes the ``-shm`` (its recovery and read marks).  Beside a live daemon it reads under
      the daemon's locks; without one SQLite rebuilds the WAL index in private memory.
    - no ``-wal`` (Go stopped cleanly: every commit is in the file): ``immutable=1``, which
      takes no lock and creates no file.  It would ignore a WAL, but there is none: a WAL-mode
      connection keeps its ``-wal`` while it is open, so no Go process has the index open,
      and one starting now writes to a new WAL, not to this file, until it checkpoints.
    - a ``-wal`` without its ``-shm``, or a rollback ``-journal`` (a copied directory): no
      live process has the index open (each would have its ``-shm``), and SQLite can read
      neither without writing; the files are copied to a private directory and read there.
    """
    side = {suffix: Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm", "-journal")}
    if side["-wal"] and side["-shm"] and not side["-journal"]:
        yield from _connected(f"file:{quote(str(path))}?mode=ro&readonly_shm=1")
    elif not side["-wal"] and not side["-journal"]:
        yield from _connected(f"file:{quote(str(path))}?immutable=1")
    else:
        with tempfile.TemporaryDirectory(prefix="canner-go-index-") as private:
            copy = Path(private) / path.name
            for suffix in ("", "-wal", "-journal"):
                if suffix == "" or side[suffix]:
                    shutil.copyfile(f"{path}{suffix}", f"{copy}{suffix}")
            yield from _connected(str(copy), uri=False)


def _connected(database: str, uri: bool = True) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(database, uri=uri)
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        yield conn
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
