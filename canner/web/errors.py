"""What an expected refusal is on the receiver's HTTP seam: :class:`HTTPError` (a status, a short
message, extra headers), raised by every door and answered by the one renderer
(:mod:`canner.web.answer`).  Pure.
"""

from __future__ import annotations

from attrs import define, field

# The tus version every answer of the receiver names (``Tus-Resumable``): tus clients check it
# on every response, whichever route answers.
TUS_VERSION = "1.0.0"


@define
class HTTPError(Exception):
    """An expected refusal with its HTTP meaning: status, a short message, extra headers."""

    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.status} {self.message}"


# Reason phrases Twisted's table lacks (it would send "Unknown Status") or words otherwise than
# RFC 9110 ("Request Time-out").
_REASONS = {
    408: b"Request Timeout",
    422: b"Unprocessable Content",
    423: b"Locked",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    507: b"Insufficient Storage",
}


def reason(status: int) -> bytes | None:
    """The reason phrase to send with ``status`` where Twisted's is missing or other (else
    None)."""
    return _REASONS.get(status)
