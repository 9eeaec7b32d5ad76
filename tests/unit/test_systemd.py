"""sd_notify over a real unix datagram socket: READY=1 once ready, WATCHDOG=1 from the reactor's
timer at a third of WatchdogSec, STOPPING=1 on stop; nothing without $NOTIFY_SOCKET."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from canner.daemon.systemd import SystemdNotifier, notify, watchdog_interval


class RunningClock(Clock):
    """A Clock whose reactor is already running (callWhenRunning calls at once)."""

    def callWhenRunning(self, f: Callable[[], object]) -> None:
        f()


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    folder = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
    path = folder / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    try:
        yield str(path), sock
    finally:
        sock.close()
        path.unlink()
        folder.rmdir()


def received(sock: socket.socket) -> list[str]:
    sock.setblocking(False)
    found = []
    try:
        while True:
            found.append(sock.recv(4096).decode())
    except BlockingIOError:
        pass
    sock.settimeout(2)
    return found


def test_notify_sends_one_datagram_and_is_silent_outside_systemd(
    notify_socket: tuple[str, socket.socket],
) -> None:
    """With $NOTIFY_SOCKET the message arrives as one datagram; without it nothing is sent."""
    path, sock = notify_socket
    assert notify("READY=1", {"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1"
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": path + ".gone"})


def test_watchdog_interval_is_a_third_of_watchdog_sec() -> None:
    """WATCHDOG_USEC (for this pid, when WATCHDOG_PID says) -> seconds between pings."""
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 10.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "2"}, pid=2) == 10.0
    assert watchdog_interval({}) is None


def test_ready_after_the_check_then_watchdog_pings_then_stopping(
    notify_socket: tuple[str, socket.socket],
) -> None:
    """READY=1 waits for the readiness Deferred; pings follow the reactor's clock."""
    path, sock = notify_socket
    clock = RunningClock()
    ready: Deferred[None] = Deferred()
    notifier = SystemdNotifier(
        clock, lambda: ready, {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000"}
    )
    notifier.startService()
    assert received(sock) == ["WATCHDOG=1"], "the first ping at once, READY=1 not yet"
    ready.callback(None)
    assert received(sock) == ["READY=1"]
    clock.advance(1.0)
    clock.advance(1.0)
    assert received(sock) == ["WATCHDOG=1", "WATCHDOG=1"]
    notifier.stopService()
    clock.advance(5.0)
    assert received(sock) == ["STOPPING=1"]
    assert clock.getDelayedCalls() == []
