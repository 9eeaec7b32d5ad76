"""The one outbound service: claim, send, verify and report back, for every kind of file.

Every file that leaves the node is a row of the ``outbound`` table
(:mod:`canner.delivery.outbound`), and its owner (objects, megawarc packages, ledgers) is an
:class:`Owner`.  Every second the service claims due rows of every kind, oldest due first, into
one set of ``delivery_concurrency`` slots, and starts one attempt per row; a freed slot is filled
at once.
An attempt asks the owner for a :class:`Shipment` (the files, planned), hands each file to the
project's sink, and records the outcome with one failure policy whatever the kind: back off 1 min
doubling to 1 h with the sink's ``Retry-After`` as a lower bound, the wait at the cap for errors
that need an operator, cut off after 24 hours, due again at once after a shutdown.

The same tick follows delivered rows up: the sink verifies every file of the copy (listing, then
read-back); a verified copy goes back to its owner, which alone decides what it may delete and
when (``next_check_at``), and deletes it when :meth:`Owner.settle` is due.  A copy not verified
is judged by :func:`canner.delivery.follow_up.record_unverified` (look again later, deliver it
again once ``verify_timeout`` passed unlisted, or flag it for an operator).  Each attempt's phase
and bytes show in :class:`~canner.delivery.liveness.InFlight`, and every fact reaches the
metrics through one :class:`~canner.observe.OutboundObserver`.
"""

from __future__ import annotations

import random
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from attrs import Factory, define, field, frozen
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner.delivery import follow_up, outbound
from canner.delivery.index import Index
from canner.delivery.jobs import Jobs, Ticker
from canner.delivery.liveness import Attempt, InFlight
from canner.delivery.queue import MAX_RETRY, PURGE_RETRY, retry_delay
from canner.observe import UNOBSERVED, Outbound, OutboundObserver, counting_sent
from canner.periodic import OnceMore
from canner.sinks.base import Delivered, DeliveryFailed, Sink
from canner.sinks.plan import ItemPlan, PlanError

log = Logger()

ATTEMPT_LIMIT = 24 * 3600.0
TICK_INTERVAL = 1.0
# How often rows left "delivering" by an attempt whose outcome could not be recorded are released.
ORPHAN_CHECK_INTERVAL = 60.0
# Verifications and owners' deletes running at once, and the bound on each.
FOLLOW_UP_CONCURRENCY = 4
FOLLOW_UP_LIMIT = 600.0
# A follow-up that crashed or timed out is due again after this long (not at every tick).
FOLLOW_UP_RETRY = PURGE_RETRY


@frozen
class Parcel:
    """One file of a shipment: where it goes, where it is, and the name attempts show."""

    plan: ItemPlan
    path: Path
    name: str | None


@frozen(kw_only=True)
class Shipment:
    """A claimed row, planned by its owner: every file goes in this one attempt, in order."""

    ref: str
    project: str
    subject: str  # how log lines name it: an object id, "package <id>", "ledger <name>"
    key: str  # its key among the attempts in flight
    files: tuple[Parcel, ...]
    overwrite: bool  # a read-back found the remote bytes wrong: send over a matching listing


@frozen(kw_only=True)
class Copy:
    """A delivered row as its follow-up sees it: the facts, the files to verify, whether it is
    verified already (then the owner's delete is what is due), and its ``verify_timeout``."""

    facts: follow_up.DeliveredCopy
    files: tuple[Parcel, ...]
    verified: bool
    verify_timeout: float


class Unshippable(Exception):
    """A claimed row cannot be sent this time (its local copy is wrong, its plan refused):
    ``cause`` is recorded as the attempt's failure."""

    def __init__(self, subject: str, project: str, cause: DeliveryFailed | PlanError) -> None:
        super().__init__(str(cause))
        self.subject, self.project, self.cause = subject, project, cause


class Owner(Protocol):
    """What owns the files of one :class:`~canner.observe.Outbound` kind.  The service moves the
    outbound rows; the owner plans, records its own facts beside them, and deletes."""

    @property
    def kind(self) -> Outbound: ...

    def sink(self, project: str) -> Sink:
        """The sink of ``project``, one of :meth:`projects` (only their rows are claimed)."""

    def projects(self) -> Sequence[str]:
        """The projects whose rows this owner can send now."""

    async def shipment(self, ref: str, stopping: threading.Event) -> Shipment:
        """Plan the claimed row ``ref``; raise :class:`Unshippable` when it cannot go."""

    async def delivered(self, shipment: Shipment, sent: Sequence[Delivered], now: float) -> None:
        """Record that every file of ``shipment`` is at its destination (``delivering ->
        delivered``), and say so in the log."""

    def record_failure(
        self, cur: sqlite3.Cursor, ref: str, error: str, at: float, needs_operator: bool, now: float
    ) -> bool:
        """``delivering -> retry_wait`` with the owner's facts (a cursor function)."""

    async def copy(self, ref: str) -> Copy | None:
        """The delivered row ``ref`` for its follow-up (None: gone meanwhile)."""

    async def verified(self, copy: Copy, now: float) -> None:
        """Record the verified copy and schedule the owner's delete (``next_check_at``)."""

    def redeliver(self, cur: sqlite3.Cursor, ref: str, reason: str, now: float) -> bool:
        """``delivered -> retry_wait`` and forget the delete planned after the verification."""

    async def settle(self, copy: Copy, now: float) -> bool:
        """The delete a verified copy allows, when due; True once the local copy is gone (the
        row then has no follow-ups left).  Postpones itself (``next_check_at``) otherwise."""


@define(eq=False, kw_only=True)
class OutboundService(Service):
    """Sends, verifies and hands back every outbound row of one data directory."""

    _index: Index
    _owners: Mapping[Outbound, Owner]
    _clock: IReactorTime
    _concurrency: int
    _random: Callable[[], float] = random.random
    _interval: float = TICK_INTERVAL
    # canner-deliver's attempts in flight (heartbeat, status page, metrics, manhole).
    in_flight: InFlight = field(
        default=Factory(lambda self: InFlight(self._clock), takes_self=True)
    )
    observer: OutboundObserver = UNOBSERVED
    _orphans_checked: float = 0.0
    _sending: Jobs[tuple[Outbound, str]] = field(init=False)
    _checking: Jobs[tuple[Outbound, str]] = field(init=False)
    _ticker: Ticker = field(init=False)
    _stopping: threading.Event = field(init=False)
    _claims: OnceMore = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._ticker = Ticker(self._clock, self._interval, self.tick, "outbound queue")
        self._claims = OnceMore(self._claim_round, "claiming deliveries")
        self._sending, self._checking = self._ticker.lane(), self._ticker.lane()
        self._stopping = self._ticker.stopping

    def startService(self) -> None:
        super().startService()
        self._ticker.start(self._start_up)

    def _start_up(self) -> Deferred[None]:
        def reset(cur: sqlite3.Cursor) -> int:
            now = self._clock.seconds()
            return sum(outbound.reset_delivering(cur, kind, now) for kind in self._owners)

        def report(count: int) -> None:
            if count:
                log.info("{count} interrupted attempts are due again", count=count)

        return self._index.run(reset).addCallback(report)

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        # Stopped while still starting: the start's query ends before the index closes; so
        # does a claim an ended attempt asked for.
        return DeferredList([self._ticker.stop(), self._claims.idle()], consumeErrors=True)

    @property
    def active(self) -> list[dict[str, Any]]:
        """The attempts in flight: file, phase, bytes sent, rate, ETA (for the manhole)."""
        return [p.as_dict() for p in self.in_flight.snapshot()]

    def lanes(self) -> dict[Outbound, list[str]]:
        """The projects each kind of row is sent for now (those with a sink)."""
        return {kind: list(owner.projects()) for kind, owner in self._owners.items()}

    def tick(self) -> Deferred[None]:
        """Claim and start due attempts, then run due follow-ups (verify, owners' deletes)."""
        return Deferred.fromCoroutine(self._tick())

    async def _tick(self) -> None:
        await self._claim()
        now = self._clock.seconds()
        free = FOLLOW_UP_CONCURRENCY - len(self._checking)
        if free <= 0 or self._stopping.is_set():
            return
        busy = self._checking.keys()
        due = await self._index.run(outbound.follow_ups_due_any, now, free, self.lanes(), busy)
        for key in due:
            if len(self._checking) >= FOLLOW_UP_CONCURRENCY:
                break
            if key not in self._checking:  # started while we asked
                self._start_follow_up(*key)

    def _start_follow_up(self, kind: Outbound, ref: str) -> None:
        """Verify or settle a row in the background: a slow metadata lookup never holds up the
        tick, so new deliveries keep being claimed meanwhile."""
        self._checking.launch(
            (kind, ref),
            self._follow_up(kind, ref),
            FOLLOW_UP_LIMIT,
            lambda failure: self._follow_up_failed(failure, kind, ref),
        )

    def _claim(self) -> Deferred[None]:
        """Fill free slots with due rows.  Runs from the tick and whenever an attempt ends, so a
        freed slot never idles until the next tick; one claim runs at a time, so slots are never
        over-filled, and a request during a claim runs it again after."""
        return self._claims.ask()

    async def _claim_round(self) -> None:
        now = self._clock.seconds()
        if now - self._orphans_checked >= ORPHAN_CHECK_INTERVAL:
            # Here, between claims, every claimed row is already in _sending.
            self._orphans_checked = now
            await self._index.run(outbound.release_orphans_any, self._sending.keys(), now)
        free = self._concurrency - len(self._sending)
        if free > 0 and not self._stopping.is_set():
            claimed = await self._index.run(outbound.claim_due_any, now, free, self.lanes())
            for kind, ref, attempt in claimed:
                self._start((kind, ref), attempt)

    def _refill(self) -> None:
        if self.running and not self._stopping.is_set():
            self._claim()

    # -- attempts ---------------------------------------------------------------------------

    def _start(self, key: tuple[Outbound, str], attempt: int) -> None:
        owner, ref = self._owners[key[0]], key[1]
        work = self._sending.launch(
            key,
            self._attempt(owner, ref, attempt),
            ATTEMPT_LIMIT,
            lambda failure: self._interrupted(failure, owner, ref, attempt),
        )
        work.addBoth(lambda _: self._refill())

    async def _attempt(self, owner: Owner, ref: str, attempt: int) -> None:
        """Attempt number ``attempt`` (1-based) of the claimed row ``ref``."""
        try:
            shipment = await owner.shipment(ref, self._stopping)
        except Unshippable as e:
            await self._failed(owner, ref, e.subject, e.project, attempt, e.cause)
            return
        log.info(
            "delivering {subject} (attempt {attempt})",
            subject=shipment.subject,
            project=shipment.project,
            attempt=attempt,
        )
        self.observer.attempt_started(owner.kind, shipment.project, attempt)
        sink = owner.sink(shipment.project)
        try:
            sent = [
                await self._send(owner.kind, sink, shipment, parcel, attempt)
                for parcel in shipment.files
            ]
        except (DeliveryFailed, PlanError) as e:
            await self._failed(owner, ref, shipment.subject, shipment.project, attempt, e)
            return
        await owner.delivered(shipment, sent, self._clock.seconds())
        self.observer.delivered(owner.kind, shipment.project)

    async def _send(
        self, kind: Outbound, sink: Sink, shipment: Shipment, parcel: Parcel, attempt: int
    ) -> Delivered:
        shown = Attempt(shipment.key, shipment.project, parcel.name, parcel.plan.size, attempt)
        with self.in_flight.running(shown):
            sent = self.in_flight.uploading(shipment.key)
            progress = counting_sent(sent, self.observer, kind, sink.destination)
            return await sink.deliver(
                parcel.plan, parcel.path, progress, overwrite=shipment.overwrite
            )

    async def _failed(
        self,
        owner: Owner,
        ref: str,
        subject: str,
        project: str,
        attempt: int,
        error: DeliveryFailed | PlanError | str,
        kind: str = "other",
    ) -> None:
        """The one failure policy: ``retry_wait`` with backoff, the sink's Retry-After as a
        lower bound within the cap, the cap for errors that need an operator."""
        needs_operator, at_least = isinstance(error, PlanError), 0.0
        if isinstance(error, DeliveryFailed):
            needs_operator, at_least, kind = (
                error.needs_operator,
                error.retry_after or 0.0,
                error.kind,
            )
        reason = str(error)
        now = self._clock.seconds()
        delay = retry_delay(attempt, self._random(), needs_operator=needs_operator)
        delay = max(delay, min(at_least, MAX_RETRY))
        await self._index.run(owner.record_failure, ref, reason, now + delay, needs_operator, now)
        (log.error if needs_operator else log.warn)(
            "delivery of {subject} failed (attempt {attempt}), retry in {delay:.0f}s: {error}",
            subject=subject,
            project=project,
            attempt=attempt,
            delay=delay,
            error=reason,
            needs_operator=needs_operator,
            failure_class=kind,
        )
        self.observer.delivery_failed(owner.kind, project, kind, needs_operator)

    def _interrupted(self, failure: Any, owner: Owner, ref: str, attempt: int) -> Deferred[None]:
        """Cancelled (shutdown), timed out or crashed: back to retry_wait."""
        now = self._clock.seconds()
        if failure.check(CancelledError) and self._stopping.is_set():
            reason = "interrupted by shutdown"
            recorded = self._index.run(owner.record_failure, ref, reason, now, False, now)
            return recorded.addCallback(lambda _: None)
        if failure.check(TimeoutError, CancelledError):
            reason, kind = f"the attempt was cut off after {ATTEMPT_LIMIT:.0f}s", "timeout"
        else:
            log.failure("delivery attempt on {ref} crashed", failure, ref=ref)
            reason, kind = f"internal error: {failure.value}", "internal"

        async def record() -> None:
            # The row's project, so the failure counts where the attempt's other facts did.
            row = await self._index.run(outbound.row_of, owner.kind, ref)
            project = row.project if row is not None else ""
            await self._failed(owner, ref, ref, project, attempt, reason, kind)

        return Deferred.fromCoroutine(record())

    # -- after delivery ---------------------------------------------------------------------

    async def _follow_up(self, kind: Outbound, ref: str) -> None:
        owner = self._owners[kind]
        copy = await owner.copy(ref)
        if copy is None:
            return
        now = self._clock.seconds()
        if copy.verified:
            await self._settle(owner, copy, now)
            return
        sink = owner.sink(copy.facts.project)
        for parcel in copy.files:
            check = await sink.verify(parcel.plan, parcel.path)
            if check.verified:
                continue
            detail = check.detail
            if len(copy.files) > 1:
                detail = f"{parcel.plan.remote_name}: {detail}"
            again = await follow_up.record_unverified(
                self._index,
                self.observer,
                copy.facts,
                check,
                detail=detail,
                verify_timeout=copy.verify_timeout,
                now=now,
                redeliver=lambda cur, reason, at: owner.redeliver(cur, ref, reason, at),
            )
            if again:
                self._refill()
            return
        await owner.verified(copy, now)
        follow_up.report_verified(self.observer, copy.facts)

    async def _settle(self, owner: Owner, copy: Copy, now: float) -> None:
        """The owner's delete; one that failed on the disk is tried again in a minute."""
        try:
            if await owner.settle(copy, now):
                follow_up.report_purged(self.observer, copy.facts)
        except OSError as e:
            log.error(
                "purging the local copy of {subject} failed, retrying in a minute: {error}",
                subject=copy.facts.subject,
                project=copy.facts.project,
                error=str(e),
            )
            again, error = now + PURGE_RETRY, f"purge: {e}"
            await self._index.run(
                outbound.record_check, owner.kind, copy.facts.ref, again, error, False, now
            )

    def _follow_up_failed(self, failure: Any, kind: Outbound, ref: str) -> Deferred[None] | None:
        if failure.check(CancelledError) and self._stopping.is_set():
            return None  # shutdown: the row is simply still due
        if not failure.check(CancelledError, TimeoutError):
            log.failure("follow-up of {kind} {ref}", failure, kind=kind.value, ref=ref)
        now = self._clock.seconds()
        error = f"follow-up failed: {failure.getErrorMessage()}"
        return self._index.run(
            outbound.record_check, kind, ref, now + FOLLOW_UP_RETRY, error, False, now
        )


def lanes_of(owners: Iterable[Owner]) -> dict[Outbound, Owner]:
    """Owners by the kind of row they own (one each)."""
    return {owner.kind: owner for owner in owners}
