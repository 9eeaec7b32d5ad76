"""Durable primitives: publish-once, locks, and coalesced directory fsyncs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred

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


class ManualRunner:
    """A BlockingRunner that runs jobs only when the test says so."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, tuple[Any, ...], Deferred[Any]]] = []

    def __call__(self, f: Any, *args: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.jobs.append((f, args, d))
        return d

    def run_next(self) -> None:
        f, args, d = self.jobs.pop(0)
        try:
            result = f(*args)
        except Exception:
            d.errback()
            return
        d.callback(result)


def test_dir_syncs_coalesce_and_never_cover_later_callers(tmp_path: Path) -> None:
    """Callers during a running fsync share the next one; none is answered by an earlier one."""
    runner = ManualRunner()
    syncer = fs.DirSyncer(runner)
    fired: list[str] = []
    syncer.sync(tmp_path).addCallback(lambda _: fired.append("a"))
    syncer.sync(tmp_path).addCallback(lambda _: fired.append("b"))
    syncer.sync(tmp_path).addCallback(lambda _: fired.append("c"))
    assert len(runner.jobs) == 1  # "a" started one fsync; "b" and "c" wait for the next
    runner.run_next()
    assert fired == ["a"]
    assert len(runner.jobs) == 1
    runner.run_next()
    assert fired == ["a", "b", "c"]
    assert runner.jobs == []


def test_dir_sync_failure_reaches_every_waiter(tmp_path: Path) -> None:
    """A failed fsync fails every caller it covered, and the next caller gets a fresh fsync."""
    runner = ManualRunner()
    syncer = fs.DirSyncer(runner)
    missing = tmp_path / "missing"
    errors: list[Any] = []
    syncer.sync(missing).addErrback(errors.append)
    runner.run_next()
    assert len(errors) == 1 and errors[0].check(FileNotFoundError)
    missing.mkdir()
    done: list[object] = []
    syncer.sync(missing).addCallback(done.append)
    runner.run_next()
    assert done == [None]
