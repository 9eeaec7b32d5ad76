"""HTTP plumbing for the IA sink: the production client, bounded response reads, failure texts."""

from __future__ import annotations

from importlib import metadata as importlib_metadata
from typing import Any

from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from canner.sinks.wire import short


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
