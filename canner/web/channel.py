"""The receiver's HTTP connection: a channel, its requests and the site that makes them.

twisted.web normally buffers a request body (in memory, or in a temp file past 100 kB) and calls
the resource after the last byte.  For tus that would write a 10 GiB body twice and lose the bytes
of an interrupted PATCH.  So as soon as a request's head is in, :class:`ReceiverRequest` routes it
once (:func:`canner.web.routing.route`) and, for an upload body, asks the site's
:class:`BodyRouter` for a sink: each chunk then goes there (a
:class:`~canner.web.stream.BodyStream`) as it arrives.

A refusal decided before the body has arrived (from the head, or at admission: 404, 409, 412,
413, 415, 423, 429, ...) is answered at once, without ``100 Continue``, and the connection is then
closed rather than read to the end of a body nobody wants (:meth:`ReceiverRequest.answer_now`).
Other requests may carry at most :data:`SMALL_BODY_MAX` bytes; larger bodies are discarded unread
and answered with 413.

The channel also guards the process: a request head must arrive whole within its deadline and
within ``totalHeadersSize`` (431), and :class:`~canner.web.connections.ConnectionLimits` caps open
connections in total and per client address.  Every answer the channel or a request words
itself is rendered by :class:`~canner.web.answer.Answer`.

Twisted's private names: only ``HTTPChannel._respondToBadRequestAndDisconnect`` is overridden
(Twisted answers malformed framing there, with a bare 400 and no ``Tus-Resumable``);
``tests/unit/test_twisted_canaries.py`` fails, naming it, when a Twisted release changes it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from io import BytesIO
from typing import Any, Protocol

from attrs import frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site

from canner.web.answer import (
    BAD_REQUEST,
    CONTINUE,
    HEAD_TOO_LARGE,
    HEAD_TOO_SLOW,
    OVER_CAPACITY,
    Answer,
)
from canner.web.connections import ConnectionCaps
from canner.web.errors import TUS_VERSION, HTTPError
from canner.web.proxy import forwarded_client
from canner.web.routing import (
    BAD_HOST_MESSAGE,
    OTHER,
    DoorPath,
    Route,
    bindable_host,
    method_override,
    route,
)

log = Logger()

SMALL_BODY_MAX = 64 * 1024
# Socket read size while streaming a large body: Twisted's 64 KiB reads cost a lot of CPU per
# byte; 1 MiB reads measured 1.5x faster.  Small requests keep the default, because every recv()
# allocates its full buffer size.
STREAM_READ_SIZE = 1 << 20
# After an early answer, what the client may still send before the connection is cut: a short
# grace lets it read the answer before a reset can destroy it.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20


class BodySink(Protocol):
    """Where :class:`ReceiverRequest` sends an upload body."""

    def chunk(self, data: bytes) -> None: ...
    def body_ended(self) -> None: ...
    def connection_lost(self) -> None: ...


class BodyRouter(Protocol):
    """Opens the sink of an upload body (a creation, an append, a whole file) from the request
    head: the site has one, the router of doors (``canner.doors.router``)."""

    def open_body(
        self, request: ReceiverRequest, route: Route, length: int | None
    ) -> BodySink | None: ...


@frozen
class RequestLine:
    """The request line, kept by the channel from the head's first line (twisted.web gives it
    to the Request only after the body, and the body's route is needed before)."""

    method: bytes
    target: bytes
    version: bytes

    @classmethod
    def parse(cls, line: bytes) -> RequestLine | None:
        parts = line.split(b" ")
        return cls(*parts) if len(parts) == 3 else None

    @property
    def path(self) -> bytes:
        return self.target.split(b"?", 1)[0]


class Phase(enum.Enum):
    """Where a connection is."""

    HEAD = "head"  # a request head is arriving, against its deadline
    REQUEST = "request"  # the head is in: its body and its answer
    IDLE = "idle"  # kept alive between requests: the next head's clock starts at its first byte
    CLOSING = "closing"  # answered early: what still arrives is discarded, then the cut
    REFUSED = "refused"  # over the connection cap: answered 503 at once, nothing parsed
    ASKING = "asking"  # a node's worker waits for the parent's cap (transport paused)
    GONE = "gone"  # lost while asking: never served


class ReceiverChannel(HTTPChannel):
    """HTTP/1.1 channel for the receiver: head deadline and size, connection caps, ``100
    Continue`` only for an admitted body, and early answers that close the connection."""

    phase = Phase.HEAD
    # The current request's first line (None until it is in, or when it does not parse).
    request_line: RequestLine | None = None
    _head_bytes = 0  # received since the head began, line ends or not (for its deadline)
    _head_size = 0  # of its complete lines, as Twisted counts them against totalHeadersSize
    _head_lines = 0
    _limited_host: str | None = None
    _head_deadline: IDelayedCall | None = None
    _discarded = 0
    _linger: IDelayedCall | None = None

    def connectionMade(self) -> None:
        site: Any = self.factory
        limits: ConnectionCaps | None = site.connection_limits
        if limits is None:
            self._serve()
            return
        host = _peer_host(self.transport)
        answer = limits.admit(host)
        if not isinstance(answer, Deferred):
            self._admitted_or_not(answer, limits, host)
            return
        # A node's worker asks its parent: nothing is read until the answer.
        self.phase = Phase.ASKING
        self.transport.pauseProducing()  # type: ignore[union-attr]
        answer.addCallback(self._answered, limits, host)

    def _answered(self, admitted: bool, limits: ConnectionCaps, host: str) -> None:
        if self.phase is Phase.GONE:  # lost while the cap was asked
            if admitted:
                limits.release(host)
            return
        self.phase = Phase.HEAD
        self.transport.resumeProducing()  # type: ignore[union-attr]
        self._admitted_or_not(admitted, limits, host)

    def _admitted_or_not(self, admitted: bool, limits: ConnectionCaps, host: str) -> None:
        if not admitted:
            site: ReceiverSite = self.factory
            if site.cap_warning_due():
                log.warn(
                    "connection cap reached ({open} open, {per} per address): refusing"
                    " connections with 503; {refused} refused so far",
                    open=limits.open,
                    per=limits.per_address or "no cap",
                    refused=limits.refused,
                )
            # Over the cap: say so cheaply (tus clients retry a 503) and close.
            self.phase = Phase.REFUSED
            self.transport.write(OVER_CAPACITY.wire())  # type: ignore[union-attr]
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        self._limited_host = host
        self._serve()

    def _serve(self) -> None:
        super().connectionMade()
        self._start_head_deadline()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.phase is Phase.ASKING:
            self.phase = Phase.GONE
            return  # HTTPChannel never started; the answer releases what it admitted
        if self.phase in (Phase.REFUSED, Phase.GONE):
            return  # refused in connectionMade: HTTPChannel never started
        self._cancel_head_deadline()
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        if self._limited_host is not None:
            self.factory.connection_limits.release(self._limited_host)
            self._limited_host = None
        super().connectionLost(reason)

    # -- the head: its deadline (the idle timer restarts on every byte, so a client trickling a
    # head byte by byte would hold its connection forever without it), its size, its first line

    def dataReceived(self, data: bytes) -> None:
        if self.phase in (Phase.REFUSED, Phase.ASKING, Phase.GONE):
            return
        if self.phase is Phase.IDLE:
            # A kept-alive connection starts its next request: its head has the same deadline.
            self.phase = Phase.HEAD
            self._start_head_deadline()
        if self.phase is Phase.HEAD:
            self._head_bytes += len(data)
        super().dataReceived(data)

    def lineReceived(self, line: bytes) -> None:
        if self.phase is Phase.CLOSING:
            return
        # Twisted answers a bare 400 past totalHeadersSize; say what it is.
        self._head_size += len(line)
        if self._head_size > self.totalHeadersSize:
            self._refuse(HEAD_TOO_LARGE)
            return
        if line and not self._head_lines:
            # The first non-empty line (Twisted skips one empty line before it); one that does
            # not parse is answered 400 by Twisted.
            self.request_line = RequestLine.parse(line)
        self._head_lines += bool(line)
        super().lineReceived(line)

    def lineLengthExceeded(self, line: bytes) -> None:
        # One line (request line or header) past MAX_LENGTH: LineReceiver would just close.
        self._refuse(HEAD_TOO_LARGE)

    def allHeadersReceived(self) -> None:
        self._cancel_head_deadline()
        self.phase = Phase.REQUEST
        request = self.requests[-1]
        # Twisted would send 100 Continue at once; the request sends it only once its body is
        # admitted (never before a refusal), so the expectation is taken from Twisted.
        expect = request.requestHeaders.getRawHeaders(b"expect")
        line = self.request_line
        wants_continue = (
            expect is not None
            and expect[0].lower() == b"100-continue"
            and line is not None
            and line.version == b"HTTP/1.1"
        )
        if wants_continue:
            request.requestHeaders.removeHeader(b"expect")
        super().allHeadersReceived()  # calls request.gotLength, which routes the request
        self.request_line = None
        self._head_size = self._head_lines = 0
        if wants_continue and isinstance(request, ReceiverRequest):
            request.continue_wanted()

    def _start_head_deadline(self) -> None:
        timeout = self.factory.header_timeout
        if timeout and self._head_deadline is None:
            self._head_bytes = 0
            self._head_deadline = self.callLater(timeout, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            if self._head_deadline.active():
                self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self._head_bytes:
            self._refuse(HEAD_TOO_SLOW)
        else:
            # A new connection that never said anything: no request to answer.
            self.transport.abortConnection()  # type: ignore[union-attr]

    def requestDone(self, request: Any) -> None:
        if self.persistent and self.phase is Phase.REQUEST:
            # An idle kept-alive connection is left to the idle timeout: the clock of the next
            # head starts with its first byte (closing it earlier would race the client's
            # next request on its pooled connection).  Before Twisted's requestDone, which
            # parses a pipelined request already buffered (and makes the phase REQUEST again).
            self.phase = Phase.IDLE
        super().requestDone(request)

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted answers malformed framing (bad Content-Length, bad chunking, bad header
        # bytes) with a bare 400 from here, before any Request exists.
        self._refuse(BAD_REQUEST)

    def rawDataReceived(self, data: bytes) -> None:
        if self.phase is Phase.CLOSING:
            self._discard(data)
            return
        super().rawDataReceived(data)

    def _refuse(self, answer: Answer) -> None:
        """Answer the head itself (malformed, too large, too slow) and close."""
        self._cancel_head_deadline()
        self.phase = Phase.CLOSING
        self.transport.write(answer.wire())  # type: ignore[union-attr]
        self.loseConnection()

    # -- 100 Continue and early answers

    def send_continue(self) -> None:
        if self.phase is Phase.REQUEST and self.transport is not None:
            self.transport.write(CONTINUE)

    def answer_and_close(self, answer: Answer) -> None:
        """Send ``answer`` for the request whose body is still arriving, then stop parsing:
        discard what follows for :data:`LINGER_SECONDS` (at most :data:`LINGER_BYTES`) so the
        client can read the answer, and cut the connection after that."""
        self.phase = Phase.CLOSING
        self._cancel_head_deadline()
        self.setRawMode()
        transport: Any = self.transport
        transport.write(answer.wire())
        transport.loseWriteConnection()
        self._linger = self.callLater(LINGER_SECONDS, transport.abortConnection)

    def _discard(self, data: bytes) -> None:
        self._discarded += len(data)
        if self._discarded > LINGER_BYTES:
            # It keeps sending: it is not reading, and we will not read a body nobody wants.
            self.transport.abortConnection()  # type: ignore[union-attr]


def _peer_host(transport: Any) -> str:
    peer = transport.getPeer() if transport is not None else None
    return str(getattr(peer, "host", None) or peer)


class ReceiverSite(Site):
    """A Site whose requests stream upload bodies through ``body_router`` (HTTP/1.1 only),
    routed with the paths doors declared (``door_paths``) besides those routing knows.
    ``forwarded``: only workers of the node reach it (the parent's private socket), so a
    request's client is the one its ``X-Forwarded-For`` names (:mod:`canner.web.proxy`)."""

    protocol = ReceiverChannel  # type: ignore[assignment]

    def __init__(
        self,
        resource: Any,
        body_router: BodyRouter,
        connection_limits: ConnectionCaps | None = None,
        header_timeout: float | None = None,
        door_paths: Sequence[DoorPath] = (),
        forwarded: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(resource, requestFactory=ReceiverRequest, **kwargs)
        self.forwarded = forwarded
        self.body_router = body_router
        self.connection_limits = connection_limits
        self.header_timeout = header_timeout
        self.door_paths = tuple(door_paths)
        self._cap_warned_at: float | None = None

    def cap_warning_due(self, every: float = 60.0) -> bool:
        """True at most once per ``every`` seconds: refusals at the connection cap are logged,
        not each one (whichever caps are in force)."""
        now = self.reactor.seconds()
        if self._cap_warned_at is None or now - self._cap_warned_at >= every:
            self._cap_warned_at = now
            return True
        return False

    def route(self, method: bytes, path: bytes) -> Route:
        """The route of a request (:func:`canner.web.routing.route`), decided once per request."""
        return route(method, path, self.door_paths)

    def log(self, request: Any) -> None:
        """No Twisted access log (subclasses report requests their own way)."""


class ReceiverRequest(Request):
    """A Request routed once from its head, that streams upload bodies and stamps
    ``Tus-Resumable`` on every response."""

    route: Route = OTHER
    started: float | None = None  # when the head was in
    body_sink: BodySink | None = None
    # What process() answers instead of routing: a body too large, a sink that failed to open.
    _refusal: Answer | None = None
    _line: RequestLine | None = None
    _body_length: int | None = None
    _big_reads = False
    _body_done = False
    lost = False
    # 100 Continue: wanted by the client, then sent once the body is admitted.
    _wants_continue = False
    _admitted = False

    def gotLength(self, length: int | None) -> None:
        channel: Any = self.channel
        self.started = channel.site.reactor.seconds()  # for the access log's duration
        self._line = line = channel.request_line
        self._body_length = length
        if line is not None:
            method = method_override(line.method, self.requestHeaders)
            self.route = channel.site.route(method, line.path)
        if not bindable_host(self.getRequestHostname()):
            self._refuse_host()
            return
        sink = None
        if self.route.streams_body:
            try:
                sink = channel.site.body_router.open_body(self, self.route, length)
            except Exception:
                log.failure("routing a request body")
                self._refusal = Answer(500, "internal error")
        if sink is not None:
            self.body_sink = sink
            self.content = BytesIO()
            if length is None or length > SMALL_BODY_MAX:
                self._big_reads = True
                # Bodies streaming at once share their memory: a sink may ask for less.
                size = getattr(sink, "read_size", STREAM_READ_SIZE)
                self.transport.bufferSize = size  # type: ignore[union-attr]
        elif self._refusal is not None or length is None or length > SMALL_BODY_MAX:
            self._refusal = self._refusal or Answer(413, "request body too large")
            self.content = BytesIO()
        else:
            super().gotLength(length)

    def _refuse_host(self) -> None:
        """A Host no route could be served with (:func:`~canner.web.routing.bindable_host`): 400 on
        every route, before any body is opened; answered at once (closing the connection) when
        a body follows, else once the request is in."""
        error = HTTPError(400, BAD_HOST_MESSAGE)
        self._refusal = Answer.of(error)
        self.content = BytesIO()
        self.answer_now(error)

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_sink is not None:
            self.body_sink.chunk(data)
        elif self._refusal is None:
            super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self._body_done = True
        if self._big_reads:  # the body is in; later small requests get the default read size
            del self.transport.bufferSize  # type: ignore[union-attr]
        if self.body_sink is not None:
            self.body_sink.body_ended()
        super().requestReceived(method_override(command, self.requestHeaders), path, version)

    def process(self) -> None:
        self.responseHeaders.setRawHeaders(b"Tus-Resumable", [TUS_VERSION.encode()])
        if self._refusal is not None:
            self.write(self._refusal.apply(self))
            self.finish()
            return
        super().process()

    def getClientAddress(self) -> Any:
        """The client: on a site of forwarded requests, the one the worker names."""
        channel: Any = self.channel
        if channel is not None and channel.site.forwarded:
            named = forwarded_client(self.requestHeaders)
            if named is not None:
                return named
        return super().getClientAddress()

    def connectionLost(self, reason: Failure) -> None:
        self.lost = True
        super().connectionLost(reason)
        if self.body_sink is not None:
            self.body_sink.connection_lost()

    # -- the gate a BodyStream talks to

    def continue_wanted(self) -> None:
        """The client waits for ``100 Continue`` before sending its body: an upload body gets
        it once admitted, any other body at once (as Twisted would)."""
        self._wants_continue = True
        if self._admitted or self.body_sink is None:
            self._send_continue()

    def go_ahead(self) -> None:
        """The body is admitted: a client waiting for ``100 Continue`` gets it now."""
        self._admitted = True
        if self._wants_continue:
            self._send_continue()

    def _send_continue(self) -> None:
        self._wants_continue = False
        if not self.lost and not self._body_done and self._body_length != 0:
            channel: Any = self.channel
            channel.send_continue()

    def answer_now(self, error: HTTPError) -> bool:
        """Answer ``error`` before the rest of the body arrives and close the connection;
        False (nothing done) when the request will reach its route anyway: an empty body, a
        body that has ended, a connection that is gone."""
        if self._body_done or self._body_length == 0 or self.lost or self._line is None:
            return False
        channel: Any = self.channel
        # The request has not been received whole: fill in what the metrics and the access
        # log read.
        self.method = method_override(self._line.method, self.requestHeaders)
        self.uri = self._line.target
        self.path = self._line.path
        answer = Answer.of(error)
        self.code = answer.status
        channel.answer_and_close(answer)
        self.sentLength = len(answer.body)
        channel.site.log(self)  # metrics and the access log, as for any answered request
        return True

    def end(self) -> None:
        """Drop the connection now (a newer request takes over a stalled upload)."""
        if not self.lost and self.channel is not None:
            transport: Any = self.channel.transport
            transport.abortConnection()
