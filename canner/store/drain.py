"""Draining a node: a durable marker in the data directory that stops new uploads.

``canner drain`` writes ``<data_dir>/draining.json`` (fsynced, then the directory) and
``canner undrain`` removes it.  While it exists the receiver refuses every creation
(``POST /files/``) with ``503`` and ``Retry-After`` and ``GET /readyz`` fails naming it, so a
load balancer sends new uploads to other nodes; PATCHes of uploads in progress, ``HEAD``,
receipt lookups and deliveries go on.  The marker lives on the node's own volume, so it
survives restarts of both daemons and of the machine.  A drained node can be retired once
:func:`retirement` finds nothing left on it that is not delivered.

Everything here that touches the disk blocks: daemons call it through their blocking runner.
"""

from __future__ import annotations

import json
import os
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

from attrs import frozen

from canner import fs

MARKER_NAME = "draining.json"
# What a refused creation tells clients; the load balancer stops sending them here long before.
RETRY_AFTER = 60


@frozen
class DrainMark:
    """Why and since when a node is draining (``since`` is Unix time; None when unreadable)."""

    since: float | None
    reason: str

    def describe(self) -> str:
        """One line for /readyz, a refused creation and ``canner status``."""
        when = (
            datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            if self.since is not None
            else "an unknown time"
        )
        text = f"node draining since {when}"
        return f"{text}: {self.reason}" if self.reason else text

    def as_dict(self) -> dict[str, object]:
        return {"since": self.since, "reason": self.reason}


def marker_path(data_dir: Path) -> Path:
    return data_dir / MARKER_NAME


def read_drain(data_dir: Path) -> DrainMark | None:
    """The node's drain marker, None when it is not draining.

    A marker that exists but cannot be parsed still drains the node (fail closed): the
    operator asked for draining, and only ``canner undrain`` undoes it.
    """
    try:
        raw = marker_path(data_dir).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return DrainMark(None, f"marker {MARKER_NAME} unreadable: {e.strerror or e}")
    try:
        doc = json.loads(raw)
        since = doc.get("since")
        return DrainMark(
            float(since) if isinstance(since, int | float) else None, str(doc.get("reason", ""))
        )
    except (ValueError, AttributeError):
        return DrainMark(None, f"unreadable marker {MARKER_NAME}")


def start_draining(data_dir: Path, now: float, reason: str = "") -> tuple[DrainMark, bool]:
    """Write the marker durably (file, then directory fsynced); returns it and whether it is new.

    An existing marker is kept as it is (its ``since`` stays the first drain's)."""
    existing = read_drain(data_dir)
    if existing is not None:
        return existing, False
    mark = DrainMark(now, reason)
    fs.replace_file(data_dir, MARKER_NAME, json.dumps(mark.as_dict()).encode() + b"\n", sync=True)
    fs.fsync_dir(data_dir)
    return mark, True


def stop_draining(data_dir: Path) -> bool:
    """Remove the marker durably; returns False when the node was not draining."""
    try:
        os.unlink(marker_path(data_dir))
    except FileNotFoundError:
        return False
    fs.fsync_dir(data_dir)
    return True


@frozen
class Retirement:
    """Whether a draining node holds nothing that still needs it, and what it still holds."""

    retirable: bool
    remaining: tuple[str, ...]

    def describe(self) -> str:
        """One line for the verdict of a drained node (``canner status``, the status page)."""
        if self.retirable:
            return "retirable: nothing here is undelivered"
        return "not retirable yet: " + "; ".join(self.remaining)

    def as_dict(self) -> dict[str, object]:
        return {"retirable": self.retirable, "remaining": list(self.remaining)}


def count_unsettled(cur: sqlite3.Cursor) -> int:
    """Objects in the delivery index not yet delivered and verified at their destination."""
    cur.execute(
        "SELECT count(*) FROM outbound WHERE kind = 'object'"
        " AND (state != 'delivered' OR verified_at IS NULL)"
    )
    return int(cur.fetchone()[0])


def count_unindexed(cur: sqlite3.Cursor, receipt_ids: list[str]) -> int:
    """How many of ``receipt_ids`` (the receipts on disk) have no row in the index yet."""
    missing = 0
    for start in range(0, len(receipt_ids), 500):
        batch = receipt_ids[start : start + 500]
        marks = ",".join("?" * len(batch))
        cur.execute(f"SELECT count(*) FROM objects WHERE object_id IN ({marks})", batch)
        missing += len(batch) - int(cur.fetchone()[0])
    return missing


def retirement(active_uploads: int, undelivered: int | None, unindexed: int | None) -> Retirement:
    """Pure: a drained node is retirable once no upload is in progress, every receipt is in the
    delivery index and every indexed object is delivered and verified (None: the index could
    not be read)."""
    remaining = []
    if active_uploads:
        remaining.append(
            f"{active_uploads} uploads in progress (abandoned ones are swept after"
            " partial_upload_retention)"
        )
    if undelivered is None or unindexed is None:
        remaining.append("the delivery index cannot be read")
    else:
        if unindexed:
            remaining.append(
                f"{unindexed} receipts not yet in the delivery index (canner-deliver's rescan"
                " adds them)"
            )
        if undelivered:
            remaining.append(f"{undelivered} objects not yet delivered and verified")
    return Retirement(not remaining, tuple(remaining))
