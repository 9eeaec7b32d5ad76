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

Nothing else in the receiver writes HTTP bytes.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen
from twisted.web.http import RESPONSES

from canner.web.errors import TUS_VERSION, HTTPError, reason

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
