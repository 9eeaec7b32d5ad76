"""Shared machinery of the end-to-end suite: a real ``twistd canner-receiver`` process and a
small tus client built on ``requests``, ``http.client`` and raw sockets.

Nothing here mocks anything: the receiver is started as a subprocess on a free loopback port with
its own temporary data directory, and every check goes through HTTP or reads the data directory
the way an operator would.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import requests
from prometheus_client.parser import text_string_to_metric_families

from canner.fs import lock_held

# Re-exported: the tests import them from here.
from tests.upload_checks import b64 as b64
from tests.upload_checks import blake3_hex as blake3_hex
from tests.upload_checks import metadata_header as metadata_header
from tests.upload_checks import snapshot as snapshot
from tests.upload_checks import upload_metadata as upload_metadata

REPO = Path(__file__).resolve().parents[2]
JS_DIR = Path(__file__).resolve().parent / "js"
ISSUER = "https://canner.test"
TUS_VERSION = "1.0.0"
OFFSET_TYPE = "application/offset+octet-stream"
RECEIPT_FIELDS = ["id", "issuer", "object_id", "checksum", "size_bytes", "accepted_at"]
OBJECT_ID = re.compile(r"[0-9a-f]{32}")
DEFAULT_MAX_UPLOAD = 64 * 1024 * 1024
HTTP_TIMEOUT = 30.0
START_TIMEOUT = 20.0
# A daemon launched behind this runs as the unprivileged user nobody, whom file permissions bind
# (the suite runs as root, who ignores them): see ``Nobody``.
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]


def parse_metadata(header: str) -> dict[str, str]:
    result = {}
    for pair in header.split(","):
        key, _, value = pair.strip().partition(" ")
        result[key] = base64.b64decode(value).decode("utf-8") if value else ""
    return result


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus endpoint, by name and labels."""
    text = requests.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Nobody:
    """How a test runs a daemon as the unprivileged user nobody: ``folder`` is a temporary
    directory nobody can reach, for its data; ``prefix`` and ``twistd`` launch it.  The
    repository may lie below a directory nobody cannot search (a 0700 temp directory), so it is
    bind-mounted into ``folder`` and the daemon runs from that mount."""

    folder: Path
    prefix: list[str]
    twistd: list[str]


# [receiver] workers of every receiver a test does not configure itself.
E2E_WORKERS = int(os.environ.get("CANNER_E2E_WORKERS", "1"))


def twistd_command() -> list[str]:
    candidate = Path(sys.executable).parent / "twistd"
    if not candidate.exists():
        candidate = REPO / ".venv" / "bin" / "twistd"
    return [str(candidate)]


def spawn_daemon(
    role: str,
    config_path: Path,
    log_path: Path,
    start: int,
    extra: Iterable[str] = (),
    prefix: Iterable[str] = (),
    twistd: Sequence[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``twistd --nodaemon canner-<role> --config ...`` from the repository root, its
    output appended to ``log_path`` under a "start #N" banner; ``prefix`` wraps the command
    (for example ``prlimit --nofile=1024``), ``twistd`` replaces the venv's script."""
    with open(log_path, "ab") as log:
        log.write(f"\n===== start #{start} =====\n".encode())
        log.flush()
        return subprocess.Popen(
            [
                *prefix,
                *(twistd if twistd is not None else twistd_command()),
                "--nodaemon",
                "--pidfile=",
                *extra,
                f"canner-{role}",
                "--config",
                str(config_path),
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


def end_process(
    proc: subprocess.Popen[bytes] | None, sig: int, timeout: float = 15.0
) -> int | None:
    """Send ``sig`` to ``proc`` (if it still runs) and wait for it to end, SIGKILL if it hangs;
    returns its exit status (None when there is no process)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


def decode_receipt_header(header: str) -> bytes:
    """The JSON bytes carried by an ``Artifact-Receipt`` header (unpadded base64url)."""
    assert re.fullmatch(r"[A-Za-z0-9_-]+", header), (
        f"Artifact-Receipt is not unpadded base64url: {header!r}"
    )
    return base64.urlsafe_b64decode(header + "=" * (-len(header) % 4))


def assert_tus_header(response: Any, what: str = "") -> None:
    """Every receiver response, errors included, carries ``Tus-Resumable: 1.0.0``."""
    value = response.headers.get("Tus-Resumable")
    status = getattr(response, "status_code", None) or getattr(response, "status", None)
    assert value == TUS_VERSION, (
        f"{what} response {status} lacks Tus-Resumable: 1.0.0 (got {value!r})"
    )


@dataclass
class RawResponse:
    """A response read with http.client (for requests that ``requests`` would rewrite)."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes


@dataclass
class Receiver:
    """One canner-receiver process with its own config and data directory."""

    root: Path
    port: int
    data_dir: Path
    config_path: Path
    log_path: Path
    config: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    session: requests.Session = field(default_factory=requests.Session)
    starts: int = 0
    launch_prefix: list[str] = field(default_factory=list)
    launch_twistd: list[str] | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    @classmethod
    def in_dir(cls, root: Path, data_dir: Path | None = None, **config: Any) -> Receiver:
        root.mkdir(parents=True, exist_ok=True)
        # Nested, so that a path traversal from uploads/ (../../x) still lands inside root.
        data_dir = data_dir or root / "srv" / "canner" / "data"
        rcv = cls(
            root=root,
            port=free_port(),
            data_dir=data_dir,
            config_path=root / "canner.toml",
            log_path=root / "receiver.log",
        )
        rcv.write_config(**config)
        return rcv

    def write_config(self, **overrides: Any) -> None:
        # The daemons refuse a missing data directory (a volume that is not mounted).
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "issuer": ISSUER,
            "data_dir": str(self.data_dir),
            "listen": f"tcp:{self.port}:interface=127.0.0.1",
            "max_upload_bytes": DEFAULT_MAX_UPLOAD,
            "min_free_bytes": 1,
            "partial_upload_retention": "30m",
            # One process, as before [receiver] workers existed; a test asks for more, and
            # CANNER_E2E_WORKERS runs a whole suite on nodes of that many workers.
            "receiver": {"workers": E2E_WORKERS},
        }
        config.update(overrides)
        self.config = config
        lines: list[str] = []
        tables = {k: v for k, v in config.items() if isinstance(v, dict)}
        for key, value in config.items():
            if key not in tables:
                lines.append(f"{key} = {_toml_value(value)}")
        for name, table in tables.items():
            lines += ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
        lines += ["", "[projects.example]", "", "[projects.other]", ""]
        self.config_path.write_text("\n".join(lines), encoding="utf-8")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def files_url(self) -> str:
        return f"{self.base_url}/files/"

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "uploads"

    @property
    def receipts_dir(self) -> Path:
        return self.data_dir / "receipts"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self.proc = spawn_daemon(
            "receiver",
            self.config_path,
            self.log_path,
            self.starts,
            prefix=self.launch_prefix,
            twistd=self.launch_twistd,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"canner-receiver exited with {self.proc.returncode} during start-up:\n"
                    + self.log_tail()
                )
            try:
                with requests.get(f"{self.base_url}/healthz", timeout=1.0) as r:
                    if r.status_code == 200:
                        return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(
                    f"canner-receiver did not answer /healthz within {timeout}s:\n"
                    + self.log_tail()
                )
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 15.0) -> int | None:
        """Send ``sig`` and wait for the process to end; returns its exit status.  A node's
        workers outlive a parent killed outright by a moment (they stop on the SIGTERM its death
        sends them) and hold ``receiver.lock`` until they end: wait for that too, as systemd
        waits for the unit's cgroup to empty before it starts the unit again."""
        status = end_process(self.proc, sig, timeout)
        lock = self.data_dir / "receiver.lock"
        deadline = time.monotonic() + timeout
        while lock_held(lock) and time.monotonic() < deadline:
            time.sleep(0.05)
        return status

    def stop(self) -> int | None:
        """Graceful stop (SIGTERM), SIGKILL if it hangs."""
        return self.kill(signal.SIGTERM)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        self.kill(sig)
        self.start()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.session.close()

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    # -- HTTP through requests --------------------------------------------------------------------

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", HTTP_TIMEOUT)
        if not url.startswith("http"):
            url = self.base_url + url
        response = self.session.request(method, url, **kwargs)
        response.close()
        assert_tus_header(response, f"{method} {url}")
        return response

    def create(
        self,
        length: int,
        checksum: str,
        project: str = "example",
        filename: str | None = None,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> requests.Response:
        h = {
            "Tus-Resumable": TUS_VERSION,
            "Upload-Length": str(length),
            "Upload-Metadata": upload_metadata(checksum, project, filename),
        }
        if body is not None:
            h["Content-Type"] = OFFSET_TYPE
        h.update(headers or {})
        return self.request("POST", self.files_url, headers=h, data=body)

    def new_upload(self, data: bytes, **kwargs: Any) -> str:
        """Create an upload for ``data`` (declaring its checksum); return its object id."""
        kwargs.setdefault("checksum", blake3_hex(data))
        r = self.create(len(data), **kwargs)
        assert r.status_code == 201, f"creation answered {r.status_code}: {r.text}"
        return self.object_id(r)

    def object_id(self, response: requests.Response) -> str:
        # Resolved against the creation URL, as every tus client does (it may be relative).
        location = urljoin(self.files_url, response.headers.get("Location", ""))
        match = re.fullmatch(re.escape(self.files_url) + r"([0-9a-f]{32})", location)
        assert match, f"unexpected Location {location!r}"
        return match.group(1)

    def upload_url(self, object_id: str) -> str:
        return self.files_url + object_id

    def patch(
        self,
        object_id: str,
        offset: int,
        data: Any,
        headers: Mapping[str, str] | None = None,
    ) -> requests.Response:
        h = {
            "Tus-Resumable": TUS_VERSION,
            "Upload-Offset": str(offset),
            "Content-Type": OFFSET_TYPE,
        }
        h.update(headers or {})
        return self.request("PATCH", self.upload_url(object_id), headers=h, data=data)

    def head(self, object_id: str, headers: Mapping[str, str] | None = None) -> requests.Response:
        h = {"Tus-Resumable": TUS_VERSION}
        h.update(headers or {})
        return self.request("HEAD", self.upload_url(object_id), headers=h)

    def get_receipt(self, object_id: str) -> requests.Response:
        return self.request("GET", f"/api/v1/receipts/{object_id}")

    def offset(self, object_id: str) -> int:
        r = self.head(object_id)
        assert r.status_code == 200, f"HEAD {object_id} answered {r.status_code}"
        return int(r.headers["Upload-Offset"])

    def wait_offset(self, object_id: str, expected: int, timeout: float = 5.0) -> int:
        """Poll HEAD until the offset is ``expected`` (bounded); returns the last offset seen."""
        deadline = time.monotonic() + timeout
        while True:
            offset = self.offset(object_id)
            if offset == expected or time.monotonic() > deadline:
                return offset
            time.sleep(0.02)

    def patch_retrying_locked(
        self, object_id: str, offset: int, data: bytes, timeout: float = 10.0
    ) -> requests.Response:
        """PATCH, retrying while the upload is locked (423) by a request that is winding down."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.patch(object_id, offset, data)
            if r.status_code != 423 or time.monotonic() > deadline:
                return r
            time.sleep(0.05)

    def upload_all(self, data: bytes, chunk: int | None = None, **kwargs: Any) -> tuple[str, str]:
        """Create and upload ``data``; return (object id, Artifact-Receipt of the final PATCH)."""
        oid = self.new_upload(data, **kwargs)
        offset, step = 0, chunk or len(data)
        while True:
            r = self.patch(oid, offset, data[offset : offset + step])
            assert r.status_code == 204, f"PATCH at {offset} answered {r.status_code}: {r.text}"
            offset = int(r.headers["Upload-Offset"])
            if offset == len(data):
                receipt = r.headers.get("Artifact-Receipt")
                assert receipt, "the final PATCH carries no Artifact-Receipt"
                return oid, receipt
            assert "Artifact-Receipt" not in r.headers, "a receipt before the upload is complete"

    # -- HTTP below requests ----------------------------------------------------------------------

    def raw(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str | bytes]] = (),
        body: bytes | None = None,
        skip_host: bool = False,
    ) -> RawResponse:
        """One request sent exactly as given (path and header values unmodified)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT)
        try:
            conn.putrequest(method, path, skip_host=skip_host, skip_accept_encoding=True)
            for name, value in headers:
                conn.putheader(name, value)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            data = resp.read()
            result = RawResponse(resp.status, resp.headers, data)
        finally:
            conn.close()
        assert_tus_header(result, f"{method} {path[:80]}")
        return result

    def open_patch(
        self, object_id: str, offset: int, content_length: int, first: bytes = b""
    ) -> socket.socket:
        """Start a PATCH over a raw socket: send its head and ``first``; the caller continues."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=HTTP_TIMEOUT)
        head = (
            f"PATCH /files/{object_id} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{self.port}\r\n"
            f"Tus-Resumable: {TUS_VERSION}\r\n"
            f"Upload-Offset: {offset}\r\n"
            f"Content-Type: {OFFSET_TYPE}\r\n"
            f"Content-Length: {content_length}\r\n"
            "\r\n"
        )
        try:
            sock.sendall(head.encode("ascii") + first)
        except BaseException:
            sock.close()
            raise
        return sock

    # -- the data directory -----------------------------------------------------------------------

    def stored(self, object_id: str) -> bytes:
        return (self.uploads_dir / object_id).read_bytes()

    def receipt_ids_on_disk(self) -> list[str]:
        return sorted(
            p.name[: -len(".json")]
            for p in self.receipts_dir.glob("*.json")
            if not p.name.endswith(".meta.json") and OBJECT_ID.fullmatch(p.name[: -len(".json")])
        )

    def upload_entries(self) -> set[str]:
        return set(os.listdir(self.uploads_dir))

    # -- receipts ---------------------------------------------------------------------------------

    def verify_receipt(
        self,
        header: str | None,
        object_id: str,
        data: bytes | None = None,
        checksum: str | None = None,
        size: int | None = None,
        not_before: float | None = None,
    ) -> dict[str, Any]:
        """Check an ``Artifact-Receipt`` the way a worker and HQ would; return the receipt."""
        assert header, f"no Artifact-Receipt for {object_id}"
        raw = decode_receipt_header(header)
        if data is not None:
            checksum, size = blake3_hex(data), len(data)
        served = self.get_receipt(object_id)
        assert served.status_code == 200, f"GET receipt {object_id}: {served.status_code}"
        assert served.headers.get("Content-Type", "").startswith("application/json")
        assert served.content == raw, (
            f"Artifact-Receipt differs from GET /api/v1/receipts/{object_id}:\n"
            f"  header: {raw!r}\n  GET:    {served.content!r}"
        )
        doc = json.loads(raw)
        assert list(doc) == RECEIPT_FIELDS, f"receipt fields {list(doc)}"
        assert raw == json.dumps(doc, separators=(",", ":")).encode(), "receipt JSON not compact"
        assert doc["id"] == f"receipt:{object_id}"
        assert doc["issuer"] == ISSUER
        assert doc["object_id"] == object_id
        if checksum is not None:
            assert doc["checksum"] == checksum
        if size is not None:
            assert doc["size_bytes"] == size
        assert type(doc["size_bytes"]) is int and doc["size_bytes"] >= 1
        assert type(doc["accepted_at"]) is int, f"accepted_at {doc['accepted_at']!r} not an int"
        now = time.time()
        lower = (not_before if not_before is not None else now - 3600) - 2
        assert lower <= doc["accepted_at"] <= now + 2, f"accepted_at {doc['accepted_at']}"
        on_disk = (self.receipts_dir / f"{object_id}.json").read_bytes()
        assert on_disk == raw, "receipts/{id}.json differs from the served receipt"
        stored = self.stored(object_id)
        assert len(stored) == doc["size_bytes"], "stored size differs from the receipt"
        assert blake3_hex(stored) == doc["checksum"], "stored bytes do not match the receipt"
        return doc


class Trickle:
    """A live writer: sends ``body`` on ``sock`` ``step`` bytes every ``interval`` seconds from
    a thread, until :meth:`stop` or the end of ``body`` (a stalled writer sends nothing)."""

    def __init__(self, sock: socket.socket, body: bytes, step: int = 64, interval: float = 0.1):
        self.sock, self.body, self.step, self.interval = sock, body, step, interval
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while self.sent < len(self.body) and not self._stop.wait(self.interval):
            self.sock.sendall(self.body[self.sent : self.sent + self.step])
            self.sent += len(self.body[self.sent : self.sent + self.step])

    def stop(self) -> int:
        """Stop sending; returns how many bytes of ``body`` were sent."""
        self._stop.set()
        self._thread.join()
        return self.sent


def raw_exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection and read until the server closes it (bounded)."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
    return received


def read_http_response(sock: socket.socket, method: str) -> tuple[int, dict[str, str], bytes]:
    """Read one response from a raw socket started with :meth:`Receiver.open_patch`."""
    resp = http.client.HTTPResponse(sock, method=method)
    try:
        resp.begin()
        body = resp.read()
        return resp.status, dict(resp.getheaders()), body
    finally:
        resp.close()
