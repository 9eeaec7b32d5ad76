"""The packaging pipeline of canner-deliver: batch, build, verify, purge sources, deliver,
verify at IA, purge the package.  One tick a second.

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
from pathlib import Path
from typing import Any

from attrs import Factory, define, evolve, field
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner import fs
from canner.blocking import BlockingRunner
from canner.config import ProjectConfig
from canner.delivery import follow_up
from canner.delivery.index import Index
from canner.delivery.jobs import Jobs, Ticker
from canner.delivery.liveness import Attempt, InFlight
from canner.delivery.queue import (
    DEFAULT_VERIFY_TIMEOUT,
    MAX_RETRY,
    PURGE_RETRY,
    retry_delay,
)
from canner.observe import UNOBSERVED, Outbound, OutboundObserver, counting_sent
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
    is_index,
    verify_package,
    wanted_dictionaries,
)
from canner.packaging.restore import PackageRestore
from canner.packaging.store import PackageStore
from canner.receipts import ReceiptStore
from canner.sinks.base import Delivered, DeliveryFailed, RemoteCheck, Sink
from canner.sinks.plan import ItemPlan, PlanError, format_date, plan_package_file
from canner.tus.store import UploadStore

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
    # Megawarc projects only (each with a delivery table), and their sinks.
    _projects: Mapping[str, ProjectConfig]
    _sinks: Mapping[str, Sink]
    _run: BlockingRunner
    _pack: BlockingRunner
    _clock: IReactorTime
    _build_concurrency: int
    _min_free_bytes: int
    # Whether a verified ledger owns an object's record (``ArchivedIds.contains``): a package
    # restored from disk never brings such a member back.
    _archived: Callable[[str], bool]
    _delivery_concurrency: int = 1
    # The deliver process's attempts in flight (heartbeat, status page, metrics): a package
    # file being uploaded shows there under its package id and file name.
    _in_flight: InFlight = field(
        default=Factory(lambda self: InFlight(self._clock), takes_self=True)
    )
    _random: Callable[[], float] = random.random
    _interval: float = TICK_INTERVAL
    # The zstd dictionaries members name instead of holding (None: such members wait).
    _dictionaries: Dictionaries | None = None
    observer: OutboundObserver = UNOBSERVED
    _resume_after: dict[int, float] = field(factory=dict)
    # What the last tick's batching did, and the package ids of builds running (for operators).
    last_batching: dict[str, int] = field(factory=dict)
    # Background work by batch id: builds, deliveries, verifications and purges.
    _building: Jobs[int] = field(init=False)
    _delivering: Jobs[int] = field(init=False)
    _checking: Jobs[int] = field(init=False)
    _ticker: Ticker = field(init=False)
    _stopping: threading.Event = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._ticker = Ticker(self._clock, self._interval, self.tick, "packaging pipeline")
        self._building, self._delivering = self._ticker.lane(), self._ticker.lane()
        self._checking = self._ticker.lane()
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
        """Batch, then start due builds, deliveries and follow-ups up to their slots."""
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
        free = self._delivery_concurrency - len(self._delivering)
        if free > 0 and self._sinks:
            for row in await self._index.run(sql.claim_deliveries, now, free, list(self._sinks)):
                self._start(self._delivering, row, self._deliver(row))
        free = FOLLOW_UP_CONCURRENCY - len(self._checking)
        if free > 0 and self._sinks:
            due = await self._index.run(
                sql.follow_ups_due, now, free, list(self._sinks), self._checking.keys()
            )
            for row in due:
                if row.batch_id not in self._checking:
                    self._start(self._checking, row, self._follow_up(row))

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
        # Each update is guarded: only the one matching what the job was doing applies.
        d = self._index.run(sql.record_build_failure, row.batch_id, error, again, now)
        d.addCallback(
            lambda _: self._index.run(
                sql.record_delivery_failure, row.batch_id, error, again, False, now
            )
        )
        if not self._stopping.is_set():
            d.addCallback(
                lambda _: self._index.run(sql.record_check, row.batch_id, again, error, False, now)
            )
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

    # -- delivery ---------------------------------------------------------------------------

    async def _plans(self, row: PackageRow) -> list[tuple[ItemPlan, Path]]:
        assert row.package_id is not None and row.batch_date is not None
        delivery = self._projects[row.project].delivery
        assert delivery is not None
        files = await self._index.run(sql.package_files, row.batch_id)
        # The indexes go last (one per megawarc, a zstd dictionary's too): an item whose
        # indexes are listed has every container.
        files.sort(key=lambda f: (is_index(f.suffix), f.suffix))
        item_bytes = sum(f.size_bytes for f in files)
        plans = []
        for f in files:
            assert f.content_md5 is not None, "verified packages have their files' MD5s"
            plan = plan_package_file(
                delivery,
                row.project,
                row.package_id,
                row.batch_date,
                f.suffix,
                f.size_bytes,
                f.content_md5,
                item_bytes,
            )
            directory = self._store.directory(row.package_id)
            plans.append((plan, directory / (row.package_id + f.suffix)))
        return plans

    async def _deliver(self, row: PackageRow) -> None:
        sink = self._sinks[row.project]
        self.observer.attempt_started(PACKAGE, row.project, row.attempts)
        names: dict[str, str] = {}
        identifier = ""
        try:
            for plan, path in await self._plans(row):
                delivered = await self._deliver_file(sink, row, plan, path)
                identifier = delivered.identifier
                names[path.name[len(row.package_id or "") :]] = delivered.remote_name
        except (DeliveryFailed, PlanError) as e:
            now = self._clock.seconds()
            needs_operator = isinstance(e, PlanError) or e.needs_operator
            delay = retry_delay(row.attempts, self._random(), needs_operator=needs_operator)
            if isinstance(e, DeliveryFailed) and e.retry_after:
                delay = max(delay, min(e.retry_after, MAX_RETRY))
            await self._index.run(
                sql.record_delivery_failure, row.batch_id, str(e), now + delay, needs_operator, now
            )
            (log.error if needs_operator else log.warn)(
                "delivery of package {package} failed (attempt {attempt}), retry in"
                " {delay:.0f}s: {error}",
                package=row.package_id,
                project=row.project,
                attempt=row.attempts,
                delay=delay,
                error=str(e),
                needs_operator=needs_operator,
            )
            reason = "other" if isinstance(e, PlanError) else e.kind
            self.observer.delivery_failed(PACKAGE, row.project, reason, needs_operator)
            return
        retention = self._projects[row.project].delivery
        assert retention is not None
        now = self._clock.seconds()
        await self._index.run(
            sql.record_delivered,
            row.batch_id,
            identifier,
            names,
            now,
            retention.local_artifact_retention,
        )
        log.info(
            "delivered package {package} as {identifier}",
            package=row.package_id,
            project=row.project,
            identifier=identifier,
            files=len(names),
        )
        self.observer.delivered(PACKAGE, row.project)

    async def _deliver_file(
        self, sink: Sink, row: PackageRow, plan: ItemPlan, path: Path
    ) -> Delivered:
        key = plan.object_id  # the package id: one file of a package is in flight at a time
        with self._in_flight.running(
            Attempt(key, row.project, plan.remote_name, plan.size, row.attempts)
        ):
            sent = self._in_flight.uploading(key)
            progress = counting_sent(sent, self.observer, PACKAGE, sink.destination)
            return await sink.deliver(plan, path, progress, overwrite=bool(row.force_upload))

    async def _follow_up(self, row: PackageRow) -> None:
        now = self._clock.seconds()
        assert row.package_id is not None
        if row.remote_verified_at is None:
            sink = self._sinks[row.project]
            plans = await self._plans(row)
            for plan, path in plans:
                check = await sink.verify(plan, path)
                if not check.verified:
                    await self._unverified(row, plan, check, now)
                    return
            await self._run(
                self._store.record_delivery, row.package_id, self._record(row, plans, now, None)
            )
            await self._index.run(sql.record_remote_verified, row.batch_id, now)
            follow_up.report_verified(self.observer, delivered_copy(row))
            return
        if row.purge_after is None or row.purge_after > now or row.sources_purged_at is None:
            await self._index.run(
                sql.record_check, row.batch_id, max(now + PURGE_RETRY, row.purge_after or 0),
                None, False, now,
            )  # fmt: skip
            return
        plans = await self._plans(row)
        try:
            suffixes = [p.name[len(row.package_id) :] for _, p in plans]
            await self._run(self._store.purge, row.package_id, suffixes)
            record = self._record(row, plans, row.remote_verified_at, now)
            await self._run(self._store.record_delivery, row.package_id, record)
        except OSError as e:
            await self._index.run(
                sql.record_check, row.batch_id, now + PURGE_RETRY, f"purge: {e}", False, now
            )
            return
        await self._index.run(sql.record_purged, row.batch_id, now)
        follow_up.report_purged(self.observer, delivered_copy(row))

    async def _unverified(
        self, row: PackageRow, plan: ItemPlan, check: RemoteCheck, now: float
    ) -> None:
        """A file of a delivered package is not (yet) verified: look again later, deliver the
        package again (``verify_timeout`` passed with the file unlisted), or flag it; the same
        policy as objects (``canner.delivery.queue.unlisted``)."""
        delivery = self._projects[row.project].delivery
        await follow_up.record_unverified(
            self._index,
            self.observer,
            delivered_copy(row),
            check,
            detail=f"{plan.remote_name}: {check.detail}",
            verify_timeout=delivery.verify_timeout if delivery else DEFAULT_VERIFY_TIMEOUT,
            now=now,
            redeliver=lambda cur, reason, at: sql.redeliver(cur, row.batch_id, reason, at),
        )

    def _record(
        self,
        row: PackageRow,
        plans: list[tuple[ItemPlan, Path]],
        verified_at: float | None,
        purged_at: float | None,
    ) -> dict[str, Any]:
        """The package's delivery record, kept beside its index for rebuilds."""
        pid = row.package_id or ""
        return {
            "package": pid,
            "project": row.project,
            "identifier": row.remote_identifier,
            "delivered_at": row.delivered_at,
            "remote_verified_at": verified_at,
            "purge_after": row.purge_after,
            "sources_purged_at": row.sources_purged_at,
            "purged_at": purged_at,
            "remote_names": {p.name[len(pid) :]: plan.remote_name for plan, p in plans},
            "md5": {p.name[len(pid) :]: plan.content_md5 for plan, p in plans},
            "sizes": {p.name[len(pid) :]: plan.size for plan, p in plans},
        }


def delivered_copy(row: PackageRow) -> follow_up.DeliveredCopy:
    """A delivered package as its follow-up sees it."""
    return follow_up.DeliveredCopy.of(
        row,
        PACKAGE,
        str(row.batch_id),
        f"package {row.package_id}",
        f"canner retry {row.package_id}",
    )
