"""The acceptance commit sequence, run on the request that completes an upload.

See docs/architecture.md, "Acceptance".

``sync_upload`` (data file, info sidecar, ``uploads/``; the origin record is written here too,
not fsynced) ->
``verify_checksum`` (BLAKE3 of the stored bytes, in the hash pool) -> ``commit_receipt`` (the
receipt published without overwriting, then ``receipts/`` fsynced: the commit point) ->
``enqueue_delivery`` (best effort).  Each step runs in as few thread hops as it can.

An upload without a declared BLAKE3 (``PUT /seesaw/...``) is receipted with the BLAKE3 of its
stored bytes; the other digests its door declared (``Content-MD5``, ``Content-Digest`` sha-256)
are checked over the same read.  The origin rule is applied here, for every door: when the
upload's door names the worker (:attr:`~canner.store.uploads.UploadDoor.names_worker`: PUT, rsync)
and it named the worker and the file, its commit goes through
:class:`~canner.accept.origins.AcceptedOrigins`: a copy of an object already accepted (same
project, downloader, file name, size and BLAKE3) gets that object's receipt, and its own bytes
are discarded.

Everything before the commit point can be redone; everything after it is idempotent.  A receipt
already on disk is returned unchanged.  One acceptance per upload runs at a time in this process
(callers join it), and the caller's flock keeps other processes out.

Storage errors are not all alike.  A failed write or fsync of the upload's data or sidecar leaves
its bytes untrustworthy: the store resets the upload (see ``UploadStore.distrust``) and the worker
must send it again; retrying the fsync would only report success over lost pages.  A failed
``receipts/`` fsync unpublishes the receipt it just linked, so nothing can serve a receipt that a
power cut would erase; the upload's bytes were durable, so a retry may commit again.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from canner.accept.origins import AcceptedOrigins, OriginKey
from canner.blocking import BlockingRunner, PoolStopped
from canner.checksum import Checksum, HashCancelled, TrailingHash, stored_digests
from canner.crashpoints import crash_point
from canner.observe import UNOBSERVED, UploadObserver
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import (
    NO_SPACE_ERRNOS,
    LockedUpload,
    StorageFault,
    UploadDoor,
    UploadInfo,
    UploadStore,
)

log = Logger()

# Uploads up to this size are synced, hashed and committed in one thread hop; larger ones hash
# in the hash pool, so a long hash never holds an I/O thread.
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


@define(eq=False, kw_only=True)
class Acceptance:
    """Turns a complete, locked upload into a receipt."""

    _uploads: UploadStore
    _receipts: ReceiptStore
    _run: BlockingRunner
    _hash: BlockingRunner
    _clock: IReactorTime
    _issuer: str
    _enqueue: Enqueue
    observer: UploadObserver = UNOBSERVED
    # Copies of accepted objects, for uploads whose door names the worker (None: no lookup):
    # the origin rule, applied here and nowhere else.
    _origins: AcceptedOrigins | None = None
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

        Deferred.fromCoroutine(self._accept(upload, self._clock.seconds())).addBoth(done)
        return joined

    def _join(self, upload_id: str) -> Deferred[Receipt]:
        waiter: Deferred[Receipt] = Deferred()
        self._waiters[upload_id].append(waiter)
        return waiter

    def stop(self) -> None:
        """Ask running hashes to stop at their next read (process shutdown)."""
        self._stopping.set()

    async def _accept(self, upload: LockedUpload, started: float) -> Receipt:
        """The steps; ``started`` is when the last byte triggered acceptance."""
        info = upload.info
        origin = info.origin
        receipt: Receipt | None = None
        hash_seconds = 0.0
        key = self._origin_key(info)
        try:
            if info.size <= INLINE_HASH_MAX and key is None:
                # Small: the whole sequence in one thread hop, in the same order.
                existing, hash_seconds, receipt = await self._run(
                    self._accept_inline, upload, origin
                )
            else:
                existing = await self._run(self.sync_upload, upload, origin)
                if existing is None:
                    hashing = self._run if info.size <= INLINE_HASH_MAX else self._hash
                    hash_seconds, digest = await hashing(self.verify_checksum, upload)
                    if key is None:
                        receipt = await self._run(self.commit_receipt, upload, digest)
                    else:
                        receipt, existing = await self._commit_once(upload, key(digest), digest)
        except ChecksumMismatch as e:
            log.warn(
                "rejected {object_id}: {reason}",
                object_id=info.upload_id,
                project=info.project,
                reason=str(e),
            )
            self.observer.checksum_mismatch(info.project)
            raise
        except (HashCancelled, PoolStopped):
            raise AcceptanceFailed("the receiver is shutting down; retry") from None
        except StorageFault as e:
            self.observer.acceptance_failed()
            log.error(
                "acceptance of {object_id} failed; the upload was reset: {error}",
                object_id=info.upload_id,
                project=info.project,
                error=str(e),
            )
            raise AcceptanceFailed(str(e), no_space=e.no_space) from None
        except OSError as e:
            self.observer.acceptance_failed()
            log.error(
                "acceptance of {object_id} failed, will be retried: {error}",
                object_id=info.upload_id,
                project=info.project,
                error=str(e),
            )
            raise AcceptanceFailed(
                f"storage failure: {e.strerror}", no_space=e.errno in NO_SPACE_ERRNOS
            ) from None
        if existing is not None:
            return existing
        assert receipt is not None
        log.info(
            "accepted {object_id} ({size} bytes) for {project}",
            object_id=receipt.object_id,
            size=receipt.size_bytes,
            project=origin.project,
            hash_s=hash_seconds,
        )
        crash_point("accepted")  # committed: no index row, no answer, nothing remembered yet
        self.observer.upload_accepted(
            origin.project, receipt.size_bytes, hash_seconds, self._clock.seconds() - started
        )
        self.enqueue_delivery(receipt, origin)
        return receipt

    def _accept_inline(
        self, upload: LockedUpload, origin: Origin
    ) -> tuple[Receipt | None, float, Receipt | None]:
        existing = self.sync_upload(upload, origin)
        if existing is not None:
            return existing, 0.0, None
        hash_seconds, digest = self.verify_checksum(upload)
        return None, hash_seconds, self.commit_receipt(upload, digest)

    def _origin_key(self, info: UploadInfo) -> Callable[[Checksum], OriginKey] | None:
        """How to key the upload among accepted objects, once hashed; None when it is not
        looked up (see :meth:`_keyed`)."""
        origin = info.origin
        if not self._keyed(origin, info.door):
            return None
        return lambda digest: OriginKey.of(origin, info.size, digest)

    def _keyed(self, origin: Origin, door: UploadDoor) -> bool:
        """Whether the origin rule holds for an upload: a lookup is configured, its door names
        the worker (not tus: a tus worker holds its own id, and resumes it), and the worker and
        the file were named."""
        return (
            self._origins is not None
            and door.names_worker
            and origin.downloader is not None
            and bool(origin.filename)
        )

    def committed_before(self, receipt: Receipt, origin: Origin, door: UploadDoor) -> None:
        """A door's recovery found its upload committed by an earlier acceptance (a crash came
        after the commit point): the delivery is enqueued again (the index insert is
        idempotent) and, where the origin rule holds, the key remembered, so a copy sent next
        is that object whatever the index says yet (this process never committed it)."""
        self.enqueue_delivery(receipt, origin)
        if self._origins is not None and self._keyed(origin, door):
            key = OriginKey.of(origin, receipt.size_bytes, receipt.checksum)
            self._origins.remember(key, receipt.object_id)

    async def _commit_once(
        self, upload: LockedUpload, key: OriginKey, digest: Checksum
    ) -> tuple[Receipt | None, Receipt | None]:
        """Commit unless an object with ``key`` exists: ``(new receipt, None)`` or
        ``(None, the existing object's receipt)``, this upload's bytes then discarded."""
        assert self._origins is not None
        receipt, created = await self._origins.once(
            key, lambda: self._run(self.commit_receipt, upload, digest)
        )
        if created:
            return receipt, None
        log.info(
            "{object_id} is a copy of {existing}, accepted before: answered with its receipt",
            object_id=upload.info.upload_id,
            existing=receipt.object_id,
            project=key.project,
            downloader=key.downloader,
        )
        await self._run(self.discard_copy, upload)
        return None, receipt

    def discard_copy(self, upload: LockedUpload) -> None:
        """Delete a stored copy of an accepted object: its data, sidecar and origin record (no
        receipt of it exists, and none will)."""
        oid = upload.info.upload_id
        self._uploads.remove(oid)
        self._receipts.forget_origin(oid)

    # The steps block; each runs on a worker thread.

    def sync_upload(self, upload: LockedUpload, origin: Origin) -> Receipt | None:
        """Step 2: fsync data, sidecar and ``uploads/`` (a failure resets the upload:
        :class:`StorageFault`), then record the origin next to where the receipt will go
        (:meth:`~canner.store.receipts.ReceiptStore.write_origin`: no fsync of its own; its name
        is made durable by the ``receipts/`` fsync that the receipt needs anyway, and the
        sidecar fsynced here backs its content until the kernel writes it back).

        Returns the receipt when an earlier acceptance committed one (``receipts/`` is fsynced
        again first, in case that acceptance failed before its own directory fsync).
        """
        oid = upload.info.upload_id
        existing = self._receipts.read(oid)
        if existing is None:
            self._uploads.sync_upload(upload)
        self._receipts.write_origin(oid, origin)
        if existing is not None:
            self._receipts.sync_directory()
        return existing

    def verify_checksum(self, upload: LockedUpload) -> tuple[float, Checksum]:
        """Step 3: BLAKE3 of the stored bytes (and, for an upload without a declared BLAKE3,
        the other digests it declared); returns the seconds it took and the BLAKE3.

        On a mismatch the upload is rejected for good (durably) and :class:`ChecksumMismatch`
        raised.
        """
        info = upload.info
        start = self._clock.seconds()
        declared = info.declared_digests if info.checksum is None else {}
        if declared:
            # Digests the trailing hash does not keep: one read of the whole file for all.
            digest, found, count = stored_digests(upload.fd, declared, self._stopping)
        else:
            # A big upload was mostly hashed as it was written (read back from the file), and
            # this reads the rest; a smaller one is read whole.  Either way through the locked
            # file.
            trailing = upload.digest if upload.digest is not None else TrailingHash()
            (digest, count), found = trailing.finish(upload.fd, self._stopping), {}
        if count != info.size:
            # The offset said complete, so bytes vanished underneath us: storage trouble.
            raise OSError(errno.EIO, f"stored {count} bytes, expected {info.size}")
        wrong = [
            f"{name} mismatch: declared {value}, stored bytes hash to {found[name]}"
            for name, value in sorted(declared.items())
            if found[name] != value
        ]
        if info.checksum is not None and digest != info.checksum:
            wrong.append(
                f"checksum mismatch: declared {info.checksum}, stored bytes hash to {digest}"
            )
        if wrong:
            reason = "; ".join(wrong)
            self._reject(upload, reason)
            raise ChecksumMismatch(reason)
        return self._clock.seconds() - start, digest

    def _reject(self, upload: LockedUpload, reason: str) -> None:
        self._uploads.reject(upload, reason)
        self._receipts.forget_origin(upload.info.upload_id)

    def commit_receipt(self, upload: LockedUpload, digest: Checksum) -> Receipt:
        """Step 4: publish the receipt (for the stored bytes' BLAKE3 ``digest``), then fsync
        ``receipts/``: the commit point.

        If that fsync fails, a receipt this call published is unpublished again before the error
        propagates, so no reader finds a receipt whose name may not survive a power cut.
        """
        info = upload.info
        receipt = Receipt(
            object_id=info.upload_id,
            issuer=self._issuer,
            checksum=digest,
            size_bytes=info.size,
            accepted_at=max(1, int(self._clock.seconds())),
        )
        stored = self._receipts.commit(receipt)
        try:
            # The commit point; concurrent acceptances share this fsync (group commit), and a
            # failed one fails each of them, so each unpublishes its own receipt below.
            self._receipts.sync_directory()
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
