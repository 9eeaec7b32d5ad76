"""The facts journal: durable facts about many objects, one file (a segment) per batch.

A release of 1,000 receipts is one segment of 1,000 JSON lines, written once and fsynced once,
instead of 1,000 side files: on this kind of disk a file costs about as much to create and
later to delete (10,000 a second) as the whole rest of its record, and the ledger deletes what
the journal no longer needs one segment at a time.

Segments are named by a sequence number (``000000000042.jsonl``), one higher than the highest
on disk.  A writer takes the number while it holds ``delivery.sqlite``'s write lock, so numbers
follow commit order across processes; a fact is written before the transaction that records it
in the index commits, so a crash in between leaves a record nobody was told about, always
before the one that was.  Readers therefore take, per object and kind, the **last** record in
segment order.

Every line is ``{"kind": ..., "object_id": ..., ...}``; what a kind holds is its writer's
business (:mod:`canner.releases`).  Blocking; run it in a thread.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import frozen

from canner import fs

_SEGMENT = re.compile(r"(\d{12})\.jsonl")


@frozen
class Journal:
    """``journal/`` in the data directory."""

    directory: Path

    def segments(self) -> list[str]:
        """Segment names in sequence order (none when the directory does not exist)."""
        try:
            names = [e.name for e in os.scandir(self.directory)]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if _SEGMENT.fullmatch(n))

    def append(self, records: Sequence[Mapping[str, Any]]) -> str:
        """Write ``records`` as the next segment, durably (file and directory entry fsynced);
        returns its name.  The caller holds the index's write lock (see the module docstring)."""
        self.directory.mkdir(exist_ok=True)
        data = b"".join(
            json.dumps(r, separators=(",", ":"), sort_keys=True).encode("utf-8") + b"\n"
            for r in records
        )
        existing = self.segments()
        sequence = int(existing[-1][:12]) + 1 if existing else 1
        while True:
            name = f"{sequence:012d}.jsonl"
            if fs.publish_once(self.directory, name, data):
                break
            sequence += 1  # never replace a segment, whoever wrote it
        fs.fsync_dir(self.directory)
        return name

    def read(self, name: str) -> Iterator[dict[str, Any]]:
        """The records of one segment; a line that does not parse (a damaged disk) raises
        ``ValueError`` naming the segment and line."""
        with open(self.directory / name, "rb") as f:
            for number, line in enumerate(f, start=1):
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get("object_id"), str):
                        raise ValueError("not a record")
                except ValueError as e:
                    raise ValueError(f"{self.directory / name}: line {number}: {e}") from None
                yield record

    def remove_spent(self, spent: Callable[[str], bool]) -> int:
        """Delete every segment all of whose objects are ``spent`` (their records archived in a
        verified ledger); returns how many went."""
        removed = 0
        for name in self.segments():
            if all(spent(r["object_id"]) for r in self.read(name)):
                (self.directory / name).unlink(missing_ok=True)
                removed += 1
        if removed:
            fs.fsync_dir(self.directory)
        return removed


class JournalLookup:
    """Every object's last record per kind, for a rescan that rebuilds index rows.

    Built at the first :meth:`get` (most rescans find nothing to rebuild and never read the
    journal), in a private temporary SQLite database (on disk, removed at :meth:`close`), so
    memory stays bounded whatever the journal's size.  Used by one thread at a time.
    """

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._db: sqlite3.Connection | None = None

    def _build(self) -> sqlite3.Connection:
        db = sqlite3.connect("", check_same_thread=False)
        try:
            db.execute(
                "CREATE TABLE facts (object_id TEXT, kind TEXT, record TEXT,"
                " PRIMARY KEY (object_id, kind)) WITHOUT ROWID"
            )
            for name in self._journal.segments():
                rows = [
                    (r["object_id"], str(r.get("kind")), json.dumps(r))
                    for r in self._journal.read(name)
                ]
                # Segment order, later lines win: an object's last record is the true one.
                db.executemany("INSERT OR REPLACE INTO facts VALUES (?, ?, ?)", rows)
            db.commit()
        except BaseException:
            db.close()
            raise
        return db

    def get(self, object_id: str, kind: str) -> dict[str, Any] | None:
        """The last ``kind`` record of ``object_id``, or None; ``ValueError`` when a segment
        is damaged."""
        if self._db is None:
            self._db = self._build()
        row = self._db.execute(
            "SELECT record FROM facts WHERE object_id = ? AND kind = ?", (object_id, kind)
        ).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
