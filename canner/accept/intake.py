"""The door-neutral intake: admission of an upload body and what happens to it after.

A door (``canner.doors``) reads its protocol's headers and asks here.
:meth:`UploadIntake.admit_creation` (drain, free space, promises) and
:meth:`~UploadIntake.admit_append` (the upload exists, one writer, its offset, a stalled writer
taken over) decide admission in a thread, and :meth:`~UploadIntake.open_stream` returns the
:class:`BodyStream` that writes the body.  Once the body is written the stream calls back here:
a complete upload goes to :class:`~canner.accept.acceptance.Acceptance`, an incomplete one is let
go (:meth:`~UploadIntake.finish`) or, for a whole file nothing resumes, discarded
(:meth:`~UploadIntake.finish_whole`).  :meth:`~UploadIntake.standing` and
:meth:`~UploadIntake.receipt` read an upload only at a moment no acceptance of it runs.  What a
door renders is an :class:`UploadStanding`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attrs import define, field, frozen
from twisted.internet import defer, task
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from canner import fs
from canner.accept.acceptance import Acceptance, AcceptanceFailed, ChecksumMismatch
from canner.blocking import BlockingRunner
from canner.config import Config
from canner.observe import UNOBSERVED, UploadObserver
from canner.store import drain
from canner.store.promises import Promises
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import (
    CorruptInfo,
    LockedUpload,
    OutOfSpace,
    StorageFault,
    UploadGone,
    UploadInfo,
    UploadStore,
)
from canner.web.channel import ReceiverRequest
from canner.web.errors import HTTPError, no_space, overpromised, space_unknown, storage_trouble
from canner.web.stream import Abandon, BodyBudget, BodyStream

log = Logger()

# How long HEAD and a receipt lookup wait for a running acceptance before answering 503; a
# 100 GiB upload hashes for minutes, and proxies commonly give up on an answer after 60 s.
ACCEPTANCE_WAIT = 20.0
ACCEPTANCE_RETRY_AFTER = 5
# How often a lookup looks again while another worker of the node accepts the upload.
ELSEWHERE_POLL = 0.05
# What a read answers instead while another worker accepts the upload.
_ELSEWHERE = object()


def _still_accepting() -> HTTPError:
    """A lookup that waited its bound for an acceptance (here or on another worker)."""
    return storage_trouble(
        "the upload is complete and its acceptance (hash and commit) is still running; retry to"
        " get the receipt",
        ACCEPTANCE_RETRY_AFTER,
    )


# A request writing an upload that has received nothing for this long is taken to be a client
# gone without closing its connection, and a newer request of the same upload takes over.
TAKEOVER_QUIET = 2.0
# How long a newer request waits for a writer still sending to fall quiet before its 423.
TAKEOVER_WAIT = 5.0


@frozen
class UploadStanding:
    """Where an upload stands after a request: what a door renders (tus: HEAD, PATCH and POST; a
    PUT: its receipt)."""

    upload_id: str
    size: int
    offset: int
    metadata: Mapping[str, str]
    receipt: Receipt | None = None
    location: str | None = None


def not_found() -> HTTPError:
    """404: no upload (and no receipt) has this id."""
    return HTTPError(404, "no such upload")


def _locked() -> HTTPError:
    return HTTPError(423, "another request is writing this upload; retry later")


def _rejected(info: UploadInfo) -> HTTPError:
    return HTTPError(422, f"upload rejected for good: {info.rejected}")


def _failure_status(failure: Failure) -> Failure:
    """Translate acceptance and storage outcomes into their HTTP meaning: the one place where
    a storage error (any ``OSError``: EACCES, EROFS, EIO, ENOSPC...) becomes 503."""
    if failure.check(ChecksumMismatch):
        return Failure(HTTPError(422, str(failure.value)))
    if failure.check(AcceptanceFailed, StorageFault, OutOfSpace):
        # 503 with Retry-After: every tus client (the Go SDK too) retries it, then HEADs.
        return Failure(storage_trouble(str(failure.value)))
    error = failure.value
    if isinstance(error, OSError):
        # Logged here: nothing before this point did (the store's own faults are logged by
        # their callers).  The client gets the reason, never a path.
        log.error("storage failure: {error}", error=str(error))
        return Failure(storage_trouble(f"storage failure: {error.strerror or error}"))
    return failure


def _check_final_append(offset: int, length: int | None, size: int) -> None:
    """An append to a complete upload may only repeat the final, empty request (409, 413)."""
    if offset != size:
        raise HTTPError(409, f"Upload-Offset {offset} does not match {size}")
    if length != 0:
        raise HTTPError(413, "the upload is already complete")


@define(eq=False, kw_only=True)
class UploadIntake:
    """Admission, body streaming and completion of uploads, for every door that streams one."""

    _config: Config
    _uploads: UploadStore
    _receipts: ReceiptStore
    _acceptance: Acceptance
    _run: BlockingRunner
    _clock: IReactorTime
    # Told the free bytes (None: unknown) each admission saw, from a worker thread.
    free_space_seen: Callable[[int | None], None] = lambda available: None
    # The origin of an accepted upload whose payload was purged (its file in receipts/ went
    # with it): the delivery index has it.  Called from a worker thread; None when unknown.
    purged_origin: Callable[[str], Origin | None] = lambda upload_id: None
    observer: UploadObserver = UNOBSERVED
    # The bytes promised to uploads in flight (canner.store.promises): creations are admitted
    # against free space minus these.
    promises: Promises = field(factory=Promises)
    # How free space is measured (called from a worker thread); tests fix it.
    free_space: Callable[[Path], int] = fs.free_bytes
    # The memory the bodies streaming at once share (canner.web.stream).
    body_budget: BodyBudget = field(factory=BodyBudget)
    # On a node of several workers (``[receiver] workers``): takes over the writer of an upload
    # that another worker holds locked (True: one still sending keeps it).  None: one process.
    take_over_elsewhere: Callable[[str], Deferred[bool]] | None = None
    # The request writing each upload now (reactor thread only).
    _writers: dict[str, BodyStream] = field(factory=dict)

    # -- the streaming seam -------------------------------------------------------------------

    def open_stream(
        self,
        request: ReceiverRequest,
        admission: Callable[[], Deferred[LockedUpload | UploadStanding]],
        finish: Callable[[LockedUpload, bool], Deferred[UploadStanding]],
        abandon: Abandon = LockedUpload.close,
    ) -> BodyStream:
        """The stream of an upload body that ``admission`` admits (a :class:`HTTPError` it raises
        or fails with is the answer), written like every upload's and handed to ``finish``
        (:meth:`finish`, :meth:`finish_whole`) once over; an upload whose body is answered
        without ``finish`` (a write failed) goes to ``abandon`` (blocking): closed, or
        :meth:`discard_whole`."""
        transport = request.transport
        assert transport is not None
        stream = BodyStream(
            self._run,
            transport,  # type: ignore[arg-type]
            self._append,
            finish,
            request,
            self._clock.seconds,
            abandon,
            self.body_budget,
        )
        try:
            admitting = admission()
        except HTTPError as e:
            stream.answered(Failure(e))
            return stream

        def admitted(result: LockedUpload | UploadStanding) -> None:
            if not isinstance(result, LockedUpload):
                stream.answered(result)
                return
            self._hold(result.info.upload_id, stream)
            stream.admitted(result)

        admitting.addCallbacks(admitted, lambda f: stream.answered(_failure_status(f)))
        return stream

    # -- admission -----------------------------------------------------------------------------

    def admit_creation(
        self, info: UploadInfo, location: str = "", with_body: bool = True
    ) -> Deferred[LockedUpload | UploadStanding]:
        """Create the upload ``info`` describes (everything the head tells checked by its door):
        refused while the node drains (503), under its free space floor (429) or when the space
        is promised to uploads in flight (503).  With ``with_body`` the upload comes locked, for
        :meth:`open_stream`; without, the outcome of an empty creation.  ``location`` is what the
        door answers the upload's address with (tus: ``Location``)."""
        created = self._run(self._create, info, location, with_body)
        return created.addCallback(self._created, info.project)

    def admit_append(
        self, upload_id: str, offset: int, length: int | None
    ) -> Deferred[LockedUpload | UploadStanding]:
        """Admit ``length`` bytes (None: not known yet) for the upload ``upload_id`` from
        ``offset``: the upload locked for :meth:`open_stream`, or the outcome of one already
        accepted when the request is its final, empty one again.  A stalled writer of the upload
        is taken over; 404, 409, 413, 422 (rejected), 423 (another writer still sending)."""
        if upload_id not in self._writers and not self._acceptance.is_running(upload_id):
            # The common case, without a coroutine: nobody here writes or accepts it.
            return self._open_anywhere(upload_id, offset, length)
        return Deferred.fromCoroutine(self._admit_known(upload_id, offset, length))

    def take_over_here(self, upload_id: str) -> Deferred[bool]:
        """Another worker of the node was refused the lock of ``upload_id``: take over a
        stalled writer of it here as for a request of this process.  Fires once no writer
        here holds it (False), or True when one still sending keeps it."""
        return Deferred.fromCoroutine(self._take_over_here(upload_id))

    async def _take_over_here(self, upload_id: str) -> bool:
        try:
            await self._take_over(upload_id, wait_for_live=True)
        except HTTPError as e:
            if e.status == 423:
                return True
            raise
        return False

    def _open_anywhere(
        self, upload_id: str, offset: int, length: int | None
    ) -> Deferred[LockedUpload | UploadStanding]:
        """:meth:`_open_for_append` in a thread; on a node, an upload locked by a writer of
        another worker is taken over there (:attr:`take_over_elsewhere`) and opened again."""
        opened = self._run(self._open_for_append, upload_id, offset, length)
        if self.take_over_elsewhere is None:
            return opened
        return Deferred.fromCoroutine(self._locked_elsewhere(opened, upload_id, offset, length))

    async def _locked_elsewhere(
        self,
        opened: Deferred[LockedUpload | UploadStanding],
        upload_id: str,
        offset: int,
        length: int | None,
    ) -> LockedUpload | UploadStanding:
        try:
            return await opened
        except HTTPError as e:
            if e.status != 423 or upload_id in self._writers:
                raise
        return await self._take_over_there(upload_id, offset, length)

    async def _take_over_there(
        self, upload_id: str, offset: int, length: int | None
    ) -> LockedUpload | UploadStanding:
        assert self.take_over_elsewhere is not None
        if await self.take_over_elsewhere(upload_id):
            raise _locked()
        opened: LockedUpload | UploadStanding = await self._run(
            self._open_for_append, upload_id, offset, length
        )
        return opened

    # -- whole files in one request (canner.doors.seesaw) ---------------------------------------

    def finish_whole(self, upload: LockedUpload, lost: bool) -> Deferred[UploadStanding]:
        """The ``finish`` of a whole-file body (an upload created by :meth:`admit_creation` with
        nothing to resume it): acceptance when every byte came, as for tus; otherwise the
        upload cannot be resumed, so it is discarded at once (:meth:`discard_whole`).  An
        acceptance that fails for a reason other than a checksum mismatch (storage trouble, the
        receiver stopping) leaves nothing either: the worker sends the file again (a mismatch
        keeps its sidecar, rejected, for the sweep)."""
        info = upload.info
        if upload.offset == info.size:
            return self.finish(upload, lost).addErrback(self._discard_unaccepted, info)
        offset = upload.offset

        def cut_short(_: object) -> UploadStanding:
            raise HTTPError(400, f"the body ended after {offset} of {info.size} bytes")

        return self._run(self.discard_whole, upload).addCallbacks(cut_short, _failure_status)

    def discard_whole(self, upload: LockedUpload) -> None:
        """Let go of a whole-file upload whose request ends without a receipt (cut short, or a
        write failed), blocking: no request can resume it, so its bytes and its promise go at
        once, before its answer.  The promise goes even when the files cannot be removed (the
        storage fails under them): those stay for the sweep, and nothing is owed to them."""
        info = upload.info
        log.info(
            "{object_id} ended at {offset} of {size} bytes without a receipt: discarded",
            object_id=info.upload_id,
            offset=upload.offset,
            size=info.size,
            project=info.project,
        )
        try:
            self._uploads.remove(info.upload_id)
        except OSError as e:
            log.warn(
                "{object_id} stays for the sweep: {error}",
                object_id=info.upload_id,
                error=e.strerror or str(e),
            )
        finally:
            upload.close()
            self.promises.release(info.upload_id)

    def stop(self) -> Deferred[None]:
        """The receiver stops: drop the connection of every request writing an upload it does
        not complete, so each records its offset durably while the thread pools still run (a
        PATCH cut by shutdown ends like one whose connection was lost; one completing its
        upload goes on to acceptance, which fsyncs).  Fires once those have let go of their
        lock, at most :data:`TAKEOVER_WAIT` later."""
        writers = [w for w in self._writers.values() if not w.completes]
        for writer in writers:
            writer.end()
        if not writers:
            return succeed(None)
        released = defer.DeferredList([w.released() for w in writers])
        released.addTimeout(TAKEOVER_WAIT, self._clock)
        return released.addBoth(lambda _: None)

    def _hold(self, upload_id: str, stream: BodyStream) -> None:
        """Remember which request writes ``upload_id`` until it lets go of the lock."""
        self._writers[upload_id] = stream

        def let_go(_: object) -> None:
            if self._writers.get(upload_id) is stream:
                del self._writers[upload_id]

        stream.released().addCallback(let_go)

    async def _take_over(self, upload_id: str, wait_for_live: bool) -> None:
        """Return once no request here writes ``upload_id`` (or its acceptance runs).

        A writer that has received and written nothing for :data:`TAKEOVER_QUIET` is a client
        gone without a word (a half-open connection keeps its lock until the idle timeout): its
        connection is dropped, what it wrote is kept, and the caller goes on once it let go of
        the lock, so the offset read next is exact.  A writer still sending is a real second
        writer: with ``wait_for_live`` the caller waits up to :data:`TAKEOVER_WAIT` for it to
        fall quiet, then gets 423; without, it returns at once (HEAD reports the live offset).
        """
        deadline = self._clock.seconds() + TAKEOVER_WAIT
        while (holder := self._writers.get(upload_id)) is not None:
            if self._acceptance.is_running(upload_id):
                return
            now = self._clock.seconds()
            quiet = now - holder.last_progress
            if quiet >= TAKEOVER_QUIET:
                log.info(
                    "dropping a stalled request on {object_id} ({quiet:.1f} s without a byte):"
                    " a newer request takes over",
                    object_id=upload_id,
                    quiet=quiet,
                )
                holder.end()
                await self._released(holder, TAKEOVER_WAIT, _locked())
                continue
            if not wait_for_live:
                return
            if now + (TAKEOVER_QUIET - quiet) > deadline:
                raise _locked()
            await task.deferLater(self._clock, TAKEOVER_QUIET - quiet)

    def _created(
        self, result: LockedUpload | UploadStanding, project: str
    ) -> LockedUpload | UploadStanding:
        self.observer.upload_created(project)
        return result

    def _create(
        self, info: UploadInfo, location: str, with_body: bool
    ) -> LockedUpload | UploadStanding:
        self._check_draining()
        available = self._check_free_space()
        refusal = self.promises.admit(
            info.upload_id, info.size, available, self._config.min_free_bytes
        )
        if refusal is not None:
            raise overpromised(refusal.describe())
        try:
            # All or nothing; an OSError is answered by _failure_status.
            self._uploads.create(info)
        except BaseException:
            self.promises.release(info.upload_id)
            raise
        if not with_body:
            return UploadStanding(info.upload_id, info.size, 0, info.metadata, None, location)
        try:
            upload = self._uploads.open_locked(info)
        except OSError:
            # The client never learns this id: leave nothing of it behind.
            self.promises.release(info.upload_id)
            with contextlib.suppress(OSError):
                self._uploads.remove(info.upload_id)
            raise
        upload.location = location
        return upload

    async def _admit_known(
        self, upload_id: str, offset: int, length: int | None
    ) -> LockedUpload | UploadStanding:
        await self._take_over(upload_id, wait_for_live=True)
        if self._acceptance.is_running(upload_id):
            # The upload is complete and being accepted: only an empty final append may join.
            size = await self._run(self._join_check, upload_id, offset, length)
            result: LockedUpload | UploadStanding = await self._join(
                size, upload_id, offset, length
            )
            return result
        return await self._open_anywhere(upload_id, offset, length)

    def _join(
        self, size: int, upload_id: str, offset: int, length: int | None
    ) -> Deferred[LockedUpload | UploadStanding]:
        running = self._acceptance.in_flight(upload_id)
        if running is None:  # it ended while we checked: answer as for any other append
            return self._run(self._open_for_append, upload_id, offset, length)
        return running.addCallback(
            lambda receipt: UploadStanding(upload_id, size, size, {}, receipt)
        )

    def _join_check(self, upload_id: str, offset: int, length: int | None) -> int:
        info = self._read_info(upload_id)
        if info is None:
            raise not_found()
        _check_final_append(offset, length, info.size)
        return info.size

    def _open_for_append(
        self, upload_id: str, offset: int, length: int | None
    ) -> LockedUpload | UploadStanding:
        self._check_free_space()
        info = self._read_info(upload_id)
        if info is None:
            accepted = self._accepted(upload_id)
            if accepted is None:
                raise not_found()
            _check_final_append(offset, length, accepted.size)
            return accepted
        if info.rejected is not None:
            raise _rejected(info)
        try:
            upload = self._uploads.open_locked(info)
        except fs.Locked:
            raise _locked() from None
        except UploadGone:
            # Purged after acceptance (or swept) since the sidecar was read.
            accepted = self._accepted(upload_id)
            if accepted is None:
                raise not_found() from None
            _check_final_append(offset, length, accepted.size)
            return accepted
        try:
            if offset != upload.offset:
                raise HTTPError(409, f"Upload-Offset {offset} does not match {upload.offset}")
            if length is not None and offset + length > info.size:
                raise HTTPError(413, "the body would pass Upload-Length")
        except HTTPError:
            upload.close()
            raise
        # Admitted before (maybe by an earlier process, or reset since): what it lacks is
        # promised again, never refused.
        self.promises.hold(upload_id, info.size, upload.offset)
        return upload

    def _check_draining(self) -> None:
        # Only creations: PATCHes of uploads in progress continue while the node drains.
        mark = drain.read_drain(self._config.data_dir)
        if mark is not None:
            raise HTTPError(
                503,
                f"{mark.describe()}: it takes no new uploads, create the upload on another node",
                (("Retry-After", str(drain.RETRY_AFTER)),),
            )

    def _check_free_space(self) -> int:
        """The free bytes of the data filesystem; 429 under the floor, 503 when unknown."""
        try:
            available = self.free_space(self._config.data_dir)
        except OSError:
            self.free_space_seen(None)
            raise space_unknown() from None
        self.free_space_seen(available)
        if available < self._config.min_free_bytes:
            raise no_space(available, self._config.min_free_bytes)
        return available

    def _read_info(self, upload_id: str) -> UploadInfo | None:
        """The sidecar; None when there is none, or when it is unreadable.

        A sidecar is only ever replaced whole, so an unreadable one (empty, short) is a creation
        that a power cut caught before it was durable, or a damaged disk: the callers then answer
        from the receipt if there is one, else 404, and the client creates a new upload (the
        sweep removes the files).  Never a 500 that would stay for good.
        """
        try:
            return self._uploads.read_info(upload_id)
        except CorruptInfo as e:
            log.warn(
                "answering as if {object_id} had no sidecar: {error} ({path})",
                object_id=upload_id,
                error=str(e),
                path=str(self._uploads.info_path(upload_id)),
            )
            return None

    def _accepted(self, upload_id: str) -> UploadStanding | None:
        """The outcome of an upload that was accepted (its payload may be purged since)."""
        receipt = self._receipts.read(upload_id)
        if receipt is None:
            return None
        origin = self._receipts.read_origin(upload_id) or self.purged_origin(upload_id)
        metadata = {"checksum": str(receipt.checksum)}
        if origin is not None:
            metadata["project"] = origin.project
            if origin.filename:
                metadata["filename"] = origin.filename
            if origin.downloader:
                metadata["downloader"] = origin.downloader
        return UploadStanding(upload_id, receipt.size_bytes, receipt.size_bytes, metadata, receipt)

    # -- the body -------------------------------------------------------------------------------

    def _append(self, upload: LockedUpload, chunks: list[bytes]) -> Deferred[int]:
        """Write chunks (in a thread); storage trouble becomes a 503 the worker retries."""

        def failed(failure: Failure) -> Failure:
            oid = upload.info.upload_id
            if failure.check(OutOfSpace):
                log.warn(
                    "out of space while writing {object_id} at offset {offset}",
                    object_id=oid,
                    offset=upload.offset,
                )
            elif failure.check(StorageFault):
                log.error(
                    "writing {object_id} failed: {error}", object_id=oid, error=str(failure.value)
                )
            return _failure_status(failure)

        size = sum(map(len, chunks))

        def stored(offset: int) -> int:
            self.observer.bytes_stored(size)
            self.promises.stored(upload.info.upload_id, offset)
            return offset

        return self._run(self._uploads.append, upload, chunks).addCallbacks(stored, failed)

    # -- after the body -------------------------------------------------------------------------

    def finish(self, upload: LockedUpload, lost: bool) -> Deferred[UploadStanding]:
        """The ``finish`` of a resumable upload's body: acceptance once every byte is stored;
        otherwise its offset made durable and its lock let go, for the next request to resume."""
        info, location = upload.info, upload.location
        if upload.offset == info.size:
            # Every byte is stored: nothing is owed any more, whatever acceptance says (an
            # upload it resets is promised again when its worker appends).
            self.promises.release(info.upload_id)
            return self._acceptance.accept(upload).addCallbacks(
                lambda receipt: UploadStanding(
                    info.upload_id, info.size, info.size, info.metadata, receipt, location
                ),
                _failure_status,
            )
        offset = upload.offset
        if lost:
            log.info(
                "connection lost on {object_id} at offset {offset}",
                object_id=info.upload_id,
                offset=offset,
            )
        # The offset answered (or found by the next HEAD) is durable before the lock goes: a
        # power cut after the 204 keeps it (see canner.store.uploads, durable offset).
        let_go = self._run(self._uploads.let_go, upload)

        def settled(result: object) -> object:
            # The parent of a worker hears of the last bytes of every request (its surveys).
            self.promises.settled(info.upload_id, offset)
            return result

        return let_go.addBoth(settled).addCallbacks(
            lambda _: UploadStanding(
                info.upload_id, info.size, offset, info.metadata, None, location
            ),
            _failure_status,
        )

    def _discard_unaccepted(self, failure: Failure, info: UploadInfo) -> Deferred[UploadStanding]:
        error = failure.value
        if isinstance(error, HTTPError) and error.status == 422:
            return fail(failure)

        def discard() -> None:
            # Acceptance has let go of the lock; no receipt exists and none will.
            if self._receipts.read(info.upload_id) is None:
                self._uploads.remove(info.upload_id)
                self._receipts.forget_origin(info.upload_id)

        def kept(error: Failure) -> None:
            # The receiver is stopping, or the disk failing: the sweep removes it later.
            log.warn(
                "{object_id} stays for the sweep: {error}",
                object_id=info.upload_id,
                error=str(error.value),
            )

        done: Deferred[None] = self._run(discard).addErrback(kept)
        return done.addCallback(lambda _: fail(failure))

    # -- where an upload stands ---------------------------------------------------------------

    def standing(self, upload_id: str) -> Deferred[UploadStanding]:
        """Where the upload ``upload_id`` (a valid id) stands (tus: what HEAD reports).

        While an acceptance of the upload runs, this waits for it (at most
        :data:`ACCEPTANCE_WAIT`, then 503): a receipt is never shown before its commit point,
        and a complete upload is never shown without the receipt that is on its way.  A complete
        upload that has no receipt and no acceptance running (a transient failure earlier) gets
        acceptance started in the background.  404 for no such upload, 410 for one rejected.
        """
        return Deferred.fromCoroutine(self._standing(upload_id)).addErrback(_failure_status)

    async def _standing(self, upload_id: str) -> UploadStanding:
        await self._take_over(upload_id, wait_for_live=False)
        outcome: UploadStanding = await self._committed(upload_id, self._status)
        return self._maybe_resume_acceptance(outcome)

    async def _committed(self, upload_id: str, read: Callable[[str], Any]) -> Any:
        """``read(upload_id)`` in a thread, at a moment no acceptance of it runs here: one that
        started while we read may have linked a receipt it has not committed yet.  On a node,
        nor on another worker: see :meth:`_accepting_elsewhere`."""
        deadline = self._clock.seconds() + ACCEPTANCE_WAIT
        while True:
            await self._after_completing_write(upload_id)
            await self._after_acceptance(upload_id)
            result = await self._run(self._unless_accepting_elsewhere, read, upload_id)
            if result is _ELSEWHERE:
                if self._clock.seconds() >= deadline:
                    raise _still_accepting()
                await task.deferLater(self._clock, ELSEWHERE_POLL)
                continue
            if not self._acceptance.is_running(upload_id) and not self._completing(upload_id):
                return result

    def _unless_accepting_elsewhere(self, read: Callable[[str], Any], upload_id: str) -> Any:
        """``read(upload_id)``, or :data:`_ELSEWHERE` (blocking)."""
        if self._accepting_elsewhere(upload_id):
            return _ELSEWHERE
        return read(upload_id)

    def _accepting_elsewhere(self, upload_id: str) -> bool:
        """On a node of several workers (blocking): whether another process holds the lock of
        ``upload_id`` while every byte is on disk and no receipt is: its final request is
        accepting it (the lock is held from the last byte through the commit), and the receipt
        is on its way.  One process knows that from its own writers and acceptances alone."""
        if self.take_over_elsewhere is None or self._receipts.receipt_path(upload_id).exists():
            return False
        info = self._read_info(upload_id)
        if info is None or info.rejected is not None:
            return False
        if self._uploads.offset(upload_id) < info.size:
            return False
        return fs.lock_held(self._uploads.data_path(upload_id))

    def _completing(self, upload_id: str) -> bool:
        writer = self._writers.get(upload_id)
        return writer is not None and writer.completes

    async def _after_completing_write(self, upload_id: str) -> None:
        """Wait while a request here has received an upload's last byte and is still writing
        it: its acceptance has not started yet, but the disk may already show every byte."""
        writer = self._writers.get(upload_id)
        if writer is None or not writer.completes:
            return
        await self._released(
            writer,
            ACCEPTANCE_WAIT,
            storage_trouble(
                "the upload's last bytes are still being written; retry to get the receipt",
                ACCEPTANCE_RETRY_AFTER,
            ),
        )

    async def _released(self, writer: BodyStream, timeout: float, refusal: HTTPError) -> None:
        """Wait until ``writer`` lets go of its upload's lock; ``refusal`` after ``timeout``."""
        let_go = writer.released()
        let_go.addTimeout(timeout, self._clock)
        try:
            await let_go
        except defer.TimeoutError:
            raise refusal from None

    def receipt(self, object_id: str) -> Deferred[bytes | None]:
        """The committed receipt of ``object_id`` (None when there is none), waiting for a
        running acceptance like :meth:`standing`."""
        return Deferred.fromCoroutine(self._receipt(object_id)).addErrback(_failure_status)

    async def _receipt(self, object_id: str) -> bytes | None:
        data: bytes | None = await self._committed(object_id, self._receipts.read_bytes)
        return data

    def _after_acceptance(self, upload_id: str) -> Deferred[None]:
        """Fires once no acceptance of ``upload_id`` runs here; 503 after the bounded wait."""
        running = self._acceptance.in_flight(upload_id)
        if running is None:
            return succeed(None)
        running.addTimeout(ACCEPTANCE_WAIT, self._clock)

        def settled(result: object) -> None:
            # Success or failure is the acceptance's business (its own request answers it);
            # the caller reads the disk afterwards.
            if isinstance(result, Failure) and result.check(defer.TimeoutError):
                raise _still_accepting()

        return running.addBoth(settled)

    def _status(self, upload_id: str) -> UploadStanding:
        info = self._read_info(upload_id)
        if info is None:
            accepted = self._accepted(upload_id)
            if accepted is None:
                raise not_found()
            return accepted
        if info.rejected is not None:
            raise HTTPError(410, f"upload rejected for good: {info.rejected}")
        receipt = self._receipts.read(upload_id)
        if receipt is not None:
            offset = info.size
        elif self._uploads.is_untrusted(info):
            offset = 0  # reset before anyone writes; the bytes there now do not count
        else:
            offset = self._uploads.offset(upload_id)
        return UploadStanding(upload_id, info.size, offset, info.metadata, receipt)

    def _maybe_resume_acceptance(self, outcome: UploadStanding) -> UploadStanding:
        if (
            outcome.offset == outcome.size
            and outcome.receipt is None
            and not self._acceptance.is_running(outcome.upload_id)
        ):
            self._run(self._lock_complete, outcome.upload_id).addCallbacks(
                self._accept_in_background,
                lambda f: None if f.check(fs.Locked) else log.failure("resuming acceptance", f),
            )
        return outcome

    def _lock_complete(self, upload_id: str) -> LockedUpload | None:
        info = self._read_info(upload_id)
        if info is None or info.rejected is not None or self._uploads.is_untrusted(info):
            return None
        try:
            upload = self._uploads.open_locked(info)
        except UploadGone:
            return None
        if upload.offset != info.size:
            upload.close()
            return None
        return upload

    def _accept_in_background(self, upload: LockedUpload | None) -> None:
        if upload is None:
            return
        self.promises.release(upload.info.upload_id)
        self._acceptance.accept(upload).addErrback(
            lambda f: (
                None
                if f.check(ChecksumMismatch, AcceptanceFailed, StorageFault)
                else log.failure(
                    "background acceptance of {object_id}", f, object_id=upload.info.upload_id
                )
            )
        )
