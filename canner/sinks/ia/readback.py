"""The read-back before a purge: a few random byte ranges of the delivered file, fetched from the
destination and compared with the local payload.

IA's metadata API says what IA believes it stores (size, MD5); the read-back checks what it
actually serves, so a purge never trusts the metadata alone.  Which ranges to fetch and how to
read a ``Content-Range`` are pure; :func:`read_local` reads the payload's bytes (blocking, run
it in a thread).  The HTTP side lives in :mod:`canner.sinks.ia.attempt`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from attrs import frozen

# How many ranges ``readback_bytes`` is spread over.
READBACK_RANGES = 3

Range = tuple[int, int]  # first and last byte offset, inclusive (as in HTTP)

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@frozen
class ReadBack:
    """What a read-back came to.

    ``ok``: every range equals the local payload (or there was nothing to compare).
    ``mismatch``: the destination served other bytes (or a different size): flag, keep the
    payload.  Otherwise a failure: ``needs_operator`` when retrying will not help (403),
    else transient (retried like any follow-up).
    """

    ok: bool
    detail: str = ""
    mismatch: bool = False
    needs_operator: bool = False


def choose_ranges(
    size: int, budget: int, random: Callable[[], float], count: int = READBACK_RANGES
) -> list[Range]:
    """Up to ``count`` ranges of ``budget // count`` bytes at random offsets of a ``size``-byte
    file, in offset order; the whole file when it fits in ``budget``; none when ``budget`` is 0.
    ``random()`` returns a float in [0, 1)."""
    if budget <= 0 or size <= 0:
        return []
    if size <= budget:
        return [(0, size - 1)]
    span = max(budget // count, 1)
    ranges = set()
    for _ in range(count):
        first = min(int(random() * (size - span + 1)), size - span)
        ranges.add((first, first + span - 1))
    return sorted(ranges)


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes FIRST-LAST/SIZE`` as numbers (SIZE None for ``*``); None when malformed."""
    if value is None:
        return None
    match = _CONTENT_RANGE.fullmatch(value.strip())
    if match is None:
        return None
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), int(match.group(2)), total


def read_local(path: Path, ranges: list[Range]) -> list[bytes]:
    """The payload's bytes at ``ranges`` (blocking).  Raises ``OSError`` (FileNotFoundError when
    the payload is gone)."""
    out = []
    with open(path, "rb") as f:
        for first, last in ranges:
            f.seek(first)
            out.append(f.read(last - first + 1))
    return out


def describe(ranges: list[Range]) -> str:
    return ", ".join(f"{first}-{last}" for first, last in ranges)
