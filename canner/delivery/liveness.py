"""Is canner-deliver moving?  Its heartbeat and the attempts it has in flight.

:class:`InFlight` tracks each running attempt in memory (phase, bytes handed to the transport,
when it started); the sink reports bytes as they stream.  :class:`HeartbeatService` writes a
snapshot of it into ``delivery.sqlite`` (table ``deliver_heartbeat``, one row) every
:data:`HEARTBEAT_INTERVAL` seconds and marks the row stopped on a clean shutdown, so the
receiver's status page, its ``/metrics`` and ``canner status`` can tell "deliver is running",
"deliver stopped" and "deliver's heartbeat is stale" apart without talking to it.  The SQL lives
in cursor functions; :func:`judge` is pure.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from attrs import define, evolve, field, frozen
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner.delivery.index import Index
from canner.periodic import PeriodicService
from canner.version import version

log = Logger()

HEARTBEAT_INTERVAL = 5.0
# A heartbeat older than this means deliver is wedged or gone without a clean stop.
STALE_AFTER = 30.0

CHECKING = "checking"  # hashing the local payload against its receipt
UPLOADING = "uploading"


@frozen
class AttemptSnapshot:
    """One attempt in flight, as of ``now``."""

    object_id: str
    project: str
    filename: str | None
    size: int
    attempt: int
    phase: str
    sent: int
    started_at: float
    upload_started_at: float | None
    rate: float | None  # bytes per second over the last RATE_WINDOW seconds
    eta_s: float | None
    stalled_s: float | None = None  # seconds without a byte sent (None: bytes are moving)
    # A file sent in parts (IA multipart): parts at the destination, of how many, and the
    # bytes there (parts finished before this attempt included).  None: one PUT.
    parts_done: int | None = None
    parts: int | None = None
    done: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "object_id": self.object_id,
            "project": self.project,
            "filename": self.filename,
            "size": self.size,
            "attempt": self.attempt,
            "phase": self.phase,
            "sent": self.sent,
            "started_at": self.started_at,
            "upload_started_at": self.upload_started_at,
            "rate": self.rate,
            "eta_s": self.eta_s,
            "stalled_s": self.stalled_s,
            "parts_done": self.parts_done,
            "parts": self.parts,
            "done": self.done,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> AttemptSnapshot:
        values: dict[str, Any] = {name: doc.get(name) for name in _PROGRESS_FIELDS}
        return cls(**values)


_PROGRESS_FIELDS = (
    "object_id",
    "project",
    "filename",
    "size",
    "attempt",
    "phase",
    "sent",
    "started_at",
    "upload_started_at",
    "rate",
    "eta_s",
    "stalled_s",
    "parts_done",
    "parts",
    "done",
)


# The rate shown is measured over about this many seconds, so a stall shows as one.
RATE_WINDOW = 30.0
# No byte sent for this long: the attempt is shown as stalled.
STALL_AFTER = 10.0


def rate_and_eta(
    size: int, sent: int, since: tuple[float, int] | None, now: float
) -> tuple[float | None, float | None]:
    """Bytes/s from ``since`` (an earlier ``(time, sent)``) to now, and the seconds left at that
    rate (None: unknown, or nothing moves)."""
    if since is None:
        return None, None
    elapsed = now - since[0]
    moved = sent - since[1]
    if elapsed <= 0.5:
        return None, None
    rate = max(0.0, moved / elapsed)
    return rate, (max(0.0, size - sent) / rate if rate > 0 else None)


@frozen
class Attempt:
    """What the in-flight list shows of one attempt: the file (an object, or a package file
    under its package id) and which attempt it is."""

    key: str
    project: str
    filename: str | None
    size: int
    attempt: int


@define(eq=False)
class _Running:
    attempt: Attempt
    started_at: float
    phase: str = CHECKING
    sent: int = 0
    upload_started_at: float | None = None
    last_sent_at: float | None = None
    # A file sent in parts: bytes at the destination before this attempt sent any, parts done.
    resumed: int = 0
    parts_done: int | None = None
    parts: int | None = None
    # (time, sent) seen by recent snapshots, oldest first, for the rate over RATE_WINDOW
    marks: list[tuple[float, int]] = field(factory=list)

    def since(self, now: float) -> tuple[float, int] | None:
        """The oldest mark within the rate window (the upload's start while it is younger)."""
        if self.upload_started_at is None:
            return None
        self.marks.append((now, self.sent))
        while len(self.marks) > 1 and self.marks[1][0] <= now - RATE_WINDOW:
            self.marks.pop(0)
        first = self.marks[0]
        if first[0] > self.upload_started_at + 0.5 and now - first[0] < RATE_WINDOW / 2:
            return (self.upload_started_at, 0)
        return first


@define(eq=False)
class InFlight:
    """The attempts running in this process, and every payload byte they have sent.

    Everything runs on the reactor thread.  (The metrics hear of sent bytes from the pipelines'
    observer, :func:`canner.observe.counting_sent`.)
    """

    _clock: IReactorTime
    total_sent: int = 0
    _running: dict[str, _Running] = field(factory=dict)

    def begin(self, attempt: Attempt) -> None:
        self._running[attempt.key] = _Running(attempt, self._clock.seconds())

    @contextmanager
    def running(self, attempt: Attempt) -> Iterator[None]:
        """``attempt`` is listed while the block runs (an ``await`` inside included)."""
        self.begin(attempt)
        try:
            yield
        finally:
            self.end(attempt.key)

    def uploading(self, object_id: str) -> Callable[[int], None]:
        """Mark the attempt uploading; returns the callback the sink reports bytes to (and, for
        a file sent in parts, parts: :class:`~canner.sinks.base.PartsProgress`)."""
        running = self._running.get(object_id)
        if running is not None:
            running.phase = UPLOADING
        return _Sent(self, object_id)

    def _sent(self, object_id: str, n: int) -> None:
        self.total_sent += n
        current = self._running.get(object_id)
        if current is None:
            return
        now = self._clock.seconds()
        if current.upload_started_at is None:
            current.upload_started_at = now
        current.sent += n
        current.last_sent_at = now

    def _parts(self, object_id: str, done: int, total: int, done_bytes: int) -> None:
        current = self._running.get(object_id)
        if current is None:
            return
        current.parts_done, current.parts = done, total
        # Bytes at the destination that this attempt did not send (resumed parts); a part
        # sent twice does not lower it.
        current.resumed = max(current.resumed, done_bytes - current.sent)

    def end(self, object_id: str) -> None:
        self._running.pop(object_id, None)

    def snapshot(self) -> list[AttemptSnapshot]:
        now = self._clock.seconds()
        found = []
        for r in sorted(self._running.values(), key=lambda r: (r.started_at, r.attempt.key)):
            a = r.attempt
            rate, eta = rate_and_eta(a.size - r.resumed, r.sent, r.since(now), now)
            quiet = None
            if r.phase == UPLOADING:
                last = r.last_sent_at or r.upload_started_at or r.started_at
                quiet = now - last if now - last >= STALL_AFTER else None
            found.append(
                AttemptSnapshot(
                    a.key,
                    a.project,
                    a.filename,
                    a.size,
                    a.attempt,
                    r.phase,
                    r.sent,
                    r.started_at,
                    r.upload_started_at,
                    rate,
                    eta,
                    quiet,
                    r.parts_done,
                    r.parts,
                    None if r.parts is None else min(a.size, r.resumed + r.sent),
                )
            )
        return found

    @property
    def bytes_in_flight(self) -> int:
        return sum(r.sent for r in self._running.values())


@frozen
class _Sent:
    """The progress callback of one attempt: bytes as they go, parts as they finish."""

    _in_flight: InFlight
    _key: str

    def __call__(self, n: int) -> None:
        self._in_flight._sent(self._key, n)

    def parts(self, done: int, total: int, done_bytes: int) -> None:
        self._in_flight._parts(self._key, done, total, done_bytes)


# -- the heartbeat row ---------------------------------------------------------------------------


@frozen
class Heartbeat:
    """The ``deliver_heartbeat`` row."""

    pid: int
    version: str
    started_at: float
    beat_at: float
    stopped_at: float | None
    in_flight: tuple[AttemptSnapshot, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "version": self.version,
            "started_at": self.started_at,
            "beat_at": self.beat_at,
            "stopped_at": self.stopped_at,
            "in_flight": [p.as_dict() for p in self.in_flight],
        }


def write_heartbeat(cur: sqlite3.Cursor, beat: Heartbeat) -> None:
    cur.execute(
        "INSERT OR REPLACE INTO deliver_heartbeat"
        " (id, pid, version, started_at, beat_at, stopped_at, in_flight)"
        " VALUES (1, ?, ?, ?, ?, ?, ?)",
        (
            beat.pid,
            beat.version,
            beat.started_at,
            beat.beat_at,
            beat.stopped_at,
            json.dumps([p.as_dict() for p in beat.in_flight]),
        ),
    )


def read_heartbeat(cur: sqlite3.Cursor) -> Heartbeat | None:
    """The last heartbeat; None when deliver never ran on this index (or it predates v2)."""
    try:
        cur.execute(
            "SELECT pid, version, started_at, beat_at, stopped_at, in_flight"
            " FROM deliver_heartbeat WHERE id = 1"
        )
    except sqlite3.OperationalError:
        return None
    row = cur.fetchone()
    if row is None:
        return None
    pid, ver, started, beat, stopped, in_flight = row
    try:
        progress = tuple(AttemptSnapshot.from_dict(d) for d in json.loads(in_flight))
    except (ValueError, TypeError):
        progress = ()
    return Heartbeat(pid, ver, started, beat, stopped, progress)


def index_answers(cur: sqlite3.Cursor) -> None:
    """Query the heartbeat table; raises when the index cannot answer (canner-deliver is ready
    once its own connection does)."""
    cur.execute("SELECT count(*) FROM deliver_heartbeat")
    cur.fetchone()


# -- what the heartbeat means (pure) -------------------------------------------------------------

RUNNING = "running"
STALE = "stale"
STOPPED = "stopped"
NEVER = "never started"
# deliver.lock is held, but the heartbeat says stopped (or was never written)
CHANGING = "starting or stopping"


@frozen
class Liveness:
    state: str  # RUNNING, STALE, STOPPED or NEVER
    age_s: float | None  # seconds since the last beat
    text: str

    @property
    def ok(self) -> bool:
        return self.state == RUNNING


def judge(
    beat: Heartbeat | None,
    now: float,
    stale_after: float = STALE_AFTER,
    lock_held: bool | None = None,
) -> Liveness:
    """What an operator should read from ``beat`` at ``now``.

    ``lock_held``: whether a process holds ``deliver.lock`` (None: not looked).  A heartbeat
    marked stopped, or none at all, while the lock is held is a deliver starting or stopping:
    never "stopped cleanly"."""
    age = None if beat is None else max(0.0, now - beat.beat_at)
    if lock_held and (beat is None or beat.stopped_at is not None):
        return Liveness(
            CHANGING,
            age,
            "canner-deliver holds deliver.lock but its heartbeat does not run: it is starting"
            " or stopping",
        )
    if beat is None:
        return Liveness(NEVER, None, "canner-deliver has never run on this data directory")
    age = max(0.0, now - beat.beat_at)
    if beat.stopped_at is not None:
        return Liveness(STOPPED, age, "canner-deliver is not running (stopped cleanly)")
    if age > stale_after:
        return Liveness(
            STALE,
            age,
            f"canner-deliver is not running or wedged: its heartbeat is {age:.0f}s old",
        )
    return Liveness(RUNNING, age, "canner-deliver is running")


# -- the service ---------------------------------------------------------------------------------


@define(eq=False)
class HeartbeatService(Service):
    """Writes the heartbeat every ``interval`` seconds; a clean stop marks it stopped.

    Stop it only once every other service of the process has stopped (canner-deliver's root
    does), while the index is still open: "stopped" must never show while deliver still works.
    """

    _index: Index
    _in_flight: InFlight
    _clock: IReactorTime
    _interval: float = HEARTBEAT_INTERVAL
    _pid: int = field(factory=os.getpid)
    _started_at: float = 0.0
    _beats: PeriodicService = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._beats = PeriodicService(
            clock=self._clock, interval=self._interval, job=self._beat, label="deliver heartbeat"
        )

    def startService(self) -> None:
        super().startService()
        self._started_at = self._clock.seconds()
        self._beats.startService()

    def _heartbeat(self, stopped: bool = False) -> Heartbeat:
        now = self._clock.seconds()
        return Heartbeat(
            self._pid,
            version(),
            self._started_at,
            now,
            now if stopped else None,
            tuple(self._in_flight.snapshot()),
        )

    def _beat(self) -> Deferred[None]:
        d: Deferred[None] = self._index.run(write_heartbeat, self._heartbeat())
        return d.addErrback(lambda f: log.failure("writing the deliver heartbeat", f))

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        # After the beat in progress: a late beat must not overwrite "stopped".
        await self._beats.stopService()
        last = evolve(self._heartbeat(stopped=True), in_flight=())
        try:
            await self._index.run(write_heartbeat, last)
        except Exception:
            log.failure("writing the deliver heartbeat")
