"""A tus client that follows the published rules of the Go canner's client SDK (which saveweb's
workers use), written here so the e2e suite can hold canner to them:

- ``Location`` is resolved against the creation URL and must be same-origin;
- HEAD must answer 200 (anything else ends the upload, 423 included);
- only 429, 503, 409 and transport errors are retried (409 by asking HEAD again);
- each PATCH sends the whole remainder of the file.

Faults a worker meets are injected on request: ``stall_first_patch_after`` sends that many body
bytes of the first PATCH and then goes silent without closing (a half-open connection, as when a
worker's network changes), ``drop_final_answer`` sends the last PATCH whole and hangs up without
reading the answer (a proxy or a reset lost it).
"""

from __future__ import annotations

import base64
import http.client
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import blake3

RETRIED = (409, 429, 503)


class UploadFailed(Exception):
    """The SDK gives up: what the worker would report."""


@dataclass
class GoStyleClient:
    files_url: str
    project: str = "example"
    max_attempts: int = 60
    # Retry-After is honoured up to this many seconds (tests need not wait a minute).
    max_wait: float = 0.5
    stall_first_patch_after: int | None = None
    drop_final_answer: bool = False
    source_address: str | None = None
    log: list[str] = field(default_factory=list)
    _stalled: list[socket.socket] = field(default_factory=list)

    def close(self) -> None:
        for sock in self._stalled:
            sock.close()

    # -- the upload ---------------------------------------------------------------------------

    def upload(self, data: bytes, filename: str = "x.warc.gz") -> bytes:
        """Upload ``data``; return the receipt JSON from ``Artifact-Receipt``."""
        checksum = "blake3:" + blake3.blake3(data).hexdigest()
        url = self._create(len(data), checksum, filename)
        for _ in range(self.max_attempts):
            status, headers = self._exchange("HEAD", url)
            if status in (429, 503):
                self._wait(headers)
                continue
            if status != 200:
                raise UploadFailed(f"HEAD {url} answered {status}")
            if "artifact-receipt" in headers:
                return _receipt(headers)
            offset = int(headers["upload-offset"])
            status, headers = self._patch(url, offset, data)
            if status == 204 and "artifact-receipt" in headers:
                return _receipt(headers)
            if status == 204 or status == 0:
                continue  # incomplete, or a transport error: HEAD again
            if status not in RETRIED:
                raise UploadFailed(f"PATCH {url} at {offset} answered {status}")
            if status != 409:
                self._wait(headers)
        raise UploadFailed(f"no receipt after {self.max_attempts} attempts")

    def _create(self, size: int, checksum: str, filename: str) -> str:
        metadata = ",".join(
            f"{k} {base64.b64encode(v.encode()).decode()}"
            for k, v in (("project", self.project), ("checksum", checksum), ("filename", filename))
        )
        for _ in range(self.max_attempts):
            status, headers = self._exchange(
                "POST",
                self.files_url,
                {"Upload-Length": str(size), "Upload-Metadata": metadata},
            )
            if status == 201:
                location = urljoin(self.files_url, headers["location"])
                if _origin(location) != _origin(self.files_url):
                    raise UploadFailed(f"cross-origin Location {headers['location']!r}")
                return location
            if status in (0, 429, 503):
                self._wait(headers)
                continue
            raise UploadFailed(f"creation answered {status}")
        raise UploadFailed("could not create the upload")

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
        return self._exchange("PATCH", url, headers, body)

    # -- HTTP -----------------------------------------------------------------------------------

    def _connection(self, url: str, timeout: float = 60.0) -> http.client.HTTPConnection:
        parts = urlsplit(url)
        source = (self.source_address, 0) if self.source_address else None
        return http.client.HTTPConnection(
            parts.hostname, parts.port, timeout=timeout, source_address=source
        )

    def _exchange(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> tuple[int, dict[str, str]]:
        """(status, lower-cased headers); status 0 for a transport error."""
        conn = self._connection(url)
        try:
            conn.request(
                method,
                urlsplit(url).path,
                body=body if body is not None else (b"" if method != "HEAD" else None),
                headers={"Tus-Resumable": "1.0.0", **(headers or {})},
            )
            resp = conn.getresponse()
            resp.read()
            result = resp.status, {k.lower(): v for k, v in resp.getheaders()}
        except OSError as e:
            self.log.append(f"{method} transport error: {e!r}")
            return 0, {}
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
        lines += [f"{k}: {v}" for k, v in headers.items()]
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
        try:
            wanted = float(headers.get("retry-after", "0.1"))
        except ValueError:
            wanted = 0.1
        time.sleep(min(max(wanted, 0.05), self.max_wait))


def _receipt(headers: dict[str, str]) -> bytes:
    value = headers["artifact-receipt"]  # unpadded base64url of the receipt JSON
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port
