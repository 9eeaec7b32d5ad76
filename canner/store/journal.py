"""The facts journal: durable facts about many objects, one file (a segment) per batch.

A release of 1,000 receipts is one segment of 1,000 JSON lines, written once and fsynced once,
instead of 1,000 side files: on this kind of disk a file costs about as much to create and
later to delete (10,000 a second) as the whole rest of its record, and the ledger deletes what
the journal no longer needs one segment at a time.

Segments are named by a sequence number (``000000000042.jsonl``), one higher than the highest
on disk, and readers take, per object and kind, the **last** record in segment and line order.
That is the true one because each kind has one ordered writer: a release segment takes its
number while its writer holds ``delivery.sqlite``'s write lock (so numbers follow commit order
across processes), and is written before that transaction commits, so a crash in between leaves
a record nobody was told about, always before the one that was; delivery records come from the
one canner-deliver that holds ``deliver.lock``, appended in order, and a purge that a crash cut
short writes its record again.

Every line is ``{"kind": ..., "object_id": ..., ...}``; what a kind holds is its writer's
business (:mod:`canner.hq.releases`, :mod:`canner.delivery.purge`).  Releases come in batches and
write a segment each (:meth:`Journal.append`); delivery records come one purge at a time and
are appended to canner-deliver's open segment (:class:`JournalLog`).  Blocking; run it in a
thread.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import frozen
from twisted.logger import Logger

from canner import fs

_SEGMENT = re.compile(r"(\d{12})\.jsonl")
# The object id of a damaged line, where that much of it is still legible.
_OBJECT_ID = re.compile(rb'"object_id":\s*"([A-Za-z0-9._:-]{1,128})"')

log = Logger()


@frozen
class Damage:
    """A journal line that does not parse: where, why, and whose record it held (None when
    that is not legible either)."""

    path: Path
    line: int
    error: str
    object_id: str | None

    def describe(self) -> str:
        return f"{self.path}: line {self.line}: {self.error}"


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

    def new_names(self) -> Iterator[str]:
        """Names for the next segment, from one past the highest on disk upward: a writer takes
        the first it can create (it never replaces a segment, whoever wrote it)."""
        self.directory.mkdir(exist_ok=True)
        existing = self.segments()
        sequence = int(existing[-1][:12]) + 1 if existing else 1
        while True:
            yield f"{sequence:012d}.jsonl"
            sequence += 1

    def append(self, records: Sequence[Mapping[str, Any]]) -> str:
        """Write ``records`` as the next segment, durably (file and directory entry fsynced);
        returns its name.  The caller holds the index's write lock (see the module docstring)."""
        data = _lines(records)
        name = next(n for n in self.new_names() if fs.publish_once(self.directory, n, data))
        fs.fsync_dir(self.directory)
        return name

    def read(self, name: str) -> Iterator[dict[str, Any]]:
        """The records of one segment; a line that does not parse (a damaged disk) raises
        ``ValueError`` naming the segment and line."""
        for item in self.scan(name):
            if isinstance(item, Damage):
                raise ValueError(item.describe())
            yield item

    def scan(self, name: str) -> Iterator[dict[str, Any] | Damage]:
        """The records of one segment, and a :class:`Damage` for each line that does not parse
        (a damaged disk), in line order."""
        path = self.directory / name
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):
                    # The tail of an append that a crash cut short (or one still being
                    # written): its writer was never told it was durable.
                    return
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get("object_id"), str):
                        raise ValueError("not a record")
                except ValueError as e:
                    legible = _OBJECT_ID.search(line)
                    yield Damage(
                        path, number, str(e), legible[1].decode("ascii") if legible else None
                    )
                    continue
                yield record

    def remove_spent(self, spent: Callable[[str], bool], keep: Container[str] = ()) -> int:
        """Delete every segment all of whose objects are ``spent`` (their records archived in a
        verified ledger), except those in ``keep`` (a log's open segment); returns how many
        went."""
        removed = 0
        for name in self.segments():
            if name not in keep and all(spent(r["object_id"]) for r in self.read(name)):
                (self.directory / name).unlink(missing_ok=True)
                removed += 1
        if removed:
            fs.fsync_dir(self.directory)
        return removed


def _lines(records: Sequence[Mapping[str, Any]]) -> bytes:
    return b"".join(
        json.dumps(r, separators=(",", ":"), sort_keys=True).encode("utf-8") + b"\n"
        for r in records
    )


class JournalLog:
    """One process's open segment, appended to: a record costs one ``fdatasync``, no file.

    For facts written one at a time by a single writer (canner-deliver's delivery records,
    under its ``deliver.lock``).  A new segment is opened at the first append after a start, after
    :data:`ROTATE_AFTER` records, and after a failed write or sync (whose file's state is then
    unknown: it is never appended to again).  A crash mid-append leaves a torn last line, which
    readers skip.  Thread-safe; blocking.
    """

    ROTATE_AFTER = 10_000

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._name: str | None = None
        self._count = 0

    @property
    def open_segment(self) -> str | None:
        return self._name

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append ``records`` durably (written and fdatasynced before this returns)."""
        data = _lines(records)
        with self._lock:
            if self._fd is None or self._count >= self.ROTATE_AFTER:
                self._open()
            assert self._fd is not None
            try:
                fs.write_all(self._fd, data)
                os.fdatasync(self._fd)
            except OSError:
                self._close()
                raise
            self._count += len(records)

    def _open(self) -> None:
        self._close()
        directory = self.journal.directory
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        for name in self.journal.new_names():
            try:
                fd = os.open(directory / name, flags, 0o644)
                break
            except FileExistsError:
                continue
        try:
            fs.fsync_dir(directory)  # the name is durable before any record relies on it
        except OSError:
            os.close(fd)
            raise
        self._fd, self._name, self._count = fd, name, 0

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._name = None, None

    def close(self) -> None:
        with self._lock:
            self._close()

    def remove_spent(self, spent: Callable[[str], bool]) -> int:
        """:meth:`Journal.remove_spent`, never of the open segment, and with appends held off
        meanwhile (a segment opened during the pass could otherwise look empty, hence spent)."""
        with self._lock:
            keep = () if self._name is None else (self._name,)
            return self.journal.remove_spent(spent, keep)


class JournalLookup:
    """Every object's last record per kind, for a rescan that rebuilds index rows.

    Built at the first :meth:`get` (most rescans find nothing to rebuild and never read the
    journal), in a private temporary SQLite database (on disk, removed at :meth:`close`), so
    memory stays bounded whatever the journal's size.  A damaged line costs only its own
    record: it is logged, kept in :attr:`damage`, and :meth:`damage_of` names it for its object
    when its id is legible (that object's record may be missing or an older one).  Used by one
    thread at a time.
    """

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._db: sqlite3.Connection | None = None
        # The damaged lines of the last build, and the first of each legible object id.
        self.damage: list[Damage] = []
        self._damaged: dict[str, Damage] = {}

    def _build(self) -> sqlite3.Connection:
        db = sqlite3.connect("", check_same_thread=False)
        try:
            db.execute(
                "CREATE TABLE facts (object_id TEXT, kind TEXT, record TEXT,"
                " PRIMARY KEY (object_id, kind)) WITHOUT ROWID"
            )
            self.damage, self._damaged = [], {}
            for name in self._journal.segments():
                rows = []
                for r in self._journal.scan(name):
                    if isinstance(r, Damage):
                        self._damaged_line(r)
                        continue
                    rows.append((r["object_id"], str(r.get("kind")), json.dumps(r)))
                # Segment order, later lines win: an object's last record is the true one.
                db.executemany("INSERT OR REPLACE INTO facts VALUES (?, ?, ?)", rows)
            db.commit()
        except BaseException:
            db.close()
            raise
        return db

    def _damaged_line(self, damage: Damage) -> None:
        self.damage.append(damage)
        if damage.object_id is not None:
            self._damaged.setdefault(damage.object_id, damage)
        log.error(
            "damaged journal line {path}:{line} skipped ({error}); the record of {object_id}"
            " it held is lost",
            path=str(damage.path),
            line=damage.line,
            error=damage.error,
            object_id=damage.object_id,
        )

    def damage_of(self, object_id: str) -> Damage | None:
        """The first damaged line that held a record of ``object_id``, if any."""
        if self._db is None:
            self._db = self._build()
        return self._damaged.get(object_id)

    def get(self, object_id: str, kind: str) -> dict[str, Any] | None:
        """The last readable ``kind`` record of ``object_id``, or None (a damaged line is
        skipped: see :meth:`damage_of`)."""
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


# -- release records (written by HQ's releases, read by the rescan) --------------------------

RELEASE = "release"


def release_record(object_id: str, released_at: float, client: str) -> dict[str, Any]:
    """What the journal (:mod:`canner.store.journal`) holds for one release."""
    return {"kind": RELEASE, "object_id": object_id, "released_at": released_at, "client": client}


def released_at_of(record: dict[str, Any] | None) -> float | None:
    """``released_at`` of a journal record (None for no record); ``ValueError`` if malformed."""
    if record is None:
        return None
    value = record.get("released_at")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"release record of {record.get('object_id')}: released_at is not a number"
        )
    return float(value)
