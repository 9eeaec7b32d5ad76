"""ThreadPoolRunner: blocking jobs on the service's threads, results back through the reactor."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.failure import Failure
from zope.interface import implementer

from canner.blocking import ThreadPoolRunner

WAIT = 30.0  # seconds; a bound on every wait, never reached when the code works


@implementer(IReactorFromThreads)
class FromThreads:
    """The one reactor method the runner needs; it records the calls instead of running them."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._lock = threading.Lock()

    def callFromThread(self, callable: Callable[..., Any], *args: object, **kwargs: object) -> None:
        assert not kwargs
        with self._lock:
            self.calls.append((callable, args))

    def run_calls(self) -> None:
        with self._lock:
            calls, self.calls = self.calls, []
        for f, args in calls:
            f(*args)


def results(d: Any) -> list[Any]:
    seen: list[Any] = []
    d.addBoth(seen.append)
    return seen


def add(a: int, b: int = 0) -> int:
    return a + b


def test_results_and_errors_reach_the_reactor_thread() -> None:
    """A job's value and a job's exception fire its Deferred only through callFromThread."""
    reactor = FromThreads()
    runner = ThreadPoolRunner(reactor, "test", 2)
    runner.startService()
    try:
        ok = results(runner(add, 2, b=3))
        bad = results(runner(int, "not a number"))
    finally:
        runner.stopService()
    assert ok == [] and bad == []
    reactor.run_calls()
    assert ok == [5]
    assert isinstance(bad[0], Failure) and bad[0].check(ValueError)


def test_stop_runs_the_jobs_already_queued_then_returns() -> None:
    """stopService waits for the job running and the jobs queued behind it: none is dropped."""
    reactor = FromThreads()
    runner = ThreadPoolRunner(reactor, "test", 1)
    runner.startService()
    started, release = threading.Event(), threading.Event()

    def blocked() -> str:
        started.set()
        assert release.wait(WAIT)
        return "first"

    first = results(runner(blocked))
    queued = [results(runner(str, n)) for n in range(3)]
    assert started.wait(WAIT)
    release.set()
    runner.stopService()
    reactor.run_calls()
    assert first == ["first"]
    assert queued == [["0"], ["1"], ["2"]]


def test_jobs_submitted_before_start_run_once_it_starts() -> None:
    """Work handed to a runner that is not started yet waits for it instead of failing."""
    reactor = FromThreads()
    runner = ThreadPoolRunner(reactor, "test", 2)
    early = results(runner(str, 7))
    runner.startService()
    runner.stopService()
    reactor.run_calls()
    assert early == ["7"]
