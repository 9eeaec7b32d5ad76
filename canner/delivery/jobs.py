"""What every outbound pipeline runs on: a tick that starts after a start-up step, and keyed
background jobs, each bounded in time and cancelled when the service stops.

The outbound service and the packaging pipeline both claim due rows on a tick and work on each
in the background (an attempt, a build, a verification); :class:`Ticker` and :class:`Jobs` are
that shared machinery, so start, stop and failure handling cannot drift apart between them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

from attrs import define, field
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from canner.periodic import PeriodicService

log = Logger()

K = TypeVar("K", bound=Hashable)


@define(eq=False)
class Jobs(Generic[K]):
    """Background jobs, one at most per key (a row's id), each cut off after its limit."""

    _clock: IReactorTime
    _running: dict[K, Deferred[None]] = field(factory=dict)

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, key: object) -> bool:
        return key in self._running

    def keys(self) -> list[K]:
        return list(self._running)

    def launch(
        self,
        key: K,
        work: Coroutine[Any, Any, None],
        limit: float,
        on_failure: Callable[[Failure], object],
    ) -> Deferred[None]:
        """Run ``work`` for ``key``, listed until it ends and cut off (``TimeoutError``) after
        ``limit`` seconds; ``on_failure`` records whatever went wrong (a cancel included), and
        a failure of its own is logged, never left unobserved."""
        d = Deferred.fromCoroutine(work)
        d.addTimeout(limit, self._clock)
        self._running[key] = d
        d.addErrback(on_failure)
        d.addErrback(lambda f: log.failure("recording background work on {key}", f, key=key))
        d.addBoth(lambda _: self._forget(key, d))
        return d

    def _forget(self, key: K, d: Deferred[None]) -> None:
        if self._running.get(key) is d:
            del self._running[key]

    def cancel(self) -> list[Deferred[None]]:
        """Cancel every job; the Deferreds to wait for (each fires once its job has ended)."""
        running = list(self._running.values())
        for work in running:
            work.cancel()
        return running


@define(eq=False)
class Ticker:
    """A pipeline's loop: ``start_up()`` once, then ``tick()`` every ``interval`` seconds (a
    failed tick is logged and the loop goes on).  ``stopping`` is set from :meth:`stop` on, for
    work that checks it between steps (in threads too)."""

    _clock: IReactorTime
    _interval: float
    _tick: Callable[[], Deferred[None]]
    _what: str
    stopping: threading.Event = field(factory=threading.Event)
    _loop: PeriodicService | None = None
    _starting: Deferred[Any] | None = None
    _lanes: list[Jobs[Any]] = field(factory=list)

    def lane(self) -> Jobs[Any]:
        """A set of this loop's jobs (attempts, checks ...), cancelled by :meth:`stop`."""
        jobs: Jobs[Any] = Jobs(self._clock)
        self._lanes.append(jobs)
        return jobs

    def start(self, start_up: Callable[[], Deferred[Any]]) -> None:
        self.stopping.clear()
        loop = self._loop = PeriodicService(
            clock=self._clock, interval=self._interval, job=self._tick, label=f"{self._what} tick"
        )
        started = start_up()

        def begin(_: object) -> None:
            if not self.stopping.is_set():
                loop.startService()

        started.addCallback(begin)
        started.addErrback(lambda f: log.failure("starting the {what}", f, what=self._what))
        self._starting = started

    def stop(self) -> Deferred[Any]:
        """Stop the loop and cancel its lanes' jobs; fires once the start-up step, the last
        tick and every job have ended (so nothing runs on after the index or the pools close)."""
        self.stopping.set()
        last_tick = self._loop.stopService() if self._loop and self._loop.running else None
        running = [d for j in self._lanes for d in j.cancel()]
        waits = [d for d in (self._starting, last_tick) if d is not None] + running
        return DeferredList(waits, consumeErrors=True)
