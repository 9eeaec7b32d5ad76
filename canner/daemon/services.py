"""The process-level services both daemons are built from, whatever they serve.

:class:`DaemonRoot` is each daemon's top service and fixes the order things stop in;
:class:`Listening` listens on a strports description and turns a refusal into one line;
:class:`LogObservers` feeds log observers (metrics, the status page's recent problems) while the
daemon runs; :class:`ShutdownHook` tells a domain object the process is stopping.  Periodic jobs
run on :class:`canner.periodic.PeriodicService`.  Nothing here knows what canner does:
``canner.daemon.roots`` builds the daemons out of them.
"""

from __future__ import annotations

import gc
import signal
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, cast

from attrs import define, field
from twisted.application import strports
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.logger import ILogObserver, Logger, LogPublisher

log = Logger()

Observer = Callable[[Mapping[str, Any]], None]


@define(eq=False)
class DaemonRoot(MultiService):
    """A daemon's top service.  Its children stop the way MultiService stops them (all at once,
    last added first); what joined through :meth:`outlive` started before them and stops only
    once every child has finished stopping, one at a time, last added first; then
    ``on_stopped`` runs (close the index, free the lock).

    Thread pools outlive the children: a child's in-flight work (a rescan between two batches, a
    build between two chunks) still runs blocking steps while the child stops, and a stopped
    pool would never answer them, so the process would wait for ever.
    """

    _on_stopped: Callable[[], None] = lambda: None
    _outliving: list[IService] = field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        MultiService.__init__(self)

    def outlive(self, service: IService) -> None:
        """Start ``service`` before the children, and stop it after all of them."""
        self._outliving.append(service)

    def startService(self) -> None:
        for service in self._outliving:
            service.startService()
        super().startService()

    def stopService(self) -> Deferred[None]:
        d: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return d

    async def _stop(self) -> None:
        await super().stopService()
        for service in reversed(self._outliving):
            try:
                await maybeDeferred(service.stopService)
            except Exception:
                log.failure("stopping {service}", service=service)
        self._on_stopped()


def quiet_repeated_stop_signals(reactor: Any) -> None:
    """Once the process has begun to stop, a further SIGTERM or SIGINT is only logged.

    The first one still goes to Twisted's handler, which stops the reactor.  Twisted would take
    a second one as another request to stop the stopping reactor and log a critical
    ``ReactorNotRunning`` traceback; the stop under way goes on either way, and SIGKILL still
    ends the process at once.  Call it once per process, with the global reactor."""
    stopping = False

    def stop_begins() -> None:
        nonlocal stopping
        stopping = True

    def once(first: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
        def handler(signum: int, frame: Any) -> None:
            if stopping:
                name = signal.Signals(signum).name
                log.info("{signal} while stopping: already stopping", signal=name)
                return
            stop_begins()
            first(signum, frame)

        return handler

    def wrap_handlers() -> None:  # once the reactor has installed its own
        for signum in (signal.SIGTERM, signal.SIGINT):
            first = signal.getsignal(signum)
            if callable(first):
                signal.signal(signum, once(first))

    reactor.callWhenRunning(wrap_handlers)
    reactor.addSystemEventTrigger("before", "shutdown", stop_begins)


@define(eq=False)
class ShutdownHook(Service):
    """Calls ``on_stop`` when the process begins to stop (add it last: it stops first); the
    thread pools stop only once the Deferred it may return has fired."""

    _on_stop: Callable[[], Deferred[None] | None]

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        return self._on_stop()


class Listening(MultiService):
    """A listener whose failure to listen (port in use, no permission) ends start-up with one
    clear line instead of a traceback."""

    def __init__(self, *, description: str, factory: Any, reactor: Any, what: str) -> None:
        super().__init__()
        self._description = description
        self._what = what
        strports.service(description, factory, reactor=reactor).setServiceParent(self)

    def _refuse(self, error: CannotListenError) -> NoReturn:
        raise cannot_listen(self._description, self._what, error)

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except CannotListenError as e:
            self._refuse(e)

    def startService(self) -> None:
        try:
            super().startService()
        except CannotListenError as e:
            self._refuse(e)


def cannot_listen(description: str, what: str, error: CannotListenError) -> SystemExit:
    """The one line that ends a start-up which cannot listen on ``description``."""
    reason = error.socketError
    text = getattr(reason, "strerror", None) or str(reason)
    return SystemExit(f"canner: cannot listen on {description} ({what}): {text}")


@define(eq=False)
class LogObservers(Service):
    """Adds ``observers`` to ``publisher`` while running (add it early: it stops late)."""

    _publisher: LogPublisher
    _observers: Iterable[Observer]

    def startService(self) -> None:
        super().startService()
        for observer in self._observers:
            self._publisher.addObserver(cast(ILogObserver, observer))

    def stopService(self) -> None:
        super().stopService()
        for observer in self._observers:
            self._publisher.removeObserver(cast(ILogObserver, observer))


def freeze_startup_objects() -> None:
    """Move every object start-up made (modules, config, the service tree: some 80,000 in the
    receiver) to the garbage collector's permanent generation.  Answered requests leave cyclic
    garbage (on the routes Klein serves, its and werkzeug's closures hold the request), so full
    collections come often; frozen objects are no longer walked by each of them."""
    gc.freeze()
