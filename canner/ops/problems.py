"""The warnings and errors a process logged lately, kept in memory for its status page.

:class:`RecentProblems` is a log observer; :func:`watching_start_up` adds it before a daemon's
start-up work, so what start-up logs (an unusable index) is kept apart and shown near the top.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

from attrs import define, field, frozen
from twisted.logger import ILogObserver, LogLevel, LogPublisher, formatEvent

RECENT_PROBLEMS = 20
_PROBLEM_LEVELS = (LogLevel.warn, LogLevel.error, LogLevel.critical)


@frozen
class Problem:
    """One warning or error logged by this process."""

    time: float
    level: str
    namespace: str
    text: str


@define(eq=False)
class RecentProblems:
    """An ``ILogObserver`` that keeps the latest warnings and errors in memory.

    Made ``starting``, it keeps the first ``size`` logged before :meth:`started` apart (they
    never rotate out): the errors of a start-up, which the page shows near its top."""

    size: int = RECENT_PROBLEMS
    starting: bool = False
    _lines: deque[Problem] = field(init=False)
    _at_start: list[Problem] = field(init=False, factory=list)
    _seen: set[tuple[object, ...]] = field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self._lines = deque(maxlen=self.size)

    def started(self) -> None:
        """Start-up is over: what is logged from now on is a recent problem."""
        self.starting = False
        self._seen.clear()

    def observe(self, event: Mapping[str, Any]) -> None:
        level = event.get("log_level")
        if level not in _PROBLEM_LEVELS:
            return
        text = formatEvent(dict(event))
        failure = event.get("log_failure")
        if failure is not None and hasattr(failure, "getErrorMessage"):
            text = f"{text}: {failure.type.__name__}: {failure.getErrorMessage()}"
        when = event.get("log_time")
        problem = Problem(
            when if isinstance(when, float) else 0.0,
            str(getattr(level, "name", level)),
            str(event.get("log_namespace", "")),
            text,
        )
        if self.starting:
            # twistd replays what was logged before its log began to every observer: once.
            key = (when, event.get("log_format"), problem.namespace)
            if key not in self._seen and len(self._at_start) < self.size:
                self._seen.add(key)
                self._at_start.append(problem)
            return
        # deque.append is atomic: events logged from worker threads need no lock.
        self._lines.append(problem)

    def latest(self) -> tuple[Problem, ...]:
        """Newest first (start-up's problems apart)."""
        return tuple(reversed(self._lines))

    def at_start(self) -> tuple[Problem, ...]:
        """What was logged before :meth:`started`, oldest first."""
        return tuple(self._at_start)


@contextmanager
def watching_start_up(publisher: LogPublisher) -> Iterator[RecentProblems]:
    """Problems heard from here on (start-up included: an unusable index), for the status page;
    a start-up that raises stops the watching."""
    problems = RecentProblems(starting=True)
    watching = cast(ILogObserver, problems.observe)
    publisher.addObserver(watching)
    try:
        yield problems
    except BaseException:
        publisher.removeObserver(watching)
        raise
