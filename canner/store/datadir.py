"""Start-up checks of the data directory, before any service is built.

Each daemon refuses to start, in one line naming the path, its user and the fix
(:class:`CannotStart`), when it cannot write what it writes in the data directory, and when
another process of its kind owns the directory (:class:`DeliverLocked`, :class:`ReceiverLocked`:
``deliver.lock`` and ``receiver.lock``, each holding its owner's pid).  The daemons run these in
``makeService`` (:mod:`canner.daemon.startup` adds deliver's own), so a refusal aborts the
launch before anything listens; ``canner check-config`` runs the same write check.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
from collections.abc import Callable, Iterable
from pathlib import Path

from canner import fs
from canner.config import Config, check_data_dir
from canner.fs import DataDirLock, Locked
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore


class CannotStart(Exception):
    """Start-up is refused for a reason the operator must fix; ``str()`` is the one line that
    says what and how."""


# What each daemon writes directly in its data directory (which is always checked, first);
# files inside these directories are theirs too.
_BOTH_WRITE = (
    "uploads",
    "receipts",
    "journal",
    "delivery.sqlite",
    "delivery.sqlite-wal",
    "delivery.sqlite-shm",
)
RECEIVER_WRITES = (*_BOTH_WRITE, "receiver.lock")
DELIVER_WRITES = (*_BOTH_WRITE, "ledger", "deliver.lock")


def process_user() -> tuple[str, str]:
    """The user and group names this process runs as (numbers when they have no name)."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return user, group


def unwritable(path: Path, tree: Path, error: OSError) -> CannotStart:
    """The one-line refusal for ``path`` (in ``tree``, which the fix names) that this process
    cannot write: the path, the user, the error and the fix."""
    user, group = process_user()
    if error.errno in (errno.EACCES, errno.EPERM):
        fix = f"fix the ownership: chown -R {user}:{group} {tree}"
    elif error.errno == errno.EROFS:
        fix = "mount it read-write (under systemd: list data_dir in ReadWritePaths=)"
    else:
        fix = "check the disk under it (dmesg)"
    reason = error.strerror or str(error)
    return CannotStart(f"cannot write {path} as user {user}: {reason}; {fix}")


def check_writes(config: Config, writes: Iterable[str]) -> Path:
    """The data directory, once it exists (:class:`ConfigError` otherwise) and this process
    could write it and every path in ``writes`` (:class:`CannotStart` naming the first it could
    not; a missing path passes: it is created in a directory checked first).  Creates nothing:
    ``canner check-config`` runs it too, as the daemons' user."""
    data_dir = check_data_dir(config)
    path = data_dir
    try:
        fs.check_writable(data_dir)
        for name in writes:
            path = data_dir / name
            fs.check_writable(path)
    except OSError as e:
        raise unwritable(path, data_dir, e) from None
    return data_dir


def prepare_data_dir(config: Config, writes: Iterable[str]) -> tuple[UploadStore, ReceiptStore]:
    """``uploads/`` and ``receipts/`` in the existing data directory, once :func:`check_writes`
    passed for ``writes`` (which name them)."""
    data_dir = check_writes(config, writes)
    path = data_dir
    try:
        for sub in ("uploads", "receipts"):
            path = data_dir / sub
            path.mkdir(exist_ok=True)
            # A crash between linking a receipt and fsyncing its directory leaves a name that a
            # power cut could still erase: make every name durable before anything serves it.
            fs.fsync_dir(path)
    except OSError as e:
        raise unwritable(path, data_dir, e) from None
    return UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")


class DeliverLocked(CannotStart):
    """Another canner-deliver owns this data directory."""


class ReceiverLocked(CannotStart):
    """Another canner-receiver serves this data directory."""


def _holder(lock: DataDirLock) -> str:
    """``pid N`` of the process holding ``lock`` (as its file says), for a refusal."""
    try:
        text = lock.path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        text = ""
    # Empty for the moment between its holder's flock and the write of its pid.
    return f"pid {text}" if text.isdigit() else "pid unknown"


def _take(config: Config, name: str, refused: Callable[[str], CannotStart]) -> DataDirLock:
    lock = DataDirLock(config.data_dir / name)
    try:
        lock.acquire()
    except Locked:
        raise refused(_holder(lock)) from None
    except OSError as e:
        raise unwritable(lock.path, config.data_dir, e) from None
    return lock


def lock_data_dir(config: Config) -> DataDirLock:
    """Take ``deliver.lock`` in the data directory, held until released or the process exits:
    :class:`DeliverLocked` (naming the holder's pid) when another process holds it,
    :class:`CannotStart` when it cannot be written."""
    return _take(
        config,
        "deliver.lock",
        lambda holder: DeliverLocked(
            f"another canner-deliver already owns {config.data_dir} ({holder}, see deliver.lock)"
        ),
    )


def lock_receiver_dir(config: Config) -> DataDirLock:
    """Take ``receiver.lock`` in the data directory, held until released or the process exits:
    :class:`ReceiverLocked` (naming the holder's pid) when another receiver holds it,
    :class:`CannotStart` when it cannot be written.  One receiver per data directory: one
    sweep, one account of promised space, one origin memory, and a start that may remove what
    a stop left of whole-file uploads because nobody else writes them."""
    return _take(
        config,
        "receiver.lock",
        lambda holder: ReceiverLocked(
            f"another canner-receiver already serves {config.data_dir}"
            f" ({holder}, see receiver.lock): stop it first, or give this one its own data_dir"
        ),
    )
