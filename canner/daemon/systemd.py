"""systemd integration without a dependency: ``sd_notify`` over ``$NOTIFY_SOCKET``.

Under ``Type=notify`` the units wait for ``READY=1``, which :class:`SystemdNotifier` sends once
the daemon is serving (the receiver: its port listens; canner-deliver: its index answered), and
with ``WatchdogSec=`` it sends ``WATCHDOG=1`` from a reactor timer every third of the interval, so
a wedged reactor stops the pings and systemd restarts the process.  ``STOPPING=1`` goes out when
the daemon begins to stop.  Outside systemd (no ``$NOTIFY_SOCKET``) nothing is sent.
The protocol is one datagram per message on a unix socket; see sd_notify(3).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorCore, IReactorTime
from twisted.logger import Logger

from canner.periodic import PeriodicService

log = Logger()


def notify(message: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to systemd; False when not under systemd.

    Errors are logged, never raised: a daemon must not die because its supervisor went away."""
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode("utf-8"))
    except OSError as e:
        log.warn("cannot notify systemd ({message}): {error}", message=message, error=str(e))
        return False
    return True


def watchdog_interval(
    environ: Mapping[str, str] = os.environ, pid: int | None = None
) -> float | None:
    """Seconds between watchdog pings (a third of ``WatchdogSec=``), None when not asked for."""
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner and owner != str(pid if pid is not None else os.getpid()):
        return None
    return int(usec) / 1e6 / 3


@define(eq=False)
class SystemdNotifier(Service):
    """READY=1 once ``ready()`` fires after the reactor runs; the watchdog; STOPPING=1.

    Add it last: it starts after every listener, and stops first."""

    _reactor: Any  # IReactorTime and IReactorCore
    _ready: Callable[[], Deferred[Any] | None] = lambda: None
    _environ: Mapping[str, str] = field(factory=lambda: os.environ)
    _send: Callable[[str], bool] | None = None
    _watchdog: PeriodicService | None = None

    def _say(self, message: str) -> bool:
        if self._send is not None:
            return self._send(message)
        return notify(message, self._environ)

    def startService(self) -> None:
        super().startService()
        core: IReactorCore = self._reactor
        core.callWhenRunning(self._when_running)

    def _when_running(self) -> None:
        d = maybeDeferred(self._ready)
        d.addCallback(lambda _: self._say("READY=1") if self.running else None)
        d.addErrback(lambda f: log.failure("not ready: systemd is not told READY=1", f))
        interval = watchdog_interval(self._environ)
        if interval is not None and self.running:
            clock: IReactorTime = self._reactor
            self._watchdog = PeriodicService(
                clock=clock,
                interval=interval,
                job=lambda: self._say("WATCHDOG=1"),
                label="the systemd watchdog ping",
            )
            self._watchdog.startService()

    def stopService(self) -> None:
        super().stopService()
        if self._watchdog is not None and self._watchdog.running:
            self._watchdog.stopService()  # the ping is synchronous: nothing to wait for
        self._say("STOPPING=1")
