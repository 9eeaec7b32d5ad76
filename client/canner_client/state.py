"""Durable resume state: one small JSON file per upload in progress.

A state is written (fsync, rename, directory fsync) before the first PATCH, so a worker killed at
any moment and started again with the same command finds its upload again.  It is keyed by the
receiver's URL, the project and the file's absolute path; the file's size, mtime and checksum are
stored to refuse a file that changed since.  The state of a receipted upload is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

VERSION = 1


def default_state_dir() -> Path:
    """``$XDG_CACHE_HOME/canner-upload`` (``~/.cache/canner-upload`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "canner-upload"


@dataclass(frozen=True)
class UploadSession:
    """An upload started on a receiver: what is needed to resume it and to check the file."""

    files_url: str
    project: str
    path: str
    size: int
    mtime_ns: int
    checksum: str
    filename: str | None
    upload_url: str
    created_at: float

    @property
    def object_id(self) -> str:
        return self.upload_url.rstrip("/").rsplit("/", 1)[-1]


def state_key(files_url: str, project: str, path: str) -> str:
    identity = json.dumps([files_url, project, os.path.abspath(path)])
    return hashlib.sha256(identity.encode("utf-8")).hexdigest()[:32]


class StateStore:
    """Resume states under one directory (created 0700 on first write)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_state_dir()

    def path_for(self, files_url: str, project: str, path: str) -> Path:
        return self.directory / f"{state_key(files_url, project, path)}.json"

    def load(self, files_url: str, project: str, path: str) -> UploadSession | None:
        """The saved session for this file, or None.  A corrupt state file is an error: it
        names an upload the server may hold, so it is not silently dropped."""
        state_path = self.path_for(files_url, project, path)
        try:
            data = state_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(data)
            if doc.pop("version") != VERSION:
                raise ValueError("unknown version")
            return UploadSession(**doc)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"resume state {state_path} is unreadable ({e}); remove it") from None

    def save(self, session: UploadSession) -> Path:
        """Write ``session`` durably; returns the state file's path."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        target = self.path_for(session.files_url, session.project, session.path)
        doc = {"version": VERSION, **asdict(session)}
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(doc, indent=1).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(self.directory)
        return target

    def remove(self, session: UploadSession) -> None:
        target = self.path_for(session.files_url, session.project, session.path)
        try:
            target.unlink()
        except FileNotFoundError:
            return
        _fsync_dir(self.directory)

    def sessions(self) -> list[UploadSession]:
        """Every saved session (unreadable files are skipped here; ``load`` reports them)."""
        found = []
        for entry in sorted(self.directory.glob("*.json")):
            try:
                doc = json.loads(entry.read_bytes())
                if doc.pop("version") == VERSION:
                    found.append(UploadSession(**doc))
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                continue
        return found


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
