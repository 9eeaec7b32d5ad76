"""The worker-declared checksum: ``blake3:`` + 64 lowercase hex characters.

The value half (:class:`Checksum`, :func:`parse_checksum`) is pure.  :func:`blake3_file` is the one
blocking digest of a stored file; call it through a blocking runner, never on the reactor thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import blake3
from attrs import frozen

_BLAKE3 = re.compile(r"blake3:([0-9a-f]{64})")
# 4 MiB reads keep the hasher busy between syscalls without holding much memory; we read with
# readinto() into one buffer rather than update_mmap(), whose mapping counts towards RSS.
_READ_SIZE = 4 << 20


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
    path: Path, consumers: Iterable[Callable[[memoryview], object]], buffer_size: int,
    stop: threading.Event | None,
) -> int:  # fmt: skip
    """Feed the whole file at ``path`` to ``consumers`` in one sequential read; return the bytes
    read.  Raises :class:`HashCancelled` soon after ``stop`` is set, so a shutdown never waits
    for a 100 GiB hash."""
    view = memoryview(bytearray(buffer_size))
    total = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as stream:
            while n := stream.readinto(view):
                if stop is not None and stop.is_set():
                    raise HashCancelled()
                for consume in consumers:
                    consume(view[:n])
                total += n
    finally:
        os.close(fd)
    return total


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
