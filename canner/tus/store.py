"""Uploads on disk: ``uploads/{id}`` holds the bytes, ``uploads/{id}.info`` the tus info sidecar.

The sidecar has the tusd filestore shape (``ID``, ``Size``, ``Offset``, ``MetaData``, ...) plus
``CreatedAt`` and, once the checksum failed, ``Rejected``.  The offset of an upload is the size of
its data file: nothing in memory is authoritative, so a restart reads only the disk.  Paths are
derived from the (validated) id, never read from the sidecar.

One writer per upload: :meth:`UploadStore.open_locked` takes a flock on the data file that holds
across processes.  Every method blocks; call them through a blocking runner.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from attrs import define, evolve, frozen

from canner import fs
from canner.checksum import Checksum, parse_checksum

# Bytes a streaming upload writes before they are handed to the kernel's writeback.
WRITE_BEHIND_WINDOW = 32 << 20
_IOV_MAX = 512


class CorruptInfo(Exception):
    """An info sidecar exists but cannot be read as one."""


@frozen
class UploadInfo:
    """What the sidecar records about an upload."""

    upload_id: str
    size: int
    metadata: Mapping[str, str]
    created_at: int
    rejected: str | None = None

    @property
    def project(self) -> str:
        return self.metadata["project"]

    @property
    def checksum(self) -> Checksum:
        return parse_checksum(self.metadata["checksum"])

    @property
    def filename(self) -> str | None:
        return self.metadata.get("filename") or None

    def to_json(self, offset: int) -> bytes:
        doc: dict[str, Any] = {
            "ID": self.upload_id,
            "Size": self.size,
            "SizeIsDeferred": False,
            "Offset": offset,
            "MetaData": dict(self.metadata),
            "IsPartial": False,
            "IsFinal": False,
            "PartialUploads": None,
            "CreatedAt": self.created_at,
        }
        if self.rejected is not None:
            doc["Rejected"] = self.rejected
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def parse_info(upload_id: str, data: bytes) -> UploadInfo:
    """Read a sidecar; :class:`CorruptInfo` when it is not one for ``upload_id``."""
    try:
        raw = json.loads(data)
        metadata = raw["MetaData"]
        size, created = raw["Size"], raw.get("CreatedAt", 0)
        ok = (
            raw["ID"] == upload_id
            and isinstance(size, int)
            and size > 0
            and isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
            and isinstance(metadata.get("project"), str)
            and isinstance(created, int)
        )
        if not ok:
            raise ValueError("unexpected shape")
        parse_checksum(metadata["checksum"])
        rejected = raw.get("Rejected")
        return UploadInfo(upload_id, size, metadata, created, rejected)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptInfo(f"info sidecar of {upload_id} is unreadable: {e}") from None


@define(eq=False)
class LockedUpload:
    """An open, flocked data file: the right to write one upload.  Close to release."""

    info: UploadInfo
    fd: int
    offset: int
    # Where a just-created upload lives (the Location of its creation response).
    location: str | None = None
    # Start of the range not yet handed to writeback (see fs.write_behind).
    _written_back: int = -1

    def write(self, chunks: list[bytes]) -> int:
        """Write ``chunks`` at the current offset; returns the new offset."""
        pos = self.offset
        pending = [memoryview(chunk) for chunk in chunks]
        while pending:
            # At most _IOV_MAX buffers per call (the kernel's IOV_MAX is 1024).
            written = os.pwritev(self.fd, pending[:_IOV_MAX], pos)
            pos += written
            while pending and written >= len(pending[0]):
                written -= len(pending.pop(0))
            if pending:
                pending[0] = pending[0][written:]
        self.offset = pos
        self._write_behind()
        return pos

    def _write_behind(self) -> None:
        if self._written_back < 0:
            self._written_back = self.offset - (self.offset % WRITE_BEHIND_WINDOW)
        if self.offset - self._written_back >= WRITE_BEHIND_WINDOW:
            # Hand the new window to writeback and wait for the one before it: dirty pages stay
            # under about two windows per upload, and the disk works while the socket streams.
            settle = max(self._written_back - WRITE_BEHIND_WINDOW, 0)
            fs.write_behind(self.fd, self._written_back, self.offset, settle)
            self._written_back = self.offset

    def truncate(self, offset: int) -> None:
        """Drop everything after ``offset`` (undo a refused chunked PATCH)."""
        os.ftruncate(self.fd, offset)
        self.offset = offset

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@frozen
class UploadStore:
    """``uploads/`` in the data directory."""

    directory: Path

    def data_path(self, upload_id: str) -> Path:
        return self.directory / upload_id

    def info_path(self, upload_id: str) -> Path:
        return self.directory / f"{upload_id}.info"

    def create(self, info: UploadInfo) -> None:
        """Create an empty upload.  Not fsynced: acceptance syncs everything it relies on."""
        fd = os.open(
            self.data_path(info.upload_id),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
            0o644,
        )
        os.close(fd)
        fs.replace_file(self.directory, f"{info.upload_id}.info", info.to_json(0), sync=False)

    def read_info(self, upload_id: str) -> UploadInfo | None:
        """The sidecar, or None when there is no such upload; :class:`CorruptInfo` if unreadable."""
        try:
            data = self.info_path(upload_id).read_bytes()
        except FileNotFoundError:
            return None
        return parse_info(upload_id, data)

    def offset(self, upload_id: str) -> int:
        """Bytes stored so far (the data file's size; 0 when it is missing)."""
        try:
            return os.stat(self.data_path(upload_id)).st_size
        except FileNotFoundError:
            return 0

    def open_locked(self, info: UploadInfo) -> LockedUpload:
        """Open and flock the data file; raise :class:`fs.Locked` while another writer holds it."""
        fd = os.open(self.data_path(info.upload_id), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fs.lock_fd(fd)
            offset = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return LockedUpload(info, fd, offset)

    def sync_upload(self, upload: LockedUpload) -> None:
        """fsync the data file and the info sidecar (step 2 of acceptance; the dir is separate)."""
        os.fsync(upload.fd)
        fs.fsync_path(self.info_path(upload.info.upload_id))

    def reject(self, upload: LockedUpload, reason: str) -> UploadInfo:
        """Durably mark the upload as never acceptable, then free its bytes."""
        rejected = evolve(upload.info, rejected=reason)
        fs.replace_file(
            self.directory, f"{upload.info.upload_id}.info", rejected.to_json(0), sync=True
        )
        fs.fsync_dir(self.directory)
        upload.truncate(0)
        return rejected

    def remove(self, upload_id: str) -> None:
        """Delete data and sidecar; already missing counts as done."""
        self.data_path(upload_id).unlink(missing_ok=True)
        self.info_path(upload_id).unlink(missing_ok=True)

    def entries(self) -> Iterator[tuple[str, float]]:
        """``(upload_id, mtime)`` of every info sidecar, for the stale-upload sweep."""
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(".info") and not entry.name.startswith(fs.TEMP_PREFIX):
                    try:
                        yield entry.name[: -len(".info")], entry.stat().st_mtime
                    except FileNotFoundError:
                        continue

    def idle_since(self, upload_id: str) -> float:
        """The last time the upload changed (newest mtime of data and sidecar)."""
        times = []
        for path in (self.data_path(upload_id), self.info_path(upload_id)):
            try:
                times.append(path.stat().st_mtime)
            except FileNotFoundError:
                continue
        return max(times, default=0.0)
