"""The acceptance commit sequence, run on the request that completes an upload.

See docs/architecture.md, "Acceptance".

Before the commit point, independent steps run concurrently: the fsyncs of the data file, the
info sidecar and ``uploads/`` (``UploadStore.sync_steps``), the origin record, the receipt
written to a fsynced temp file, and the BLAKE3 of the stored bytes.  Only when all of them have
succeeded and the hash matches is the receipt published (a hard link, never overwriting) and
``receipts/`` fsynced: the commit point.  Then ``enqueue_delivery`` (best effort).  The kernel
shares one journal commit among concurrent fsyncs, so an acceptance waits for about two rounds
of fsync instead of six in a row.

Everything before the commit point can be redone; everything after it is idempotent.  A receipt
already on disk is returned unchanged.  One acceptance per upload runs at a time in this process
(callers join it), and the caller's flock keeps other processes out.

Storage errors are not all alike.  A failed fsync of the upload's data, sidecar or ``uploads/``
leaves its bytes untrustworthy: the store resets the upload (see ``UploadStore.distrust``) and
the worker must send it again; retrying the fsync would only report success over lost pages.  A
failed ``receipts/`` fsync unpublishes the receipt it just linked, so nothing can serve a receipt
that a power cut would erase; the upload's bytes were durable, so a retry may commit again.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import define, field
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from canner.blocking import BlockingRunner
from canner.checksum import Checksum, HashCancelled, blake3_file
from canner.fs import fsync_dir
from canner.receipts import Origin, Receipt, ReceiptStore
from canner.tus.store import NO_SPACE_ERRNOS, LockedUpload, StorageFault, UploadInfo, UploadStore

log = Logger()

# Uploads up to this size hash on an I/O thread; larger ones in the hash pool, so a long hash
# never holds an I/O thread.
INLINE_HASH_MAX = 4 << 20


class ChecksumMismatch(Exception):
    """The stored bytes do not hash to the declared checksum: the upload is rejected for good."""


class AcceptanceFailed(Exception):
    """A storage or sync step failed; no receipt exists.  The worker retries later: the upload is
    either still complete (acceptance runs again) or was reset after a storage fault (HEAD says
    where to resume)."""

    def __init__(self, message: str, *, no_space: bool = False) -> None:
        super().__init__(message)
        self.no_space = no_space


Enqueue = Callable[[Receipt, Origin], None]


@define(eq=False)
class Acceptance:
    """Turns a complete, locked upload into a receipt."""

    _uploads: UploadStore
    _receipts: ReceiptStore
    _run: BlockingRunner
    _hash: BlockingRunner
    _clock: IReactorTime
    _issuer: str
    _enqueue: Enqueue
    _waiters: dict[str, list[Deferred[Receipt]]] = field(factory=dict)
    _stopping: threading.Event = field(factory=threading.Event)

    def is_running(self, upload_id: str) -> bool:
        """True while an acceptance of ``upload_id`` runs in this process."""
        return upload_id in self._waiters

    def in_flight(self, upload_id: str) -> Deferred[Receipt] | None:
        """A Deferred for the acceptance of ``upload_id`` running now, if any (safe to cancel)."""
        return self._join(upload_id) if upload_id in self._waiters else None

    def accept(self, upload: LockedUpload) -> Deferred[Receipt]:
        """Run acceptance for a complete ``upload`` whose lock the caller hands over.

        The lock is released when acceptance ends.  Fails with :class:`ChecksumMismatch` or
        :class:`AcceptanceFailed`.  Cancelling the returned Deferred does not stop acceptance.
        """
        upload_id = upload.info.upload_id
        assert upload_id not in self._waiters, "the caller holds the lock"
        self._waiters[upload_id] = []
        joined = self._join(upload_id)

        def done(result: object) -> None:
            # The one release point of the lock, on the reactor thread, in the same turn that
            # ends is_running(): no request can find the lock free while the acceptance still
            # counts as running, or the other way round.  Closing a regular file does not block.
            upload.close()
            waiters = self._waiters.pop(upload_id)
            for waiter in waiters:
                if waiter.called:  # cancelled by its caller
                    continue
                if isinstance(result, Failure):
                    waiter.errback(result)
                else:
                    waiter.callback(result)  # type: ignore[arg-type]

        Deferred.fromCoroutine(self._accept(upload)).addBoth(done)
        return joined

    def _join(self, upload_id: str) -> Deferred[Receipt]:
        waiter: Deferred[Receipt] = Deferred()
        self._waiters[upload_id].append(waiter)
        return waiter

    def stop(self) -> None:
        """Ask running hashes to stop at their next read (process shutdown)."""
        self._stopping.set()

    async def _accept(self, upload: LockedUpload) -> Receipt:
        info = upload.info
        origin = Origin(info.project, info.filename)
        try:
            existing = await self._run(self.committed_receipt, upload, origin)
            if existing is not None:
                return existing
            receipt, hash_seconds = await self._commit(upload, origin)
        except ChecksumMismatch as e:
            log.warn("rejected {object_id}: {reason}", object_id=info.upload_id,
                     project=info.project, reason=str(e))  # fmt: skip
            raise
        except HashCancelled:
            raise AcceptanceFailed("the receiver is shutting down; retry") from None
        except StorageFault as e:
            log.error(
                "acceptance of {object_id} failed; the upload was reset: {error}",
                object_id=info.upload_id,
                project=info.project,
                error=str(e),
            )
            raise AcceptanceFailed(str(e), no_space=e.no_space) from None
        except OSError as e:
            log.error(
                "acceptance of {object_id} failed, will be retried: {error}",
                object_id=info.upload_id,
                project=info.project,
                error=str(e),
            )
            raise AcceptanceFailed(
                f"storage failure: {e.strerror}", no_space=e.errno in NO_SPACE_ERRNOS
            ) from None
        log.info(
            "accepted {object_id} ({size} bytes) for {project}",
            object_id=receipt.object_id,
            size=receipt.size_bytes,
            project=origin.project,
            hash_s=hash_seconds,
        )
        self.enqueue_delivery(receipt, origin)
        return receipt

    async def _commit(self, upload: LockedUpload, origin: Origin) -> tuple[Receipt, float]:
        """Everything before the commit point, concurrently; then the commit point.

        Waits for every step to end before deciding, so nothing runs on behind a failure.
        Returns the receipt on disk and the seconds the hash took.
        """
        info = upload.info
        receipt = Receipt(
            object_id=info.upload_id,
            issuer=self._issuer,
            checksum=info.checksum,
            size_bytes=info.size,
            accepted_at=max(1, int(self._clock.seconds())),
        )
        hasher = self._run if info.size <= INLINE_HASH_MAX else self._hash
        syncs = [self._run(step) for step in self._uploads.sync_steps(upload)]
        steps: list[Deferred[Any]] = [
            *syncs,
            self._run(self._receipts.record_origin, info.upload_id, origin),
            self._run(self._receipts.prepare, receipt),
            hasher(self.hash_upload, upload),
        ]
        results = await DeferredList(steps, consumeErrors=True)
        prepared_ok, prepared = results[-2]
        failed = [value for ok, value in results if not ok]
        if failed:
            if prepared_ok:
                await self._run(self._receipts.discard, prepared)
            sync_failures = [value for ok, value in results[: len(syncs)] if not ok]
            if sync_failures and isinstance(sync_failures[0].value, OSError):
                raise await self._run(self._distrust, upload, sync_failures[0].value)
            failed[0].raiseException()
        (digest, count), seconds = results[-1][1]
        try:
            self._check_hash(info, digest, count)
        except ChecksumMismatch as e:
            await self._run(self._reject, upload, prepared, str(e))
            raise
        except OSError:
            await self._run(self._receipts.discard, prepared)
            raise
        stored = await self._run(self.commit_receipt, receipt, prepared)
        return stored, seconds

    # The steps block; each runs on a worker thread.

    def committed_receipt(self, upload: LockedUpload, origin: Origin) -> Receipt | None:
        """The receipt an earlier acceptance committed, if any (``receipts/`` is fsynced again
        first, in case that acceptance failed before its own directory fsync; the origin record
        is completed too)."""
        oid = upload.info.upload_id
        existing = self._receipts.read(oid)
        if existing is not None:
            self._receipts.record_origin(oid, origin)
            fsync_dir(self._receipts.directory)
        return existing

    def hash_upload(self, upload: LockedUpload) -> tuple[tuple[Checksum, int], float]:
        """BLAKE3 of the stored bytes: ``((digest, bytes read), seconds)``."""
        start = self._clock.seconds()
        path = self._uploads.data_path(upload.info.upload_id)
        result = blake3_file(path, upload.info.size, self._stopping)
        return result, self._clock.seconds() - start

    @staticmethod
    def _check_hash(info: UploadInfo, digest: Checksum, count: int) -> None:
        if count != info.size:
            # The offset said complete, so bytes vanished underneath us: storage trouble.
            raise OSError(errno.EIO, f"stored {count} bytes, expected {info.size}")
        if digest != info.checksum:
            raise ChecksumMismatch(
                f"checksum mismatch: declared {info.checksum}, stored bytes hash to {digest}"
            )

    def _distrust(self, upload: LockedUpload, error: OSError) -> StorageFault:
        fault = self._uploads.distrust(upload, "fsync failed", error)
        self._receipts.forget_origin(upload.info.upload_id)
        return fault

    def _reject(self, upload: LockedUpload, prepared: Path, reason: str) -> None:
        """The upload is rejected for good (durably), and no receipt is left prepared."""
        self._receipts.discard(prepared)
        self._uploads.reject(upload, reason)
        self._receipts.forget_origin(upload.info.upload_id)

    def commit_receipt(self, receipt: Receipt, prepared: Path) -> Receipt:
        """Publish the prepared receipt, then fsync ``receipts/``: the commit point.

        If that fsync fails, a receipt this call published is unpublished again before the error
        propagates, so no reader finds a receipt whose name may not survive a power cut.
        """
        stored = self._receipts.publish(receipt, prepared)
        try:
            fsync_dir(self._receipts.directory)  # the commit point
        except OSError:
            if stored is receipt:
                self._receipts.unpublish(receipt.object_id)
            raise
        return stored

    def enqueue_delivery(self, receipt: Receipt, origin: Origin) -> None:
        try:
            self._enqueue(receipt, origin)
        except Exception:
            log.failure("enqueueing {object_id} for delivery", object_id=receipt.object_id)
