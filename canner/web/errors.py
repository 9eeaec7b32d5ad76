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


# The storage's refusals, the same through every door: the client sends again later.
def _retry_later(status: int, message: str) -> HTTPError:
    return HTTPError(status, message, (("Retry-After", "60"),))


def no_space(available: int, required: int) -> HTTPError:
    """429: the data filesystem has less than ``min_free_bytes`` available."""
    return _retry_later(429, f"insufficient storage: {available} bytes free, {required} required")


def overpromised(reason: str) -> HTTPError:
    """503: the free space is promised to uploads in flight; create the upload later (or on
    another node)."""
    return _retry_later(503, f"insufficient storage for a new upload: {reason}")


def space_unknown() -> HTTPError:
    """503: free space on the data filesystem could not be determined."""
    return _retry_later(503, "free space on the data directory cannot be determined")


def storage_trouble(message: str, retry_after: int = 60) -> HTTPError:
    """503: the storage failed or is full; send again later (HEAD says from where)."""
    return HTTPError(503, message, (("Retry-After", str(retry_after)),))


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
