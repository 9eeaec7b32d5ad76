"""Numbers and ids as people read them: sizes, durations, shortened object ids.  Pure."""

from __future__ import annotations

import re

_ID = re.compile(r"(?<![0-9a-f])([0-9a-f]{8})[0-9a-f]{24}(?![0-9a-f])")


def shorten_ids(text: str) -> str:
    """``text`` with every 32-hex object id cut to its first 8 characters and an ellipsis."""
    return _ID.sub(r"\1…", text)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m {s % 60}s"
    if s < 172800:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"
