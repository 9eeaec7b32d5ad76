"""The packaging pipeline of canner-deliver: batch, build, verify, purge sources.  One tick a
second; a package that is ready to go is an outbound row, which the outbound service sends,
verifies at IA and hands back to :class:`~canner.packaging.package_owner.PackageOwner`.

Each step is a guarded transition in ``delivery.sqlite`` (:mod:`canner.packaging.batches`)
and each file deleted has an owner that reached its deleting state first: a member's upload
goes only once its package is sealed and every member re-read from it matched its receipt
(``verified``), and only after its receipt's side file names the package; a package's
containers go only once every file was verified at IA and its retention passed.  Builds and
verification passes run in their own bounded thread pool (``packaging_concurrency``), so
packing never takes the delivery threads.  A build cut short (crash, stop) leaves a temp
directory, removed at the next start, and its batch is built again from the start.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from attrs import define, evolve, field
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner import fs
from canner.blocking import BlockingRunner
from canner.config import ProjectConfig
from canner.delivery.index import Index
from canner.delivery.jobs import Jobs, Ticker
from canner.delivery.queue import (
    PURGE_RETRY,
    retry_delay,
)
from canner.observe import Outbound
from canner.packaging import batches as sql
from canner.packaging.batches import Member, PackageRow
from canner.packaging.dictionary_api import Dictionaries, DictionaryUnavailable
from canner.packaging.megawarc import (
    CHUNK,
    BuildStopped,
    DictionaryMissing,
    MemberMismatch,
    VerifyFailed,
    build_package,
    verify_package,
    wanted_dictionaries,
)
from canner.packaging.restore import PackageRestore
from canner.packaging.store import PackageStore
from canner.sinks.plan import format_date
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore

log = Logger()

PACKAGE = Outbound.PACKAGE

TICK_INTERVAL = 1.0
FOLLOW_UP_CONCURRENCY = 2
JOB_LIMIT = 24 * 3600.0
# A verification or source purge that failed on I/O is tried again after this long.
RESUME_DELAY = 60.0


def purge_sources(
    uploads: UploadStore,
    receipts: ReceiptStore,
    package: PackageRow,
    placements: list[tuple[str, str, int]],
) -> None:
    """Name the package next to each member's receipt (durably), then delete the members'
    uploads, info sidecars and tus temp files; missing is done.  Blocking."""
    assert package.package_id is not None
    for object_id, suffix, offset in placements:
        receipts.record_package(
            object_id,
            {
                "package": package.package_id,
                "project": package.project,
                "batch_date": package.batch_date,
                "file": package.package_id + suffix,
                "offset": offset,
            },
        )
    fs.fsync_dir(receipts.directory)
    prefixes = tuple(f"{fs.TEMP_PREFIX}{oid}" for oid, _, _ in placements)
    for object_id, _, _ in placements:
        uploads.remove(object_id)
    if prefixes:
        for entry in uploads.directory.iterdir():
            if entry.name.startswith(prefixes):
                entry.unlink(missing_ok=True)
    fs.fsync_dir(uploads.directory)


@define(eq=False, kw_only=True)
class PackagingService(Service):
    """Batches, builds and delivers the megawarc projects of one data directory (collaborators
    by keyword)."""

    _index: Index
    _uploads: UploadStore
    _receipts: ReceiptStore
    _store: PackageStore
    # Megawarc projects only (each with a delivery table and a sink).
    _projects: Mapping[str, ProjectConfig]
    _run: BlockingRunner
    _pack: BlockingRunner
    _clock: IReactorTime
    _build_concurrency: int
    _min_free_bytes: int
    # Whether a verified ledger owns an object's record (``ArchivedIds.contains``): a package
    # restored from disk never brings such a member back.
    _archived: Callable[[str], bool]
    _random: Callable[[], float] = random.random
    _interval: float = TICK_INTERVAL
    # The zstd dictionaries members name instead of holding (None: such members wait).
    _dictionaries: Dictionaries | None = None
    _resume_after: dict[int, float] = field(factory=dict)
    # What the last tick's batching did, and the package ids of builds running (for operators).
    last_batching: dict[str, int] = field(factory=dict)
    # Builds (with their verification and source purge) by batch id.
    _building: Jobs[int] = field(init=False)
    _ticker: Ticker = field(init=False)
    _stopping: threading.Event = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._ticker = Ticker(self._clock, self._interval, self.tick, "packaging pipeline")
        self._building = self._ticker.lane()
        self._stopping = self._ticker.stopping

    def startService(self) -> None:
        super().startService()
        self._ticker.start(lambda: Deferred.fromCoroutine(self._recover()))

    async def _recover(self) -> None:
        """Builds and deliveries cut short start over; temp directories go; packages on disk
        that the index lost come back."""
        reset = await self._index.run(sql.reset_interrupted, self._clock.seconds())
        if reset["builds"] or reset["deliveries"]:
            log.info(
                "{builds} interrupted package builds and {deliveries} package deliveries are"
                " due again",
                **reset,
            )
        removed = await self._run(self._store.sweep_temps)
        if removed:
            log.info("removed {count} unfinished package builds", count=len(removed))
        await self.restore_packages()

    def restore_packages(self) -> Deferred[int]:
        """Bring back every package on disk that has no row (``delivery.sqlite`` was lost); a
        stop ends it between two packages."""
        restore = PackageRestore(
            index=self._index,
            store=self._store,
            run=self._run,
            now=self._clock.seconds,
            archived=self._archived,
            keep_going=lambda: not self._stopping.is_set(),
        )
        return restore.run()

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        # Stopped while still recovering: its steps end before the thread pools stop.
        return self._ticker.stop()

    @property
    def building(self) -> list[int]:
        return sorted(self._building.keys())

    def tick(self) -> Deferred[None]:
        """Batch, then start due builds up to their slots."""
        return Deferred.fromCoroutine(self._tick())

    async def _tick(self) -> None:
        if self._stopping.is_set():
            return
        now = self._clock.seconds()
        packaging = {pid: p.packaging for pid, p in self._projects.items()}
        if packaging:
            self.last_batching = await self._index.run(sql.assign_batches, packaging, now)
            if self.last_batching["closed"]:
                log.info(
                    "closed {closed} batches ({assigned} objects batched)", **self.last_batching
                )
        free = self._build_concurrency - len(self._building)
        if free > 0:
            for row in await self._index.run(sql.unfinished_builds, self._building.keys(), free):
                if self._resume_after.get(row.batch_id, 0.0) <= now:
                    self._start(self._building, row, self._build(row))
            free = self._build_concurrency - len(self._building)
            for row in await self._index.run(sql.claim_builds, now, free):
                self._start(self._building, row, self._build(row))

    def _start(self, jobs: Jobs[int], row: PackageRow, work: Coroutine[Any, Any, None]) -> None:
        jobs.launch(row.batch_id, work, JOB_LIMIT, lambda failure: self._job_failed(failure, row))

    def _job_failed(self, failure: Any, row: PackageRow) -> Deferred[Any] | None:
        """Anything a job did not handle: log it, and put the row back where a retry finds it."""
        now = self._clock.seconds()
        if not (failure.check(CancelledError) and self._stopping.is_set()):
            log.failure("packaging work on batch {batch_id}", failure, batch_id=row.batch_id)
        self._resume_after[row.batch_id] = now + RESUME_DELAY
        error = f"interrupted: {failure.getErrorMessage()}"
        again = now if self._stopping.is_set() else now + RESUME_DELAY
        # Guarded: it applies only to a build still running.
        d = self._index.run(sql.record_build_failure, row.batch_id, error, again, now)
        d.addErrback(lambda f: log.failure("recording packaging work", f))
        return d

    # -- build, verify, purge sources -------------------------------------------------------

    async def _build(self, row: PackageRow) -> None:
        if row.state == "building":
            built = await self._pack_batch(row)
            if built is None:
                return
            row = built
        if row.state == "sealed" and not await self._verify(row):
            return
        await self._purge_sources(row)

    async def _pack_batch(self, row: PackageRow) -> PackageRow | None:
        batch_id = row.batch_id
        members = await self._index.run(sql.batch_members, batch_id)
        if not members:
            await self._index.run(sql.drop_empty, batch_id)
            return None
        package_id = sql.package_id_of(row.project, members)
        batch_date = format_date(members[0].accepted_at)
        if not await self._index.run(sql.record_building, batch_id, package_id, batch_date):
            return None  # no longer building (a second writer): leave it alone
        needed = sum(m.size_bytes for m in members)
        free = await self._run(self._store.free_bytes)
        if free - needed < self._min_free_bytes:
            await self._build_failed(
                row, f"not enough free space for a {needed}-byte package ({free} bytes free)"
            )
            return None
        frames = await self._dictionary_frames(row, members)
        if frames is None:
            return None
        work = await self._run(self._store.new_work, package_id)
        log.info(
            "building package {package} of {members} objects ({bytes} bytes)",
            package=package_id,
            project=row.project,
            members=len(members),
            bytes=needed,
            batch_id=batch_id,
        )
        try:
            built = await self._pack(
                build_package,
                members,
                self._uploads.data_path,
                work,
                package_id,
                self._stopping,
                dictionaries=frames,
            )
        except DictionaryMissing as e:  # a dictionary given, then not usable: a retry fetches
            await self._run(self._store.discard, work)
            await self._build_failed(row, f"building failed: {e}")
            return None
        except MemberMismatch as e:
            await self._run(self._store.discard, work)
            now = self._clock.seconds()
            await self._index.run(
                sql.reject_member, batch_id, e.member.object_id, f"packing: {e}", now
            )
            log.error(
                "{object_id} does not match its receipt ({error}): flagged for an operator and"
                " left in place; its batch is built again without it",
                object_id=e.member.object_id,
                project=row.project,
                error=str(e),
                package=package_id,
                needs_operator=True,
            )
            return None
        except BuildStopped:
            await self._run(self._store.discard, work)
            now = self._clock.seconds()
            await self._index.run(sql.record_build_failure, batch_id, "stopped", now, now)
            return None
        except OSError as e:
            await self._run(self._store.discard, work)
            await self._build_failed(row, f"building failed: {e}")
            return None
        await self._run(self._store.publish, work, package_id)
        now = self._clock.seconds()
        placements = [(p.object_id, p.suffix, p.data_offset) for p in built.placements]
        await self._index.run(
            sql.record_sealed, batch_id, sorted(built.files.items()), placements, now
        )
        log.info(
            "sealed package {package}: {files}",
            package=package_id,
            project=row.project,
            files=sorted(built.files),
        )
        return evolve(row, state="sealed", package_id=package_id, batch_date=batch_date)

    async def _dictionary_frames(
        self, row: PackageRow, members: list[Member]
    ) -> dict[str, bytes] | None:
        """The dictionary frames the members name and do not hold; None when one cannot be had
        yet: the batch then waits (back to ``closed``) until that dictionary's next attempt,
        and none of its members is ever filed as "not a WARC" for want of it."""
        wanted = await self._run(wanted_dictionaries, members, self._uploads.data_path)
        if not wanted:
            return {}
        url = self._projects[row.project].packaging.zstd_dictionary_url
        now = self._clock.seconds()
        try:
            if self._dictionaries is None:
                raise DictionaryUnavailable(
                    row.project, wanted[0][1], "unconfigured", "no dictionary store", now + 60
                )
            return await self._dictionaries.frames(row.project, url, wanted)
        except DictionaryUnavailable as e:
            error = f"waiting for {e}"
            again = max(e.next_attempt_at, now + 1.0)
            await self._index.run(sql.record_build_failure, row.batch_id, error, again, now)
            log.warn(
                "package build of batch {batch_id} waits for zstd dictionary {dict_id} of"
                " {dict_project}, retry in {delay:.0f}s: {error}",
                batch_id=row.batch_id,
                project=row.project,
                dict_project=e.project,
                dict_id=e.dict_id,
                delay=again - now,
                error=e.detail,
            )
            return None

    async def _build_failed(self, row: PackageRow, error: str) -> None:
        now = self._clock.seconds()
        delay = retry_delay(row.build_attempts, self._random())
        await self._index.run(sql.record_build_failure, row.batch_id, error, now + delay, now)
        log.error(
            "package build of batch {batch_id} failed, retry in {delay:.0f}s: {error}",
            batch_id=row.batch_id,
            project=row.project,
            delay=delay,
            error=error,
        )

    async def _verify(self, row: PackageRow) -> bool:
        """The verification pass: every member re-read from the sealed package."""
        assert row.package_id is not None
        directory = self._store.directory(row.package_id)
        members = [m.object_id for m in await self._index.run(sql.batch_members, row.batch_id)]
        try:
            md5s = await self._pack(
                verify_package, directory, row.package_id, self._stopping, CHUNK, members
            )
        except BuildStopped:
            return False
        except (VerifyFailed, OSError, ValueError, KeyError) as e:
            now = self._clock.seconds()
            if isinstance(e, OSError):
                self._resume_after[row.batch_id] = now + RESUME_DELAY
                log.error(
                    "verifying package {package} failed, retrying: {error}",
                    package=row.package_id,
                    error=str(e),
                )
                return False
            log.error(
                "package {package} does not hold what its index says ({error}); building it again",
                package=row.package_id,
                error=str(e),
                needs_operator=True,
            )
            await self._index.run(sql.unseal, row.batch_id, f"verification: {e}", now)
            return False
        now = self._clock.seconds()
        await self._index.run(sql.record_verified, row.batch_id, md5s, now)
        log.info("verified package {package} against its receipts", package=row.package_id)
        return True

    async def _purge_sources(self, row: PackageRow) -> None:
        placements = await self._index.run(sql.member_placements, row.batch_id)
        try:
            await self._run(purge_sources, self._uploads, self._receipts, row, placements)
        except OSError as e:
            self._resume_after[row.batch_id] = self._clock.seconds() + PURGE_RETRY
            log.error(
                "purging the sources of package {package} failed, retrying: {error}",
                package=row.package_id,
                error=str(e),
            )
            return
        await self._index.run(sql.record_sources_purged, row.batch_id, self._clock.seconds())
        log.info(
            "purged the {count} uploads packed in {package}",
            count=len(placements),
            package=row.package_id,
            project=row.project,
        )
