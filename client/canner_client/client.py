"""The tus client: upload a file to a canner receiver and come back with its receipt.

One upload is a small state machine driven by what the server says, never by what the client
assumes: HEAD tells the offset to continue from, PATCH sends bytes from there, and a complete
upload without a receipt (the final response was lost, or the server is still accepting) is
asked for its receipt until it appears.  Every failure that can pass (transport errors,
timeouts, 5xx, 409, 423, 429) is retried with backoff until the caller's deadline; every refusal
that cannot change is raised at once with the server's message.
"""

from __future__ import annotations

import base64
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote, urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter

from canner_client import __version__
from canner_client.errors import (
    CannerError,
    EndpointMissing,
    FileChanged,
    ReceiptMismatch,
    UnknownObject,
    UploadLost,
    UploadRefused,
)
from canner_client.hashing import blake3_file
from canner_client.receipt import FIELDS, Receipt
from canner_client.retry import Backoff, RetryPolicy, parse_retry_after
from canner_client.state import StateStore, UploadSession

TUS_VERSION = "1.0.0"
OFFSET_TYPE = "application/offset+octet-stream"
SEND_BLOCK = 1024 * 1024  # bytes handed to the socket per write: fewer, larger syscalls
_LOST_CHECKS = 3  # how many times a 404 on an upload is re-checked before it counts as lost


@dataclass(frozen=True)
class Timeouts:
    """Seconds the client waits before it treats a request as failed (and retries it).

    ``connect`` bounds the TCP connect and every blocked write of a request body (an upload
    the network stopped taking); ``read`` bounds the wait for the server's answer to ordinary
    requests; ``acceptance`` bounds the wait for the answer to the request that completes an
    upload, which the server gives only after it has hashed and committed the whole file.
    """

    connect: float = 30.0
    read: float = 60.0
    acceptance: float = 3600.0


@dataclass(frozen=True)
class ProgressEvent:
    """What an upload is doing, for progress displays.

    ``phase`` is ``hashing``, ``uploading``, ``resuming`` (once, when an upload started earlier
    goes on: ``done`` is the offset the server has), ``accepting`` (all bytes are on the server,
    the receipt is not there yet), ``waiting`` (a retry; ``message`` says why) or ``done``.
    ``done``/``total`` are bytes of the current phase.
    """

    path: str
    phase: str
    done: int
    total: int
    object_id: str | None = None
    message: str | None = None


ProgressCallback = Callable[[ProgressEvent], None]


@dataclass(frozen=True)
class ObjectStatus:
    """Where an accepted object stands (``GET /api/v1/objects/{id}``).

    ``delivery``, ``payload`` and ``hq`` are the server's three independent parts as given;
    ``archived`` is None until the record is in a ledger; ``raw`` is the whole document.
    """

    object_id: str
    receipt: Receipt | None
    project: str | None
    delivery: dict[str, Any]
    payload: dict[str, Any]
    hq: dict[str, Any]
    archived: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False)


class _Transient(Exception):
    """A failure that may pass: retry after a wait (``retry_after`` from the server, if any)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Gone(Exception):
    """The server answered 404 or 410 for the upload itself."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Adapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["blocksize"] = SEND_BLOCK
        super().init_poolmanager(*args, **kwargs)


class _Body:
    """``length`` bytes of ``f`` from ``offset``, read in blocks as the socket takes them."""

    def __init__(self, f: Any, offset: int, length: int, sent: Callable[[int], None]) -> None:
        f.seek(offset)
        self._f = f
        self._left = length
        self._sent = sent

    def __len__(self) -> int:
        return self._left

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        want = self._left if n is None or n < 0 else min(n, self._left)
        data: bytes = self._f.read(want)
        if not data:  # the file got shorter: the server will refuse the short body
            raise FileChanged(f"{self._f.name} ended early while being uploaded")
        self._left -= len(data)
        self._sent(len(data))
        return data

    def __iter__(self) -> Any:
        while True:
            block = self.read(SEND_BLOCK)
            if not block:
                return
            yield block


def _refused(error: Exception) -> bool:
    """The transport error is a refused connection (nothing listens at the address)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        for arg in getattr(seen, "args", ()):
            if isinstance(arg, ConnectionRefusedError):
                return True
        seen = seen.__cause__ or seen.__context__ or getattr(seen, "reason", None)
        if not isinstance(seen, BaseException):
            break
    return "[Errno 111]" in str(error) or "Connection refused" in str(error)


def _describe(error: Exception) -> str:
    """A transport error in one line: its kind and the system's reason when there is one."""
    text = str(error)
    reason = re.search(r"\[Errno \d+\] [^'\")]+", text)
    return f"{type(error).__name__}: {reason.group(0) if reason else text[:300]}"


def _server_message(response: requests.Response) -> str:
    text = response.text.strip() if response.content else ""
    return text[:500] or response.reason or f"HTTP {response.status_code}"


def _classify(response: requests.Response, what: str) -> Exception:
    """The exception for an unexpected answer: retry (_Transient), gone (_Gone) or final."""
    status = response.status_code
    message = _server_message(response)
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    if status in (404, 410):
        return _Gone(status, message)
    if status == 423:
        return _Transient(f"{what}: another request is writing this upload", retry_after)
    if status in (408, 409, 429) or status >= 500:
        return _Transient(f"{what}: {status} {message}", retry_after)
    return UploadRefused(status, message, what)


class Client:
    """A client of one canner receiver.

    ``base_url`` is the receiver's root (``http://host:8080``; a trailing ``/files/`` is
    accepted too).  ``timeout`` is a :class:`Timeouts` or one number for ``connect`` and
    ``read``; ``retry`` a :class:`RetryPolicy`.  ``chunk_size`` bounds the bytes of one PATCH,
    so a failed request never resends more than that (None: the rest of the file at once).
    Resume state lives in ``state_dir`` (default ``~/.cache/canner-upload``).  A client may be
    shared by threads.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float | Timeouts | None = None,
        retry: RetryPolicy | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        root = base_url.rstrip("/")
        if root.endswith("/files"):
            root = root[: -len("/files")]
        if urlsplit(root).scheme not in ("http", "https"):
            raise ValueError(f"the receiver URL must be http(s)://...; got {base_url!r}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError("chunk_size must be at least 1 byte")
        self.base_url = root
        self.files_url = root + "/files/"
        parts = urlsplit(root)
        self._address = f"{parts.scheme}://{parts.netloc}"  # where a refused connection went
        if timeout is None:
            timeout = Timeouts()
        elif not isinstance(timeout, Timeouts):
            timeout = Timeouts(float(timeout), float(timeout))
        self.timeouts = timeout
        self.retry = RetryPolicy() if retry is None else retry
        self.chunk_size = chunk_size
        self.states = StateStore(None if state_dir is None else Path(state_dir))
        self._local = threading.local()

    # -- public API -------------------------------------------------------------------------------

    def upload(
        self,
        path: str | os.PathLike[str],
        project: str,
        filename: str | None = None,
        progress: ProgressCallback | None = None,
        restart: bool = False,
    ) -> Receipt:
        """Upload the file at ``path`` to ``project`` and return its verified receipt.

        An upload of the same file to the same receiver and project that was interrupted
        earlier (this process or another) is resumed, after checking the file is unchanged;
        a changed file raises :class:`FileChanged` unless ``restart`` discards the old upload.
        ``filename`` defaults to the file's base name.
        """
        full = os.path.abspath(os.fspath(path))
        notify = _Notifier(full, progress)
        backoff = Backoff(self.retry)
        session = self.states.load(self.files_url, project, full)
        if session is not None and restart:
            self.states.remove(session)
            session = None
        if session is not None:
            _check_unchanged(session)
            checksum, _ = self._hash(full, session.size, notify)
            if checksum != session.checksum:
                raise FileChanged(
                    f"{full} changed since its upload started (checksum {checksum}, was "
                    f"{session.checksum}); rerun with --restart to upload it as a new object"
                )
            try:
                return self._drive(session, notify, backoff, resuming=True)
            except UploadLost as e:
                notify.emit("waiting", 0, session.size, session.object_id, f"{e}; starting over")
                self.states.remove(session)
            checksum_known: str | None = checksum
        else:
            checksum_known = None
        session = self._create(full, project, filename, checksum_known, notify, backoff)
        return self._drive(session, notify, backoff, offset=0)

    def resume(self, session: UploadSession, progress: ProgressCallback | None = None) -> Receipt:
        """Finish an upload started earlier (see :meth:`pending`), checking the file first."""
        notify = _Notifier(session.path, progress)
        _check_unchanged(session)
        checksum, _ = self._hash(session.path, session.size, notify)
        if checksum != session.checksum:
            raise FileChanged(f"{session.path} changed since its upload started")
        return self._drive(session, notify, Backoff(self.retry))

    def pending(self) -> list[UploadSession]:
        """Uploads to this receiver that were started and have no receipt yet."""
        return [s for s in self.states.sessions() if s.files_url == self.files_url]

    def receipt(self, object_id: str) -> Receipt:
        """The receipt of an accepted object (retrying transient failures);
        :class:`UnknownObject` when the server has none."""
        backoff = Backoff(self.retry)
        while True:
            backoff.check()
            try:
                found = self._try_receipt(object_id, self.timeouts.read)
            except _Transient as e:
                backoff.wait(str(e), e.retry_after)
                continue
            except requests.RequestException as e:
                backoff.wait(f"GET receipt: {_describe(e)}")
                continue
            if found is None:
                raise UnknownObject(f"the server has no receipt for {object_id}")
            return found

    def status(self, object_id: str) -> ObjectStatus:
        """Delivery status of an accepted object (``GET /api/v1/objects/{id}``)."""
        url = f"{self.base_url}/api/v1/objects/{quote(object_id, safe='')}"
        backoff = Backoff(self.retry)
        while True:
            backoff.check()
            try:
                r = self._request("GET", url, timeout=self._timeout(self.timeouts.read))
            except requests.RequestException as e:
                backoff.wait(f"GET status: {_describe(e)}")
                continue
            if r.status_code == 200:
                return _parse_status(object_id, r)
            if r.status_code == 404:
                if not r.headers.get("Content-Type", "").startswith("application/json"):
                    raise EndpointMissing(
                        f"{self.base_url} does not offer GET /api/v1/objects/{{id}} "
                        "(the receiver is older than this client)"
                    )
                raise UnknownObject(f"the server knows no object {object_id}")
            error = _classify(r, "GET status")
            if isinstance(error, _Transient):
                backoff.wait(str(error), error.retry_after)
                continue
            if isinstance(error, _Gone):
                raise UnknownObject(f"the server knows no object {object_id}")
            raise error

    # -- HTTP ------------------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            adapter = _Adapter()
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            session.headers["User-Agent"] = f"canner-client/{__version__}"
            session.headers["Tus-Resumable"] = TUS_VERSION
            self._local.session = session
        return session

    def _timeout(self, read: float) -> tuple[float, float]:
        return (self.timeouts.connect, read)

    def _request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        response = self._session().request(method, url, allow_redirects=False, **kwargs)
        response.close()
        return response

    # -- the steps of an upload ------------------------------------------------------------------

    def _hash(self, path: str, size: int, notify: _Notifier) -> tuple[str, int]:
        notify.emit("hashing", 0, size)
        checksum, hashed = blake3_file(path, lambda done: notify.emit("hashing", done, size))
        return checksum, hashed

    def _create(
        self,
        path: str,
        project: str,
        filename: str | None,
        checksum: str | None,
        notify: _Notifier,
        backoff: Backoff,
    ) -> UploadSession:
        before = os.stat(path)
        if checksum is None:
            checksum, _ = self._hash(path, before.st_size, notify)
        after = os.stat(path)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise FileChanged(f"{path} changed while it was being hashed")
        name = os.path.basename(path) if filename is None else filename
        metadata = _metadata([("project", project), ("checksum", checksum), ("filename", name)])
        headers = {"Upload-Length": str(after.st_size), "Upload-Metadata": metadata}
        notify.emit("uploading", 0, after.st_size)
        while True:
            backoff.check()
            try:
                r = self._request(
                    "POST",
                    self.files_url,
                    headers=headers,
                    timeout=self._timeout(self.timeouts.read),
                )
            except requests.RequestException as e:
                message = f"POST: {_describe(e)}"
                notify.emit("waiting", 0, after.st_size, None, message)
                backoff.wait(message, refused_at=self._address if _refused(e) else None)
                continue
            backoff.answered = True
            if r.status_code == 201 and r.headers.get("Location"):
                break
            error = _classify(r, "upload creation")
            if isinstance(error, _Transient):
                notify.emit("waiting", 0, after.st_size, None, str(error))
                backoff.wait(str(error), error.retry_after)
                continue
            if isinstance(error, _Gone):
                raise UploadRefused(error.status, str(error), "upload creation")
            raise error
        session = UploadSession(
            files_url=self.files_url,
            project=project,
            path=path,
            size=after.st_size,
            mtime_ns=after.st_mtime_ns,
            checksum=checksum,
            filename=name,
            upload_url=urljoin(self.files_url, r.headers["Location"]),
            created_at=time.time(),
        )
        self.states.save(session)
        return session

    def _drive(
        self,
        session: UploadSession,
        notify: _Notifier,
        backoff: Backoff,
        offset: int | None = None,  # None: ask the server (HEAD) first
        resuming: bool = False,  # an upload started earlier: say where it goes on from
    ) -> Receipt:
        """Bring ``session`` to its receipt: HEAD, PATCH, and receipt recovery, with retries."""
        size, oid = session.size, session.object_id
        lost = 0
        # Bytes handed to the socket by the last PATCH: once all were, the server may be busy
        # accepting, and a HEAD (which a receiver may hold until then) gets a long timeout.
        reached = [0]
        with open(session.path, "rb") as f:
            while True:
                backoff.check()
                try:
                    if offset is None:
                        wait = self.timeouts.acceptance if reached[0] >= size else None
                        offset, receipt = self._head(session, wait)
                        backoff.answered = True
                        if resuming and receipt is None and offset is not None:
                            # Said once: the bytes before ``offset`` are not sent again.
                            notify.emit("resuming", offset, size, oid)
                        resuming = False
                    elif offset < size:
                        _check_unchanged(session)
                        reached[0] = offset
                        offset, receipt = self._patch(session, f, offset, notify, backoff, reached)
                    else:
                        reached[0] = size
                        notify.emit("accepting", size, size, oid)
                        receipt = self._recover_receipt(session)
                        if receipt is None:
                            # The server has every byte and no receipt: accepting still, or
                            # waiting for a final request to accept it.  Ask again shortly.
                            raise _Transient("the server is still accepting the upload")
                    if receipt is not None:
                        return self._finish(session, receipt, notify)
                except _Transient as e:
                    offset = None
                    backoff.answered = True
                    notify.emit("waiting", 0, size, oid, str(e))
                    backoff.wait(str(e), e.retry_after)
                except requests.RequestException as e:
                    offset = None
                    message = _describe(e)
                    notify.emit("waiting", 0, size, oid, message)
                    backoff.wait(message, refused_at=self._address if _refused(e) else None)
                except _Gone as e:
                    offset = None
                    backoff.answered = True
                    receipt = self._receipt_or_none(oid)
                    if receipt is not None:
                        return self._finish(session, receipt, notify)
                    if e.status == 410:
                        self.states.remove(session)
                        raise UploadRefused(
                            410, f"the server rejected this upload for good ({e})"
                        ) from None
                    lost += 1
                    if lost >= _LOST_CHECKS:
                        raise UploadLost(
                            f"the server no longer knows upload {oid} and has no receipt for it"
                        ) from None
                    backoff.wait(f"upload {oid} not found")

    def _head(
        self, session: UploadSession, wait: float | None = None
    ) -> tuple[int | None, Receipt | None]:
        read = self.timeouts.read if wait is None else wait
        r = self._request("HEAD", session.upload_url, timeout=self._timeout(read))
        if r.status_code != 200:
            raise _classify(r, "HEAD")
        receipt = _receipt_header(r)
        if receipt is not None:
            return session.size, receipt
        length = r.headers.get("Upload-Length")
        if length is not None and length.isdigit() and int(length) != session.size:
            raise ReceiptMismatch(
                f"upload {session.upload_url} has length {length}, the file {session.size}"
            )
        offset = r.headers.get("Upload-Offset", "")
        if not offset.isdigit() or int(offset) > session.size:
            raise _Transient(f"HEAD answered an unusable Upload-Offset {offset!r}")
        return int(offset), None

    def _patch(
        self,
        session: UploadSession,
        f: Any,
        offset: int,
        notify: _Notifier,
        backoff: Backoff,
        position: list[int],
    ) -> tuple[int | None, Receipt | None]:
        """One PATCH from ``offset``; ``position[0]`` follows the bytes handed to the socket."""
        size = session.size
        length = size - offset
        if self.chunk_size is not None:
            length = min(length, self.chunk_size)
        final = offset + length == size

        def sent(n: int) -> None:
            position[0] += n
            notify.emit("uploading", position[0], size, session.object_id)

        notify.emit("uploading", offset, size, session.object_id)
        r = self._request(
            "PATCH",
            session.upload_url,
            headers={"Upload-Offset": str(offset), "Content-Type": OFFSET_TYPE},
            data=_Body(f, offset, length, sent),
            timeout=self._timeout(self.timeouts.acceptance if final else self.timeouts.read),
        )
        if r.status_code != 204:
            raise _classify(r, "PATCH")
        receipt = _receipt_header(r)
        if receipt is not None:
            return size, receipt
        new = r.headers.get("Upload-Offset", "")
        if not new.isdigit():
            raise _Transient(f"PATCH answered an unusable Upload-Offset {new!r}")
        if int(new) > offset:
            backoff.progressed()
        # Complete without a receipt cannot be the answer of a final PATCH; ask the server.
        return (int(new) if int(new) < size else None), None

    def _recover_receipt(self, session: UploadSession) -> Receipt | None:
        """All bytes are stored: the receipt if it exists, else an empty final PATCH, which
        joins a running acceptance (or starts one) and answers with the receipt."""
        found = self._try_receipt(session.object_id, self.timeouts.acceptance)
        if found is not None:
            return found
        r = self._request(
            "PATCH",
            session.upload_url,
            headers={"Upload-Offset": str(session.size), "Content-Type": OFFSET_TYPE},
            data=b"",
            timeout=self._timeout(self.timeouts.acceptance),
        )
        if r.status_code != 204:
            raise _classify(r, "final PATCH")
        return _receipt_header(r)

    def _try_receipt(self, object_id: str, timeout: float) -> Receipt | None:
        url = f"{self.base_url}/api/v1/receipts/{quote(object_id, safe='')}"
        r = self._request("GET", url, timeout=self._timeout(timeout))
        if r.status_code == 200:
            try:
                return Receipt.from_json(r.content)
            except ValueError as e:
                raise _Transient(f"GET receipt answered no receipt: {e}") from None
        if r.status_code == 404:
            return None
        error = _classify(r, "GET receipt")
        if isinstance(error, _Gone):
            return None
        raise error

    def _receipt_or_none(self, object_id: str) -> Receipt | None:
        try:
            return self._try_receipt(object_id, self.timeouts.read)
        except (_Transient, requests.RequestException, CannerError):
            return None

    def _finish(self, session: UploadSession, receipt: Receipt, notify: _Notifier) -> Receipt:
        problems = []
        if receipt.object_id != session.object_id:
            problems.append(f"object id {receipt.object_id} (expected {session.object_id})")
        if receipt.checksum != session.checksum:
            problems.append(f"checksum {receipt.checksum} (expected {session.checksum})")
        if receipt.size_bytes != session.size:
            problems.append(f"size {receipt.size_bytes} (expected {session.size})")
        if problems:
            raise ReceiptMismatch(f"the receipt for {session.path} has " + "; ".join(problems))
        self.states.remove(session)
        notify.emit("done", session.size, session.size, session.object_id)
        return receipt


class _Notifier:
    def __init__(self, path: str, callback: ProgressCallback | None) -> None:
        self.path = path
        self._callback = callback

    def emit(
        self,
        phase: str,
        done: int,
        total: int,
        object_id: str | None = None,
        message: str | None = None,
    ) -> None:
        if self._callback is not None:
            self._callback(ProgressEvent(self.path, phase, done, total, object_id, message))


def _check_unchanged(session: UploadSession) -> None:
    try:
        st = os.stat(session.path)
    except FileNotFoundError:
        raise FileChanged(f"{session.path} no longer exists") from None
    if (st.st_size, st.st_mtime_ns) != (session.size, session.mtime_ns):
        raise FileChanged(
            f"{session.path} changed since its upload started (size or modification time); "
            "rerun with --restart to upload it as a new object"
        )


def _metadata(pairs: list[tuple[str, str]]) -> str:
    return ",".join(
        f"{key} {base64.b64encode(value.encode('utf-8')).decode('ascii')}" for key, value in pairs
    )


def _receipt_header(response: requests.Response) -> Receipt | None:
    value = response.headers.get("Artifact-Receipt")
    if not value:
        return None
    try:
        return Receipt.from_header(value)
    except ValueError as e:
        raise _Transient(f"unusable Artifact-Receipt: {e}") from None


def _parse_status(object_id: str, response: requests.Response) -> ObjectStatus:
    try:
        doc = response.json()
    except ValueError:
        raise CannerError(f"GET /api/v1/objects/{object_id} answered no JSON") from None
    if not isinstance(doc, dict):
        raise CannerError(f"GET /api/v1/objects/{object_id} answered no JSON object")
    nested = doc.get("receipt")
    source: dict[str, Any] = nested if isinstance(nested, dict) else doc
    try:
        receipt: Receipt | None = Receipt.from_dict({name: source[name] for name in FIELDS})
    except (KeyError, ValueError):
        receipt = None

    def part(name: str) -> dict[str, Any]:
        value = doc.get(name)
        return value if isinstance(value, dict) else {}

    archived = doc.get("archived")
    return ObjectStatus(
        object_id=object_id,
        receipt=receipt,
        project=doc.get("project") if isinstance(doc.get("project"), str) else None,
        delivery=part("delivery"),
        payload=part("payload"),
        hq=part("hq"),
        archived=archived if isinstance(archived, dict) else None,
        raw=doc,
    )
