"""What the domain tells the metrics: typed observers, and a silent default.

The domain calls an observer at the moment a fact becomes true (an upload created, bytes stored,
a receipt committed, an attempt started, bytes sent, a copy verified ...);
:class:`canner.ops.metrics.Metrics` implements both protocols.  No metric is derived from the
wording
of a log line or from headers parsed a second time: logs say what happened for people, observers
count it for Prometheus, and either can change without the other.

Calls come from the reactor thread, or from a worker thread where noted; implementations must be
cheap and must not raise.

Three kinds of file leave a node (:class:`Outbound`): objects delivered one by one, megawarc
package files and ledgers.  Every outbound call names its kind, so a dashboard can tell a stuck
ledger from a stuck object queue.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from attrs import define


class Outbound(enum.Enum):
    """What kind of file an outbound transfer moves."""

    OBJECT = "object"
    PACKAGE = "package"
    LEDGER = "ledger"


class Destination(enum.Enum):
    """Where a sink sends bytes."""

    IA = "ia"
    DIRECTORY = "directory"


class UploadObserver(Protocol):
    """The receiver's facts about uploads."""

    def upload_created(self, project: str) -> None:
        """A tus creation made a new upload (before its answer is sent)."""

    def bytes_stored(self, count: int) -> None:
        """``count`` bytes of an upload body were written (from a worker thread or not)."""

    def upload_accepted(self, project: str, size: int, hash_seconds: float, seconds: float) -> None:
        """A receipt was committed: ``seconds`` from the last byte to the durable receipt."""

    def checksum_mismatch(self, project: str) -> None:
        """An upload's stored bytes did not match its declared checksum: rejected for good."""

    def acceptance_failed(self) -> None:
        """An acceptance failed on storage; the client retries."""

    def stale_removed(self, count: int) -> None:
        """The sweep removed ``count`` abandoned partial uploads."""


class AdoptionObserver(Protocol):
    """The rsync intake's facts (:mod:`canner.doors.rsync.intake`)."""

    def adoption_waiting(self, count: int) -> None:
        """``count`` finished rsync files wait for adoption (set by each scan, then lowered as
        each is adopted)."""

    def adopted(self, project: str, seconds: float | None) -> None:
        """A file was adopted and its receipt committed, ``seconds`` after rsync renamed it into
        place (None when a restart finished it: the arrival time is not kept)."""


class OutboundObserver(Protocol):
    """The facts of every transfer that leaves the node, whatever its kind."""

    def attempt_started(self, kind: Outbound, project: str, attempt: int) -> None:
        """Attempt number ``attempt`` (1-based) to send a file began."""

    def bytes_sent(self, kind: Outbound, destination: Destination, count: int) -> None:
        """``count`` more payload bytes reached the sink's connection or copy."""

    def part_sent(self, kind: Outbound) -> None:
        """IA acknowledged one more part of a multipart upload."""

    def delivered(self, kind: Outbound, project: str) -> None:
        """The destination accepted the whole file (not yet verified)."""

    def delivery_failed(
        self, kind: Outbound, project: str, reason: str, needs_operator: bool
    ) -> None:
        """An attempt failed; ``reason`` is a failure class (``network``, ``forbidden`` ...)."""

    def verified(self, kind: Outbound) -> None:
        """The remote copy was checked and found right."""

    def purged(self, kind: Outbound) -> None:
        """The local copy was removed after a verified delivery."""

    def redelivered(self, kind: Outbound, project: str) -> None:
        """A delivered file still missing at its destination was sent to be delivered again."""


class DictionaryObserver(Protocol):
    """The packaging pipeline's facts about zstd dictionaries that members name."""

    def dictionary_fetched(self, project: str) -> None:
        """A dictionary was fetched from the project's dictionary API and kept."""

    def dictionary_unavailable(self, project: str, reason: str) -> None:
        """A dictionary could not be had (``reason``: ``unconfigured``, ``api``, ``download``,
        ``mismatch``, ``invalid``): the members naming it wait."""


class Unobserved:
    """Every observer, doing nothing: the default where nobody counts (tests, the CLI)."""

    def upload_created(self, project: str) -> None:
        pass

    def bytes_stored(self, count: int) -> None:
        pass

    def upload_accepted(self, project: str, size: int, hash_seconds: float, seconds: float) -> None:
        pass

    def checksum_mismatch(self, project: str) -> None:
        pass

    def acceptance_failed(self) -> None:
        pass

    def stale_removed(self, count: int) -> None:
        pass

    def attempt_started(self, kind: Outbound, project: str, attempt: int) -> None:
        pass

    def bytes_sent(self, kind: Outbound, destination: Destination, count: int) -> None:
        pass

    def part_sent(self, kind: Outbound) -> None:
        pass

    def delivered(self, kind: Outbound, project: str) -> None:
        pass

    def delivery_failed(
        self, kind: Outbound, project: str, reason: str, needs_operator: bool
    ) -> None:
        pass

    def verified(self, kind: Outbound) -> None:
        pass

    def purged(self, kind: Outbound) -> None:
        pass

    def redelivered(self, kind: Outbound, project: str) -> None:
        pass

    def dictionary_fetched(self, project: str) -> None:
        pass

    def dictionary_unavailable(self, project: str, reason: str) -> None:
        pass


UNOBSERVED = Unobserved()


class UnobservedAdoption:
    """:class:`AdoptionObserver`, doing nothing."""

    def adoption_waiting(self, count: int) -> None:
        pass

    def adopted(self, project: str, seconds: float | None) -> None:
        pass


UNOBSERVED_ADOPTION = UnobservedAdoption()


def counting_sent(
    report: Callable[[int], None],
    observer: OutboundObserver,
    kind: Outbound,
    destination: Destination,
) -> Callable[[int], None]:
    """A sink's progress callback that also tells ``observer`` of the bytes sent (and passes a
    multipart sink's parts on to ``report``, when it listens)."""
    return _CountingSent(report, observer, kind, destination)


@define
class _CountingSent:
    _report: Callable[[int], None]
    _observer: OutboundObserver
    _kind: Outbound
    _destination: Destination
    _parts_done: int | None = None  # as last heard (the first report is where it resumed)

    def __call__(self, count: int) -> None:
        self._report(count)
        self._observer.bytes_sent(self._kind, self._destination, count)

    def parts(self, done: int, total: int, done_bytes: int) -> None:
        if self._parts_done is not None:
            for _ in range(done - self._parts_done):
                self._observer.part_sent(self._kind)
        self._parts_done = done
        parts = getattr(self._report, "parts", None)
        if callable(parts):
            parts(done, total, done_bytes)
