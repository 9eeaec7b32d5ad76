"""HTTP plumbing for the IA sink: the production client, bounded response reads, a streamed
digest of a whole download, failure texts."""

from __future__ import annotations

import hashlib
from importlib import metadata as importlib_metadata
from typing import Any

from attrs import frozen
from treq.client import HTTPClient
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from canner.blocking import BlockingRunner
from canner.sinks.ia.wire import short


def make_http_client(reactor: Any, connect_timeout: float = 60.0) -> HTTPClient:
    """The production client: a connect timeout, and no persistent connections (a PUT's
    connection is never reused)."""
    pool = _QuietPool(reactor, persistent=False)
    return HTTPClient(Agent(reactor, connectTimeout=connect_timeout, pool=pool))


class _QuietPool(HTTPConnectionPool):
    """A pool whose per-connection factories do not log "Starting factory" for every request."""

    class _factory(HTTPConnectionPool._factory):  # type: ignore[valid-type,misc]  # noqa: N801
        noisy = False


def canner_user_agent() -> str:
    try:
        version = importlib_metadata.version("canner")
    except importlib_metadata.PackageNotFoundError:
        version = "0"
    return f"canner/{version}"


_RESPONSE_DONE = Failure(ResponseDone())


class _BoundedCollector(TwistedProtocol):
    """Collects at most ``limit`` bytes of a response body; more is cut off (``truncated``)."""

    def __init__(self, limit: int, done: Deferred[tuple[bytes, bool]]) -> None:
        self._limit = limit
        self._done = done
        self._chunks: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        if self._done.called:
            return
        room = self._limit - self._size
        if len(data) > room:
            self._chunks.append(data[:room])
            self._done.callback((b"".join(self._chunks), True))
            if self.transport is not None:
                self.transport.stopProducing()  # type: ignore[attr-defined]
            return
        self._chunks.append(data)
        self._size += len(data)

    def connectionLost(self, reason: Failure = _RESPONSE_DONE) -> None:
        if self._done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback((b"".join(self._chunks), False))
        else:
            self._done.errback(reason)


def read_bounded(
    response: IResponse, limit: int, timeout: float, clock: IReactorTime
) -> Deferred[tuple[bytes, bool]]:
    """Read at most ``limit`` bytes of ``response``'s body within ``timeout`` seconds.

    Fires with ``(body, truncated)``; fails with ``TimeoutError`` when the body is too slow.
    """
    collector: _BoundedCollector

    def cancel(d: Deferred[tuple[bytes, bool]]) -> None:
        transport = collector.transport
        if transport is not None:
            transport.stopProducing()  # type: ignore[attr-defined]

    done: Deferred[tuple[bytes, bool]] = Deferred(cancel)
    collector = _BoundedCollector(limit, done)
    response.deliverBody(collector)
    return done.addTimeout(timeout, clock)


# A whole-file read-back hashes this many bytes per job on the blocking runner: MD5 runs at a few
# hundred MB/s, so a batch is a few milliseconds of a worker thread, and the reactor thread only
# queues buffers.  (Hashing each 64 KiB chunk on the reactor would hold it for ~0.1 ms per chunk:
# fine for a ledger, but some 3 minutes of reactor time for a 100 GiB file.)
DIGEST_BATCH = 4 << 20


@frozen
class StreamedBody:
    """A response body read through: its MD5 (hex) and size.  ``cut``: more than the expected
    number of bytes arrived and reading stopped there (``md5`` is then of no use)."""

    md5: str
    size: int
    cut: bool = False


def _update(md5: Any, chunks: list[bytes]) -> None:
    for chunk in chunks:
        md5.update(chunk)  # hashlib releases the GIL for buffers this size


class _DigestReader(TwistedProtocol):
    """Feeds a response body to MD5, ``batch`` bytes per job on ``run``, one job at a time.

    While a batch is hashed the next one is collected; when that one is full too, the transport
    is paused until the hash catches up, so at most two batches are held.  Any byte that arrives,
    and any batch hashed, resets the no-progress watchdog (``idle`` seconds).
    """

    def __init__(
        self,
        run: BlockingRunner,
        limit: int,
        batch: int,
        clock: IReactorTime,
        idle: float,
        done: Deferred[StreamedBody],
    ) -> None:
        self._run = run
        self._limit = limit
        self._batch = batch
        self._idle = idle
        self._done = done
        self._md5 = hashlib.md5()
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._received = 0
        self._hashing = False
        self._paused = False
        self._ended = False
        self._watchdog = clock.callLater(idle, self._no_progress)
        done.addBoth(self._stop_watchdog)

    def _stop_watchdog(self, result: Any) -> Any:
        if self._watchdog.active():
            self._watchdog.cancel()
        return result

    def _progress(self) -> None:
        if self._watchdog.active():
            self._watchdog.reset(self._idle)

    def _no_progress(self) -> None:
        self._stop_transport()
        if not self._done.called:
            self._done.errback(TimeoutError(f"no bytes arrived for {self._idle:g}s"))

    def _stop_transport(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        if self._done.called:
            return
        self._progress()
        self._received += len(data)
        if self._received > self._limit:
            self._stop_transport()
            self._done.callback(StreamedBody("", self._received, cut=True))
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= self._batch:
            self._next()

    def connectionLost(self, reason: Failure = _RESPONSE_DONE) -> None:
        if self._done.called:
            return
        if not reason.check(ResponseDone, PotentialDataLoss):
            self._done.errback(reason)
            return
        self._ended = True
        self._paused = False  # nothing left to resume
        self._next()

    def _next(self) -> None:
        """Hash what was collected, unless a hash runs (then pause once a batch waits); at the
        end of the body, once everything is hashed, fire the result."""
        if self._hashing:
            if self._buffered >= self._batch and not self._paused and not self._ended:
                self._paused = True
                self.transport.pauseProducing()  # type: ignore[union-attr]
            return
        if not self._chunks:
            if self._ended:
                self._done.callback(StreamedBody(self._md5.hexdigest(), self._received))
            return
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        self._hashing = True
        self._run(_update, self._md5, chunks).addBoth(self._hashed)

    def _hashed(self, result: Any) -> None:
        self._hashing = False
        if self._done.called:
            return
        if isinstance(result, Failure):
            self._stop_transport()
            self._done.errback(result)
            return
        self._progress()
        if self._paused:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[union-attr]
        if self._ended or self._buffered >= self._batch:
            self._next()


def read_digest(
    response: IResponse,
    *,
    limit: int,
    run: BlockingRunner,
    clock: IReactorTime,
    idle: float,
    batch: int = DIGEST_BATCH,
) -> Deferred[StreamedBody]:
    """Stream ``response``'s body into an MD5 without holding it (at most ``2 * batch`` bytes).

    Reading stops after ``limit`` bytes (``cut``).  Fails with ``TimeoutError`` when no byte
    arrives (and no batch is hashed) for ``idle`` seconds, with the connection's failure when
    the body breaks off, or with what ``run`` raised; cancelling it closes the connection.
    """
    reader: _DigestReader

    def cancel(d: Deferred[StreamedBody]) -> None:
        reader._stop_transport()

    done: Deferred[StreamedBody] = Deferred(cancel)
    reader = _DigestReader(run, limit, batch, clock, idle, done)
    response.deliverBody(reader)
    return done


class _Discard(TwistedProtocol):
    def connectionMade(self) -> None:
        self.transport.stopProducing()  # type: ignore[union-attr]


def discard(response: IResponse) -> None:
    """Close the connection of a response whose body is of no use (not read at all)."""
    response.deliverBody(_Discard())


def first_headers(headers: Headers) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): values[0].decode("latin-1")
        for name, values in headers.getAllRawHeaders()
        if values
    }


def describe_failure(error: BaseException, what: str) -> str:
    """A short text for a network failure, naming Twisted's wrapped reasons."""
    reasons = getattr(error, "reasons", None)
    if reasons:
        inner = "; ".join(
            f"{type(r.value).__name__}: {r.value}" if isinstance(r, Failure) else repr(r)
            for r in reasons
        )
        return short(f"{what}: {type(error).__name__} ({inner})")
    return short(f"{what}: {type(error).__name__}: {error}")
