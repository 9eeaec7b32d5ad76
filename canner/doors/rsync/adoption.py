"""Adopting one finished rsync file into the store, crash-safe at every step.

The steps, each durable before the next (``<data>/adopting/`` is the adoption area, on the
same filesystem as the incoming tree and ``uploads/``, so every move is a rename):

1. ``claim``: ``adopting/{id}.claim`` records the origin (project, downloader, file name) and is
   fsynced; then the file is renamed from the incoming tree to ``adopting/{id}`` and both
   directories are fsynced.  From here the file is canner's: rsync can no longer replace it.
   (A crash before the claim's rename leaves only its temp file: the receiver's sweep removes
   it, :func:`canner.store.sweep.sweep_stale`.)
2. ``hash``: BLAKE3 over the stored bytes (read back from the file, in the hash pool).
3. ``stage``: the tus info sidecar ``uploads/{id}.info`` (door ``rsync``; the computed checksum is
   the declared one), then ``adopting/{id}`` renamed to ``uploads/{id}``: a complete upload.
4. The one acceptance (:class:`~canner.accept.acceptance.Acceptance`) fsyncs, verifies (the hash
   from step 2 is handed over, so nothing is read twice) and commits the receipt; or, for a file
   with the same origin, size and BLAKE3 as an object already accepted (a worker that sent the
   item again), removes the copy and answers with that object's receipt (its origin rule).
5. ``release``: the claim is removed.

Recovery reads the claim and looks where the bytes are (:func:`claim_state`): a receipt means
step 5 is left; ``adopting/{id}`` means step 2 onward; ``uploads/{id}`` means step 4 onward;
nowhere means the rename of step 1 never happened (the file is still in the incoming tree and
is found again) and the claim goes.  The object id is chosen once, in the claim, so a redo never
makes a second object.  Every function here blocks; call them through a blocking runner.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import stat
from pathlib import Path

from attrs import frozen

from canner import fs
from canner.checksum import Checksum, TrailingHash
from canner.crashpoints import crash_point
from canner.doors.rsync.incoming import CLAIM_SUFFIX, Arrival
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadDoor, UploadInfo, UploadStore

# Bytes hashed per read call while adopting (the whole file is read once).
_HASH_BUDGET = 1 << 62


class ClaimState(enum.Enum):
    """Where a claimed file's bytes are (what recovery continues from)."""

    RECEIPTED = "receipted"  # accepted: only the claim is left to remove
    MOVED = "moved"  # in adopting/{id}: hash, stage, accept
    STORED = "stored"  # in uploads/{id} with its sidecar: accept
    UNMOVED = "unmoved"  # never left the incoming tree: drop the claim


@frozen
class Claim:
    """An adoption in progress: the object id it will have and the file's origin."""

    object_id: str
    project: str
    downloader: str | None
    filename: str

    def to_json(self) -> bytes:
        doc = {
            "object_id": self.object_id,
            "project": self.project,
            "downloader": self.downloader,
            "filename": self.filename,
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def upload_info(self, size: int, checksum: str, created_at: int) -> UploadInfo:
        """The sidecar of the upload this claim becomes (what a tus creation would have had)."""
        metadata = {"project": self.project, "filename": self.filename, "checksum": checksum}
        if self.downloader is not None:
            metadata["downloader"] = self.downloader
        return UploadInfo(self.object_id, size, metadata, created_at, door=UploadDoor.RSYNC)


def parse_claim(data: bytes) -> Claim:
    """``ValueError`` when ``data`` is not a claim."""
    raw = json.loads(data)
    downloader = raw["downloader"]
    fields = (raw["object_id"], raw["project"], raw["filename"])
    if not all(isinstance(v, str) and v for v in fields) or not (
        downloader is None or isinstance(downloader, str)
    ):
        raise ValueError("unexpected claim shape")
    return Claim(raw["object_id"], raw["project"], downloader, raw["filename"])


class NotARegularFile(Exception):
    """What was claimed is not a regular file (a worker's symlink raced the rename)."""


@frozen
class AdoptionArea:
    """``adopting/`` in the data directory: claims and the files they hold."""

    directory: Path

    def data_path(self, object_id: str) -> Path:
        return self.directory / object_id

    def claim_path(self, object_id: str) -> Path:
        return self.directory / f"{object_id}{CLAIM_SUFFIX}"

    def claim(self, claim: Claim, arrival: Arrival) -> bool:
        """Step 1: record ``claim`` durably, then move the file in.  False (and no claim left)
        when the file is gone from the incoming tree (another round adopted it, or the worker's
        rsync replaced it: it is found again)."""
        path = self.claim_path(claim.object_id)
        temp = fs.write_temp(self.directory, path.name, claim.to_json(), sync=True)
        # A crash here leaves the temp alone in adopting/ (the file is still in the incoming
        # tree and is found again): the receiver's sweep removes it (canner.store.sweep).
        crash_point("rsync.claim_written")
        try:
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        fs.fsync_dir(self.directory)
        crash_point("rsync.claimed")
        try:
            os.rename(arrival.path, self.data_path(claim.object_id))
        except FileNotFoundError:
            self.release(claim.object_id)
            return False
        # Both directories: a move whose source entry survived a power cut would be adopted
        # twice, and one whose destination entry did not would be lost.
        fs.fsync_dir(self.directory)
        fs.fsync_dir(arrival.path.parent)
        crash_point("rsync.moved")
        return True

    def claims(self) -> list[Claim]:
        """Every readable claim (an unreadable one is skipped: it is reported by the caller's
        scan of names, see :meth:`claim_ids`)."""
        found = []
        for object_id in self.claim_ids():
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
                found.append(parse_claim(self.claim_path(object_id).read_bytes()))
        return found

    def claim_ids(self) -> list[str]:
        with os.scandir(self.directory) as it:
            return sorted(
                e.name[: -len(CLAIM_SUFFIX)]
                for e in it
                if e.name.endswith(CLAIM_SUFFIX) and not e.name.startswith(fs.TEMP_PREFIX)
            )

    def hash(self, object_id: str) -> tuple[TrailingHash, Checksum, int]:
        """Step 2: BLAKE3 over the claimed file's stored bytes: the running digest (handed to the
        acceptance, which then reads nothing again), the checksum and the size.
        :class:`NotARegularFile` for anything but a regular file."""
        fd = os.open(self.data_path(object_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(object_id)
            digest = TrailingHash()
            digest.catch_up(fd, st.st_size, _HASH_BUDGET)
            checksum, size = digest.finish(fd)
            return digest, checksum, size
        finally:
            os.close(fd)

    def stage(self, info: UploadInfo, uploads: UploadStore) -> None:
        """Step 3: the sidecar, then the bytes into ``uploads/``: a complete upload, which the
        acceptance makes durable (it fsyncs data, sidecar and ``uploads/``)."""
        fs.replace_file(uploads.directory, f"{info.upload_id}.info", info.to_json(), sync=False)
        crash_point("rsync.staged")
        os.rename(self.data_path(info.upload_id), uploads.data_path(info.upload_id))
        crash_point("rsync.stored")

    def drop(self, object_id: str) -> None:
        """Remove the claimed copy and then the claim (a duplicate, or not a file)."""
        path = self.data_path(object_id)
        if path.is_dir() and not path.is_symlink():
            os.rmdir(path)  # a directory rsync made under a final name is empty or refused
        else:
            path.unlink(missing_ok=True)
        self.release(object_id)

    def release(self, object_id: str) -> None:
        """Step 5: the claim goes (not fsynced: a claim that comes back finds its receipt)."""
        self.claim_path(object_id).unlink(missing_ok=True)


def claim_state(
    claim: Claim, area: AdoptionArea, uploads: UploadStore, receipts: ReceiptStore
) -> ClaimState:
    """Where recovery continues ``claim`` from (blocking)."""
    oid = claim.object_id
    if receipts.read(oid) is not None:
        return ClaimState.RECEIPTED
    if os.path.lexists(area.data_path(oid)):
        return ClaimState.MOVED
    if os.path.lexists(uploads.data_path(oid)):
        return ClaimState.STORED
    return ClaimState.UNMOVED
