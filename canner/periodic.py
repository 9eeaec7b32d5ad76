"""Work that repeats: on a timer (:class:`PeriodicService`), or on request (:class:`OnceMore`).

Every periodic job of both daemons runs on :class:`PeriodicService` (STYLE P10): runs never
overlap, a failing run is logged and the next one still comes, and stopping waits for the run in
progress.  :class:`OnceMore` is for work asked for at any moment (an attempt ended, a file
arrived): one run at a time, and whatever is asked during a run makes exactly one more run.
Both take their clock or nothing from the caller, and neither knows what its job does.
"""

from __future__ import annotations

from collections.abc import Callable

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

log = Logger()


@define(eq=False, kw_only=True)
class PeriodicService(Service):
    """Runs ``job`` every ``interval`` seconds on ``clock``: at start unless ``now`` is False.

    The next run waits for a Deferred ``job`` returns, so runs never overlap; a run that fails
    (or raises) is logged under ``label`` and the loop goes on.  :meth:`stopService` fires once
    the run in progress, if any, has ended.
    """

    _clock: IReactorTime
    _interval: float
    _job: Callable[[], object]
    _label: str
    _now: bool = True
    _loop: LoopingCall | None = field(default=None, init=False)
    _done: Deferred[None] | None = field(default=None, init=False)

    def startService(self) -> None:
        super().startService()
        loop = self._loop = LoopingCall(self._guarded)
        loop.clock = self._clock
        done = loop.start(self._interval, now=self._now)
        # _guarded never fails, so neither does the loop; say so if that ever changes.
        done.addErrback(lambda f: log.failure("{label} stopped", f, label=self._label))
        self._done = done.addCallback(lambda _: None)

    def _guarded(self) -> Deferred[None]:
        d = maybeDeferred(self._job)
        d.addErrback(lambda f: log.failure("{label} failed", f, label=self._label))
        return d.addCallback(lambda _: None)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        done, self._done = self._done, None
        return done if done is not None else succeed(None)


@define(eq=False)
class OnceMore:
    """Runs ``job`` when asked, one run at a time: asked while a run is in progress (however
    often, from the job itself too), it runs exactly once more after it.  A failing run is
    logged under ``label`` and never reaches whoever asked.  After :meth:`stop` it runs no more.
    """

    _job: Callable[[], object]
    _label: str
    _busy: bool = field(default=False, init=False)
    _again: bool = field(default=False, init=False)
    _stopped: bool = field(default=False, init=False)
    _idle: list[Deferred[None]] = field(factory=list, init=False)

    def ask(self) -> Deferred[None]:
        """Run now, or once more after the run in progress; fires once no run is left to do
        (at once when stopped, or when the job ran to its end without waiting)."""
        if self._stopped:
            return succeed(None)
        if self._busy:
            self._again = True
        else:
            # Set before the job starts: a job that asks again must not start a second loop.
            self._busy = True
            Deferred.fromCoroutine(self._runs())
        return self.idle()

    async def _runs(self) -> None:
        try:
            while True:
                self._again = False
                try:
                    await maybeDeferred(self._job)
                except Exception:
                    log.failure("{label} failed", label=self._label)
                if not self._again or self._stopped:
                    break
        finally:
            self._busy = False
            waiters, self._idle = self._idle, []
            for waiter in waiters:
                waiter.callback(None)

    def idle(self) -> Deferred[None]:
        """Fires once no run is in progress or left to do (at once when none is)."""
        if not self._busy:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle.append(waiter)
        return waiter

    def stop(self) -> Deferred[None]:
        """Ask for no more runs; fires once the run in progress, if any, has ended."""
        self._stopped = True
        return self.idle()
