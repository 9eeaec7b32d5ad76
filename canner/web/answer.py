"""The one renderer of the answers canner words itself: refusals, errors and protocol answers.

An :class:`Answer` is a status, extra headers and a one-line message.  Every answer carries
``Tus-Resumable`` (tus clients check it on errors too) and, with a message, a plain-text body.
It is rendered one of two ways, from the same value:

- :meth:`Answer.apply` through twisted.web's ``Request``, for answers given once the request
  reached its route (Klein's error handlers, the request's own 413 and 500);
- :meth:`Answer.wire` as the complete HTTP/1.1 bytes, for answers given on the connection before
  a route could: a refusal decided from the head while the body is still arriving, a head that
  is malformed, too large or too slow, a connection over the cap.  Those always close the
  connection.

A door's resource answers through :func:`render_error` and :func:`answer_later` (the body its
handler's Deferred fires with, or the refusal it fails with); nothing else in the receiver writes
HTTP bytes.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES
from twisted.web.iweb import IRequest
from twisted.web.server import NOT_DONE_YET, Request

from canner.web.errors import TUS_VERSION, HTTPError, reason

log = Logger()

_TEXT = "text/plain; charset=utf-8"


@frozen
class Answer:
    """An answer: ``status``, extra ``headers`` and a ``message`` (no body when empty)."""

    status: int
    message: str = ""
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, error: HTTPError) -> Answer:
        return cls(error.status, error.message, error.headers)

    @property
    def body(self) -> bytes:
        return (self.message + "\n").encode("utf-8") if self.message else b""

    def _headers(self) -> list[tuple[str, str]]:
        headers = [("Tus-Resumable", TUS_VERSION), *self.headers]
        if self.message:
            headers.append(("Content-Type", _TEXT))
        return headers

    def apply(self, request: Any) -> bytes:
        """Set the status and headers on a twisted.web ``request``; the body to return."""
        request.setResponseCode(self.status, reason(self.status))
        for name, value in self._headers():
            request.setHeader(name, value)
        if not self.message:
            request.defaultContentType = None  # no body: no Content-Type (Twisted adds one)
        return self.body

    def wire(self) -> bytes:
        """The whole HTTP/1.1 response, closing the connection."""
        phrase = reason(self.status) or RESPONSES.get(self.status, b"Error")
        body = self.body
        lines = [b"HTTP/1.1 %d %s" % (self.status, phrase)]
        lines += [f"{name}: {value}".encode("latin-1") for name, value in self._headers()]
        lines += [b"Content-Length: %d" % len(body), b"Connection: close", b"", b""]
        return b"\r\n".join(lines) + body


# Answers of the connection itself, before any route.
BAD_REQUEST = Answer(400)
HEAD_TOO_LARGE = Answer(431)
HEAD_TOO_SLOW = Answer(408)
OVER_CAPACITY = Answer(503, headers=(("Retry-After", "5"),))
# The interim answer a client that sent ``Expect: 100-continue`` waits for before its body.
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def render_error(request: IRequest, error: HTTPError) -> bytes:
    """A refusal given once the request reached its route: status and headers set on
    ``request``, the body to return."""
    return Answer.of(error).apply(request)


def answer_later(request: Request, answered: Deferred[bytes]) -> int:
    """Answer ``request`` once ``answered`` fires: with the body it fires with (status and
    headers set by its handler), or with the refusal it fails with (an :class:`HTTPError`;
    anything else is a 500 with the failure logged).  A connection that drops first cancels the
    wait (never an upload's stream).  What a resource's ``render`` returns."""
    request.notifyFinish().addErrback(lambda _: answered.cancel())
    answered.addCallbacks(_write, _refusal, callbackArgs=(request,), errbackArgs=(request,))
    return NOT_DONE_YET


def _write(body: bytes, request: Any) -> None:
    if not request.finished and request.channel is not None:
        request.write(body)
        request.finish()


def _refusal(failure: Failure, request: Any) -> None:
    if failure.check(CancelledError):
        return  # the connection went first: nobody to answer
    error = failure.value
    if not isinstance(error, HTTPError):
        log.failure("answering {method} {path}", failure, method=request.method, path=request.path)
        error = HTTPError(500, "internal error")
    if not request.finished and request.channel is not None:
        _write(render_error(request, error), request)
