"""Write a Go canner's data directory exactly as ``docs/reference/go-canner.md`` describes it
(§1.4.4 receipts, §1.6 layout, §1.7 ``delivery.sqlite``), for ``canner adopt-go`` tests.

:func:`write_go_data_dir` makes one object (or upload) per state the Go canner can leave behind,
with tusd ``.info`` files whose ``Storage`` paths are absolute and point elsewhere (where the
directory was written, not where it is), ``.attempt`` markers on partial uploads, identity
packages as hard links with their three-line manifests, a mergewarc package whose sources were
purged, and the temp files and locks a stop or a crash leaves.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import blake3

ISSUER = "https://go-canner.example/"
ELSEWHERE = "/srv/old-canner/data"  # where the Go canner ran: no file is there
NOW = 1_780_000_000
DAY = 86400

# delivery.go openDeliveryStore, as the reference gives it (STRICT, foreign keys declared).
DDL = """
CREATE TABLE IF NOT EXISTS artifacts (
  object_id TEXT PRIMARY KEY, project TEXT NOT NULL, filename TEXT NOT NULL,
  checksum TEXT NOT NULL, size_bytes INTEGER NOT NULL, accepted_at INTEGER NOT NULL,
  package_id TEXT NULL REFERENCES packages(package_id), packaging_error TEXT NULL,
  source_purged_at INTEGER NULL, next_source_purge_at INTEGER NOT NULL DEFAULT 0,
  source_purge_error TEXT NULL
) STRICT;
CREATE INDEX IF NOT EXISTS artifacts_package_idx
  ON artifacts(project, package_id, packaging_error, accepted_at, object_id);
CREATE INDEX IF NOT EXISTS artifacts_source_purge_idx
  ON artifacts(source_purged_at, next_source_purge_at, accepted_at, object_id);
CREATE TABLE IF NOT EXISTS packaging_projects (
  project TEXT PRIMARY KEY, draining INTEGER NOT NULL DEFAULT 0 CHECK (draining IN (0, 1)),
  updated_at INTEGER NOT NULL
) STRICT;
CREATE TABLE IF NOT EXISTS packages (
  package_id TEXT PRIMARY KEY, project TEXT NOT NULL,
  packager TEXT NOT NULL CHECK (packager IN ('identity', 'mergewarc')),
  filename TEXT NOT NULL, manifest_filename TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('building', 'sealed', 'blocked')),
  size_bytes INTEGER, checksum TEXT, manifest_checksum TEXT, member_count INTEGER NOT NULL,
  build_attempts INTEGER NOT NULL DEFAULT 0, next_build_at INTEGER NOT NULL, build_error TEXT,
  updated_at INTEGER NOT NULL, created_at INTEGER NOT NULL, sealed_at INTEGER,
  purge_after INTEGER, next_purge_attempt_at INTEGER, purge_error TEXT, purged_at INTEGER
) STRICT;
CREATE INDEX IF NOT EXISTS packages_build_idx
  ON packages(state, next_build_at, created_at, package_id);
CREATE INDEX IF NOT EXISTS packages_purge_idx
  ON packages(purged_at, next_purge_attempt_at, purge_after, package_id);
CREATE TABLE IF NOT EXISTS package_members (
  package_id TEXT NOT NULL REFERENCES packages(package_id), ordinal INTEGER NOT NULL,
  object_id TEXT NOT NULL UNIQUE, offset_bytes INTEGER NOT NULL, size_bytes INTEGER NOT NULL,
  checksum TEXT NOT NULL, PRIMARY KEY (package_id, ordinal)
) STRICT;
CREATE TABLE IF NOT EXISTS deliveries (
  package_id TEXT NOT NULL REFERENCES packages(package_id), sink_id TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('pending', 'delivering', 'retry_wait', 'delivered')),
  plan TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at INTEGER NOT NULL,
  last_error TEXT, remote_id TEXT, progress TEXT, updated_at INTEGER NOT NULL,
  delivered_at INTEGER, PRIMARY KEY (package_id, sink_id)
) STRICT;
CREATE INDEX IF NOT EXISTS deliveries_due_idx
  ON deliveries(state, next_attempt_at, package_id, sink_id);
"""


def receipt_bytes(oid: str, data: bytes, accepted_at: int, issuer: str = ISSUER) -> bytes:
    """§1.4.4: compact, fields in struct order, no trailing newline."""
    doc = {
        "id": f"receipt:{oid}",
        "issuer": issuer,
        "object_id": oid,
        "checksum": "blake3:" + blake3.blake3(data).hexdigest(),
        "size_bytes": len(data),
        "accepted_at": accepted_at,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def info_bytes(oid: str, size: int, metadata: dict[str, str]) -> bytes:
    """tusd filestore's FileInfo: Offset always 0, MetaData keys sorted, Storage absolute."""
    doc = {
        "ID": oid,
        "Size": size,
        "SizeIsDeferred": False,
        "Offset": 0,
        "MetaData": dict(sorted(metadata.items())),
        "IsPartial": False,
        "IsFinal": False,
        "PartialUploads": None,
        "Storage": {
            "InfoPath": f"{ELSEWHERE}/uploads/{oid}.info",
            "Path": f"{ELSEWHERE}/uploads/{oid}",
            "Type": "filestore",
        },
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def checksum_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


@dataclass
class GoObject:
    oid: str
    data: bytes  # the whole artifact
    state: str
    project: str = "example"
    filename: str = "page.warc.gz"

    @property
    def checksum(self) -> str:
        return checksum_of(self.data)

    def metadata(self) -> dict[str, str]:
        return {"checksum": self.checksum, "filename": self.filename, "project": self.project}


@dataclass
class GoDir:
    root: Path
    objects: dict[str, GoObject] = field(default_factory=dict)  # by state
    leftovers: list[str] = field(default_factory=list)
    # The end of the partial upload's last PATCH (its .attempt marker's mtime).
    last_patch_at: float = 0.0

    def of(self, state: str) -> GoObject:
        return self.objects[state]

    @property
    def receipts(self) -> dict[str, bytes]:
        found = {}
        for name in os.listdir(self.root / "receipts"):
            if name.endswith(".json") and not name.startswith("."):
                found[name[:-5]] = (self.root / "receipts" / name).read_bytes()
        return found


def new_oid() -> str:
    return secrets.token_hex(16)


def _pkgid() -> str:
    return secrets.token_hex(32)


def _plan(identifier: str, remote: str, filename: str) -> str:
    return json.dumps(
        {
            "version": 1,
            "sink": "internet_archive",
            "credentials_file": "/run/secrets/ia.keys",
            "identifier": identifier,
            "files": {remote: filename, f"{remote}.manifest.jsonl": f"{filename}.manifest.jsonl"},
            "metadata": {"collection": ["test_collection"], "title": ["x"]},
            "local_artifact_retention_nanos": 30_000_000_000,
        },
        separators=(",", ":"),
    )


def _identity_manifest(obj: GoObject, accepted_at: int) -> bytes:
    lines = [
        {"format": "artifact", "packager": "identity", "type": "canner-package", "version": 1},
        {
            "accepted_at": accepted_at,
            "checksums": [obj.checksum],
            "name": f"{obj.oid}/{obj.filename}",
            "object_id": obj.oid,
            "offset": 0,
            "receipt_id": f"receipt:{obj.oid}",
            "size": len(obj.data),
            "type": "input",
        },
        {"checksums": [obj.checksum], "inputs": 1, "size": len(obj.data), "type": "output"},
    ]
    return b"".join(json.dumps(line, sort_keys=True).encode() + b"\n" for line in lines)


# Every state write_go_data_dir makes, and what adopt-go does with it.
STATES = {
    "delivered_purged": "delivered",  # identity package delivered, Go purged everything
    "delivered_kept": "delivered",  # identity delivered, package file kept until purge_after
    "merge_delivered_a": "delivered",  # members of a delivered mergewarc package (purged)
    "merge_delivered_b": "delivered",
    "accepted": "deliver",  # accepted, not packaged yet: from its upload
    "sealed_pending": "deliver",  # identity sealed, source purged: from the package file
    "building": "deliver",  # identity reserved, not built: rebuilt from its upload
    "delivering": "deliver",  # Go's attempt cut short (source still there)
    "merge_retry_a": "deliver",  # mergewarc sealed, retry_wait, sources purged: extracted
    "merge_retry_b": "deliver",
    "blocked": "deliver",  # mergewarc blocked (an invalid member): rebuilt from its upload
    "partial": "in_flight",  # half uploaded, with an .attempt marker
    "empty": "in_flight",  # created, no byte yet
    "complete": "in_flight",  # every byte in, killed before acceptance: no receipt
}


def write_go_data_dir(root: Path, project: str = "example") -> GoDir:
    """A Go data directory at ``root`` holding one object per state of :data:`STATES`."""
    go = GoDir(root)
    for sub in ("uploads", "receipts", "packages", "package-manifests"):
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root / sub, 0o750)
    (root / "packages" / ".canner-keep").write_bytes(b"")
    db = sqlite3.connect(root / "delivery.sqlite")
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(DDL)
    for i, state in enumerate(STATES):
        data = f"{state} ".encode() * (200 + 37 * i) + secrets.token_bytes(64)
        go.objects[state] = GoObject(new_oid(), data, state, project)
    accepted = NOW - DAY

    def upload(obj: GoObject, stored: bytes) -> None:
        (root / "uploads" / obj.oid).write_bytes(stored)
        (root / "uploads" / f"{obj.oid}.info").write_bytes(
            info_bytes(obj.oid, len(obj.data), obj.metadata())
        )

    def accept(obj: GoObject, package_id: str | None, source_purged: bool) -> None:
        (root / "receipts" / f"{obj.oid}.json").write_bytes(
            receipt_bytes(obj.oid, obj.data, accepted)
        )
        os.chmod(root / "receipts" / f"{obj.oid}.json", 0o640)
        if not source_purged:
            upload(obj, obj.data)
        db.execute(
            "INSERT INTO artifacts (object_id, project, filename, checksum, size_bytes,"
            " accepted_at, package_id, source_purged_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                obj.oid,
                obj.project,
                obj.filename,
                obj.checksum,
                len(obj.data),
                accepted,
                package_id,
                accepted + 60 if source_purged else None,
            ),
        )

    def package(
        members: list[GoObject],
        packager: str,
        state: str,
        delivery: str | None,
        purged: bool,
        keep_sources: bool = False,
    ) -> str:
        pid = _pkgid()
        ext = ".gz" if packager == "identity" else ".warc.zst"
        filename = f"{project}-{pid[:24]}{ext}"
        manifest = f"{filename}.manifest.jsonl"
        offset = 0
        for ordinal, obj in enumerate(members):
            accept(obj, pid, source_purged=state == "sealed" and not keep_sources)
            db.execute(
                "INSERT INTO package_members VALUES (?, ?, ?, ?, ?, ?)",
                (pid, ordinal, obj.oid, offset, len(obj.data), obj.checksum),
            )
            offset += len(obj.data)
        payload = b"".join(o.data for o in members)
        sealed = state == "sealed"
        if sealed and not purged:
            path = root / "packages" / filename
            if packager == "identity" and keep_sources:
                os.link(root / "uploads" / members[0].oid, path)  # a hard link, as Go makes
            else:
                path.write_bytes(payload)
            if packager == "identity":
                (root / "package-manifests" / manifest).write_bytes(
                    _identity_manifest(members[0], accepted)
                )
            else:
                (root / "package-manifests" / manifest).write_bytes(b'{"stand-in":true}\n')
        done = delivery == "delivered"
        db.execute(
            "INSERT INTO packages (package_id, project, packager, filename, manifest_filename,"
            " state, size_bytes, checksum, member_count, next_build_at, updated_at, created_at,"
            " sealed_at, purge_after, next_purge_attempt_at, purged_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                pid,
                project,
                packager,
                filename,
                manifest,
                state,
                len(payload) if sealed else None,
                checksum_of(payload) if sealed else None,
                len(members),
                0,
                accepted,
                accepted,
                accepted + 30 if sealed else None,
                (NOW + DAY if not purged else accepted + 200) if done else None,
                (NOW + DAY if not purged else accepted + 200) if done else None,
                accepted + 230 if purged else None,
            ),
        )
        if delivery is not None:
            identifier = f"saveweb-{project}-{pid[:24]}"
            db.execute(
                "INSERT INTO deliveries (package_id, sink_id, state, plan, attempts,"
                " next_attempt_at, last_error, remote_id, updated_at, delivered_at)"
                " VALUES (?, 'internet_archive', ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    pid,
                    delivery,
                    _plan(identifier, filename, filename),
                    1 if done else 3,
                    0,
                    None if done else "503 SlowDown",
                    identifier if done else None,
                    accepted + 100,
                    accepted + 100 if done else None,
                ),
            )
        return pid

    o = go.objects
    package([o["delivered_purged"]], "identity", "sealed", "delivered", purged=True)
    package([o["delivered_kept"]], "identity", "sealed", "delivered", purged=False)
    package(
        [o["merge_delivered_a"], o["merge_delivered_b"]],
        "mergewarc",
        "sealed",
        "delivered",
        purged=True,
    )
    accept(o["accepted"], None, source_purged=False)
    package([o["sealed_pending"]], "identity", "sealed", "pending", purged=False)
    package([o["building"]], "identity", "building", None, purged=False)
    package([o["delivering"]], "identity", "sealed", "delivering", purged=False, keep_sources=True)
    package(
        [o["merge_retry_a"], o["merge_retry_b"]], "mergewarc", "sealed", "retry_wait", purged=False
    )
    blocked = package([o["blocked"]], "mergewarc", "blocked", None, purged=False)
    db.execute(
        "UPDATE artifacts SET packaging_error = 'not a WARC-Zstd file' WHERE object_id = ?",
        (o["blocked"].oid,),
    )
    db.execute(
        "UPDATE packages SET build_error = ? WHERE package_id = ?",
        (f"{o['blocked'].oid}: not a WARC-Zstd file", blocked),
    )
    db.execute("INSERT INTO packaging_projects VALUES (?, 1, ?)", (project, accepted))
    db.commit()
    db.close()
    # Uploads in flight: a partial one with its .attempt marker, and one with no byte yet.
    partial = o["partial"]
    upload(partial, partial.data[: len(partial.data) // 2])
    (root / "uploads" / f"{partial.oid}.attempt").write_bytes(b"")
    # Recent (a minute ago): canner's stale-upload sweep must not take it.
    go.last_patch_at = float(int(time.time()) - 60)
    os.utime(root / "uploads" / f"{partial.oid}.attempt", (go.last_patch_at, go.last_patch_at))
    upload(o["empty"], b"")
    upload(o["complete"], o["complete"].data)
    # What stops and crashes leave: temps, a stale lock (a dead pid), a stop request.
    leftovers = {
        "uploads/.attempt-123": b"",
        f"uploads/{partial.oid}.lock": b"999999999",
        f"uploads/{partial.oid}.stop": b"",
        "receipts/.receipt-456": b'{"id":',
        "packages/.package-789": b"half",
        "package-manifests/.manifest-012": b"",
        "delivery.lock": b"",
    }
    for name, content in leftovers.items():
        (root / name).write_bytes(content)
    go.leftovers = sorted(leftovers)
    return go


def metadata_header(obj: GoObject) -> str:
    return ",".join(
        f"{k} {base64.b64encode(v.encode()).decode()}" for k, v in obj.metadata().items()
    )


def kill_writer_after(root: Path, sql: str, *params: object) -> None:
    """What a Go daemon SIGKILLed after a commit leaves: a process opens ``delivery.sqlite`` in
    WAL mode without automatic checkpoints, commits ``sql`` and is killed (SIGKILL), so the
    commit is only in ``delivery.sqlite-wal`` and the ``-shm`` stays behind."""
    script = (
        "import os, signal, sqlite3, sys, json\n"
        "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "db.execute('PRAGMA journal_mode=WAL')\n"
        "db.execute('PRAGMA wal_autocheckpoint=0')\n"
        "db.execute(sys.argv[2], json.loads(sys.argv[3]))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(root / "delivery.sqlite"), sql, json.dumps(params)],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (root / "delivery.sqlite-wal").stat().st_size > 0
    assert (root / "delivery.sqlite-shm").exists()


def listing(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: size, mtime (ns) and SHA-256 of its content."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            st = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, digest)
    return found
