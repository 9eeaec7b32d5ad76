"""The repeating-work primitives: PeriodicService on a timer, OnceMore on request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import LogEvent, globalLogPublisher

from canner.periodic import OnceMore, PeriodicService


def _capture() -> tuple[list[LogEvent], Any]:
    events: list[LogEvent] = []
    globalLogPublisher.addObserver(events.append)
    return events, lambda: globalLogPublisher.removeObserver(events.append)


def held(pending: list[Deferred[None]]) -> Callable[[], Deferred[None]]:
    """A job whose every run waits until the test fires its Deferred (kept in ``pending``)."""

    def job() -> Deferred[None]:
        d: Deferred[None] = Deferred()
        pending.append(d)
        return d

    return job


def test_a_periodic_job_runs_at_start_and_every_interval() -> None:
    """The job runs at start, then once per interval of the injected clock."""
    clock = Clock()
    runs: list[float] = []
    service = PeriodicService(
        clock=clock, interval=10.0, job=lambda: runs.append(clock.seconds()), label="job"
    )
    service.startService()
    clock.advance(10.0)
    clock.advance(10.0)
    assert runs == [0.0, 10.0, 20.0]
    service.stopService()
    assert clock.getDelayedCalls() == []


def test_a_periodic_job_may_wait_for_its_first_interval() -> None:
    """With now=False the first run comes one interval after start."""
    clock = Clock()
    runs: list[float] = []
    service = PeriodicService(
        clock=clock, interval=5.0, job=lambda: runs.append(clock.seconds()), label="job", now=False
    )
    service.startService()
    assert runs == []
    clock.advance(5.0)
    assert runs == [5.0]
    service.stopService()


def test_runs_never_overlap() -> None:
    """A run that has not ended holds the next one back until it has."""
    clock = Clock()
    pending: list[Deferred[None]] = []
    job = held(pending)
    service = PeriodicService(clock=clock, interval=1.0, job=job, label="job")
    service.startService()
    clock.advance(5.0)
    assert len(pending) == 1
    pending[0].callback(None)
    clock.advance(1.0)
    assert len(pending) == 2
    pending[1].callback(None)
    service.stopService()


def test_a_failing_run_is_logged_and_the_loop_goes_on() -> None:
    """A run that raises or fails is logged under the label; the next run still comes."""
    clock = Clock()
    runs: list[int] = []

    def job() -> Deferred[None]:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("boom")
        return Deferred.fromCoroutine(_fail())

    async def _fail() -> None:
        raise ValueError("bad")

    events, stop_capture = _capture()
    try:
        service = PeriodicService(clock=clock, interval=1.0, job=job, label="the job")
        service.startService()
        clock.advance(1.0)
        clock.advance(1.0)
        service.stopService()
    finally:
        stop_capture()
    assert len(runs) == 3
    failures = [e for e in events if "log_failure" in e and e.get("label") == "the job"]
    assert [f["log_failure"].type for f in failures] == [RuntimeError, ValueError, ValueError]
    for failure in failures:
        failure["log_failure"].cleanFailure()


def test_stopping_waits_for_the_run_in_progress() -> None:
    """stopService fires only once the run in progress has ended, and no run follows."""
    clock = Clock()
    pending: list[Deferred[None]] = []
    job = held(pending)
    service = PeriodicService(clock=clock, interval=1.0, job=job, label="job")
    service.startService()
    stopped = service.stopService()
    fired: list[object] = []
    stopped.addCallback(fired.append)
    assert fired == []
    pending[0].callback(None)
    assert fired == [None]
    clock.advance(10.0)
    assert len(pending) == 1
    assert clock.getDelayedCalls() == []


def test_a_stopped_service_starts_again() -> None:
    """A service stopped and started again runs its job again."""
    clock = Clock()
    runs: list[float] = []
    service = PeriodicService(
        clock=clock, interval=1.0, job=lambda: runs.append(clock.seconds()), label="job"
    )
    service.startService()
    service.stopService()
    clock.advance(3.0)
    service.startService()
    assert runs == [0.0, 3.0]
    service.stopService()


# -- OnceMore ------------------------------------------------------------------------------------


def test_asked_while_idle_it_runs_at_once() -> None:
    """An ask with no run in progress runs the job now; its Deferred fires when it ends."""
    runs: list[int] = []
    once = OnceMore(lambda: succeed(runs.append(1)), "job")
    fired: list[object] = []
    once.ask().addCallback(fired.append)
    assert runs == [1]
    assert fired == [None]


def test_asks_during_a_run_make_exactly_one_more_run() -> None:
    """However many asks come during a run, one more run follows it, and then none."""
    pending: list[Deferred[None]] = []
    job = held(pending)
    once = OnceMore(job, "job")
    first = once.ask()
    waits = [once.ask() for _ in range(3)]
    assert len(pending) == 1
    pending[0].callback(None)
    assert len(pending) == 2
    fired: list[object] = []
    for d in [first, *waits]:
        d.addCallback(fired.append)
    assert fired == []
    pending[1].callback(None)
    assert len(pending) == 2
    assert fired == [None] * 4


def test_a_job_that_asks_again_runs_once_more_without_nesting() -> None:
    """A job that asks from inside its own run gets one more run after it, not a nested one."""
    depth = 0
    runs: list[int] = []
    once: OnceMore

    def job() -> Deferred[None]:
        nonlocal depth
        depth += 1
        runs.append(depth)
        if len(runs) < 3:
            once.ask()
        depth -= 1
        return succeed(None)

    once = OnceMore(job, "job")
    once.ask()
    assert runs == [1, 1, 1]


def test_a_failing_run_is_logged_and_never_reaches_who_asked() -> None:
    """A failed run is logged under the label; the asker's Deferred still fires, and the run
    asked for meanwhile still comes."""
    pending: list[Deferred[None]] = []
    job = held(pending)
    events, stop_capture = _capture()
    try:
        once = OnceMore(job, "the job")
        fired: list[object] = []
        once.ask().addCallback(fired.append)
        once.ask()
        pending[0].errback(RuntimeError("boom"))
        assert len(pending) == 2
        pending[1].callback(None)
    finally:
        stop_capture()
    assert fired == [None]
    failures = [e for e in events if "log_failure" in e and e.get("label") == "the job"]
    assert [f["log_failure"].type for f in failures] == [RuntimeError]
    failures[0]["log_failure"].cleanFailure()


def test_after_stop_nothing_more_runs() -> None:
    """stop fires once the run in progress ends; no run asked for follows, nor any later ask."""
    pending: list[Deferred[None]] = []
    job = held(pending)
    once = OnceMore(job, "job")
    once.ask()
    once.ask()
    stopped: list[object] = []
    once.stop().addCallback(stopped.append)
    assert stopped == []
    pending[0].callback(None)
    assert stopped == [None]
    once.ask()
    assert len(pending) == 1


def test_idle_fires_once_no_run_is_left() -> None:
    """idle fires at once when nothing runs, else after the run in progress and the one more."""
    pending: list[Deferred[None]] = []
    job = held(pending)
    once = OnceMore(job, "job")
    fired: list[object] = []
    once.idle().addCallback(fired.append)
    assert fired == [None]
    once.ask()
    once.ask()
    once.idle().addCallback(fired.append)
    pending[0].callback(None)
    assert fired == [None]
    pending[1].callback(None)
    assert fired == [None, None]
