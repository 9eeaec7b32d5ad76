"""The streaming seam: upload bodies go to disk as they arrive, never buffered whole.

twisted.web normally buffers a request body (in memory, or in a temp file past 100 kB) and calls
the resource after the last byte.  For tus that would write a 10 GiB body twice and lose the bytes
of an interrupted PATCH.  :class:`ReceiverRequest` asks its site, as soon as the headers are in,
whether the body belongs to an upload; if so each chunk goes to a :class:`BodyStream`, which admits
the request (in a thread), writes chunks at the upload's offset (in a thread), pauses the socket
while writes lag behind, and keeps what was written when the connection drops.

A refusal decided before the body has arrived (from the head, or at admission: 404, 409, 412,
413, 415, 423, 429, ...) is answered at once, without ``100 Continue``, and the connection is then
closed rather than read to the end of a body nobody wants (:meth:`ReceiverRequest.answer_now`).

Other requests may carry at most :data:`SMALL_BODY_MAX` bytes; larger bodies are discarded unread
and answered with 413.

The channel also guards the process: a request head must arrive whole within its deadline, and
:class:`~canner.connections.ConnectionLimits` caps open connections in total and per client
address (over the cap a connection gets a bare 503 and is closed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from io import BytesIO
from typing import Any, Protocol

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, HTTPChannel
from twisted.web.server import Request, Site

from canner.blocking import BlockingRunner, PoolStopped
from canner.connections import ConnectionLimits
from canner.tus.protocol import TUS_VERSION, TusError, method_override, reason
from canner.tus.store import LockedUpload

log = Logger()

SMALL_BODY_MAX = 64 * 1024
# Pause the socket once this much received data waits for the disk; with one write in flight a
# stream holds at most about twice this (plus one socket read) in memory.
PENDING_HIGH_WATER = 1 << 20
# Socket read size while streaming a large body: Twisted's 64 KiB reads cost a lot of CPU per
# byte; 1 MiB reads measured 1.5x faster.  Small requests keep the default, because every recv()
# allocates its full buffer size.
STREAM_READ_SIZE = 1 << 20
# After an early refusal, what the client may still send before the connection is cut: a short
# grace lets it read the answer before a reset can destroy it.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class BodySink(Protocol):
    """Where :class:`ReceiverRequest` sends an upload body."""

    def chunk(self, data: bytes) -> None: ...
    def body_ended(self) -> None: ...
    def connection_lost(self) -> None: ...


class BodyRouter(Protocol):
    """Decides, from the request head, whether a body streams into an upload."""

    def open_body(
        self, request: ReceiverRequest, method: bytes, path: bytes, length: int | None
    ) -> BodySink | None: ...


class ReceiverChannel(HTTPChannel):
    """HTTP/1.1 channel for the receiver.

    Its own protocol-error answers carry ``Tus-Resumable``; an oversized head is 431, a head not
    finished within the site's ``header_timeout`` is 408; ``100 Continue`` for an upload body
    waits for its admission; and after an early answer the rest of the request is discarded for a
    short grace, then the connection is cut.
    """

    _limited_host: str | None = None
    _over_cap: bool = False
    _head_deadline: IDelayedCall | None = None
    _answered_early: bool = False
    _discarded: int = 0
    _linger: IDelayedCall | None = None

    def connectionMade(self) -> None:
        site: Any = self.factory
        limits: ConnectionLimits | None = getattr(site, "connection_limits", None)
        if limits is not None:
            host = _peer_host(self.transport)
            if not limits.admit(host):
                if limits.due_warning(time.monotonic()):
                    log.warn(
                        "connection cap reached ({open} open, {per} per address): refusing"
                        " connections with 503; {refused} refused so far",
                        open=limits.open,
                        per=limits.per_address or "no cap",
                        refused=limits.refused,
                    )
                # Over the cap: say so cheaply (tus clients retry a 503) and close.
                self.transport.write(  # type: ignore[union-attr]
                    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\n"
                    b"Content-Length: 0\r\nConnection: close\r\n\r\n"
                )
                self.transport.loseConnection()  # type: ignore[union-attr]
                self._over_cap = True
                return
            self._limited_host = host
        super().connectionMade()
        self._start_head_deadline()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._over_cap:
            return  # refused in connectionMade: HTTPChannel never started
        self._cancel_head_deadline()
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        if self._limited_host is not None:
            self.factory.connection_limits.release(self._limited_host)
            self._limited_host = None
        super().connectionLost(reason)

    # -- the head deadline: the idle timer restarts on every byte, so a client trickling a head
    # byte by byte would hold its connection forever without it.

    _between_requests: bool = False
    _head_bytes: int = 0

    def dataReceived(self, data: bytes) -> None:
        if self._over_cap:
            return
        if self._between_requests:
            # A kept-alive connection starts its next request: its head has the same deadline.
            self._between_requests = False
            self._start_head_deadline()
        if self._head_deadline is not None:
            self._head_bytes += len(data)
        super().dataReceived(data)

    def _start_head_deadline(self) -> None:
        timeout = getattr(self.factory, "header_timeout", None)
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
            self._refuse(b"408 Request Timeout")
        else:
            # A new connection that never said anything: no request to answer.
            self.transport.abortConnection()  # type: ignore[union-attr]

    def allHeadersReceived(self) -> None:
        self._cancel_head_deadline()
        super().allHeadersReceived()

    def requestDone(self, request: Any) -> None:
        super().requestDone(request)
        if self.persistent and not self._answered_early:
            # An idle kept-alive connection is left to the idle timeout: the clock of the next
            # head starts with its first byte (closing it earlier would race the client's
            # next request on its pooled connection).
            self._between_requests = True

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted answers malformed framing (bad Content-Length, bad chunking, bad header
        # bytes) with a bare 400 from here, before any Request exists.
        self._refuse(b"400 Bad Request")

    def lineReceived(self, line: bytes) -> None:
        if self._answered_early:
            return
        # Twisted counts the head's size and answers 400 past totalHeadersSize; say what it is.
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._refuse(b"431 Request Header Fields Too Large")
            return
        super().lineReceived(line)

    def lineLengthExceeded(self, line: bytes) -> None:
        # One line (request line or header) past MAX_LENGTH: LineReceiver would just close.
        self._refuse(b"431 Request Header Fields Too Large")

    def rawDataReceived(self, data: bytes) -> None:
        if self._answered_early:
            self._discard(data)
            return
        super().rawDataReceived(data)

    def _refuse(self, status: bytes) -> None:
        self._cancel_head_deadline()
        self.transport.write(  # type: ignore[union-attr]
            b"HTTP/1.1 "
            + status
            + b"\r\nTus-Resumable: "
            + TUS_VERSION.encode()
            + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        self.loseConnection()

    # -- 100 Continue and early answers

    def _send100Continue(self) -> None:
        request = self.requests[-1] if self.requests else None
        if isinstance(request, ReceiverRequest) and request.body_sink is not None:
            request.continue_wanted()  # sent once the upload admits the body, never on refusal
            return
        super()._send100Continue()

    def send_continue(self) -> None:
        if not self._answered_early and self.transport is not None:
            self.transport.write(_CONTINUE)

    def answer_and_close(self, response: bytes) -> None:
        """Send a complete response for the request whose body is still arriving, then stop
        parsing: discard what follows for :data:`LINGER_SECONDS` (at most :data:`LINGER_BYTES`)
        so the client can read the answer, and cut the connection after that."""
        self._answered_early = True
        self._cancel_head_deadline()
        self.setRawMode()
        transport: Any = self.transport
        transport.write(response)
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
    """A Site whose requests stream upload bodies through ``body_router`` (HTTP/1.1 only)."""

    protocol = ReceiverChannel  # type: ignore[assignment]

    def __init__(
        self,
        resource: Any,
        body_router: BodyRouter,
        connection_limits: ConnectionLimits | None = None,
        header_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(resource, requestFactory=ReceiverRequest, **kwargs)
        self.body_router = body_router
        self.connection_limits = connection_limits
        self.header_timeout = header_timeout

    def log(self, request: Any) -> None:
        """No per-request access log: at hundreds of uploads a second it costs a fifth of the
        reactor's time; the structured events (accepted, rejected, ...) say what matters."""


class ReceiverRequest(Request):
    """A Request that streams tus bodies and stamps ``Tus-Resumable`` on every response."""

    body_sink: BodySink | None = None
    body_too_large: bool = False
    _big_reads: bool = False
    _router_failed: bool = False
    _body_length: int | None = None
    _body_done: bool = False
    _wants_continue: bool = False
    _admitted: bool = False

    def gotLength(self, length: int | None) -> None:
        channel: Any = self.channel
        self._body_length = length
        # The request line reaches a Request only after its body; until then the channel keeps
        # it in _command/_path (private, but unchanged since Twisted 16).
        method = method_override(channel._command, self.requestHeaders)
        path = channel._path.split(b"?", 1)[0]
        try:
            sink = channel.site.body_router.open_body(self, method, path, length)
        except Exception:
            log.failure("routing a request body")
            sink, self._router_failed = None, True
        if sink is not None:
            self.body_sink = sink
            self.content = BytesIO()
            if length is None or length > SMALL_BODY_MAX:
                self._big_reads = True
                self.transport.bufferSize = STREAM_READ_SIZE  # type: ignore[union-attr]
        elif self._router_failed or length is None or length > SMALL_BODY_MAX:
            self.body_too_large = True
            self.content = BytesIO()
        else:
            super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_sink is not None:
            self.body_sink.chunk(data)
        elif not self.body_too_large:
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
        if self._router_failed:
            self.setResponseCode(500)
            self.write(b"internal error\n")
            self.finish()
            return
        if self.body_too_large:
            self.setResponseCode(413)
            self.setHeader(b"Content-Type", b"text/plain; charset=utf-8")
            self.write(b"request body too large\n")
            self.finish()
            return
        super().process()

    def connectionLost(self, reason: Failure) -> None:
        super().connectionLost(reason)
        if self.body_sink is not None:
            self.body_sink.connection_lost()

    # -- the gate a BodyStream talks to

    def continue_wanted(self) -> None:
        """The client waits for ``100 Continue`` before sending its body."""
        self._wants_continue = True
        if self._admitted:
            self._send_continue()

    def go_ahead(self) -> None:
        """The body is admitted: a client waiting for ``100 Continue`` gets it now."""
        self._admitted = True
        if self._wants_continue:
            self._send_continue()

    def _send_continue(self) -> None:
        self._wants_continue = False
        if not self._disconnected and not self._body_done:
            channel: Any = self.channel
            channel.send_continue()

    def answer_now(self, error: TusError) -> bool:
        """Answer ``error`` before the rest of the body arrives and close the connection;
        False (nothing done) when the request will reach its route anyway: an empty body, a
        body that has ended, a connection that is gone."""
        if self._body_done or self._body_length == 0 or self._disconnected:
            return False
        channel: Any = self.channel
        self.method = method_override(channel._command, self.requestHeaders)
        self.uri = channel._path
        self.path = self.uri.split(b"?", 1)[0]
        self.code = error.status
        phrase = reason(error.status) or RESPONSES.get(error.status, b"Error")
        body = (error.message + "\n").encode("utf-8")
        head = [
            b"HTTP/1.1 %d %s" % (error.status, phrase),
            b"Tus-Resumable: " + TUS_VERSION.encode(),
            *(f"{name}: {value}".encode("latin-1") for name, value in error.headers),
            b"Content-Type: text/plain; charset=utf-8",
            b"Content-Length: %d" % len(body),
            b"Connection: close",
        ]
        channel.answer_and_close(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.sentLength = len(body)
        channel.site.log(self)  # metrics and the access log, as for any answered request
        return True

    def end(self) -> None:
        """Drop the connection now (a newer request takes over a stalled upload)."""
        if not self._disconnected and self.channel is not None:
            transport: Any = self.channel.transport
            transport.abortConnection()


class _Transport(Protocol):
    def pauseProducing(self) -> None: ...
    def resumeProducing(self) -> None: ...


class Gate(Protocol):
    """The request behind a :class:`BodyStream` (see :class:`ReceiverRequest`)."""

    def go_ahead(self) -> None: ...
    def answer_now(self, error: TusError) -> bool: ...
    def end(self) -> None: ...


Write = Callable[[LockedUpload, list[bytes]], "Deferred[int]"]
Finish = Callable[[LockedUpload, bool], "Deferred[Any]"]


@define(eq=False)
class BodyStream:
    """One upload body on its way to disk.

    The owner calls :meth:`admitted` with the locked upload once admission is decided, or
    :meth:`answered` with the final result (a value, or a Failure such as a refusal) when the body
    is not to be written; chunks received before that wait, with the socket paused.  Chunks go to
    disk through ``write(upload, chunks)``, one call at a time; a failed write becomes the
    result.  When the body has ended (or the connection dropped) and every chunk is written,
    ``finish(upload, lost)``
    runs and its result is what :meth:`result` gives.  A body that would run past the upload's
    length is refused with 413 and the bytes it wrote are truncated away.

    A refusal made at admission while the body is still arriving is answered through ``gate``
    at once, not after the whole body.  ``last_progress`` (``now()`` of
    the last byte received or written) tells a stalled writer from a live one;
    :meth:`released` fires once the stream no longer holds the upload's lock.
    """

    _run: BlockingRunner
    _transport: _Transport
    _write: Write
    _finish: Finish
    _gate: Gate | None = None
    _now: Callable[[], float] = lambda: 0.0
    last_progress: float = 0.0
    _early: bool = False
    _let_go: bool = False
    _release_waiters: list[Deferred[None]] = field(factory=list)
    _result: object = None
    _waiters: list[Deferred[Any]] = field(factory=list)
    _upload: LockedUpload | None = None
    _start_offset: int = 0
    _received: int = 0
    _answer: object | None = None
    _pending: list[bytes] = field(factory=list)
    _pending_bytes: int = 0
    _writing: bool = False
    _paused: bool = False
    _ended: bool = False
    _lost: bool = False
    _settled: bool = False

    def __attrs_post_init__(self) -> None:
        self.last_progress = self._now()

    def admitted(self, upload: LockedUpload) -> None:
        self._upload = upload
        self._start_offset = upload.offset
        self.last_progress = self._now()
        if self._gate is not None and not self._ended and not self._lost:
            self._gate.go_ahead()
        self._pump()

    @property
    def completes(self) -> bool:
        """True once the bytes received (written or not yet) make the upload complete: the
        stream will go on to acceptance unless writing fails."""
        upload = self._upload
        return (
            upload is not None
            and self._answer is None
            and self._start_offset + self._received >= upload.info.size
        )

    def end(self) -> None:
        """Drop the request's connection; what it wrote is kept, then the lock is released."""
        if self._gate is not None:
            self._gate.end()

    def released(self) -> Deferred[None]:
        """Fires once this stream holds no lock on its upload any more."""
        if self._let_go:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._release_waiters.append(waiter)
        return waiter

    def _release(self, _: object = None) -> None:
        self._let_go = True
        waiters, self._release_waiters = self._release_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def answered(self, result: object) -> None:
        self._answer = result
        self._drop_pending()
        self._pump()

    def chunk(self, data: bytes) -> None:
        if self._answer is not None or self._settled:
            return
        self.last_progress = self._now()
        self._received += len(data)
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= PENDING_HIGH_WATER and not self._paused and not self._lost:
            self._paused = True
            self._transport.pauseProducing()
        self._pump()

    def body_ended(self) -> None:
        self._ended = True
        self._pump()

    def connection_lost(self) -> None:
        self._lost = True
        self._paused = False
        self._pump()

    def _drop_pending(self) -> None:
        self._pending, self._pending_bytes = [], 0
        self._resume()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._transport.resumeProducing()

    def _pump(self) -> None:
        if self._writing or self._settled:
            return
        if self._answer is not None:
            if self._ended or self._lost:
                self._settle()
            elif self._can_answer_now():
                self._early = True
                self._settle()
            return
        upload = self._upload
        if upload is None:
            return  # admission still running
        if self._pending:
            chunks, size = self._pending, self._pending_bytes
            self._pending, self._pending_bytes = [], 0
            if upload.offset + size > upload.info.size:
                self._refuse_overrun(upload)
                return
            self._writing = True
            self._resume()
            self._write(upload, chunks).addBoth(self._written)
        elif self._ended or self._lost:
            self._settle()

    def _can_answer_now(self) -> bool:
        # Only refusals made at admission, before any byte of the body was written: after a
        # failure mid-body (a full disk) the client still gets its answer after the body, as
        # clients that do not read while they send (tuspy, requests) could not see it earlier.
        answer = self._answer
        return (
            self._gate is not None
            and self._upload is None
            and isinstance(answer, Failure)
            and answer.check(TusError) is not None
        )

    def _written(self, result: object) -> None:
        self._writing = False
        self.last_progress = self._now()
        if isinstance(result, Failure):
            if not result.check(TusError, PoolStopped):
                log.error(
                    "writing upload {object_id} failed: {error}",
                    object_id=self._upload.info.upload_id if self._upload else None,
                    error=str(result.value),
                )
            if self._answer is None:
                self._answer = result
            self._drop_pending()
        self._pump()

    def _refuse_overrun(self, upload: LockedUpload) -> None:
        self._answer = Failure(
            TusError(413, "the body would pass Upload-Length; nothing was stored")
        )
        self._drop_pending()
        self._writing = True
        self._run(upload.truncate, self._start_offset).addBoth(self._written)

    def _settle(self) -> None:
        self._settled = True
        upload, answer = self._upload, self._answer
        if answer is None:
            assert upload is not None
            self._finish(upload, self._lost).addBoth(self._finished)
            return
        closing: Deferred[Any] = self._run(upload.close) if upload is not None else succeed(None)
        closing.addErrback(lambda f: None if _stopping(f) else log.failure("closing an upload", f))
        # The lock goes first, so a client retrying at once after the answer finds it free.
        closing.addCallback(self._release).addCallback(lambda _: self._fire(answer))

    def _finished(self, result: object) -> None:
        self._release()
        self._fire(result)

    def result(self) -> Deferred[Any]:
        """The stream's final result (now or later); cancelling it does not affect the stream.

        The result is kept rather than pushed into one Deferred, so a request that never reaches
        its route (a dropped connection, a path no route matches) leaves no failure unobserved.
        """
        waiter: Deferred[Any] = Deferred()
        if self._result is not None:
            _deliver(waiter, self._result)
        else:
            self._waiters.append(waiter)
        return waiter

    def _fire(self, result: object) -> None:
        if isinstance(result, Failure) and _stopping(result):
            log.info("an upload stream was cut short: the receiver is stopping")
            # The client resumes from the offset HEAD reports once the receiver is back.
            result = Failure(
                TusError(
                    503, "the receiver is stopping: resume the upload", (("Retry-After", "5"),)
                )
            )
        if isinstance(result, Failure) and not result.check(TusError):
            log.failure("upload stream ended badly", result)
            result = Failure(TusError(500, "internal error"))
        self._result = result
        if self._early and not self._ended and self._gate is not None:
            assert isinstance(result, Failure) and isinstance(result.value, TusError)
            if self._gate.answer_now(result.value):
                return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:  # a waiter cancelled by its route (connection lost)
                _deliver(waiter, result)


def _stopping(failure: Failure) -> bool:
    """The process stops under the stream: its thread pools take no more work.  What was
    written stays; the upload's file and lock close with the process."""
    return failure.check(PoolStopped) is not None


def _deliver(waiter: Deferred[Any], result: object) -> None:
    if isinstance(result, Failure):
        waiter.errback(result)
    else:
        waiter.callback(result)
