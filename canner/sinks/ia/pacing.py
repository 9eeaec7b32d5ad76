"""Pacing PUTs by IA's task limits: ``check_limit``'s reading -> the PUTs allowed at once.

IA queues one task per file a PUT stores, and rations how many tasks an item (``bucket``) and an
account (``accesskey``) may have queued, besides a global limit on all of IA's queues.
``check_limit`` answers ``{"over_limit": 0|1, "detail": {"bucket_tasks_queued",
"bucket_ration", "accesskey_tasks_queued", "accesskey_ration", "total_tasks_queued",
"total_global_limit", ...}}`` (field names as IA sends them; see
docs/reference/internet-archive.md, "Rate limiting").

:func:`parse_check_limit` reads that leniently: a field that is missing or not a number is
unknown.  :func:`pace` turns a reading into a :class:`Pace` (pure): for a queue that is over its
ration, no PUT; near it (:data:`NEAR` of the ration or more), one PUT at a time; otherwise no
more PUTs at once than the ration has room for.  Anything unknown allows everything, so a broken
probe or a new answer shape never stops delivery.  :class:`PutGate` counts the PUTs running per
item and per account and lets an attempt in only while its pace allows one more.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

# From this share of a ration on, PUTs to that item or account go one at a time.
NEAR = 0.75


@frozen
class LimitReading:
    """What ``check_limit`` said; None wherever it said nothing usable."""

    over_limit: bool | None = None
    item_queued: int | None = None
    item_ration: int | None = None
    account_queued: int | None = None
    account_ration: int | None = None
    total_queued: int | None = None
    global_limit: int | None = None


def _count(value: object) -> int | None:
    """A non-negative count, from an int or a decimal string; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def parse_check_limit(doc: object) -> LimitReading:
    """The reading of a ``check_limit`` answer (its parsed JSON); unknown fields are None."""
    if not isinstance(doc, Mapping):
        return LimitReading()
    over = doc.get("over_limit")
    over_limit = None if over is None else over not in (0, "0", False)
    detail = doc.get("detail")
    if not isinstance(detail, Mapping):
        detail = {}
    return LimitReading(
        over_limit=over_limit,
        item_queued=_count(detail.get("bucket_tasks_queued")),
        item_ration=_count(detail.get("bucket_ration")),
        account_queued=_count(detail.get("accesskey_tasks_queued")),
        account_ration=_count(detail.get("accesskey_ration")),
        total_queued=_count(detail.get("total_tasks_queued")),
        global_limit=_count(detail.get("total_global_limit", detail.get("global_limit"))),
    )


@frozen
class Pace:
    """PUTs allowed at once to the item and to the account (None: IA sets no bound)."""

    item: int | None = None
    account: int | None = None
    reason: str = ""

    @property
    def stopped(self) -> bool:
        """No PUT at all may start now."""
        return self.item == 0 or self.account == 0


UNBOUNDED = Pace()


def _allowed(queued: int | None, ration: int | None) -> int | None:
    if queued is None or ration is None or ration <= 0:
        return None
    if queued >= ration:
        return 0
    if queued >= NEAR * ration:
        return 1
    return ration - queued  # each PUT queues a task: never more than the room left


def _least(*bounds: int | None) -> int | None:
    known = [b for b in bounds if b is not None]
    return min(known) if known else None


def pace(reading: LimitReading | None) -> Pace:
    """The PUTs ``reading`` allows at once (None, a failed probe: no bound)."""
    if reading is None:
        return UNBOUNDED
    item = _allowed(reading.item_queued, reading.item_ration)
    account = _allowed(reading.account_queued, reading.account_ration)
    total = _allowed(reading.total_queued, reading.global_limit)
    reasons = []
    if item is not None and item <= 1:
        state = "over" if item == 0 else "near"
        reasons.append(
            f"the item's tasks are {state} its ration"
            f" ({reading.item_queued} queued of {reading.item_ration})"
        )
    if account is not None and account <= 1:
        state = "over" if account == 0 else "near"
        reasons.append(
            f"the account's tasks are {state} its ration"
            f" ({reading.account_queued} queued of {reading.account_ration})"
        )
    if total is not None and total <= 1:
        state = "over" if total == 0 else "near"
        reasons.append(
            f"IA's queues are {state} the global limit"
            f" ({reading.total_queued} queued of {reading.global_limit})"
        )
    # over_limit is IA's own verdict; it stops PUTs even when the detail says nothing.
    if reading.over_limit:
        account = 0
        if not reasons:
            reasons.append("check_limit reports over_limit")
    return Pace(item=item, account=_least(account, total), reason="; ".join(reasons))


@define(eq=False)
class PutGate:
    """The PUTs running through one sink, per item and in all (the sink's account).

    Reactor thread only."""

    _clock: IReactorTime
    _items: dict[str, int] = field(factory=dict)
    _running: int = 0
    _waiters: list[Deferred[None]] = field(factory=list)

    def running(self, item: str | None = None) -> int:
        """PUTs running to ``item`` (None: to every item)."""
        return self._running if item is None else self._items.get(item, 0)

    def enter(self, item: str, allowed: Pace) -> bool:
        """Count a PUT to ``item`` as running if ``allowed`` has room for one more; False (and
        nothing counted) otherwise."""
        if allowed.item is not None and self._items.get(item, 0) >= allowed.item:
            return False
        if allowed.account is not None and self._running >= allowed.account:
            return False
        self._items[item] = self._items.get(item, 0) + 1
        self._running += 1
        return True

    def leave(self, item: str) -> None:
        """A PUT counted by :meth:`enter` ended: wake whoever waits for room."""
        left = self._items.get(item, 0) - 1
        if left > 0:
            self._items[item] = left
        else:
            self._items.pop(item, None)
        self._running = max(self._running - 1, 0)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:
                waiter.callback(None)

    def room_or_timeout(self, timeout: float) -> Deferred[None]:
        """Fires when a PUT through the gate ends, or after ``timeout`` seconds (cancellable)."""
        waiter: Deferred[None] = Deferred()
        self._waiters.append(waiter)

        def fire() -> None:
            if not waiter.called:
                waiter.callback(None)

        call = self._clock.callLater(timeout, fire)

        def done(result: object) -> object:
            if call.active():
                call.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            return result

        return waiter.addBoth(done)
