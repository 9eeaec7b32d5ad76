"""The rsync intake service: finds the files rsync finished and adopts them one at a time.

It learns of files from inotify (``IN_MOVED_TO``: rsync renames a finished file into place) and
from a scan of the whole incoming tree every ``scan_interval`` (what inotify missed: a queue
overflow, a directory made before its watch, a restart).  Each notification asks for a round; a
round finishes the claims a crash left (:mod:`canner.doors.rsync.adoption`), then adopts every file
the scan finds, in turn, through the receiver's one :class:`~canner.accept.acceptance.Acceptance`
(which also applies the origin rule: a file sent again by its worker is the object it was).
Rounds never overlap: a request during a round runs one more round after it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attrs import define, field
from twisted.application.service import Service
from twisted.internet import inotify
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.filepath import FilePath

from canner.accept.acceptance import Acceptance, AcceptanceFailed, ChecksumMismatch
from canner.blocking import BlockingRunner
from canner.checksum import TrailingHash
from canner.config import Config, RsyncConfig
from canner.crashpoints import crash_point
from canner.doors.rsync.adoption import (
    AdoptionArea,
    Claim,
    ClaimState,
    NotARegularFile,
    claim_state,
)
from canner.doors.rsync.incoming import Arrival, adoption_dir, arrivals, is_final_name
from canner.ids import ObjectIds
from canner.observe import UNOBSERVED_ADOPTION, AdoptionObserver
from canner.periodic import OnceMore, PeriodicService
from canner.store.datadir import CannotStart
from canner.store.receipts import Origin, ReceiptStore
from canner.store.uploads import UploadDoor, UploadStore

log = Logger()

_WATCH_MASK = inotify.IN_MOVED_TO | inotify.IN_CREATE | inotify.IN_CLOSE_WRITE


class AdoptionAbandoned(Exception):
    """A claimed upload can no longer be accepted (its bytes were rejected or vanished)."""


def prepare_rsync(config: Config, rsync: RsyncConfig) -> AdoptionArea:
    """Make ``adopting/`` and one incoming directory per project (start-up, blocking), and check
    that they share the data directory's filesystem (every adoption step is a rename)."""
    area = AdoptionArea(adoption_dir(config.data_dir))
    try:
        area.directory.mkdir(mode=0o750, exist_ok=True)
        rsync.incoming.mkdir(mode=0o750, exist_ok=True)
        for project in config.projects:
            (rsync.incoming / project).mkdir(mode=0o750, exist_ok=True)
        devices = {os.stat(p).st_dev for p in (config.data_dir, area.directory, rsync.incoming)}
    except OSError as e:
        raise CannotStart(f"cannot prepare the rsync intake in {rsync.incoming}: {e}") from None
    if len(devices) != 1:
        raise CannotStart(
            f"[rsync] incoming {rsync.incoming} is not on the filesystem of data_dir"
            f" {config.data_dir}: adoption must be a rename, never a copy"
        )
    return area


@define(eq=False, kw_only=True)
class RsyncIntake(Service):
    """Adopts finished rsync files from ``incoming`` (see the module docstring)."""

    _incoming: Path
    _projects: Sequence[str]
    _area: AdoptionArea
    _uploads: UploadStore
    _receipts: ReceiptStore
    _acceptance: Acceptance
    _run: BlockingRunner
    _hash: BlockingRunner
    _clock: IReactorTime
    _ids: ObjectIds
    _interval: float
    _reactor: Any = None  # for inotify; None: scans only (tests)
    observer: AdoptionObserver = UNOBSERVED_ADOPTION
    _timer: PeriodicService | None = field(default=None, init=False)
    _notifier: inotify.INotify | None = field(default=None, init=False)
    # One round at a time; a file that arrives during a round makes exactly one more.
    _rounds: OnceMore = field(init=False)
    _stopping: bool = field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self._rounds = OnceMore(
            lambda: Deferred.fromCoroutine(self._round()), "rsync adoption round"
        )

    @classmethod
    def for_config(
        cls,
        config: Config,
        rsync: RsyncConfig,
        *,
        acceptance: Acceptance,
        uploads: UploadStore,
        receipts: ReceiptStore,
        io: BlockingRunner,
        hashing: BlockingRunner,
        reactor: Any,
        observer: AdoptionObserver,
    ) -> RsyncIntake:
        """The receiver's rsync door (``[rsync]``), over the receiver's one acceptance (start-up,
        blocking: it makes the adoption area)."""
        return cls(
            incoming=rsync.incoming,
            projects=tuple(config.projects),
            area=prepare_rsync(config, rsync),
            uploads=uploads,
            receipts=receipts,
            acceptance=acceptance,
            run=io,
            hash=hashing,
            clock=reactor,
            ids=config.object_ids,
            interval=rsync.scan_interval,
            reactor=reactor,
            observer=observer,
        )

    def startService(self) -> None:
        super().startService()
        if self._reactor is not None:
            self._notifier = inotify.INotify(self._reactor)
            self._notifier.startReading()
            for project in self._projects:
                self._notifier.watch(
                    FilePath(str(self._incoming / project)),
                    mask=_WATCH_MASK,
                    autoAdd=True,
                    recursive=True,
                    callbacks=[self._notified],
                )
        self._timer = PeriodicService(
            clock=self._clock, interval=self._interval, job=self.kick, label="rsync scan"
        )
        self._timer.startService()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stopping = True
        stopped = self._rounds.stop()  # no round starts from here on
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stopService()
        if self._notifier is not None:
            self._notifier.connectionLost(None)
            self._notifier = None
        return stopped

    def idle(self) -> Deferred[None]:
        """Fires once no round runs (at once when none does)."""
        return self._rounds.idle()

    def _notified(self, _ignored: object, path: FilePath[Any], mask: int) -> None:
        # Twisted's inotify hands out bytes paths.
        if is_final_name(os.fsdecode(path.basename())):
            self.kick()

    def kick(self) -> None:
        """Ask for a round: now, or right after the one that runs."""
        self._rounds.ask()

    async def _round(self) -> None:
        # Waiting: claims a crash or a failure left that this round could not finish, and every
        # finished file in the incoming tree until it is adopted.
        stuck = 0
        for claim in await self._run(self._area.claims):
            if self._stopping:
                return
            stuck += 0 if await self._settle(claim, None) else 1
        found: list[Arrival] = await self._run(
            lambda: list(arrivals(self._incoming, self._projects))
        )
        waiting = stuck + len(found)
        self.observer.adoption_waiting(waiting)
        for arrival in found:
            if self._stopping:
                return
            if await self._adopt(arrival):
                waiting -= 1
                self.observer.adoption_waiting(waiting)

    async def _adopt(self, arrival: Arrival) -> bool:
        """Adopt one file; False when it failed (logged): the file, or its claim, waits for the
        next round."""
        try:
            if arrival.size == 0:
                # Nothing to deliver, and an upload has at least one byte (seesaw sends
                # --min-size 1): the name goes, so it does not wait for ever.
                await self._run(arrival.path.unlink, True)
                log.warn(
                    "removed empty rsync file {filename} of {project}",
                    filename=arrival.filename,
                    project=arrival.project,
                )
                return True
            claim = Claim(self._ids.new(), arrival.project, arrival.downloader, arrival.filename)
            if not await self._run(self._area.claim, claim, arrival):
                return True  # gone from incoming/: adopted already, or replaced and found again
            return await self._settle(claim, arrival.arrived_at)
        except Exception:
            log.failure("adopting {path} failed; it is tried again", path=str(arrival.path))
            return False

    async def _settle(self, claim: Claim, arrived_at: float | None) -> bool:
        """Carry ``claim`` through the rest of its steps, from wherever the bytes are; False when
        a step failed (logged) and the claim stays for the next round."""
        oid = claim.object_id
        try:
            state = await self._run(claim_state, claim, self._area, self._uploads, self._receipts)
            if state is ClaimState.RECEIPTED:
                await self._committed_before(claim)
                return True
            if state is ClaimState.UNMOVED:
                await self._run(self._area.release, oid)
                return True
            if state is ClaimState.STORED:
                await self._accept(claim, None, arrived_at)
                return True
            try:
                digest, checksum, size = await self._hash(self._area.hash, oid)
            except NotARegularFile:
                log.warn(
                    "dropped {filename} of {project}: not a regular file",
                    filename=claim.filename,
                    project=claim.project,
                )
                await self._run(self._area.drop, oid)
                return True
            info = claim.upload_info(size, str(checksum), int(self._clock.seconds()))
            await self._run(self._area.stage, info, self._uploads)
            await self._accept(claim, digest, arrived_at)
            return True
        except (AcceptanceFailed, ChecksumMismatch) as e:
            log.error(
                "adoption of {object_id} failed, tried again: {error}",
                object_id=oid,
                project=claim.project,
                error=str(e),
            )
            return False
        except AdoptionAbandoned as e:
            # Only a damaged disk gets here: the bytes no longer hash as they did.
            log.error(
                "adoption of {object_id} gave up: {error}",
                object_id=oid,
                project=claim.project,
                error=str(e),
            )
            return True
        except Exception:
            log.failure("adoption of {object_id} failed; it is tried again", object_id=oid)
            return False

    async def _committed_before(self, claim: Claim) -> None:
        """A crash came after the commit point: the index row may never have been written, and
        this process does not remember the key, so both are done again before the claim goes
        (the insert is idempotent).  A re-sent copy then finds the object."""
        receipt = await self._run(self._receipts.read, claim.object_id)
        if receipt is not None:
            origin = Origin(claim.project, claim.filename, claim.downloader)
            self._acceptance.committed_before(receipt, origin, UploadDoor.RSYNC)
        await self._run(self._area.release, claim.object_id)

    async def _accept(
        self, claim: Claim, digest: TrailingHash | None, arrived_at: float | None
    ) -> None:
        """Accept the stored upload of ``claim``, then let the claim go.  A copy of an object
        already accepted (the acceptance's origin rule) is answered with that object's receipt
        and its bytes are gone: it is no new adoption."""
        oid = claim.object_id
        info = await self._run(self._uploads.read_info, oid)
        if info is None or info.rejected is not None:
            # Only a damaged disk gets here: the bytes no longer hash as they did.
            await self._run(self._area.release, oid)
            raise AdoptionAbandoned(f"the upload of {oid} is gone or rejected")
        upload = await self._run(self._uploads.open_locked, info)
        if digest is not None:
            upload.digest = digest
        receipt = await self._acceptance.accept(upload)
        crash_point("rsync.accepted")
        await self._run(self._area.release, oid)
        adopted = receipt.object_id == oid
        log.info(
            "adopted {filename} from {downloader} as {object_id}"
            if adopted
            else "{filename} from {downloader} is {object_id}, already accepted",
            filename=claim.filename,
            downloader=claim.downloader,
            object_id=receipt.object_id,
            project=claim.project,
        )
        if adopted:
            seconds = None if arrived_at is None else max(0.0, self._clock.seconds() - arrived_at)
            self.observer.adopted(claim.project, seconds)
