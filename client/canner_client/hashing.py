"""BLAKE3 of a file: multithreaded, in bounded memory.

The file is hashed through read-only memory maps of ``WINDOW`` bytes, one at a time: blake3's
multithreaded ``update`` gets large contiguous input (what makes it fast) without copying, and
resident memory stays at about one window however large the file is.  Where a file cannot be
mapped (some filesystems), it is read into a reused buffer instead.
"""

from __future__ import annotations

import mmap
import os
from typing import Callable

import blake3

WINDOW = 32 * 1024 * 1024  # a multiple of mmap.ALLOCATIONGRANULARITY
_SMALL = 1024 * 1024  # below this, threads cost more than they save

Progress = Callable[[int], None]


def _new_hasher(size: int) -> blake3.blake3:
    threads = blake3.blake3.AUTO if size >= _SMALL else 1
    return blake3.blake3(max_threads=threads)


def blake3_file(path: str, progress: Progress | None = None) -> tuple[str, int]:
    """``("blake3:<hex>", size)`` of the file at ``path``; ``progress(bytes_done)`` per window."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hasher = _new_hasher(size)
        try:
            done = _hash_mapped(f.fileno(), size, hasher, progress)
        except (OSError, ValueError):
            f.seek(0)
            hasher = _new_hasher(size)
            done = _hash_read(f, hasher, progress)
    return "blake3:" + hasher.hexdigest(), done


def _hash_mapped(fd: int, size: int, hasher: blake3.blake3, progress: Progress | None) -> int:
    offset = 0
    while offset < size:
        length = min(WINDOW, size - offset)
        with mmap.mmap(fd, length, offset=offset, access=mmap.ACCESS_READ) as window:
            hasher.update(window)
        offset += length
        if progress is not None:
            progress(offset)
    return offset


def _hash_read(f: object, hasher: blake3.blake3, progress: Progress | None) -> int:
    buf = bytearray(WINDOW)
    view = memoryview(buf)
    done = 0
    readinto = f.readinto  # type: ignore[attr-defined]
    while True:
        n = readinto(buf)
        if not n:
            return done
        hasher.update(view[:n])
        done += n
        if progress is not None:
            progress(done)
