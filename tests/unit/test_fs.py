"""Durable primitives: publish-once, locks, and coalesced directory fsyncs."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from canner import fs


def test_publish_once_creates_and_never_replaces(tmp_path: Path) -> None:
    """The first publish wins; later ones report False and change nothing."""
    assert fs.publish_once(tmp_path, "r.json", b"first")
    assert not fs.publish_once(tmp_path, "r.json", b"second")
    assert (tmp_path / "r.json").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_orphaned_temps_are_found_by_age(tmp_path: Path) -> None:
    """Only temp files older than the orphan age are reported."""
    old = fs.write_temp(tmp_path, "old", b"x", sync=False)
    fresh = fs.write_temp(tmp_path, "fresh", b"x", sync=False)
    (tmp_path / "keep").write_bytes(b"x")
    os.utime(old, (1000.0, 1000.0))
    now = fresh.stat().st_mtime
    assert list(fs.orphaned_temps(tmp_path, now)) == [old]


def test_names_in_answers_as_exists_does_for_names_in_the_directory(tmp_path: Path) -> None:
    """``has(name)`` is True for a file or a directory held and for one added while the block
    runs, False for a name absent or removed, and False for everything in a missing
    directory; the descriptor it holds is closed after the block."""
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "sub").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    with fs.names_in(tmp_path) as has:
        assert has("a.json") and has("sub")
        assert not has("b.json")
        (tmp_path / "b.json").write_bytes(b"{}")
        (tmp_path / "a.json").unlink()
        assert has("b.json") and not has("a.json")
    assert len(os.listdir("/proc/self/fd")) == before
    with fs.names_in(tmp_path / "missing") as has:
        assert not has("b.json")


def test_flock_excludes_a_second_descriptor(tmp_path: Path) -> None:
    """A second open of the same file cannot take the lock until the first closes."""
    path = tmp_path / "f"
    path.write_bytes(b"")
    first = os.open(path, os.O_RDWR)
    second = os.open(path, os.O_RDWR)
    try:
        fs.lock_fd(first)
        with pytest.raises(fs.Locked):
            fs.lock_fd(second)
        os.close(first)
        fs.lock_fd(second)
    finally:
        os.close(second)


def test_data_dir_lock_refuses_a_second_holder(tmp_path: Path) -> None:
    """Only one DataDirLock per path; released locks can be taken again."""
    one, two = fs.DataDirLock(tmp_path / "deliver.lock"), fs.DataDirLock(tmp_path / "deliver.lock")
    one.acquire()
    with pytest.raises(fs.Locked):
        two.acquire()
    one.release()
    two.acquire()
    two.release()


class ScriptedFsync:
    """Stands in for ``fsync_dir``: call n blocks until ``release(n)``, then fails with the
    error given to it, if any; ``began(n)`` waits until call n has begun."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._began: dict[int, threading.Event] = {}
        self._go: dict[int, tuple[threading.Event, list[OSError | None]]] = {}
        self.calls = 0

    def _slot(self, n: int) -> tuple[threading.Event, tuple[threading.Event, list[OSError | None]]]:
        with self._lock:
            began = self._began.setdefault(n, threading.Event())
            go = self._go.setdefault(n, (threading.Event(), [None]))
        return began, go

    def __call__(self, path: Path) -> None:
        with self._lock:
            self.calls += 1
            n = self.calls
        began, (go, error) = self._slot(n)
        began.set()
        assert go.wait(10), f"fsync {n} was never released"
        if error[0] is not None:
            raise error[0]

    def began(self, n: int) -> None:
        assert self._slot(n)[0].wait(10), f"fsync {n} never began"

    def release(self, n: int, error: OSError | None = None) -> None:
        go, slot = self._slot(n)[1]
        slot[0] = error
        go.set()


class CountingCondition(threading.Condition):
    """A Condition that tells when ``n`` threads are waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self._changed = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1
        self._changed.set()
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1

    def until_waiting(self, n: int) -> None:
        for _ in range(1000):
            with self:
                if self.waiting >= n:
                    return
                self._changed.clear()
            self._changed.wait(0.01)
        raise AssertionError(f"never {n} waiters")


class Caller:
    """A thread calling ``sync()`` once; ``outcome()`` is None or the error it raised."""

    def __init__(self, group: fs.GroupFsync) -> None:
        self.error: OSError | None = None
        self.returned = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(group,))
        self._thread.start()

    def _run(self, group: fs.GroupFsync) -> None:
        try:
            group.sync()
        except OSError as e:
            self.error = e
        self.returned.set()

    def outcome(self) -> OSError | None:
        self._thread.join(10)
        assert self.returned.is_set(), "sync() never returned"
        return self.error


def test_a_group_fsync_waiter_is_covered_only_by_an_fsync_begun_after_its_call(
    tmp_path: Path,
) -> None:
    """Callers arriving while an fsync runs are not answered by it: they share the next one."""
    fsync, condition = ScriptedFsync(), CountingCondition()
    group = fs.GroupFsync(tmp_path, fsync, condition)
    first = Caller(group)
    fsync.began(1)
    second, third = Caller(group), Caller(group)
    condition.until_waiting(2)
    fsync.release(1)
    assert first.outcome() is None
    fsync.began(2)  # one of the two runs the next fsync, for both
    assert not second.returned.is_set() and not third.returned.is_set()
    fsync.release(2)
    assert second.outcome() is None and third.outcome() is None
    assert fsync.calls == 2


def test_a_failed_group_fsync_fails_every_waiter_of_its_round_and_none_of_the_next(
    tmp_path: Path,
) -> None:
    """The error of an fsync reaches each caller it was to cover; a caller that arrived while it
    ran gets an fsync of its own, which succeeds."""
    fsync, condition = ScriptedFsync(), CountingCondition()
    group = fs.GroupFsync(tmp_path, fsync, condition)
    first = Caller(group)
    fsync.began(1)
    covered = [Caller(group), Caller(group)]
    condition.until_waiting(2)
    fsync.release(1)
    assert first.outcome() is None
    fsync.began(2)
    later = Caller(group)
    condition.until_waiting(2)  # the other of round 2, and the later one for round 3
    fsync.release(2, OSError(errno.EIO, "Input/output error"))
    errors = [caller.outcome() for caller in covered]
    assert all(isinstance(e, OSError) and e.errno == errno.EIO for e in errors)
    assert errors[0] is not errors[1]
    fsync.began(3)
    fsync.release(3)
    assert later.outcome() is None
    assert fsync.calls == 3


def test_a_lone_group_fsync_caller_fsyncs_the_directory(tmp_path: Path) -> None:
    """Without contention every call is one real fsync of the directory; a missing directory
    raises its error."""
    fs.GroupFsync(tmp_path).sync()
    with pytest.raises(FileNotFoundError):
        fs.GroupFsync(tmp_path / "missing").sync()
