"""The delivery scheduler: tick -> claim -> sink -> record, with bounded concurrency.

Every second (``tick``) the service claims due rows, oldest due first, up to the free delivery
slots, and starts one attempt per row; attempts are not awaited by the tick.  An attempt checks
the local payload against its receipt (BLAKE3, computing the MD5 once and storing it), hands it to
the project's sink, and records ``delivered`` or ``retry_wait`` through guarded updates.  The same
tick follows delivered rows up: verify the remote copy, then purge the local payload once verified
and past retention; a delivered object still unlisted ``verify_timeout`` after its delivery
goes back to be delivered again (flagged for an operator once that keeps happening).  Attempts
are cancellable, bounded by 24 hours, and cancelled on stop; a
cancelled attempt is due again right after restart.  Each attempt's phase and the payload bytes
its sink reports are tracked in :class:`~canner.delivery.liveness.InFlight` (the heartbeat,
``/metrics`` and the manhole's ``scheduler.active`` read it).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

from attrs import Factory, define, evolve, field
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner.blocking import BlockingRunner
from canner.checksum import HashCancelled, delivery_digests
from canner.config import DeliveryConfig
from canner.delivery import follow_up
from canner.delivery import index as sql
from canner.delivery.index import Index, QueueRow
from canner.delivery.jobs import Jobs, Ticker
from canner.delivery.liveness import Attempt, InFlight
from canner.delivery.purge import delete_payload, purge_is_due
from canner.delivery.queue import (
    DEFAULT_VERIFY_TIMEOUT,
    MAX_RETRY,
    PURGE_RETRY,
    VERIFY_MAX,
    retry_delay,
)
from canner.journal import JournalLog
from canner.observe import UNOBSERVED, Outbound, OutboundObserver, counting_sent
from canner.receipts import ReceiptStore
from canner.sinks.base import DeliveryFailed, Sink
from canner.sinks.plan import ItemPlan, PlanError, plan_upload
from canner.tus.store import UploadStore

log = Logger()

ATTEMPT_LIMIT = 24 * 3600.0
TICK_INTERVAL = 1.0
# How often rows left "delivering" by an attempt whose outcome could not be recorded are released.
ORPHAN_CHECK_INTERVAL = 60.0
# Verifications and purges running at once, and the bound on each.
FOLLOW_UP_CONCURRENCY = 4
FOLLOW_UP_LIMIT = 600.0
# DeliveryFailed.kind of a local payload that is missing, unreadable or changed.
LOCAL_PAYLOAD = "local_payload"
OBJECT = Outbound.OBJECT


@define(eq=False, kw_only=True)
class DeliveryService(Service):
    """Runs deliveries, verifications and purges for one data directory (collaborators by
    keyword)."""

    _index: Index
    _uploads: UploadStore
    _receipts: ReceiptStore
    _journal: JournalLog
    _sinks: Mapping[str, Sink]
    # Where a row goes (plan_row with its project's delivery table, in the daemon).
    _planner: Callable[[QueueRow], ItemPlan]
    _retention: Mapping[str, float]
    _run: BlockingRunner
    _hash: BlockingRunner
    _clock: IReactorTime
    _concurrency: int
    _random: Callable[[], float] = random.random
    _interval: float = TICK_INTERVAL
    # Per project: how long a delivered object may stay unlisted before it is delivered again.
    _verify_timeouts: Mapping[str, float] = field(factory=dict)
    _claiming: bool = False
    _orphans_checked: float = 0.0
    _claim_again: bool = False
    # canner-deliver's attempts in flight (shared with the other pipelines in the daemon).
    in_flight: InFlight = field(
        default=Factory(lambda self: InFlight(self._clock), takes_self=True)
    )
    observer: OutboundObserver = UNOBSERVED
    _active: Jobs[str] = field(init=False)  # delivery attempts, by object id
    _checking: Jobs[str] = field(init=False)  # verifications and purges
    _ticker: Ticker = field(init=False)
    _stopping: threading.Event = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._ticker = Ticker(self._clock, self._interval, self.tick, "delivery queue")
        self._active, self._checking = self._ticker.lane(), self._ticker.lane()
        self._stopping = self._ticker.stopping

    def startService(self) -> None:
        super().startService()
        self._ticker.start(self._start_up)

    def _start_up(self) -> Deferred[None]:
        def reset(count: int) -> None:
            if count:
                log.info("{count} interrupted attempts are due again", count=count)

        return self._index.run(sql.reset_delivering, self._clock.seconds()).addCallback(reset)

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        # Stopped while still starting: the start's query ends before the index closes.
        return self._ticker.stop()

    @property
    def active(self) -> list[dict[str, Any]]:
        """The attempts in flight: object, phase, bytes sent, rate, ETA (for the manhole)."""
        return [p.as_dict() for p in self.in_flight.snapshot()]

    def tick(self) -> Deferred[None]:
        """Claim and start due attempts, then run due follow-ups (verify, purge)."""
        return Deferred.fromCoroutine(self._tick())

    async def _tick(self) -> None:
        await self._claim()
        now = self._clock.seconds()
        free_checks = FOLLOW_UP_CONCURRENCY - len(self._checking)
        if free_checks > 0 and self._sinks:
            due = await self._index.run(
                sql.follow_ups_due, now, free_checks, list(self._sinks), self._checking.keys()
            )
            for row in due:
                if len(self._checking) >= FOLLOW_UP_CONCURRENCY:
                    break
                if row.object_id not in self._checking:  # started while we asked
                    self._start_follow_up(row)

    async def _claim(self) -> None:
        """Fill free delivery slots with due rows.  Runs from the tick and whenever an attempt
        ends, so a freed slot never idles until the next tick; one claim runs at a time, so
        slots are never over-filled, and a request during a claim runs it again after."""
        if self._claiming:
            self._claim_again = True
            return
        self._claiming = True
        try:
            while True:
                self._claim_again = False
                free = self._concurrency - len(self._active)
                now = self._clock.seconds()
                if now - self._orphans_checked >= ORPHAN_CHECK_INTERVAL:
                    # Here, between claims, every claimed row is already in _active.
                    self._orphans_checked = now
                    await self._index.run(sql.release_orphans, self._active.keys(), now)
                if free > 0 and self._sinks and not self._stopping.is_set():
                    for row in await self._index.run(sql.claim_due, now, free, list(self._sinks)):
                        self._start(row)
                if not self._claim_again:
                    break
        finally:
            self._claiming = False

    def _refill(self) -> None:
        if self.running and not self._stopping.is_set():
            Deferred.fromCoroutine(self._claim()).addErrback(
                lambda f: log.failure("claiming deliveries", f)
            )

    def _start_follow_up(self, row: QueueRow) -> None:
        """Verify or purge ``row`` in the background: a slow metadata lookup never holds up the
        tick, so new deliveries keep being claimed meanwhile."""
        self._checking.launch(
            row.object_id,
            self._follow_up(row),
            FOLLOW_UP_LIMIT,
            lambda failure: self._follow_up_failed(failure, row),
        )

    def _follow_up_failed(self, failure: Any, row: QueueRow) -> Deferred[None] | None:
        if failure.check(CancelledError) and self._stopping.is_set():
            return None  # shutdown: the row is simply still due
        if not failure.check(CancelledError, TimeoutError):
            log.failure("follow-up of {object_id}", failure, object_id=row.object_id)
        now = self._clock.seconds()
        return self._index.run(
            sql.record_follow_up,
            row.object_id,
            now + VERIFY_MAX,
            f"follow-up failed: {failure.getErrorMessage()}",
            False,
            now,
        )

    # -- attempts ---------------------------------------------------------------------------

    def _start(self, row: QueueRow) -> None:
        attempt = self._active.launch(
            row.object_id,
            self._attempt(row),
            ATTEMPT_LIMIT,
            lambda failure: self._record_interruption(failure, row),
        )
        attempt.addBoth(lambda _: self._refill())

    async def _attempt(self, row: QueueRow) -> None:
        attempt = Attempt(row.object_id, row.project, row.filename, row.size_bytes, row.attempts)
        with self.in_flight.running(attempt):
            await self._attempt_tracked(row)

    async def _attempt_tracked(self, row: QueueRow) -> None:
        log.info(
            "delivering {object_id} (attempt {attempt})",
            object_id=row.object_id,
            project=row.project,
            attempt=row.attempts,
        )
        self.observer.attempt_started(OBJECT, row.project, row.attempts)
        sink = self._sinks[row.project]
        try:
            row = await self._prepare(row)
            try:
                plan = self._planner(row)
            except PlanError as e:
                raise DeliveryFailed(str(e), needs_operator=True) from None
            progress = counting_sent(
                self.in_flight.uploading(row.object_id), self.observer, OBJECT, sink.destination
            )
            delivered = await sink.deliver(
                plan,
                self._uploads.data_path(row.object_id),
                progress,
                overwrite=bool(row.force_upload),
            )
        except DeliveryFailed as e:
            await self._record_failure(
                row,
                e.reason,
                needs_operator=e.needs_operator,
                at_least=e.retry_after or 0.0,
                kind=e.kind,
            )
            return
        now = self._clock.seconds()
        await self._index.run(
            sql.record_delivered,
            row.object_id,
            delivered.identifier,
            delivered.remote_name,
            now,
            self._retention[row.project],
        )
        log.info(
            "delivered {object_id} as {identifier}/{remote_name}",
            object_id=row.object_id,
            project=row.project,
            identifier=delivered.identifier,
            remote_name=delivered.remote_name,
            attempt=row.attempts,
        )
        self.observer.delivered(OBJECT, row.project)

    async def _prepare(self, row: QueueRow) -> QueueRow:
        """Check the local payload against its receipt, once, and store its MD5."""
        if row.content_md5 is not None:
            return row
        path = self._uploads.data_path(row.object_id)
        try:
            blake, md5_hex, size = await self._hash(delivery_digests, path, self._stopping)
        except FileNotFoundError:
            raise DeliveryFailed(
                "the local payload is missing", needs_operator=True, kind=LOCAL_PAYLOAD
            ) from None
        except HashCancelled:
            raise CancelledError() from None
        except OSError as e:
            raise DeliveryFailed(
                f"reading the local payload failed: {e.strerror}", kind=LOCAL_PAYLOAD
            ) from None
        if size != row.size_bytes or str(blake) != row.checksum:
            raise DeliveryFailed(
                f"the local payload ({size} bytes, {blake}) does not match its receipt",
                needs_operator=True,
                kind=LOCAL_PAYLOAD,
            )
        await self._index.run(sql.set_content_md5, row.object_id, md5_hex)
        return evolve(row, content_md5=md5_hex)

    async def _record_failure(
        self,
        row: QueueRow,
        reason: str,
        *,
        needs_operator: bool,
        at_least: float = 0.0,
        kind: str = "other",
    ) -> None:
        """``retry_wait`` with backoff; ``at_least`` is the sink's Retry-After, if any."""
        now = self._clock.seconds()
        delay = retry_delay(row.attempts, self._random(), needs_operator=needs_operator)
        delay = max(delay, min(at_least, MAX_RETRY))  # a sink's Retry-After, within the cap
        await self._index.run(
            sql.record_failure, row.object_id, reason, now + delay, needs_operator, now
        )
        emit = log.error if needs_operator else log.warn
        emit(
            "delivery of {object_id} failed (attempt {attempt}), retry in {delay:.0f}s: {error}",
            object_id=row.object_id,
            project=row.project,
            attempt=row.attempts,
            delay=delay,
            error=reason,
            needs_operator=needs_operator,
            failure_class=kind,
        )
        self.observer.delivery_failed(OBJECT, row.project, kind, needs_operator)

    def _record_interruption(self, failure: Any, row: QueueRow) -> Deferred[None]:
        """Cancelled (shutdown), timed out or crashed: back to retry_wait."""
        if failure.check(CancelledError) and self._stopping.is_set():
            now = self._clock.seconds()
            return self._index.run(
                sql.record_failure, row.object_id, "interrupted by shutdown", now, False, now
            )
        if failure.check(TimeoutError, CancelledError):
            reason, kind = f"the attempt was cut off after {ATTEMPT_LIMIT:.0f}s", "timeout"
        else:
            log.failure("delivery attempt on {object_id} crashed", failure, object_id=row.object_id)
            reason, kind = f"internal error: {failure.value}", "internal"
        return Deferred.fromCoroutine(
            self._record_failure(row, reason, needs_operator=False, kind=kind)
        )

    # -- after delivery ---------------------------------------------------------------------

    async def _follow_up(self, row: QueueRow) -> None:
        now = self._clock.seconds()
        if row.verified_at is None:
            await self._verify(row, now)
            return
        if purge_is_due(row, now):
            try:
                await self._run(
                    delete_payload, self._uploads, self._receipts, self._journal, row, now
                )
            except OSError as e:
                log.error(
                    "purging {object_id} failed, retrying in a minute: {error}",
                    object_id=row.object_id,
                    error=str(e),
                )
                await self._index.run(
                    sql.record_follow_up,
                    row.object_id,
                    now + PURGE_RETRY,
                    f"purge: {e}",
                    False,
                    now,
                )
                return
            await self._index.run(sql.record_purged, row.object_id, now)
            follow_up.report_purged(self.observer, delivered_copy(row))

    async def _verify(self, row: QueueRow, now: float) -> None:
        """Look for the delivered copy; record it verified, look again later, deliver it again
        (``verify_timeout`` passed and it is not listed), or flag the row."""
        path = self._uploads.data_path(row.object_id)
        check = await self._sinks[row.project].verify(located(row), path)
        if check.verified:
            await self._index.run(sql.record_verified, row.object_id, now)
            follow_up.report_verified(self.observer, delivered_copy(row))
            return
        if await follow_up.record_unverified(
            self._index,
            self.observer,
            delivered_copy(row),
            check,
            detail=check.detail,
            verify_timeout=self._verify_timeouts.get(row.project, DEFAULT_VERIFY_TIMEOUT),
            now=now,
            redeliver=lambda cur, reason, at: sql.redeliver(cur, row.object_id, reason, at),
        ):
            self._refill()


def delivered_copy(row: QueueRow) -> follow_up.DeliveredCopy:
    """A delivered object as its follow-up sees it."""
    return follow_up.DeliveredCopy.of(row, OBJECT, row.object_id, row.object_id, "canner retry")


def plan_row(delivery: DeliveryConfig, row: QueueRow) -> ItemPlan:
    """Where ``row`` goes, from its stable values only, so a retry resolves the same place
    (the MD5 is computed before the first attempt)."""
    assert row.content_md5 is not None, "the scheduler computes the MD5 before delivering"
    plan = plan_upload(
        delivery,
        row.project,
        row.object_id,
        row.filename,
        row.accepted_at,
        row.size_bytes,
        row.content_md5,
    )
    return evolve(plan, checksum=row.checksum)


def planner(deliveries: Mapping[str, DeliveryConfig]) -> Callable[[QueueRow], ItemPlan]:
    """The daemon's planner: each row by its project's delivery table."""
    return lambda row: plan_row(deliveries[row.project], row)


def located(row: QueueRow) -> ItemPlan:
    """A delivered row as a plan to verify: where it went (as recorded at its delivery, even if
    the templates changed since) and what must be there."""
    assert row.remote_identifier is not None and row.remote_name is not None
    return ItemPlan(
        project=row.project,
        object_id=row.object_id,
        identifier=row.remote_identifier,
        remote_name=row.remote_name,
        size=row.size_bytes,
        content_md5=row.content_md5 or "",
        size_hint=row.size_bytes,
        headers=(),
        checksum=row.checksum,
    )
