"""Durable primitives: publish-once, locks, and coalesced directory fsyncs."""

from __future__ import annotations

import os
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
