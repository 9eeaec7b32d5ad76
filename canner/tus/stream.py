"""The streaming seam: upload bodies go to disk as they arrive, never buffered whole.

twisted.web normally buffers a request body (in memory, or in a temp file past 100 kB) and calls
the resource after the last byte.  For tus that would write a 10 GiB body twice and lose the bytes
of an interrupted PATCH.  :class:`ReceiverRequest` asks its site, as soon as the headers are in,
whether the body belongs to an upload; if so each chunk goes to a :class:`BodyStream`, which admits
the request (in a thread), writes chunks at the upload's offset (in a thread), pauses the socket
while writes lag behind, and keeps what was written when the connection drops.

Other requests may carry at most :data:`SMALL_BODY_MAX` bytes; larger bodies are discarded unread
and answered with 413.
"""

from __future__ import annotations

from collections.abc import Callable
from io import BytesIO
from typing import Any, Protocol

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site

from canner.blocking import BlockingRunner
from canner.tus.protocol import TUS_VERSION, TusError, method_override
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
    """HTTP/1.1 channel whose own protocol-error answers also carry ``Tus-Resumable``, and
    which answers an oversized request head with 431 instead of a silent close."""

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted answers malformed framing (bad Content-Length, bad chunking, bad header
        # bytes) with a bare 400 from here, before any Request exists.
        self._refuse(b"400 Bad Request")

    def lineReceived(self, line: bytes) -> None:
        # Twisted counts the head's size and answers 400 past totalHeadersSize; say what it is.
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._refuse(b"431 Request Header Fields Too Large")
            return
        super().lineReceived(line)

    def lineLengthExceeded(self, line: bytes) -> None:
        # One line (request line or header) past MAX_LENGTH: LineReceiver would just close.
        self._refuse(b"431 Request Header Fields Too Large")

    def _refuse(self, status: bytes) -> None:
        self.transport.write(  # type: ignore[union-attr]
            b"HTTP/1.1 "
            + status
            + b"\r\nTus-Resumable: "
            + TUS_VERSION.encode()
            + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        self.loseConnection()


class ReceiverSite(Site):
    """A Site whose requests stream upload bodies through ``body_router`` (HTTP/1.1 only)."""

    protocol = ReceiverChannel  # type: ignore[assignment]

    def __init__(self, resource: Any, body_router: BodyRouter, **kwargs: Any) -> None:
        super().__init__(resource, requestFactory=ReceiverRequest, **kwargs)
        self.body_router = body_router

    def log(self, request: Any) -> None:
        """No per-request access log: at hundreds of uploads a second it costs a fifth of the
        reactor's time; the structured events (accepted, rejected, ...) say what matters."""


class ReceiverRequest(Request):
    """A Request that streams tus bodies and stamps ``Tus-Resumable`` on every response."""

    body_sink: BodySink | None = None
    body_too_large: bool = False
    _big_reads: bool = False
    _router_failed: bool = False

    def gotLength(self, length: int | None) -> None:
        channel: Any = self.channel
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


class _Transport(Protocol):
    def pauseProducing(self) -> None: ...
    def resumeProducing(self) -> None: ...


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
    """

    _run: BlockingRunner
    _transport: _Transport
    _write: Write
    _finish: Finish
    _result: object = None
    _waiters: list[Deferred[Any]] = field(factory=list)
    _upload: LockedUpload | None = None
    _start_offset: int = 0
    _answer: object | None = None
    _pending: list[bytes] = field(factory=list)
    _pending_bytes: int = 0
    _writing: bool = False
    _paused: bool = False
    _ended: bool = False
    _lost: bool = False
    _settled: bool = False

    def admitted(self, upload: LockedUpload) -> None:
        self._upload = upload
        self._start_offset = upload.offset
        self._pump()

    def answered(self, result: object) -> None:
        self._answer = result
        self._drop_pending()
        self._pump()

    def chunk(self, data: bytes) -> None:
        if self._answer is not None or self._settled:
            return
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

    def _written(self, result: object) -> None:
        self._writing = False
        if isinstance(result, Failure):
            if not result.check(TusError):
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
        if answer is not None:
            if upload is not None:
                self._run(upload.close).addErrback(lambda f: log.failure("closing an upload", f))
            self._fire(answer)
            return
        assert upload is not None
        self._finish(upload, self._lost).addBoth(self._fire)

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
        if isinstance(result, Failure) and not result.check(TusError):
            log.failure("upload stream ended badly", result)
            result = Failure(TusError(500, "internal error"))
        self._result = result
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:  # a waiter cancelled by its route (connection lost)
                _deliver(waiter, result)


def _deliver(waiter: Deferred[Any], result: object) -> None:
    if isinstance(result, Failure):
        waiter.errback(result)
    else:
        waiter.callback(result)
