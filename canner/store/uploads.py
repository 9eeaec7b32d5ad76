"""Uploads on disk: ``uploads/{id}`` holds the bytes, ``uploads/{id}.info`` the tus info sidecar.

The sidecar has the tusd filestore shape (``ID``, ``Size``, ``Offset``, ``MetaData``, ...) plus
``CreatedAt``, ``Rejected`` once the checksum failed, and ``Untrusted`` while the data file must be
reset (see below), and ``Door``, the door that created the upload (:class:`UploadDoor`; a sidecar
written before canner recorded it is read as its door was inferred then, :func:`inferred_door`).
The offset of an upload is the size of its data file: nothing in memory is authoritative, so a
restart reads only the disk.  Paths are derived from the (validated) id, never
read from the sidecar.

Durable offset: a power cut can bring a data file back at the length the kernel had reached with
the bytes it had not written back as zeros (ext4 commits the size before the data).  So ``Offset``
holds the offset whose bytes are durable, marked by ``OffsetIsDurable: true`` (sidecars written
before it existed carry ``Offset: 0`` whatever is stored: without the mark the offset is unknown,
:attr:`UploadInfo.durable` is None, and such an upload is never cut).
:meth:`UploadStore.checkpoint` fsyncs the data, then records the offset (the sidecar fsynced,
then ``uploads/``): at the end of every PATCH that does not complete its upload, before its 204
(or 503), and every :data:`CHECKPOINT_BYTES` of a long body.  A body that completes its upload
is not checkpointed: acceptance fsyncs it and records its origin right after, which is what
marks its whole length as durable.  While the receiver runs, the data file's size is the offset
(the page cache holds the bytes, and outlives a killed process); at the first start after the
machine restarted, :func:`canner.store.recovery.cut_after_restart` cuts every upload in flight
back to its durable offset before anything reads it.

One writer per upload: :meth:`UploadStore.open_locked` takes a flock on the data file that holds
across processes, and never creates the file (only :meth:`UploadStore.create` does).

Storage errors: the kernel reports a failed writeback once, and the pages it could not write stay
in the page cache looking valid, so after any error from a write, a writeback or an fsync of an
upload's data or sidecar, its stored bytes are untrustworthy.  :meth:`UploadStore.distrust`
records that in the sidecar (durably, first), truncates the data file to zero bytes and fsyncs it:
the worker re-sends, and no receipt can come from the suspect bytes.  A write refused for lack of
space (``ENOSPC``/``EDQUOT`` from ``pwritev`` itself) is no such error: the kernel took nothing,
and the bytes before it are kept.  Every method blocks; call them through a blocking runner.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from attrs import Factory, define, evolve, field, frozen

from canner import fs
from canner.checksum import Checksum, TrailingHash, parse_checksum
from canner.store.receipts import Origin

# Bytes a streaming upload writes before they are handed to the kernel's writeback.
WRITE_BEHIND_WINDOW = 32 << 20
# A long body's offset is made durable (fsync, then the sidecar) every this many bytes: what a
# power cut in its middle can cost the worker to send again.  Four write-behind windows: by then
# all but the last window or two are written back already, so the fsync waits for little.
CHECKPOINT_BYTES = 4 * WRITE_BEHIND_WINDOW
# Uploads at least this big are hashed as they are written (LockedUpload.digest): reading a
# big file again at acceptance is what the worker would wait for, hundreds of milliseconds per
# GiB from the page cache and disk speed once it no longer fits.  Smaller ones are hashed at
# acceptance in one pass, which costs less CPU than reading back each write.
TRAILING_HASH_MIN = 256 << 20
# Trailing hashes put aside between the PATCHes of a big upload (a worker resuming after a
# dropped connection), at most this many (a hasher's state is about 2 KiB).
KEPT_DIGESTS_MAX = 1000

# Sidecar metadata keys of digests a door declared besides BLAKE3 (hex), by hashlib name.
DECLARED_DIGESTS = {"md5": "content-md5", "sha256": "content-sha256"}

# What a file was when a digest of it was put aside: device, inode, size, mtime.
FileState = tuple[int, int, int, int]


def file_state(stat: os.stat_result) -> FileState:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


_IOV_MAX = 512


class CorruptInfo(Exception):
    """An info sidecar exists but cannot be read as one."""


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class OutOfSpace(Exception):
    """The filesystem refused more bytes; what was written before stays (the offset says how
    much)."""


class StorageFault(Exception):
    """The storage failed under an upload's bytes; the upload was reset (or, when even that
    failed, is marked for reset) and must be sent again from its new offset."""

    def __init__(self, message: str, *, no_space: bool) -> None:
        super().__init__(message)
        self.no_space = no_space


class UploadGone(Exception):
    """The upload's data file is gone (swept, purged) or was replaced since it was looked up."""


class UploadDoor(StrEnum):
    """The way an upload came in, as its sidecar records it."""

    TUS = "tus"  # POST /files/ and PATCHes: resumable, its worker declares the BLAKE3
    PUT = "put"  # PUT /seesaw/...: a whole file in one request, never resumed
    RSYNC = "rsync"  # adopted from the rsync incoming tree (canner.doors.rsync)
    GO_ADOPTED = "go-adopted"  # taken over from a Go canner's data directory (adopt-go)

    @property
    def whole_file(self) -> bool:
        """Its bytes all come in one request: never resumed, never accepted after that request
        ended without a receipt."""
        return self is UploadDoor.PUT

    @property
    def names_worker(self) -> bool:
        """It can name the worker that sent the file (a downloader), so a copy of an accepted
        file is that file (:mod:`canner.accept.origins`)."""
        return self in (UploadDoor.PUT, UploadDoor.RSYNC)


def inferred_door(metadata: Mapping[str, str]) -> UploadDoor:
    """The door of a sidecar written before canner recorded one, as canner inferred it then:
    rsync's adoption marked its own (``MetaData["door"]``); an upload that declared no BLAKE3
    was a whole file (a PUT); any other one was resumable (tus, and adopt-go's, which wrote
    tus sidecars)."""
    if metadata.get("door") == UploadDoor.RSYNC:
        return UploadDoor.RSYNC
    return UploadDoor.PUT if "checksum" not in metadata else UploadDoor.TUS


@frozen
class UploadInfo:
    """What the sidecar records about an upload."""

    upload_id: str
    size: int
    metadata: Mapping[str, str]
    created_at: int
    rejected: str | None = None
    # Set (durably) after a storage error, until the data file has been reset to empty.
    untrusted: str | None = None
    # The offset whose bytes are durable (fsynced); None in a sidecar written before canner
    # recorded it (then the data file's size counts, as it did).
    durable: int | None = None
    # Set by the door that creates the upload; left out (a sidecar from before), what its
    # metadata implies.
    door: UploadDoor = field(
        default=Factory(lambda self: inferred_door(self.metadata), takes_self=True)
    )

    @property
    def project(self) -> str:
        return self.metadata["project"]

    @property
    def checksum(self) -> Checksum | None:
        """The BLAKE3 the worker declared (tus; rsync's and adopt-go's are computed or
        taken over); None when the door declares none (a PUT): acceptance then receipts the
        BLAKE3 of the stored bytes."""
        text = self.metadata.get("checksum")
        return None if text is None else parse_checksum(text)

    @property
    def whole_file(self) -> bool:
        """True for an upload of the PUT door (``PUT /seesaw/...``): its bytes all come in one
        request, so it is never resumed, and a complete one left without a receipt is never
        accepted later."""
        return self.door.whole_file

    @property
    def declared_digests(self) -> dict[str, str]:
        """Other digests the worker declared, checked over the stored bytes at acceptance:
        ``{"md5" | "sha256": lowercase hex}`` (see :data:`DECLARED_DIGESTS`)."""
        return {
            name: self.metadata[key]
            for name, key in DECLARED_DIGESTS.items()
            if key in self.metadata
        }

    @property
    def filename(self) -> str | None:
        return self.metadata.get("filename") or None

    @property
    def downloader(self) -> str | None:
        """The worker named by the door (``PUT /seesaw/...``, an rsync downloader directory);
        None when it names none."""
        return self.metadata.get("downloader") or None

    @property
    def origin(self) -> Origin:
        return Origin(self.project, self.filename, self.downloader)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "ID": self.upload_id,
            "Size": self.size,
            "SizeIsDeferred": False,
            "Offset": 0 if self.durable is None else self.durable,
            "MetaData": dict(self.metadata),
            "IsPartial": False,
            "IsFinal": False,
            "PartialUploads": None,
            "CreatedAt": self.created_at,
            "Door": self.door.value,
        }
        if self.rejected is not None:
            doc["Rejected"] = self.rejected
        if self.untrusted is not None:
            doc["Untrusted"] = self.untrusted
        if self.durable is not None:
            doc["OffsetIsDurable"] = True
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
        if "checksum" in metadata:
            parse_checksum(metadata["checksum"])
        rejected, untrusted = raw.get("Rejected"), raw.get("Untrusted")
        if not all(v is None or isinstance(v, str) for v in (rejected, untrusted)):
            raise ValueError("Rejected and Untrusted are strings")
        durable = None
        if raw.get("OffsetIsDurable") is True:
            durable = raw.get("Offset")
            if type(durable) is not int or not 0 <= durable <= size:
                raise ValueError("a durable Offset is an integer from 0 to Size")
        recorded = raw.get("Door")
        door = inferred_door(metadata) if recorded is None else UploadDoor(recorded)
        return UploadInfo(upload_id, size, metadata, created, rejected, untrusted, durable, door)
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
    # For a big upload, BLAKE3 of the stored bytes so far, read back as they are written:
    # acceptance hashes only what it has not covered yet.
    digest: TrailingHash | None = None
    # Given the digest and the file's state after the last write when the lock is let go.
    _set_aside: Callable[[str, TrailingHash, FileState], None] | None = None
    _covers: FileState | None = None
    # Start of the range not yet handed to writeback (see fs.write_behind).
    _written_back: int = -1
    # Bytes from the first dropped from the page cache (written back and hashed already).
    _dropped: int = 0

    def write(self, chunks: list[bytes]) -> int:
        """Write ``chunks`` at the current offset; returns the new offset.

        :class:`OutOfSpace` when the filesystem refuses bytes (:attr:`offset` counts what was
        written before); any other ``OSError`` leaves the upload's bytes untrustworthy (see
        :meth:`UploadStore.append`).
        """
        start = self.offset
        pending = [memoryview(chunk) for chunk in chunks]
        while pending:
            # At most _IOV_MAX buffers per call (the kernel's IOV_MAX is 1024).
            try:
                written = os.pwritev(self.fd, pending[:_IOV_MAX], self.offset)
            except OSError as e:
                if e.errno in NO_SPACE_ERRNOS:
                    raise OutOfSpace(f"no space left to store {self.info.upload_id}") from e
                raise
            self.offset += written
            while pending and written >= len(pending[0]):
                written -= len(pending.pop(0))
            if pending:
                pending[0] = pending[0][written:]
        self._write_behind()
        self._trail(self.offset - start)
        return self.offset

    def _trail(self, written: int) -> None:
        if self.digest is None:
            return
        # What was just written is read back while it is in the page cache; a resumed upload's
        # older bytes are caught up with as much again per write, so that by its end acceptance
        # has little left to read, without one write waiting for a long read of old bytes.
        try:
            self.digest.catch_up(self.fd, self.offset, 2 * written)
            self._covers = file_state(os.fstat(self.fd))
        except OSError:
            # Not this write's failure: acceptance reads the whole file again and meets the
            # error there, where a storage failure is handled.
            self.digest, self._covers = TrailingHash(), None

    def _write_behind(self) -> None:
        if self._written_back < 0:
            self._written_back = self.offset - (self.offset % WRITE_BEHIND_WINDOW)
        if self.offset - self._written_back >= WRITE_BEHIND_WINDOW:
            # Hand the new window to writeback and wait for the one before it: dirty pages stay
            # under about two windows per upload, and the disk works while the socket streams.
            settle = max(self._written_back - WRITE_BEHIND_WINDOW, 0)
            fs.write_behind(self.fd, self._written_back, self.offset, settle)
            self._written_back = self.offset
            self._drop_settled(settle)

    def _drop_settled(self, settled: int) -> None:
        """Let the page cache forget what a trailing hash has read back and writeback has
        written: nothing of the receiver reads it again, and the next writes reuse those
        pages rather than take fresh ones (which costs several times as much CPU as a copy
        into a page already mapped, bench/README.md)."""
        if self.digest is None:
            return
        end = min(settled, self.digest.hashed)
        if end > self._dropped:
            os.posix_fadvise(self.fd, self._dropped, end - self._dropped, os.POSIX_FADV_DONTNEED)
            self._dropped = end

    def truncate(self, offset: int) -> None:
        """Drop everything after ``offset`` (undo a refused chunked PATCH)."""
        os.ftruncate(self.fd, offset)
        self.offset = offset
        self._written_back = -1
        self._dropped = min(self._dropped, offset)
        self._covers = None
        if self.digest is not None and self.digest.hashed > offset:
            self.digest = TrailingHash()

    def close(self) -> None:
        if self.fd >= 0:
            if self.digest is not None and self._covers is not None and self._set_aside:
                self._set_aside(self.info.upload_id, self.digest, self._covers)
            os.close(self.fd)
            self.fd = -1


@define(eq=False)
class UploadStore:
    """``uploads/`` in the data directory."""

    directory: Path
    # Acceptances of this process share their fsyncs of uploads/ (group commit).
    _directory_sync: fs.GroupFsync = field(
        init=False, default=Factory(lambda self: fs.GroupFsync(self.directory), takes_self=True)
    )
    # Uploads whose reset after a storage error has not completed yet (see distrust).
    _distrusted: set[str] = field(factory=set)
    # Trailing hashes of big uploads between two locks, oldest first (see _take_digest).
    _kept: dict[str, tuple[TrailingHash, FileState]] = field(factory=dict)
    _kept_lock: threading.Lock = field(factory=threading.Lock)

    def data_path(self, upload_id: str) -> Path:
        return self.directory / upload_id

    def info_path(self, upload_id: str) -> Path:
        return self.directory / f"{upload_id}.info"

    def create(self, info: UploadInfo) -> None:
        """Create an empty upload (a tus upload's ``info`` records its durable offset as 0).
        Not fsynced: acceptance syncs everything it relies on, a checkpoint what it records.

        All or nothing: on an ``OSError`` whatever was created is removed again (as far as the
        storage lets it) before the error propagates.  A power cut soon after may leave the data
        file without a sidecar, or with an empty one (the rename reached the disk before the
        content): such an upload was never durably created, and it is gone for the client (the
        intake answers 404) and the sweep.
        """
        fd = os.open(
            self.data_path(info.upload_id),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
            0o644,
        )
        try:
            os.close(fd)
            fs.replace_file(self.directory, f"{info.upload_id}.info", info.to_json(), sync=False)
        except OSError:
            with contextlib.suppress(OSError):
                self.remove(info.upload_id)
            raise

    def read_info(self, upload_id: str) -> UploadInfo | None:
        """The sidecar, or None when there is no such upload; :class:`CorruptInfo` if unreadable."""
        try:
            data = self.info_path(upload_id).read_bytes()
        except FileNotFoundError:
            return None
        return parse_info(upload_id, data)

    def present(self, upload_id: str) -> bool:
        """True while the upload's data file or its sidecar is on disk."""
        return self.data_path(upload_id).exists() or self.info_path(upload_id).exists()

    def offset(self, upload_id: str) -> int:
        """Bytes stored so far (the data file's size; 0 when it is missing)."""
        try:
            return os.stat(self.data_path(upload_id)).st_size
        except FileNotFoundError:
            return 0

    def open_locked(self, info: UploadInfo) -> LockedUpload:
        """Open and flock the data file of an existing upload.

        Raises :class:`fs.Locked` while another writer holds it, and :class:`UploadGone` when the
        file is missing or was unlinked or replaced before the lock was taken (the inode is
        checked under the lock, so a purge or sweep racing this never gets its file re-created).
        An upload marked untrusted is reset first (:class:`StorageFault` if that fails).
        """
        path = self.data_path(info.upload_id)
        try:
            # Read as well as write: the trailing hash reads back what was written.
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UploadGone(info.upload_id) from None
        try:
            fs.lock_fd(fd)
            stat = os.fstat(fd)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                raise UploadGone(info.upload_id) from None
            if (current.st_dev, current.st_ino) != (stat.st_dev, stat.st_ino):
                raise UploadGone(info.upload_id)
        except BaseException:
            os.close(fd)
            raise
        upload = LockedUpload(info, fd, stat.st_size, set_aside=self._set_aside)
        if info.size >= TRAILING_HASH_MIN:
            upload.digest = self._take_digest(info.upload_id, stat)
        if self.is_untrusted(info):
            try:
                self._reset(upload)
            except OSError as e:
                upload.close()
                raise StorageFault(
                    f"the upload cannot be reset after a storage failure: {e.strerror or e}",
                    no_space=e.errno in NO_SPACE_ERRNOS,
                ) from None
            except BaseException:
                upload.close()
                raise
        return upload

    def _set_aside(self, upload_id: str, digest: TrailingHash, covers: FileState) -> None:
        with self._kept_lock:
            self._kept.pop(upload_id, None)
            self._kept[upload_id] = (digest, covers)
            while len(self._kept) > KEPT_DIGESTS_MAX:
                del self._kept[next(iter(self._kept))]

    def _take_digest(self, upload_id: str, stat: os.stat_result) -> TrailingHash:
        """The digest put aside when the upload's last lock was let go, if the file (inode,
        size and mtime, read under the new lock) is exactly as that lock left it; else a new
        one, which catches up from the first byte."""
        with self._kept_lock:
            kept = self._kept.pop(upload_id, None)
        if kept is not None and kept[1] == file_state(stat):
            return kept[0]
        return TrailingHash()

    def is_untrusted(self, info: UploadInfo) -> bool:
        """True while the upload's data file waits for its reset (its offset is then 0)."""
        return info.untrusted is not None or info.upload_id in self._distrusted

    def append(self, upload: LockedUpload, chunks: list[bytes]) -> int:
        """Write ``chunks`` at the upload's offset; returns the new offset.

        :class:`OutOfSpace` keeps the bytes written before it; any other storage error resets
        the upload (:meth:`distrust`) and raises :class:`StorageFault`.
        """
        try:
            offset = upload.write(chunks)
        except OutOfSpace:
            raise
        except OSError as e:
            raise self.distrust(upload, "writing failed", e) from None
        info = upload.info
        if (
            not info.whole_file
            and offset < info.size
            and offset - (info.durable or 0) >= CHECKPOINT_BYTES
        ):
            self.checkpoint(upload)
        return offset

    def checkpoint(self, upload: LockedUpload) -> None:
        """Make the upload's offset durable: fsync the data, then record the offset in the
        sidecar (fsynced, then ``uploads/``).  Nothing is done when the offset recorded is
        already this one.

        :class:`OutOfSpace` when the sidecar cannot be written for lack of space: the bytes
        stay (the durable offset recorded before still holds); any other storage error resets
        the upload (:meth:`distrust`) and raises :class:`StorageFault`.
        """
        info = upload.info
        if info.durable == upload.offset:
            return
        try:
            os.fsync(upload.fd)
        except OSError as e:
            raise self.distrust(upload, "fsync failed", e) from None
        durable = evolve(info, durable=upload.offset)
        try:
            self._write_info(durable)
        except OSError as e:
            if e.errno in NO_SPACE_ERRNOS:
                raise OutOfSpace(f"no space left to record the offset of {info.upload_id}") from e
            raise self.distrust(upload, "recording the offset failed", e) from None
        upload.info = durable

    def let_go(self, upload: LockedUpload) -> None:
        """End a PATCH that leaves its upload incomplete: :meth:`checkpoint`, then release the
        lock (also when the checkpoint fails)."""
        try:
            self.checkpoint(upload)
        finally:
            upload.close()

    def cut_back(self, upload_id: str, keep: int) -> int | None:
        """Truncate the data file to ``keep`` bytes, durably, if it is longer (under its lock);
        the length it had, or None when nothing was cut (or the file is gone).  Start-up only:
        :class:`fs.Locked` while a writer holds it."""
        try:
            fd = os.open(self.data_path(upload_id), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fs.lock_fd(fd)
            length = os.fstat(fd).st_size
            if length <= keep:
                return None
            os.ftruncate(fd, keep)
            os.fsync(fd)
            return length
        finally:
            os.close(fd)

    def sync_upload(self, upload: LockedUpload) -> None:
        """fsync the data file, the info sidecar and ``uploads/`` (step 2 of acceptance; the
        directory fsync shared with concurrent acceptances, :class:`fs.GroupFsync`).

        A failure resets the upload (:meth:`distrust`) and raises :class:`StorageFault`: a
        retried fsync would report success for pages the kernel already dropped.
        """
        try:
            os.fsync(upload.fd)
            fs.fsync_path(self.info_path(upload.info.upload_id))
            self._directory_sync.sync()
        except OSError as e:
            raise self.distrust(upload, "fsync failed", e) from None

    def distrust(self, upload: LockedUpload, context: str, error: OSError) -> StorageFault:
        """The storage failed under ``upload``: make sure no receipt ever comes from its bytes.

        In order: the mark goes into the sidecar (durably, so a crash right after still resets
        the upload on its next use), the data file is truncated to zero and fsynced, and the mark
        is cleared.  Whatever of that fails, the mark stays in this process too, and the upload
        is reset before anyone may write or accept it.  Returns the error to raise.
        """
        info = upload.info
        reason = f"{context}: {error.strerror or error}"
        self._distrusted.add(info.upload_id)
        try:
            self._write_info(evolve(info, untrusted=reason))
        except OSError:
            pass  # the in-process mark and the truncation below still hold
        try:
            self._reset(upload)
        except OSError:
            pass  # marked: the next open_locked tries again
        return StorageFault(
            f"storage failure ({reason}); the upload is reset: send it again from the offset"
            " HEAD reports",
            no_space=error.errno in NO_SPACE_ERRNOS,
        )

    def _reset(self, upload: LockedUpload) -> None:
        """Truncate an untrusted upload to zero bytes, durably, then clear its mark."""
        upload.truncate(0)
        os.fsync(upload.fd)
        upload.info = evolve(upload.info, untrusted=None, durable=0)
        self._write_info(upload.info)
        self._distrusted.discard(upload.info.upload_id)

    def _write_info(self, info: UploadInfo) -> None:
        fs.replace_file(self.directory, f"{info.upload_id}.info", info.to_json(), sync=True)
        fs.fsync_dir(self.directory)

    def reject(self, upload: LockedUpload, reason: str) -> UploadInfo:
        """Durably mark the upload as never acceptable, then free its bytes."""
        rejected = evolve(upload.info, rejected=reason)
        self._write_info(rejected)
        upload.truncate(0)
        return rejected

    def remove(self, upload_id: str) -> None:
        """Delete data and sidecar; already missing counts as done."""
        self.data_path(upload_id).unlink(missing_ok=True)
        self.info_path(upload_id).unlink(missing_ok=True)

    def idle_since(self, upload_id: str) -> float:
        """The last time the upload changed (newest mtime of data and sidecar); 0.0 when both
        are gone.  Two stats of string paths: the sweep asks it of every upload in flight."""
        data = os.path.join(self.directory, upload_id)
        times = []
        for path in (data, data + ".info"):
            try:
                times.append(os.stat(path).st_mtime)
            except FileNotFoundError:
                continue
        return max(times, default=0.0)
