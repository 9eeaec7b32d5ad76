"""The directory sink: a project's objects copied to storage of the operator's own (a NAS, a disk).

An object goes to ``<path>/<identifier>/<remote_name>`` (``path`` may hold ``{project}``; the
identifier and remote-name templates are the same as the IA sink's).  The copy is written to a
partial file beside its final name, fsynced, linked (or renamed) into place and the directory
fsynced, so the final name never shows partial bytes, even after a SIGKILL.  The copy goes in
chunks (``copy_file_range`` where the kernel can, else read and write through a buffer), so it
works across filesystems.  A file already at the final name is never overwritten: identical
content (size and BLAKE3) counts as delivered, anything else is flagged for an operator.
Verification re-reads the destination and compares its BLAKE3 with the receipt before the
payload may be purged.

Every copy and hash runs through the injected blocking runners, never on the reactor thread; a
copy that makes no progress for ``no_progress_timeout`` seconds fails the attempt (it is retried
with the usual backoff), and a cancelled copy stops at its next chunk and removes its partial file.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from attrs import define, field, frozen
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from canner import templates
from canner.blocking import BlockingRunner
from canner.checksum import Checksum, HashCancelled, blake3_file
from canner.config import (
    ConfigError,
    DeliveryContext,
    DeliveryTable,
    SinkTable,
    check_template,
    string_key,
)
from canner.fs import fsync_dir, write_all
from canner.observe import Destination
from canner.periodic import PeriodicService
from canner.sinks.base import Delivered, DeliveryFailed, RemoteCheck
from canner.sinks.plan import ItemPlan

log = Logger()

T = TypeVar("T")

# A copy in progress is "<final directory>/.canner-partial-<object_id>": never a final name,
# because check_directory_delivery refuses templates whose names could start with it.
PARTIAL_PREFIX = ".canner-partial-"
# Bytes per copy step: the stop flag and the progress counter are checked between steps.
COPY_CHUNK = 8 << 20
# The user-space buffer where copy_file_range is unavailable (1 MiB stays in the CPU caches).
BUFFER_SIZE = 1 << 20
# errnos for which os.link is not available on the destination filesystem (then: rename).
_NO_LINK = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS})
# errnos for which copy_file_range cannot copy between these two files (then: read and write).
_NO_COPY_RANGE = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}
)


class CopyStopped(Exception):
    """The copy was cancelled or timed out; its partial file is removed."""


# The fields a directory sink's ``path`` may hold.
PATH_FIELDS = ("project",)


def expand_path(template: str, project: str) -> Path:
    """``path`` with ``{project}`` expanded (a template :func:`check_directory_delivery` let
    through)."""
    return Path(templates.expand(template, {"project": project}))


NAME = "directory"


@frozen(kw_only=True)
class DirectoryDelivery(DeliveryTable):
    """``[projects.<id>.delivery]`` with ``sink = "directory"``: the destination root, an absolute
    path template that may hold ``{project}``."""

    path: str


def parse_directory_delivery(raw: Mapping[str, Any], where: DeliveryContext) -> DirectoryDelivery:
    # Relative to the config file's directory, like every other path; the sink checks at
    # start-up that the expanded directory exists.
    path = os.path.abspath(where.base_dir / string_key(raw, "path", where.name + ".path"))
    return DirectoryDelivery(**where.common, path=path)


def check_directory_delivery(delivery: DeliveryTable, where: DeliveryContext) -> None:
    """A directory table's templates never name a partial file and ``path`` holds only
    ``{project}``; megawarc packages are not copied to directories.  Raises :class:`ConfigError`
    naming the key.  (The registry checks every sink's templates against the plan's rules.)"""
    assert isinstance(delivery, DirectoryDelivery)
    if where.packaging.megawarc:
        raise ConfigError(
            f"projects.{where.project_id}.packaging.mode",
            'megawarc packages are delivered to sink = "internet_archive" only',
        )
    for key, template in (
        ("identifier", delivery.identifier),
        ("remote_name", delivery.remote_name),
    ):
        if any(part.startswith(PARTIAL_PREFIX) for part in template.split("/")):
            raise ConfigError(
                f"{where.name}.{key}", f"names must not start with {PARTIAL_PREFIX!r}"
            )
    check_template(delivery.path, PATH_FIELDS, f"{where.name}.path")


DIRECTORY_TABLE = SinkTable(
    name=NAME,
    keys=frozenset({"path"}),
    parse=parse_directory_delivery,
    check=check_directory_delivery,
)


def destination_root(project_id: str, delivery: DirectoryDelivery) -> Path:
    """The project's destination root, which must exist (blocking: stats it); a missing one is
    a :class:`ConfigError` naming ``path``."""
    root = expand_path(delivery.path, project_id)
    if not root.is_dir():
        raise ConfigError(
            f"projects.{project_id}.delivery.path", f"{root} does not exist or is not a directory"
        )
    return root


@frozen
class Placement:
    """Where one object goes in a destination root."""

    root: Path
    identifier: str
    remote_name: str
    object_id: str

    @property
    def final(self) -> Path:
        return self.root / self.identifier / self.remote_name

    @property
    def partial(self) -> Path:
        return self.final.parent / (PARTIAL_PREFIX + self.object_id)


@define
class Progress:
    """Bytes copied so far: written by the copying thread, read by the watchdog."""

    copied: int = 0


# --- blocking steps (run through the runners) ----------------------------------------------


def inspect_file(
    path: Path, root: Path, root_device: int, stop: threading.Event
) -> tuple[Checksum, int] | None:
    """BLAKE3 and size of the file at ``path``, or None when nothing is there (blocking).

    Raises ``IsADirectoryError`` when ``path`` is not a regular file, and ``OSError`` when ``root``
    is no longer on ``root_device`` (:func:`check_root`).
    """
    check_root(root, root_device)
    try:
        if not path.is_file():
            if path.exists():
                raise IsADirectoryError(errno.EISDIR, "not a regular file", str(path))
            return None
        return blake3_file(path, 1 << 20, stop)
    except FileNotFoundError:
        return None


def _make_dirs(root: Path, directory: Path) -> None:
    """Create ``directory`` below ``root`` with its missing parents, each new name fsynced in its
    parent.  ``root`` itself is never created: a missing root (an unmounted NAS) is an error."""
    missing = []
    current = directory
    while current != root and not current.is_dir():
        missing.append(current)
        current = current.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:
            pass
        fsync_dir(new.parent)


def check_root(root: Path, device: int) -> None:
    """Raise ``OSError`` unless ``root`` is a directory on filesystem ``device`` (blocking).

    A destination unmounted since start-up leaves an empty mount point on another filesystem;
    writing there would fill the wrong disk and vanish when the NAS comes back.
    """
    st = os.stat(root)
    if st.st_dev != device:
        raise OSError(
            errno.ENODEV,
            "the destination is not on the filesystem it was on at start-up (unmounted?)",
            str(root),
        )


def copy_into_place(
    source: Path,
    place: Placement,
    size: int,
    root_device: int,
    progress: Progress,
    stop: threading.Event,
) -> bool:
    """Copy ``source`` to ``place.final`` durably; False when the final name already existed.

    Writes ``place.partial`` (replacing a stale one from a killed attempt) chunk by chunk, fsyncs
    it, links it to the final name (or renames it where links are not supported) and fsyncs the
    directory.  On any failure, or once ``stop`` is set (:class:`CopyStopped`), the partial file
    is removed.  Raises ``OSError`` for I/O errors (``ENOSPC`` ...) and :class:`ValueError` when
    ``source`` is not ``size`` bytes; checks first that the root is still on ``root_device``.
    """
    check_root(place.root, root_device)
    _make_dirs(place.root, place.final.parent)
    place.partial.unlink(missing_ok=True)
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(place.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _copy_fd(src, dst, size, progress, stop)
                os.fsync(dst)
            finally:
                os.close(dst)
            if stop.is_set():
                raise CopyStopped()
            return _publish(place)
        except BaseException:
            place.partial.unlink(missing_ok=True)
            raise
    finally:
        os.close(src)


def _copy_fd(src: int, dst: int, size: int, progress: Progress, stop: threading.Event) -> None:
    """Copy ``src`` to ``dst`` from their current offsets until end of file, checking ``stop``
    between chunks; ``ValueError`` when that is not exactly ``size`` bytes."""
    copied = _copy_in_kernel(src, dst, size, progress, stop)
    if copied is None:
        copied = _copy_through_buffer(src, dst, size, progress, stop)
    if copied != size:
        raise ValueError(f"the local payload is {copied} bytes, its receipt says {size}")


def _copy_in_kernel(
    src: int, dst: int, size: int, progress: Progress, stop: threading.Event
) -> int | None:
    """``copy_file_range`` chunk by chunk (no copy through user space; a server-side copy on
    NFS); None when the kernel or the filesystems cannot, before anything was copied."""
    copied = 0
    while True:
        if stop.is_set():
            raise CopyStopped()
        try:
            n = os.copy_file_range(src, dst, COPY_CHUNK)
        except OSError as e:
            if copied == 0 and e.errno in _NO_COPY_RANGE:
                return None
            raise
        if n == 0:
            return copied
        copied += n
        progress.copied = copied
        if copied > size:
            return copied


def _copy_through_buffer(
    src: int, dst: int, size: int, progress: Progress, stop: threading.Event
) -> int:
    buffer = memoryview(bytearray(min(BUFFER_SIZE, max(size, 1))))
    copied = 0
    while True:
        if stop.is_set():
            raise CopyStopped()
        n = os.readv(src, [buffer])
        if n == 0:
            return copied
        write_all(dst, buffer[:n])
        copied += n
        progress.copied = copied
        if copied > size:
            return copied


def _publish(place: Placement) -> bool:
    try:
        os.link(place.partial, place.final)
    except FileExistsError:
        place.partial.unlink()
        return False
    except OSError as e:
        if e.errno not in _NO_LINK:
            raise
        # No hard links here (some NAS filesystems): the final name was absent a moment ago and
        # this process is the only canner writer (deliver.lock), so rename.
        if place.final.exists():
            place.partial.unlink()
            return False
        os.rename(place.partial, place.final)
    else:
        place.partial.unlink()
    fsync_dir(place.final.parent)
    return True


# --- the sink ------------------------------------------------------------------------------


@define(eq=False)
class DirectorySink:
    """One project's directory destination (a :class:`~canner.sinks.base.Sink`).

    ``run`` does the copying, ``hash`` the BLAKE3 re-reads; both keep I/O off the reactor thread.
    """

    destination: ClassVar[Destination] = Destination.DIRECTORY

    _delivery: DirectoryDelivery
    _root: Path
    _root_device: int
    _run: BlockingRunner
    _hash: BlockingRunner
    _clock: IReactorTime
    no_progress_timeout: float = 900.0

    @classmethod
    def for_delivery(
        cls,
        project_id: str,
        delivery: DirectoryDelivery,
        run: BlockingRunner,
        hash: BlockingRunner,
        clock: IReactorTime,
    ) -> DirectorySink:
        """A sink for one project's directory delivery; checks that its root exists (blocking).

        Remembers the filesystem ``path`` is on: copies refuse to go anywhere else later.
        """
        root = destination_root(project_id, delivery)
        return cls(delivery, root, os.stat(root).st_dev, run, hash, clock)

    def place(self, plan: ItemPlan) -> Placement:
        return Placement(self._root, plan.identifier, plan.remote_name, plan.object_id)

    def deliver(
        self,
        plan: ItemPlan,
        path: Path,
        report: Callable[[int], None],
        *,
        overwrite: bool = False,
    ) -> Deferred[Delivered]:
        """Copy the file into place; ``report(n)`` hears of copied bytes about once a second.
        ``overwrite`` changes nothing: a directory sink never replaces a file it finds there
        (a different one is flagged for an operator)."""
        return Deferred.fromCoroutine(self._deliver(plan, path, report))

    async def _deliver(
        self, plan: ItemPlan, path: Path, report: Callable[[int], None]
    ) -> Delivered:
        place = self.place(plan)
        delivered = Delivered(place.identifier, place.remote_name)
        if await self._already_there(plan, place):
            return delivered
        started = self._clock.seconds()
        progress = Progress()
        reported = _Reporter(progress, report)
        ticker = PeriodicService(
            clock=self._clock,
            interval=PROGRESS_INTERVAL,
            job=reported.tick,
            label="directory copy progress",
            now=False,
        )
        ticker.startService()
        try:
            placed = await self._watched(
                copy_into_place,
                progress,
                self._run,
                path,
                place,
                plan.size,
                self._root_device,
                progress,
            )
        except ValueError as e:
            raise DeliveryFailed(str(e), needs_operator=True) from None
        except FileNotFoundError as e:
            if Path(str(e.filename)) == path:
                raise DeliveryFailed("the local payload is missing", needs_operator=True) from None
            raise DeliveryFailed(f"copying to {place.final} failed: {e.strerror}") from None
        except OSError as e:
            raise DeliveryFailed(f"copying to {place.final} failed: {e.strerror or e}") from None
        finally:
            ticker.stopService()
            reported.tick()
        if not placed and not await self._already_there(plan, place):
            # Someone else wrote the name while this copy ran; it must not be overwritten.
            raise DeliveryFailed(f"{place.final} appeared during the copy", needs_operator=True)
        log.info(
            "copied {object_id} to {path}",
            object_id=plan.object_id,
            project=plan.project,
            path=str(place.final),
            size=plan.size,
            duration_s=self._clock.seconds() - started,
        )
        return delivered

    async def _already_there(self, plan: ItemPlan, place: Placement) -> bool:
        """True when the final name holds this object; DeliveryFailed when it holds another."""
        try:
            found = await self._watched(
                inspect_file, None, self._hash, place.final, self._root, self._root_device
            )
        except IsADirectoryError:
            raise DeliveryFailed(
                f"{place.final} exists and is not a regular file", needs_operator=True
            ) from None
        except OSError as e:
            raise DeliveryFailed(f"{place.final} is unreadable: {e.strerror or e}") from None
        if found is None:
            return False
        checksum, size = found
        if size == plan.size and str(checksum) == plan.checksum:
            log.info(
                "{object_id} is already at {path}; no copy needed",
                object_id=plan.object_id,
                path=str(place.final),
            )
            return True
        raise DeliveryFailed(
            f"a different file is already at {place.final} ({size} bytes, {checksum}); "
            "not overwriting it",
            needs_operator=True,
        )

    def verify(self, plan: ItemPlan, path: Path | None = None) -> Deferred[RemoteCheck]:
        """Re-read the whole copy: its BLAKE3 against the plan's (the receipt's); ``path`` is
        not needed."""
        return Deferred.fromCoroutine(self._verify(plan))

    async def _verify(self, plan: ItemPlan) -> RemoteCheck:
        final = self._root / plan.identifier / plan.remote_name
        try:
            found = await self._watched(
                inspect_file, None, self._hash, final, self._root, self._root_device
            )
        except OSError as e:
            return RemoteCheck(False, f"{final} is unreadable: {e.strerror or e}")
        if found is None:
            return RemoteCheck(False, f"{final} is missing", needs_operator=True, absent=True)
        checksum, size = found
        if size != plan.size or str(checksum) != plan.checksum:
            return RemoteCheck(
                False,
                f"{final} differs from its receipt: {size} bytes, {checksum}",
                needs_operator=True,
            )
        return RemoteCheck(True)

    def _watched(
        self,
        f: Callable[..., T],
        progress: Progress | None,
        runner: BlockingRunner,
        *args: Any,
    ) -> Deferred[T]:
        """Run ``f(*args, stop)`` through ``runner``.  Cancelling the result sets ``stop``; with
        ``progress``, no change of ``progress.copied`` for ``no_progress_timeout`` seconds sets it
        too and fails the result with :class:`DeliveryFailed` at once (a hung write cannot be
        interrupted, but it no longer holds up the attempt)."""
        stop = threading.Event()
        watch = _Watch(self._clock, stop, progress, self.no_progress_timeout)
        job = runner(f, *args, stop)
        return watch.follow(job)


# How often a running copy's progress is reported to the outbound service (attempts in flight).
PROGRESS_INTERVAL = 1.0


@define(eq=False)
class _Reporter:
    """Hands the growth of ``progress.copied`` (written by the copying thread) to ``report``."""

    _progress: Progress
    _report: Callable[[int], None]
    _sent: int = 0

    def tick(self) -> None:
        copied = self._progress.copied
        if copied > self._sent:
            self._report(copied - self._sent)
            self._sent = copied


@define(eq=False)
class _Watch:
    """The Deferred handed to the caller of one blocking job, with its stop flag and watchdog."""

    _clock: IReactorTime
    _stop: threading.Event
    _progress: Progress | None
    _timeout: float
    _outer: Deferred[Any] | None = None
    _timer: IDelayedCall | None = None
    _seen: int = field(default=-1)

    def follow(self, job: Deferred[T]) -> Deferred[T]:
        outer: Deferred[T] = Deferred(self._cancel)
        self._outer = outer
        if self._progress is not None:
            self._seen = self._progress.copied
            self._timer = self._clock.callLater(self._timeout, self._check)
        job.addBoth(self._done)
        return outer

    def _cancel(self, outer: Deferred[Any]) -> None:
        self._stop.set()
        self._disarm()

    def _disarm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _check(self) -> None:
        self._timer = None
        assert self._progress is not None and self._outer is not None
        if self._progress.copied != self._seen:
            self._seen = self._progress.copied
            self._timer = self._clock.callLater(self._timeout, self._check)
            return
        self._stop.set()
        self._outer.errback(DeliveryFailed(f"no copy progress for {self._timeout:g}s"))

    def _done(self, result: Any) -> None:
        self._disarm()
        assert self._outer is not None
        if not self._outer.called:
            if isinstance(result, Failure) and result.check(HashCancelled, CopyStopped):
                self._outer.errback(CancelledError())
            elif isinstance(result, Failure):
                self._outer.errback(result)
            else:
                self._outer.callback(result)
        elif isinstance(result, Failure) and not result.check(
            HashCancelled, CopyStopped, OSError, ValueError
        ):
            log.failure("a stopped sink job ended badly", result)
