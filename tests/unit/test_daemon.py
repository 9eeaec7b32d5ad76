"""A daemon's top service: what outlives its children, and thread pools that have stopped."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from attrs import define, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactor
from twisted.python.failure import Failure

from canner.blocking import PoolStopped, ThreadPoolRunner
from canner.config import Config, parse_config
from canner.daemon.services import DaemonRoot
from canner.fs import DataDirLock
from canner.store.datadir import DeliverLocked, ReceiverLocked, lock_data_dir, lock_receiver_dir


@define(eq=False)
class Recorded(Service):
    """A service that notes its start and stop in ``events``; its stop can be held open."""

    _name: str
    _events: list[str]
    _hold: bool = False
    stopping: Deferred[None] | None = field(default=None, init=False)

    def startService(self) -> None:
        super().startService()
        self._events.append(f"start {self._name}")

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        self._events.append(f"stop {self._name}")
        if self._hold:
            self.stopping = Deferred()
            return self.stopping
        return None


def test_what_outlives_the_children_stops_only_after_all_of_them() -> None:
    """The thread pools (and the heartbeat) start before the children and stop once every
    child's stop has finished, last added first; ``on_stopped`` runs after that."""
    events: list[str] = []
    root = DaemonRoot(lambda: events.append("on_stopped"))
    root.outlive(Recorded("pool", events))
    root.outlive(Recorded("heartbeat", events))
    child = Recorded("rescan", events, hold=True)
    child.setServiceParent(root)
    root.startService()
    assert events == ["start pool", "start heartbeat", "start rescan"]
    stopped = root.stopService()
    assert events[3:] == ["stop rescan"] and not stopped.called, "stopped under a stopping child"
    assert child.stopping is not None
    child.stopping.callback(None)
    assert events[4:] == ["stop heartbeat", "stop pool", "on_stopped"]
    assert stopped.called


def test_a_stopped_thread_pool_refuses_work_at_once() -> None:
    """Work handed to a stopped pool fails with PoolStopped instead of never answering."""

    class Reactor(MemoryReactor):
        def callFromThread(self, f: Any, *args: Any) -> None:  # the pool's threads hand back
            f(*args)

    runner = ThreadPoolRunner(Reactor(), "canner-test", 1)
    runner.startService()
    runner.stopService()
    results: list[Any] = []
    runner(lambda: 1).addBoth(results.append)
    [failure] = results
    assert isinstance(failure, Failure) and failure.check(PoolStopped)


# -- one owner per data directory ------------------------------------------------------------


@pytest.mark.parametrize(
    ("take", "name", "refusal"),
    [
        (lock_receiver_dir, "receiver.lock", ReceiverLocked),
        (lock_data_dir, "deliver.lock", DeliverLocked),
    ],
)
def test_a_second_owner_of_a_data_dir_is_refused_naming_the_first(
    tmp_path: Path, take: Callable[[Config], DataDirLock], name: str, refusal: type[Exception]
) -> None:
    """The lock holds its owner's pid; a second taker gets one line naming the directory, the
    lock and that pid; once the first lets go, it may start."""
    raw = {"issuer": "https://canner.test", "data_dir": str(tmp_path), "min_free_bytes": 1}
    config = parse_config({**raw, "projects": {"example": {}}}, tmp_path)
    first = take(config)
    assert (tmp_path / name).read_text() == f"{os.getpid()}\n"
    with pytest.raises(refusal) as refused:
        take(config)
    text = str(refused.value)
    assert "\n" not in text and str(tmp_path) in text and name in text
    assert f"(pid {os.getpid()}, see {name})" in text
    first.release()
    take(config).release()
