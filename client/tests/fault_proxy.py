"""A loopback HTTP/1.1 proxy that puts a volunteer's network between the client and a receiver.

Every client connection carries one request: the proxy forwards it upstream with
``Connection: close`` and relays the answer byte for byte, unless a queued :class:`Fault` matches
the request.  Faults: answer with a status of our own (429/503 with ``Retry-After``), cut the
connection after some body bytes, stall the body (forward some bytes, then swallow the rest
until released), or drop the response (the request reached the receiver, the answer never
reaches the client).  The proxy counts the body bytes it forwarded, per request.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Match = Callable[["Request"], bool]


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]  # names lower-cased
    length: int
    forwarded: int = 0  # body bytes sent upstream
    status: int | None = None  # the status the client saw (None: no answer)
    fault: str | None = None

    @property
    def offset(self) -> int | None:
        value = self.headers.get("upload-offset")
        return int(value) if value is not None else None


@dataclass
class Fault:
    """One fault, applied to the next ``times`` requests that ``match``.

    ``kind``: ``reply`` (answer ``status`` with ``headers``, never forward), ``delay`` (forward
    after ``delay`` seconds, like a receiver that holds a request), ``cut`` (close both
    sides after ``after`` body bytes), ``stall`` (forward ``after`` body bytes, swallow the rest
    until ``release`` is set or the client goes away, then close), ``drop`` (forward, then close
    the client's connection instead of answering when the answer has ``drop_if_header``).
    """

    kind: str
    match: Match
    times: int = 1
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    after: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    drop_if_header: str | None = None
    delay: float = 0.0
    reached: threading.Event = field(default_factory=threading.Event)  # set when applied


def is_method(method: str) -> Match:
    return lambda r: r.method == method


def final_patch(size: int) -> Match:
    """The PATCH that carries the last byte of a ``size``-byte upload (not an empty one)."""
    return lambda r: r.method == "PATCH" and r.length > 0 and (r.offset or 0) + r.length == size


class FaultProxy:
    """Listens on 127.0.0.1 (a free port) in front of ``127.0.0.1:upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self.requests: list[Request] = []
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def patch_bytes(self) -> int:
        """PATCH body bytes forwarded to the receiver so far."""
        with self._lock:
            return sum(r.forwarded for r in self.requests if r.method == "PATCH")

    def seen(self, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if method is None or r.method == method]

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for fault in self._faults:
                fault.release.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join(5)
        for thread in self._threads:
            thread.join(5)

    # -- the relay -------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _take(self, request: Request) -> Fault | None:
        with self._lock:
            self.requests.append(request)
            for fault in self._faults:
                if fault.times > 0 and fault.match(request):
                    fault.times -= 1
                    request.fault = fault.kind
                    fault.reached.set()
                    return fault
        return None

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(60)
        upstream: socket.socket | None = None
        try:
            reader = client.makefile("rb")
            request, head = _read_request(reader)
            if request is None:
                return
            fault = self._take(request)
            if fault is not None and fault.kind == "reply":
                _drain(reader, request.length)
                extra = "".join(f"{k}: {v}\r\n" for k, v in fault.headers.items())
                body = b"" if request.method == "HEAD" else b"injected fault\n"
                client.sendall(
                    f"HTTP/1.1 {fault.status} Injected\r\nTus-Resumable: 1.0.0\r\n{extra}"
                    f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n".encode()
                    + body
                )
                request.status = fault.status
                return
            if fault is not None and fault.kind == "delay":
                time.sleep(fault.delay)
            upstream = socket.create_connection(self.upstream, timeout=60)
            upstream.sendall(head)
            limit = fault.after if fault is not None and fault.kind in ("cut", "stall") else None
            self._forward_body(reader, upstream, request, limit)
            if fault is not None and fault.kind == "cut":
                return
            if fault is not None and fault.kind == "stall":
                client.settimeout(0.05)
                while not fault.release.wait(0.05):
                    if not _drain_some(reader):
                        break  # the client went away
                return
            response = _read_all(upstream)
            head_end = response.find(b"\r\n\r\n")
            status_line = response[: response.find(b"\r\n")].split()
            response_head = response[:head_end].decode("latin-1").lower()
            if (
                fault is not None
                and fault.kind == "drop"
                and (
                    fault.drop_if_header is None
                    or f"\n{fault.drop_if_header.lower()}:" in response_head
                )
            ):
                return
            if len(status_line) >= 2 and status_line[1].isdigit():
                request.status = int(status_line[1])
            client.sendall(response)
        except OSError:
            pass
        finally:
            if upstream is not None:
                upstream.close()
            client.close()

    def _forward_body(
        self, reader: object, upstream: socket.socket, request: Request, limit: int | None
    ) -> None:
        left = request.length if limit is None else min(limit, request.length)
        read = reader.read  # type: ignore[attr-defined]
        while left > 0:
            block = read(min(left, 1 << 20))
            if not block:
                break
            upstream.sendall(block)
            left -= len(block)
            with self._lock:
                request.forwarded += len(block)


def _read_request(reader: object) -> tuple[Request | None, bytes]:
    readline = reader.readline  # type: ignore[attr-defined]
    line = readline(65536)
    if not line:
        return None, b""
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    lines = [line]
    while True:
        raw = readline(65536)
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        if name.strip().lower() == "connection":
            continue
        headers[name.strip().lower()] = value.strip()
        lines.append(raw)
    lines.append(b"Connection: close\r\n\r\n")
    length = int(headers.get("content-length", "0"))
    return Request(method, target, headers, length), b"".join(lines)


def _drain(reader: object, n: int) -> None:
    read = reader.read  # type: ignore[attr-defined]
    while n > 0:
        block = read(min(n, 1 << 20))
        if not block:
            return
        n -= len(block)


def _drain_some(reader: object) -> bool:
    """Swallow what the client sends; False once it closed its side."""
    try:
        return bool(reader.read1(1 << 20))  # type: ignore[attr-defined]
    except TimeoutError:
        return True


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        block = sock.recv(1 << 16)
        if not block:
            return b"".join(chunks)
        chunks.append(block)
