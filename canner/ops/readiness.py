"""Is this receiver fit to take uploads?  ``GET /readyz`` and the free-space floor watch.

``/healthz`` says the process answers; :func:`check_readiness` says whether uploads would be
accepted now: the node not draining (``canner drain``), free space at or above
``min_free_bytes`` (and known) and not all promised to uploads in flight
(:mod:`canner.store.promises`), the data directory's ``uploads/`` and ``receipts/`` writable,
and, on a node whose workers serve the socket, every worker listening (:func:`with_workers`).  An
unreadable ``delivery.sqlite`` is not among them: the receiver still accepts and receipts
uploads (receipts are the commit point, the index is rebuilt from them), so it is the status
verdict's and ``canner_index_readable``'s to report.  A load balancer that
polls ``/readyz`` stops sending work while it answers 503.  :class:`FloorWatch` logs crossing the
floor and recovering once each, however many requests see it.  Everything here that touches the
disk blocks: call it through the blocking runner.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from attrs import define, field, frozen
from twisted.logger import Logger

from canner import fs
from canner.ops.inventory import unusable_dirs
from canner.ops.node import WorkerCount, WorkerRoster
from canner.ops.verdict import draining_reason, upload_refusals
from canner.store.drain import read_drain
from canner.store.promises import Promises, overpromised

log = Logger()

OK, BELOW, UNKNOWN = "ok", "below", "unknown"


@define(eq=False)
class FloorWatch:
    """Remembers which side of the floor free space was last seen on; logs each change once.

    ``observe`` may be called from any thread."""

    floor: int
    _state: str | None = None
    _lock: threading.Lock = field(factory=threading.Lock)

    def observe(self, available: int | None) -> None:
        if available is None:
            state = UNKNOWN
        else:
            state = BELOW if available < self.floor else OK
        with self._lock:
            previous, self._state = self._state, state
        if state == previous:
            return
        if state == BELOW:
            log.warn(
                "free space {free_bytes} is under the floor {min_free_bytes}: uploads are refused"
                " (429) until it recovers",
                free_bytes=available,
                min_free_bytes=self.floor,
            )
        elif state == UNKNOWN:
            log.error("free space on the data directory cannot be determined: uploads are refused")
        elif previous is not None:
            log.info(
                "free space {free_bytes} is back over the floor {min_free_bytes}: uploads are"
                " accepted again",
                free_bytes=available,
                min_free_bytes=self.floor,
            )


@frozen
class Readiness:
    ready: bool
    reasons: tuple[str, ...]
    free_bytes: int | None
    promised_bytes: int | None = None
    # A receiver that runs workers: how many (None: it serves the socket itself).
    workers: WorkerCount | None = None

    def as_dict(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "status": "ready" if self.ready else "not ready",
            "reasons": list(self.reasons),
            "free_bytes": self.free_bytes,
            "promised_bytes": self.promised_bytes,
        }
        if self.workers is not None:
            doc["workers"] = self.workers.as_dict()
        return doc


def with_workers(check: Callable[[], Readiness], roster: WorkerRoster) -> Callable[[], Readiness]:
    """``check`` on a node whose workers serve the socket: also not ready, saying so, while fewer
    workers than configured listen (blocking, as ``check`` is)."""

    def ready() -> Readiness:
        found = check()
        workers = WorkerCount.of(roster)
        missing = workers.missing
        reasons = found.reasons if missing is None else (*found.reasons, missing)
        return Readiness(not reasons, reasons, found.free_bytes, found.promised_bytes, workers)

    return ready


def check_readiness(
    data_dir: Path, min_free_bytes: int, watch: FloorWatch, promises: Promises | None = None
) -> Readiness:
    """Whether uploads would be accepted now, and every reason they would not (blocking),
    worded as ``canner status`` and the status page word them (:mod:`canner.ops.verdict`).  With
    ``promises``, free space they leave under the floor is such a reason."""
    reasons = []
    draining = read_drain(data_dir)
    if draining is not None:
        reasons.append(draining_reason(draining))
    free: int | None = None
    free_error = None
    try:
        free = fs.free_bytes(data_dir)
    except OSError as e:
        free_error = e.strerror or str(e)
    watch.observe(free)
    reasons += upload_refusals(
        free_bytes=free,
        free_error=free_error,
        min_free_bytes=min_free_bytes,
        unusable=unusable_dirs(data_dir),
    )
    if free is not None and free >= min_free_bytes and promises is not None:
        # Not even one more byte could be promised: every creation would be refused.
        refusal = overpromised(free, promises.total, promises.uploads, 1, min_free_bytes)
        if refusal is not None:
            reasons.append(f"free space is promised to uploads in flight: {refusal.describe()}")
    promised = promises.total if promises is not None else None
    return Readiness(not reasons, tuple(reasons), free, promised)
