"""Durable file-system primitives: fsync of files and directories, publish-once files, free space.

Every function here blocks; call it through a :class:`~canner.blocking.BlockingRunner`.
:class:`GroupFsync` coalesces one directory's fsyncs across the threads that call it (group
commit), on those threads: no thread hop of its own (a reactor-side one cost more than it saved).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from attrs import define, field

TEMP_PREFIX = ".tmp-"
# A temp file lives for milliseconds; one older than this was orphaned by a crash.
TEMP_ORPHAN_AGE = 3600.0


def fsync_path(path: Path) -> None:
    """fsync the file or directory at ``path``."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory, making the names created or removed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@define
class _Round:
    """One fsync of a :class:`GroupFsync`: the callers it covers wait for it to end."""

    done: bool = False
    error: OSError | None = None


@define(eq=False)
class GroupFsync:
    """Group commit of one directory's fsyncs, for any number of threads.

    :meth:`sync` returns only after an fsync of :attr:`path` that *began after the call* has
    ended, so every name created or removed in the directory before the call is durable then;
    an fsync that failed raises its error (an ``OSError``) in every caller it was to cover, and
    in no caller of the next one.  Callers that arrive while an fsync runs share the next one:
    one of them runs it on its own thread when the running one ends, the others wait for it.
    So under concurrent acceptances a directory is fsynced about once per fsync's duration,
    whatever the number of callers, and a lone caller costs one fsync and two uncontended
    lock round trips.
    """

    path: Path
    _fsync: Callable[[Path], None] = fsync_dir
    _lock: threading.Condition = field(factory=threading.Condition, repr=False)
    # The round new callers join: it has not begun, so it covers what they did before.
    _next: _Round = field(factory=_Round, repr=False)
    _running: bool = field(default=False, repr=False)

    def sync(self) -> None:
        """fsync :attr:`path`, or wait for an fsync of it that begins after this call."""
        with self._lock:
            mine = self._next
            while not mine.done and self._running:
                self._lock.wait()
            if not mine.done:
                # Nobody runs an fsync and ours has not begun: begin it here, for every caller
                # that joined it; later callers join the next round.
                self._running = True
                self._next = _Round()
                leader = True
            else:
                leader = False
        if leader:
            try:
                self._fsync(self.path)
            except OSError as e:
                mine.error = e
            with self._lock:
                mine.done, self._running = True, False
                self._lock.notify_all()
        if mine.error is not None:
            error = mine.error
            # A fresh exception per caller: one object raised in several threads at once would
            # share (and tangle) its traceback.
            raise OSError(error.errno, error.strerror, error.filename) from error


_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], function)


_sync_file_range = _load_sync_file_range()


def write_behind(fd: int, start: int, end: int, settle_before: int) -> None:
    """Start writeback of ``[start, end)``; wait until bytes before ``settle_before`` are written.

    Linux's sync_file_range: it keeps a large upload's dirty pages bounded while it streams, so
    the fsync at acceptance has only the tail left to flush.  It is no durability guarantee
    (acceptance still fsyncs), but it *does* consume writeback errors: the kernel reports a
    failed writeback once per open file, so an error here must reach the caller (``OSError``),
    or the later fsync on the same descriptor would succeed over lost pages.  A no-op where the
    call is missing.
    """
    if _sync_file_range is None:
        return
    if settle_before > 0:
        _checked(
            _sync_file_range(
                fd,
                0,
                settle_before,
                _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER,
            )
        )
    _checked(_sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WRITE))


def _checked(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")


def free_bytes(path: Path) -> int:
    """Bytes available to unprivileged users on the filesystem holding ``path`` (statvfs)."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than it was given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_temp(directory: Path, stem: str, data: bytes, *, sync: bool) -> Path:
    """Write ``data`` to a fresh temp file in ``directory`` (fsynced when ``sync``); return it."""
    # os.urandom is the source secrets.token_hex reads, without SystemRandom's frames.
    temp = directory / f"{TEMP_PREFIX}{stem}-{os.urandom(6).hex()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return temp


def check_writable(path: Path) -> None:
    """Raise the ``OSError`` that writing at ``path`` would meet now: in a directory a file is
    created and removed, an existing file is opened for writing.  A missing path passes (it is
    created later, in a directory checked too)."""
    if path.is_dir():
        write_temp(path, "writable", b"", sync=False).unlink()
    elif path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CLOEXEC))


def publish_once(directory: Path, name: str, data: bytes) -> bool:
    """Create ``directory/name`` holding ``data``, durably, never replacing an existing file.

    The content is fsynced before the name appears (a hard link from a temp file), so the name
    never points at partial bytes.  Returns False when the name already existed (nothing written).
    The caller must still fsync ``directory`` before relying on the name.
    """
    temp = write_temp(directory, name, data, sync=True)
    try:
        os.link(temp, directory / name)
    except FileExistsError:
        return False
    finally:
        temp.unlink(missing_ok=True)
    return True


def replace_file(directory: Path, name: str, data: bytes, *, sync: bool) -> None:
    """Atomically replace ``directory/name`` with ``data`` (temp file + rename).

    With ``sync`` the content is fsynced before the rename; the directory is not fsynced.
    """
    temp = write_temp(directory, name, data, sync=sync)
    try:
        os.replace(temp, directory / name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


@contextmanager
def names_in(directory: Path) -> Iterator[Callable[[str], bool]]:
    """Within the block, ``has(name)``: whether ``directory`` holds an entry ``name`` (a name,
    not a path), looked up relative to a descriptor of the directory opened once: a
    ``faccessat`` per name, without the full path's walk or a stat result to build, the lookup
    a caller that asks it of every upload in ``uploads/`` (a survey, start-up) repeats by the
    hundred thousand.  A directory that does not exist holds nothing; like ``os.path.exists``,
    ``has`` answers False where the lookup fails."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield lambda name: False
        return
    try:
        yield lambda name: os.access(name, os.F_OK, dir_fd=fd)
    finally:
        os.close(fd)


def orphaned_temps(directory: Path, now: float) -> Iterator[Path]:
    """Temp files in ``directory`` older than :data:`TEMP_ORPHAN_AGE` (left by a crash)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(TEMP_PREFIX):
                try:
                    if now - entry.stat().st_mtime > TEMP_ORPHAN_AGE:
                        yield Path(entry.path)
                except FileNotFoundError:
                    continue


class Locked(Exception):
    """Another writer (in this or another process) holds the lock."""


def lock_fd(fd: int) -> None:
    """Take an exclusive, non-blocking flock on ``fd``; raise :class:`Locked` when held elsewhere.

    flock locks belong to the open file description, so they exclude other descriptors in this
    process as well as other processes, and vanish when the holder dies.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise Locked() from None
        raise


def lock_held(path: Path) -> bool:
    """Whether a process holds the flock on ``path`` (a :class:`DataDirLock`); False when the
    file does not exist.  Nothing is written: when the lock is free it is taken and let go at
    once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        lock_fd(fd)
    except Locked:
        return True
    finally:
        os.close(fd)
    return False


@define(eq=False)
class DataDirLock:
    """An exclusive process lock on a data directory (``<data_dir>/<name>.lock``)."""

    path: Path
    _fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`Locked`; the lock lasts until :meth:`release` or exit."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            lock_fd(fd)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def fileno(self) -> int:
        """The locked descriptor (a process it is handed to keeps the lock while it lives)."""
        assert self._fd is not None, "not locked"
        return self._fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
