"""The errors the client raises.  Every one says what happened in words a worker can act on."""

from __future__ import annotations


class CannerError(Exception):
    """Base class of everything this package raises on purpose."""


class UploadRefused(CannerError):
    """The server refused the upload for good (400, 404 on creation, 413, 415, 422, ...).

    Retrying the same request cannot succeed; ``status`` is the HTTP status and ``message`` the
    server's own explanation.
    """

    def __init__(self, status: int, message: str, what: str = "upload") -> None:
        self.status = status
        self.message = message
        super().__init__(f"{what} refused by the server ({status}): {message}")


class FileChanged(CannerError):
    """The file differs from the one whose upload was started (size, mtime or checksum)."""


class ReceiptMismatch(CannerError):
    """The server returned a receipt that does not describe the uploaded file."""


class DeadlineExceeded(CannerError):
    """Retries went on until the caller's deadline; ``last_error`` says what failed last."""

    def __init__(self, message: str, last_error: str | None = None) -> None:
        self.last_error = last_error
        suffix = f" (last error: {last_error})" if last_error else ""
        super().__init__(message + suffix)


class NothingListens(CannerError):
    """Every connection to the server was refused, several times in a row, and it never
    answered: most likely a wrong URL or port, not a server restarting."""


class UnknownObject(CannerError):
    """The server has no object (or receipt) with this id."""


class EndpointMissing(CannerError):
    """The server does not offer this API (it is older than this client)."""


class UploadLost(CannerError):
    """The server no longer knows an upload that was started and has no receipt for it
    (a partial upload past the server's retention).  Starting over is the only way on."""
