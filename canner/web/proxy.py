"""A reverse proxy to another process's HTTP site over a unix socket: how a receiver worker
serves the node's one view (the status page, ``/readyz``, ``/metrics``, HQ's API) from the
parent process that owns it.

:class:`NodeProxy` is a twisted.web leaf resource: it forwards a request's method, path and
query, headers (``Host`` kept, hop-by-hop headers dropped, the client's address appended to
``X-Forwarded-For``) and its body (a small one: the channel streams only upload bodies, and
those never come here) to the site listening on ``address``, over persistent connections, and
streams the answer back with its status and headers.  When that site does not answer (refused,
gone, too slow), the client gets ``503`` with ``Retry-After`` and a one-line body naming it,
never a 500.  :func:`forwarded_headers`, :func:`answer_headers` and :func:`forwarded_client`
are the pure header rules; :func:`unix_agent` is the HTTP client both the proxy and the
parent's metrics scrape (``canner.ops.node``) use.  Unix socket addresses that start with a
NUL byte are Linux's abstract namespace.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from attrs import define, field
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import (
    ConnectError,
    ConnectingCancelledError,
    ConnectionDone,
    TimeoutError,
)
from twisted.internet.interfaces import IConsumer, IDelayedCall, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgentEndpointFactory, IBodyProducer, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from canner.web.answer import Answer

log = Logger()

FORWARDED_FOR = b"X-Forwarded-For"
# RFC 9110 §7.6.1: these describe one connection, not the message; never forwarded.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Framed anew on each side: the body's length (the client agent and twisted.web set it) and
# ``Expect`` (the worker already answered ``100 Continue`` to its client).
_REFRAMED = frozenset({b"content-length", b"expect"})
# The URL the agent is given: its host is never resolved (the endpoint is the unix socket).
_BASE = b"http://canner-node"
# Persistent connections kept open to the parent; more requests at once open more.
POOL_SIZE = 8


def _connection_tokens(headers: Headers) -> set[bytes]:
    """The header names ``Connection`` says are hop-by-hop too."""
    named = set()
    for value in headers.getRawHeaders(b"connection", []):
        named |= {t.strip().lower() for t in value.split(b",") if t.strip()}
    return named


def _end_to_end(headers: Headers, drop: frozenset[bytes]) -> Headers:
    dropped = HOP_BY_HOP | drop | _connection_tokens(headers)
    kept = Headers()
    for name, values in headers.getAllRawHeaders():
        if name.lower() not in dropped:
            kept.setRawHeaders(name, list(values))
    return kept


def forwarded_headers(headers: Headers, client: str) -> Headers:
    """The headers to forward of a request with ``headers`` from ``client`` (its address as this
    process sees it): all but hop-by-hop ones and the body's framing, ``Host`` as sent, and
    ``client`` appended to ``X-Forwarded-For`` (its last entry is therefore always the one this
    process vouches for; earlier ones are what the client claimed)."""
    kept = _end_to_end(headers, _REFRAMED)
    chain = [v.strip() for v in kept.getRawHeaders(FORWARDED_FOR, []) if v.strip()]
    kept.setRawHeaders(FORWARDED_FOR, [b", ".join([*chain, client.encode("latin-1")])])
    return kept


def answer_headers(headers: Headers) -> Headers:
    """The headers of a forwarded answer to pass on to the client: all but hop-by-hop ones and
    ``Content-Length`` (set from the answer's length)."""
    return _end_to_end(headers, frozenset({b"content-length"}))


def forwarded_client(headers: Headers) -> IPv4Address | IPv6Address | None:
    """The client a forwarding worker names: the last entry of ``X-Forwarded-For`` (the one the
    worker added) as an address, None when absent or not an IP address.  Trust it only on a
    site that only workers reach (the parent's private socket)."""
    values = headers.getRawHeaders(FORWARDED_FOR)
    if not values:
        return None
    last = values[-1].split(b",")[-1].strip().decode("latin-1")
    try:
        ip = ipaddress.ip_address(last)
    except ValueError:
        return None
    if ip.version == 6:
        return IPv6Address("TCP", last, 0)
    return IPv4Address("TCP", last, 0)


@implementer(IAgentEndpointFactory)
@define
class _UnixEndpoints:
    _reactor: Any
    _address: str
    _timeout: float

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return UNIXClientEndpoint(self._reactor, self._address, timeout=self._timeout)


def unix_agent(
    reactor: Any, address: str, connect_timeout: float = 5.0, persistent: bool = True
) -> tuple[Agent, Any]:
    """An HTTP client agent whose every request goes to the site on unix socket ``address``
    (any URL: its host is not resolved), over connections kept open when ``persistent``, and
    the connection pool to close when done (``pool.closeCachedConnections()``)."""
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    pool.maxPersistentPerHost = POOL_SIZE
    endpoints = _UnixEndpoints(reactor, address, connect_timeout)
    return Agent.usingEndpointFactory(reactor, endpoints, pool=pool), pool


@implementer(IBodyProducer)
@define
class _Bytes:
    """A request body already in memory, written at once."""

    _body: bytes
    length: int = field(init=False)

    def __attrs_post_init__(self) -> None:
        self.length = len(self._body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def _target(request: Any) -> bytes:
    """The request's path and query (an absolute-form target loses its scheme and host)."""
    uri: bytes = request.uri
    if uri.startswith(b"/"):
        return uri
    rest = uri.partition(b"://")[2]
    path = rest[rest.find(b"/") :] if b"/" in rest else b"/"
    return path


def _client_host(request: Any) -> str:
    address = request.getClientAddress()
    return str(getattr(address, "host", None) or address)


# Failures that mean the other site did not answer: the socket refused or missing, the
# connection lost before an answer, the deadline passed.
_UNREACHABLE = (
    ConnectError,
    ConnectingCancelledError,
    ResponseNeverReceived,
    ResponseFailed,
    CancelledError,
    TimeoutError,
)


@define(eq=False)
class _Exchange:
    """One forwarded request: waits for the answer's head, then streams its body back."""

    _proxy: NodeProxy
    _request: Any
    _deadline: IDelayedCall | None = None
    _waiting: Deferred[IResponse] | None = None
    _body: Any = None  # the answer body's transport while it streams
    _gone: bool = False  # the client went away

    def start(self, agent: Agent, timeout: float, reactor: Any) -> None:
        request = self._request
        content = request.content
        body = None
        if content is not None:
            content.seek(0)
            data = content.read()
            if data or request.requestHeaders.hasHeader(b"content-length"):
                body = _Bytes(data)
        headers = forwarded_headers(request.requestHeaders, _client_host(request))
        self._deadline = reactor.callLater(timeout, self._expire)
        request.notifyFinish().addErrback(self._client_gone)
        self._waiting = agent.request(request.method, _BASE + _target(request), headers, body)
        self._waiting.addCallbacks(self._answer, self._failed)

    def _answer(self, response: IResponse) -> None:
        self._waiting = None
        self._proxy.reached()
        if self._gone:
            response.deliverBody(_Discard())
            return
        request = self._request
        request.setResponseCode(response.code, response.phrase)
        request.responseHeaders = answer_headers(response.headers)
        if response.length is not UNKNOWN_LENGTH and request.method != b"HEAD":
            request.setHeader(b"Content-Length", b"%d" % response.length)
        response.deliverBody(_Relay(self))

    def _failed(self, failure: Failure) -> None:
        self._waiting = None
        self._cancel_deadline()
        if self._gone:
            return
        if failure.check(*_UNREACHABLE):
            self._proxy.unreachable(failure)
        else:
            fields = self._fields()
            log.failure(
                "forwarding {method} {path} to the node",
                failure,
                method=fields["method"],
                path=fields["path"],
            )
        self._write_answer(self._proxy.refusal)

    def _write_answer(self, answer: Answer) -> None:
        request = self._request
        if request.finished or request.channel is None:
            return
        request.responseHeaders = Headers()
        request.write(answer.apply(request))
        request.finish()

    def _fields(self) -> dict[str, str]:
        return {
            "method": self._request.method.decode("ascii", "replace"),
            "path": self._request.path.decode("utf-8", "replace"),
        }

    # -- the answer's body

    def streaming(self, transport: Any) -> None:
        self._body = transport

    def data(self, data: bytes) -> None:
        if not self._gone and not self._request.finished:
            self._request.write(data)

    def ended(self, reason: Failure) -> None:
        self._body = None
        self._cancel_deadline()
        request = self._request
        if self._gone or request.finished:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            request.finish()
            return
        # The answer broke off after its head: the status is sent, so the client must see the
        # answer cut, not a short body that looks whole.
        log.warn(
            "the node's answer to {method} {path} broke off: {error}",
            error=str(reason.value),
            **self._fields(),
        )
        _abort(request)

    # -- time and the client

    def _expire(self) -> None:
        self._deadline = None
        if self._waiting is not None:
            self._waiting.cancel()  # -> _failed: 503
        elif self._body is not None:
            self._body.stopProducing()  # -> ended, with the answer cut

    def _cancel_deadline(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _client_gone(self, _: Failure) -> None:
        self._gone = True
        self._cancel_deadline()
        if self._waiting is not None:
            self._waiting.cancel()
        elif self._body is not None:
            self._body.stopProducing()


def _describe(failure: Failure) -> str:
    """A failure in a few words: its message, else the name of its type."""
    return str(failure.value) or type(failure.value).__name__


def _abort(request: Any) -> None:
    channel = request.channel
    transport = getattr(channel, "transport", None)
    if transport is not None:
        transport.abortConnection()


class _Relay(Protocol):
    """Hands the answer's body to its exchange as it arrives."""

    def __init__(self, exchange: _Exchange) -> None:
        self._exchange = exchange

    def connectionMade(self) -> None:
        self._exchange.streaming(self.transport)

    def dataReceived(self, data: bytes) -> None:
        self._exchange.data(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self._exchange.ended(reason)


class _Discard(Protocol):
    """Drops an answer nobody waits for any more (its connection with it)."""

    def connectionMade(self) -> None:
        transport: Any = self.transport
        transport.stopProducing()


class NodeProxy(Resource):
    """Forwards every request it is given to the site on unix socket ``address`` (the node's
    parent process), and streams the answer back.

    An answer's head must arrive within ``timeout`` seconds, its whole body within the same
    deadline; otherwise (or when the socket refuses or the connection drops first) the client
    gets 503 with ``Retry-After: retry_after`` and one line naming the node's parent.  An answer
    that breaks off after its head cuts the client's connection.  Going down and coming back are
    logged once each.  Reactor thread only; :meth:`close` when the process stops."""

    isLeaf = True

    def __init__(
        self,
        address: str,
        reactor: Any,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        retry_after: int = 5,
    ) -> None:
        super().__init__()
        self._reactor = reactor
        self._timeout = timeout
        self._agent, self._pool = unix_agent(reactor, address, connect_timeout)
        self._down = False
        self.refusal = Answer(
            503,
            "the node's parent process does not answer; retry later",
            (("Retry-After", str(retry_after)),),
        )

    def render(self, request: Any) -> int:
        _Exchange(self, request).start(self._agent, self._timeout, self._reactor)
        return NOT_DONE_YET

    def reached(self) -> None:
        if self._down:
            self._down = False
            log.info("the node's parent process answers again")

    def unreachable(self, failure: Failure) -> None:
        if not self._down:
            self._down = True
            log.warn(
                "the node's parent process does not answer: {error}; its pages get 503",
                error=_describe(failure),
            )

    def close(self) -> Deferred[None]:
        """Close the kept connections (the process stops)."""
        closed: Deferred[None] = self._pool.closeCachedConnections()
        return closed
