"""The one door for blocking work: ``run_blocking(f, *args) -> Deferred``.

fsync, hashing, file and directory I/O and SQLite never run on the reactor thread.  Production uses
:class:`ThreadPoolRunner` (a named thread pool started and stopped as a Service); unit tests use
:func:`run_inline`, which runs ``f`` at once and returns an already-fired Deferred.  A
:class:`ThreadPoolRunner` outlives the services that call it (see ``canner.service.DaemonRoot``);
a call after it stopped fails at once with :class:`PoolStopped` instead of never answering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

P = ParamSpec("P")
T = TypeVar("T")


class PoolStopped(Exception):
    """Blocking work was handed to a thread pool that has already stopped."""


class BlockingRunner(Protocol):
    """Runs a blocking callable somewhere other than the reactor thread."""

    def __call__(self, f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]: ...


def run_inline(f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
    """A synchronous :class:`BlockingRunner` for unit tests."""
    try:
        return succeed(f(*args, **kwargs))
    except BaseException:
        return fail()


@define(eq=False)
class ThreadPoolRunner(Service):
    """A :class:`BlockingRunner` on its own thread pool, which lives as long as the service."""

    _reactor: IReactorFromThreads
    _name: str
    _size: int
    _pool: ThreadPool = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._pool = ThreadPool(minthreads=0, maxthreads=self._size, name=self._name)

    def __call__(self, f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        if self._pool.joined:
            # A stopped ThreadPool drops new work without a word: its Deferred would never fire.
            return fail(PoolStopped(f"the {self._name} thread pool has stopped"))
        return deferToThreadPool(self._reactor, self._pool, f, *args, **kwargs)

    def startService(self) -> None:
        super().startService()
        self._pool.start()

    def stopService(self) -> None:
        super().stopService()
        # Blocks until running jobs end; every job here is bounded (one fsync, one write).
        self._pool.stop()
