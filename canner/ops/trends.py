"""The last 24 hours, minute by minute, for the status page's trend charts.

Once a minute each daemon that holds a writer connection to ``delivery.sqlite`` records a sample
(table ``trends``): per project and for all projects together (project ``''``), the cumulative
bytes accepted and delivered, the backlog in bytes and objects, and the free bytes on the data
filesystem: from the totals the index keeps up to date (``object_totals``), so a sample costs
the same whatever the index holds.  Samples older than :data:`WINDOW` are deleted in the same
transaction, so the table stays at about 1440 rows per project and survives restarts.  Rates
per minute are differences of the cumulative columns (:func:`per_minute`, pure).  The SQL
lives in cursor functions.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path

from attrs import frozen

from canner import fs

WINDOW = 24 * 3600.0
SAMPLE_INTERVAL = 60.0
ALL = ""


@frozen
class TrendPoint:
    """One sample of one project (or of all, ``project == ''``)."""

    minute: int  # unix time // 60
    accepted_bytes: int
    delivered_bytes: int
    pending_bytes: int
    pending_objects: int
    free_bytes: int | None = None

    @property
    def time(self) -> float:
        return self.minute * 60.0


def sample_trends(cur: sqlite3.Cursor, free_bytes: int | None, now: float) -> int:
    """Record this minute's sample of every project and of all; drop samples past the window.

    Returns the number of rows written.  A second sample in the same minute replaces the first.
    """
    minute = int(now // 60)
    # The index keeps these totals up to date as rows change (schema v9's object_totals): a
    # sample reads one row per project, not every object.
    cur.execute(
        "SELECT project, accepted_bytes, delivered_bytes, pending_bytes, pending_objects"
        " FROM object_totals WHERE objects > 0 ORDER BY project"
    )
    rows: list[tuple[int, str, int, int, int, int, int | None]] = [
        (minute, p, a, d, pb, po, None) for p, a, d, pb, po in cur.fetchall()
    ]
    rows.append(
        (
            minute,
            ALL,
            sum(r[2] for r in rows),
            sum(r[3] for r in rows),
            sum(r[4] for r in rows),
            sum(r[5] for r in rows),
            free_bytes,
        )
    )
    cur.executemany(
        "INSERT OR REPLACE INTO trends (minute, project, accepted_bytes, delivered_bytes,"
        " pending_bytes, pending_objects, free_bytes) VALUES (?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
    cur.execute("DELETE FROM trends WHERE minute < ?", (int((now - WINDOW) // 60),))
    return len(rows)


def record_sample(cur: sqlite3.Cursor, data_dir: Path, now: float) -> int:
    """:func:`sample_trends` with the free bytes of ``data_dir`` (blocking; run in a thread)."""
    try:
        free: int | None = fs.free_bytes(data_dir)
    except OSError:
        free = None
    return sample_trends(cur, free, now)


def read_trends(cur: sqlite3.Cursor, now: float) -> dict[str, tuple[TrendPoint, ...]]:
    """The samples of the last :data:`WINDOW` by project, oldest first ({} before schema v2)."""
    try:
        cur.execute(
            "SELECT project, minute, accepted_bytes, delivered_bytes, pending_bytes,"
            " pending_objects, free_bytes FROM trends WHERE minute >= ? ORDER BY project, minute",
            (int((now - WINDOW) // 60),),
        )
    except sqlite3.OperationalError:
        return {}
    found: dict[str, list[TrendPoint]] = {}
    for project, *values in cur.fetchall():
        found.setdefault(project, []).append(TrendPoint(*values))
    return {p: tuple(points) for p, points in found.items()}


def per_minute(points: Iterable[TrendPoint], column: str) -> list[tuple[float, float]]:
    """The per-minute rate of a cumulative ``column`` between consecutive samples (>= 0: an
    index rebuilt smaller is not negative traffic)."""
    result = []
    previous: TrendPoint | None = None
    for point in points:
        if previous is not None and point.minute > previous.minute:
            gap = point.minute - previous.minute
            delta = getattr(point, column) - getattr(previous, column)
            result.append((point.time, max(0.0, delta / gap)))
        previous = point
    return result


def levels(points: Iterable[TrendPoint], column: str) -> list[tuple[float, float]]:
    """``column`` as it was at each sample (samples without a value are skipped)."""
    return [(p.time, float(v)) for p in points if (v := getattr(p, column)) is not None]


def projects(trends: Mapping[str, tuple[TrendPoint, ...]]) -> list[str]:
    return sorted(p for p in trends if p != ALL)
