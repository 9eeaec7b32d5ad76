"""The worker-declared checksum: ``blake3:`` + 64 lowercase hex characters.

The value half (:class:`Checksum`, :func:`parse_checksum`) is pure.  The digests of stored files
(:func:`blake3_file`, :class:`TrailingHash` for a file still being written, and
:func:`delivery_digests`) block; call them through a blocking runner, never on the reactor thread.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import blake3
from attrs import define, field, frozen

_BLAKE3 = re.compile(r"blake3:([0-9a-f]{64})")
# 1 MiB reads keep the hasher busy between syscalls (a read costs microseconds, hashing the MiB
# a few hundred) while two hashes at once hold 4 MiB (with 4 MiB reads they held 16, a sixth of
# the receiver's peak RSS with 32 uploads at once, bench/README.md).  We read into
# buffers rather than hash through mmap (update_mmap): a mapping counts towards RSS, and a disk
# error under a mapping is a SIGBUS that kills the process instead of an EIO acceptance handles.
_READ_SIZE = 1 << 20
# A trailing hash reads back what was just written in pieces of this size, into a buffer each
# thread keeps (a fresh bytes object per read costs its allocation and page faults: some 40% of
# the read-back's CPU, bench/README.md).
_CATCH_UP_READ = 256 << 10
_catch_up_buffers = threading.local()


def _catch_up_buffer() -> memoryview:
    buffer: memoryview | None = getattr(_catch_up_buffers, "buffer", None)
    if buffer is None:
        buffer = _catch_up_buffers.buffer = memoryview(bytearray(_CATCH_UP_READ))
    return buffer


class HashCancelled(Exception):
    """Hashing stopped early because its stop event was set (process shutdown)."""


@frozen
class Checksum:
    """A BLAKE3 digest in its envelope form."""

    hex_digest: str

    def __str__(self) -> str:
        return f"blake3:{self.hex_digest}"


def parse_checksum(text: str) -> Checksum:
    """Parse ``blake3:<64 lowercase hex>``; raise ``ValueError`` for anything else."""
    match = _BLAKE3.fullmatch(text)
    if match is None:
        raise ValueError("checksum must be 'blake3:' followed by 64 lowercase hex characters")
    return Checksum(match.group(1))


def _read_through(
    path: Path,
    consumers: Iterable[Callable[[memoryview], object]],
    buffer_size: int,
    stop: threading.Event | None,
) -> int:
    """Feed the whole file at ``path`` to ``consumers`` in one sequential read; return the bytes
    read (see :func:`_read_from`)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_from(fd, 0, list(consumers), buffer_size, stop)
    finally:
        os.close(fd)


def _read_from(
    fd: int,
    start: int,
    consumers: list[Callable[[memoryview], object]],
    buffer_size: int,
    stop: threading.Event | None,
) -> int:
    """Feed the file open at ``fd``, from ``start`` to its end, to ``consumers``; return the
    bytes read.  Raises :class:`HashCancelled` soon after ``stop`` is set, so a shutdown never
    waits for a 100 GiB hash.  A read error is raised as the ``OSError`` it is (never a short
    count taken for the end of the file), and so is a file shorter than ``start``."""
    left = os.fstat(fd).st_size - start
    if left < 0:
        raise OSError(errno.EIO, f"the file is shorter than the {start} bytes read before")
    if left <= buffer_size:
        # Often nothing or a few bytes (the rest of a trailing hash): a buffer just that big.
        return _read_in_turn(fd, start, consumers, max(left, 1), stop)
    os.posix_fadvise(fd, start, 0, os.POSIX_FADV_SEQUENTIAL)
    return _read_ahead(fd, start, consumers, buffer_size, stop)


def _read_in_turn(
    fd: int,
    start: int,
    consumers: list[Callable[[memoryview], object]],
    buffer_size: int,
    stop: threading.Event | None,
) -> int:
    """Read, then consume, in the calling thread: for a single buffer's worth, where a second
    thread would cost more than it saves."""
    view = memoryview(bytearray(buffer_size))
    total = 0
    while n := os.preadv(fd, [view], start + total):
        if stop is not None and stop.is_set():
            raise HashCancelled()
        for consume in consumers:
            consume(view[:n])
        total += n
    return total


def _read_ahead(
    fd: int,
    start: int,
    consumers: list[Callable[[memoryview], object]],
    buffer_size: int,
    stop: threading.Event | None,
) -> int:
    """Read the next buffer in a helper thread while the calling thread consumes this one.

    Copying out of the page cache costs a third of hashing a file with BLAKE3; overlapping the
    two takes a 1 GiB hash from about 390 to 220 ms (``bench/README.md``).  Two buffers: the
    helper only ever fills one the consumer has handed back.  Both ``preadv`` and the hashers
    release the GIL.  The helper thread has ended when this returns or raises.
    """
    buffers = [memoryview(bytearray(buffer_size)) for _ in range(2)]
    empty: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    filled: queue.SimpleQueue[tuple[int, int] | OSError] = queue.SimpleQueue()

    def fill() -> None:
        position = start
        while (index := empty.get()) is not None:
            try:
                n = os.preadv(fd, [buffers[index]], position)
            except OSError as e:
                filled.put(e)
                return
            filled.put((index, n))
            if n == 0:
                return
            position += n

    reader = threading.Thread(target=fill, name="canner-read-ahead", daemon=True)
    empty.put(0)
    empty.put(1)
    reader.start()
    total = 0
    try:
        while True:
            item = filled.get()
            if isinstance(item, OSError):
                raise item
            index, n = item
            if n == 0:
                return total
            if stop is not None and stop.is_set():
                raise HashCancelled()
            for consume in consumers:
                consume(buffers[index][:n])
            total += n
            empty.put(index)
    finally:
        empty.put(None)  # the helper ends after the read it may be in
        reader.join()


@define
class TrailingHash:
    """BLAKE3 of a growing file from its first byte, read back from the file behind its writer.

    The bytes are hashed as the file returns them after they were written, never from the
    writer's buffers, so the digest is over the stored bytes, as a read of the whole file at
    acceptance would be; it only moves most of that read to while the upload streams, when
    the pages are fresh in the page cache.  Whoever truncates the file below :attr:`hashed`
    must start a new one.  Blocking; one thread at a time (the holder of the upload's lock).
    """

    _hasher: blake3.blake3 = field(factory=lambda: blake3.blake3(max_threads=1))
    hashed: int = 0

    def catch_up(self, fd: int, until: int, budget: int) -> None:
        """Hash the file's bytes from :attr:`hashed` towards ``until``, at most ``budget``."""
        end = min(until, self.hashed + budget)
        buffer = _catch_up_buffer()
        while self.hashed < end:
            n = os.preadv(fd, [buffer[: min(_CATCH_UP_READ, end - self.hashed)]], self.hashed)
            if not n:
                raise OSError(errno.EIO, f"the file ends at {self.hashed}, expected {end} bytes")
            self._hasher.update(buffer[:n])
            self.hashed += n

    def finish(self, fd: int, stop: threading.Event | None = None) -> tuple[Checksum, int]:
        """Hash the rest of the file; return the digest and the bytes hashed in all.

        Leaves this object as it was (the rest is hashed into a copy), so it can be finished
        again.  ``OSError`` (``EIO``) when the file is now shorter than what was hashed;
        :class:`HashCancelled` when ``stop`` is set.
        """
        hasher = self._hasher.copy()
        rest = _read_from(fd, self.hashed, [hasher.update], _READ_SIZE, stop)
        return Checksum(hasher.hexdigest()), self.hashed + rest


def stored_digests(
    fd: int, names: Iterable[str], stop: threading.Event | None = None
) -> tuple[Checksum, dict[str, str], int]:
    """BLAKE3 and the hashlib digests ``names`` (hex) of the file open at ``fd``, in one read
    from its first byte (blocking): ``(blake3, {name: hex}, bytes read)``."""
    hasher = blake3.blake3(max_threads=1)
    others = {name: hashlib.new(name, usedforsecurity=False) for name in names}
    consumers: list[Callable[[memoryview], object]] = [hasher.update]
    consumers += [h.update for h in others.values()]
    total = _read_from(fd, 0, consumers, _READ_SIZE, stop)
    hexes = {name: h.hexdigest() for name, h in others.items()}
    return Checksum(hasher.hexdigest()), hexes, total


def blake3_file(
    path: Path, expected_size: int, stop: threading.Event | None = None
) -> tuple[Checksum, int]:
    """Hash the whole file at ``path`` (blocking).  Returns the digest and the bytes hashed.

    Reading stops at end of file; the caller compares the count with the size it expects.
    ``expected_size`` only sizes the read buffer.  Raises :class:`HashCancelled` when ``stop``
    is set.
    """
    hasher = blake3.blake3(max_threads=1)
    total = _read_through(path, [hasher.update], min(_READ_SIZE, max(expected_size, 1)), stop)
    return Checksum(hasher.hexdigest()), total


def delivery_digests(path: Path, stop: threading.Event | None = None) -> tuple[Checksum, str, int]:
    """BLAKE3 and MD5 of ``path`` in one read (blocking): ``(blake3, md5 hex, bytes read)``.

    Delivery checks the BLAKE3 against the receipt before it sends anything, and sends the MD5
    as ``Content-MD5`` so IA verifies what it stored.
    """
    hasher, md5 = blake3.blake3(max_threads=1), hashlib.md5(usedforsecurity=False)
    total = _read_through(path, [hasher.update, md5.update], _READ_SIZE, stop)
    return Checksum(hasher.hexdigest()), md5.hexdigest(), total
