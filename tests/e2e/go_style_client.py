"""A tus client that follows the published rules of the Go canner's client SDK (which saveweb's
workers use) to the letter, written here so the e2e suite can hold canner to them
(``docs/reference/go-canner.md``, section 1.17):

- ``New(base)``: the base must be absolute http(s) with a host; query and fragment are dropped;
- creation POSTs ``{base}/files/``; 429 and 503 are waited out, a transport error is fatal (the
  upload may exist), anything but 201 is fatal;
- ``Location`` is resolved against the **base URL** (not the creation URL) and must be
  same-origin; the object id is its unescaped last path segment;
- HEAD must answer 200 with ``Upload-Length`` equal to the size and ``Upload-Offset`` in
  [0, size]; 429/503 are waited out, a transport error waits ``retry_delay``, anything else
  (404, 423, 500) is fatal; offset == size fetches ``{base}/api/v1/receipts/{id}``, whose
  failure is fatal;
- each PATCH sends the whole remainder; 204 decodes ``Artifact-Receipt`` (or fetches the
  receipt when it is absent); 409, 429 and 503 are waited out; a transport error waits
  ``retry_delay``; anything else is fatal;
- a receipt is checked for ``object_id``, ``checksum`` and ``size_bytes``.

The one liberty: ``Retry-After`` is honoured up to ``max_wait`` seconds, so tests need not wait
a minute.  Faults a worker meets are injected on request: ``stall_first_patch_after`` sends that
many body bytes of the first PATCH and then goes silent without closing (a half-open
connection, as when a worker's network changes), ``drop_final_answer`` sends the last PATCH
whole and hangs up without reading the answer (a proxy or a reset lost it).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urljoin, urlsplit, urlunsplit

import blake3

WAITED = (429, 503)


class UploadFailed(Exception):
    """The SDK gives up: what the worker would report."""


@dataclass
class GoStyleClient:
    base_url: str
    project: str = "example"
    max_attempts: int = 60
    # Retry-After is honoured up to this many seconds (tests need not wait a minute).
    max_wait: float = 0.5
    # The SDK's RetryDelay (1 s there): the wait after a transport error or without Retry-After.
    retry_delay: float = 0.1
    stall_first_patch_after: int | None = None
    drop_final_answer: bool = False
    source_address: str | None = None
    # For an https base: the context that checks the server's certificate.
    ssl_context: ssl.SSLContext | None = None
    # Sent with every request, as a proxy in front of canner would add them.
    extra_headers: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    _stalled: list[socket.socket] = field(default_factory=list)

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the base URL must be absolute http(s): {self.base_url!r}")
        self.base_url = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))

    def close(self) -> None:
        for sock in self._stalled:
            sock.close()

    # -- the upload ---------------------------------------------------------------------------

    def upload(self, data: bytes, filename: str = "x.warc.gz") -> bytes:
        """Upload ``data``; return the receipt JSON, checked against the session."""
        checksum = "blake3:" + blake3.blake3(data).hexdigest()
        url = self._create(len(data), checksum, filename)
        object_id = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
        session = {"object_id": object_id, "checksum": checksum, "size_bytes": len(data)}
        return self._resume(url, data, session)

    def resume(self, session: dict[str, object], data: bytes) -> bytes:
        """The SDK's ``Resume``: a worker's saved session (``upload_url``, ``object_id``,
        ``checksum``, ``size_bytes``) checked as ``validateSession`` does, the content hashed
        again, then the same loop as an upload; return the receipt JSON."""
        url = urljoin(self.base_url, str(session["upload_url"]))
        if _origin(url) != _origin(self.base_url):
            raise UploadFailed("invalid upload session")
        object_id = str(session["object_id"])
        if unquote(urlsplit(url).path.rsplit("/", 1)[-1]) != object_id:
            raise UploadFailed("invalid upload session")
        checksum = str(session["checksum"])
        if not checksum.startswith("blake3:") or len(checksum) != 7 + 64:
            raise UploadFailed("invalid upload session checksum")
        size = session["size_bytes"]
        if not isinstance(size, int) or size < 1:
            raise UploadFailed("invalid upload session")
        if len(data) != size or "blake3:" + blake3.blake3(data).hexdigest() != checksum:
            raise UploadFailed("artifact changed since upload creation")
        # validateReceipt compares only these with the receipt.
        checked = {"object_id": object_id, "checksum": checksum, "size_bytes": size}
        return self._resume(url, data, checked)

    def _resume(self, url: str, data: bytes, session: dict[str, object]) -> bytes:
        object_id = str(session["object_id"])
        for _ in range(self.max_attempts):
            status, headers, _ = self._exchange("HEAD", url)
            if status == 0:
                time.sleep(self.retry_delay)
                continue
            if status in WAITED:
                self._wait(headers)
                continue
            if status != 200:
                raise UploadFailed(f"HEAD {url} answered {status}")
            offset = _head_offset(headers, len(data))
            if offset == len(data):
                return self._receipt(object_id, session, "upload is complete but")
            status, headers = self._patch(url, offset, data)
            if status == 204:
                if "artifact-receipt" in headers:
                    return _checked(_decode_receipt(headers["artifact-receipt"]), session)
                return self._receipt(object_id, session, "PATCH answered 204 but")
            if status == 0:
                time.sleep(self.retry_delay)
                continue
            if status not in (409, *WAITED):
                raise UploadFailed(f"PATCH {url} at {offset} answered {status}")
            self._wait(headers)
        raise UploadFailed(f"no receipt after {self.max_attempts} attempts")

    def _files_url(self) -> str:
        return self.base_url.rstrip("/") + "/files/"

    def _create(self, size: int, checksum: str, filename: str) -> str:
        metadata = ",".join(
            f"{k} {base64.b64encode(v.encode()).decode()}"
            for k, v in (("project", self.project), ("checksum", checksum), ("filename", filename))
        )
        for _ in range(self.max_attempts):
            status, headers, _ = self._exchange(
                "POST",
                self._files_url(),
                {"Upload-Length": str(size), "Upload-Metadata": metadata},
            )
            if status == 201:
                location = urljoin(self.base_url, headers["location"])
                if _origin(location) != _origin(self.base_url):
                    raise UploadFailed(f"cross-origin upload location {headers['location']!r}")
                return location
            if status == 0:
                raise UploadFailed("creation: transport error (not retried: ambiguous)")
            if status in WAITED:
                self._wait(headers)
                continue
            raise UploadFailed(f"creation answered {status}")
        raise UploadFailed("could not create the upload")

    def _receipt(self, object_id: str, session: dict[str, object], context: str) -> bytes:
        url = self.base_url.rstrip("/") + "/api/v1/receipts/" + quote(object_id, safe="")
        status, _, body = self._exchange("GET", url)
        if status != 200:
            raise UploadFailed(f"{context} receipt is unavailable ({status})")
        return _checked(body, session)

    def _patch(self, url: str, offset: int, data: bytes) -> tuple[int, dict[str, str]]:
        body = data[offset:]
        headers = {"Upload-Offset": str(offset), "Content-Type": "application/offset+octet-stream"}
        if self.stall_first_patch_after is not None:
            count, self.stall_first_patch_after = self.stall_first_patch_after, None
            self._stall(url, headers, body, count)
            return 0, {}
        if self.drop_final_answer:
            self.drop_final_answer = False
            self._send_and_hang_up(url, headers, body)
            return 0, {}
        status, headers, _ = self._exchange("PATCH", url, headers, body)
        return status, headers

    # -- HTTP -----------------------------------------------------------------------------------

    def _connection(self, url: str, timeout: float = 60.0) -> http.client.HTTPConnection:
        parts = urlsplit(url)
        source = (self.source_address, 0) if self.source_address else None
        if parts.scheme == "https":
            return http.client.HTTPSConnection(
                parts.hostname,
                parts.port,
                timeout=timeout,
                source_address=source,
                context=self.ssl_context,
            )
        return http.client.HTTPConnection(
            parts.hostname, parts.port, timeout=timeout, source_address=source
        )

    def _exchange(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body); status 0 for a transport error."""
        conn = self._connection(url)
        try:
            conn.request(
                method,
                urlsplit(url).path,
                body=body if body is not None else (b"" if method in ("POST", "PATCH") else None),
                headers={"Tus-Resumable": "1.0.0", **self.extra_headers, **(headers or {})},
            )
            resp = conn.getresponse()
            content = resp.read(64 * 1024)
            result = resp.status, {k.lower(): v for k, v in resp.getheaders()}, content
        except OSError as e:
            self.log.append(f"{method} transport error: {e!r}")
            return 0, {}, b""
        finally:
            conn.close()
        self.log.append(f"{method} {result[0]}")
        return result

    def _raw_head(self, url: str, headers: dict[str, str], length: int) -> socket.socket:
        parts = urlsplit(url)
        source = (self.source_address, 0) if self.source_address else None
        sock = socket.create_connection(
            (parts.hostname, parts.port), timeout=60, source_address=source
        )
        lines = [f"PATCH {parts.path} HTTP/1.1", f"Host: {parts.netloc}", "Tus-Resumable: 1.0.0"]
        lines += [f"{k}: {v}" for k, v in {**self.extra_headers, **headers}.items()]
        lines += [f"Content-Length: {length}", "", ""]
        sock.sendall("\r\n".join(lines).encode("ascii"))
        return sock

    def _stall(self, url: str, headers: dict[str, str], body: bytes, count: int) -> None:
        sock = self._raw_head(url, headers, len(body))
        sock.sendall(body[:count])
        self._stalled.append(sock)  # kept open and silent: the server sees no FIN
        self.log.append(f"PATCH stalled after {count} bytes")

    def _send_and_hang_up(self, url: str, headers: dict[str, str], body: bytes) -> None:
        with self._raw_head(url, headers, len(body)) as sock:
            sock.sendall(body)
        self.log.append("PATCH sent whole, answer dropped")

    def _wait(self, headers: dict[str, str]) -> None:
        """Retry-After in whole seconds (capped at ``max_wait``); without it, ``retry_delay``."""
        value = headers.get("retry-after", "")
        wanted = int(value) if value.isdigit() and int(value) > 0 else 0
        time.sleep(min(wanted, self.max_wait) if wanted else self.retry_delay)


def _head_offset(headers: dict[str, str], size: int) -> int:
    """HEAD's offset, as the SDK checks it: Upload-Length must be the size, offset in range."""
    length, offset = headers.get("upload-length", ""), headers.get("upload-offset", "")
    if not (length.isdigit() and offset.isdigit()) or int(length) != size:
        raise UploadFailed(f"HEAD answered Upload-Length {length!r}, Upload-Offset {offset!r}")
    if not 0 <= int(offset) <= size:
        raise UploadFailed(f"HEAD answered Upload-Offset {offset} outside [0, {size}]")
    return int(offset)


def _decode_receipt(value: str) -> bytes:
    """The SDK decodes ``Artifact-Receipt`` strictly as unpadded base64url."""
    if "=" in value:
        raise UploadFailed(f"Artifact-Receipt is padded: {value!r}")
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))


def _checked(receipt: bytes, session: dict[str, object]) -> bytes:
    """The SDK's validateReceipt: object_id, checksum and size_bytes match the session."""
    fields = json.loads(receipt)
    for key, wanted in session.items():
        if fields.get(key) != wanted:
            raise UploadFailed(f"receipt {key} {fields.get(key)!r} is not {wanted!r}")
    return receipt


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc
