"""An in-memory canner-receiver for unit tests, driven at the HTTP byte level.

:meth:`InMemoryReceiver.build` assembles the receiver's real Site the way
``canner.daemon.roots.receiver_service`` does (upload and receipt stores over a real data directory,
acceptance with its fsyncs, the intake, the doors, metrics, ``receiver_site``), with a
:class:`~twisted.internet.task.Clock` for time and :class:`HeldRunner` for blocking work.  This is
the tests' one copy of that wiring: when the composition changes, only :meth:`build` follows.

Clients connect in memory (``site.buildProtocol`` and a :class:`ClientTransport`): a test writes
raw request bytes, in as many pieces as it likes, advances the clock, and reads back the parsed
responses and whether the server closed, half-closed or aborted the connection.  What a reactor
would do between events (deliver ``connectionLost`` once a transport was asked to close, hold
back bytes while the server paused reading) is done by :meth:`InMemoryReceiver.settle`, which
every helper calls.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from attrs import define, field, frozen
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from canner.accept.intake import UploadIntake
from canner.blocking import run_inline
from canner.config import Config, parse_config
from canner.daemon.roots import receiver_parts
from canner.doors.base import DoorFactory
from canner.doors.router import DOORS
from canner.ops.metrics import RECEIVER, Metrics
from canner.ops.problems import RecentProblems
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import UploadStore
from canner.web.channel import ReceiverSite
from canner.web.connections import ConnectionLimits

# Re-exported: the tests import them from here.
from tests.upload_checks import b64 as b64
from tests.upload_checks import blake3_hex as blake3_hex
from tests.upload_checks import metadata_header as metadata_header
from tests.upload_checks import upload_metadata

P = ParamSpec("P")
T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB
ISSUER = "https://canner.test"
TUS_VERSION = "1.0.0"
OFFSET_TYPE = "application/offset+octet-stream"
MAX_UPLOAD = 64 * MiB
RECEIPT_FIELDS = ["id", "issuer", "object_id", "checksum", "size_bytes", "accepted_at"]
# The clock starts at a plausible date: receipts carry it.
START = 1784764800.0

Header = tuple[str, str | bytes]


def chunked(pieces: Iterable[bytes]) -> bytes:
    """A body in HTTP/1.1 chunked transfer coding, one chunk per piece."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    return out + b"0\r\n\r\n"


# -- blocking work --------------------------------------------------------------------------------


@define(eq=False)
class HeldRunner:
    """A :class:`~canner.blocking.BlockingRunner` that runs each call at once, like
    :func:`~canner.blocking.run_inline`, except while ``held``: then calls wait, in order, until
    :meth:`InMemoryReceiver.release` runs them."""

    held: bool = False
    _queue: list[tuple[Callable[[], Any], Deferred[Any]]] = field(factory=list)

    def __call__(self, f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        if not self.held:
            return run_inline(f, *args, **kwargs)
        waiter: Deferred[T] = Deferred()
        self._queue.append((partial(f, *args, **kwargs), waiter))
        return waiter

    @property
    def waiting(self) -> int:
        """How many calls are held."""
        return len(self._queue)

    def run_held(self) -> bool:
        """Run the oldest held call; False when none waits."""
        if not self._queue:
            return False
        call, waiter = self._queue.pop(0)
        run_inline(call).chainDeferred(waiter)
        return True


# -- the client side ------------------------------------------------------------------------------


class ClientTransport(StringTransport):
    """The server's view of one client socket: what it wrote, and how it ended the connection."""

    write_closed = False
    aborted = False

    def loseWriteConnection(self) -> None:
        # A half-close: the server sent its last byte but still reads.
        self.write_closed = True

    def abortConnection(self) -> None:
        self.aborted = True
        super().abortConnection()


@frozen
class Response:
    """One parsed HTTP response (interim ``1xx`` ones included)."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @property
    def status_line(self) -> str:
        return f"HTTP/1.1 {self.status} {self.reason}"

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def header(self, name: str) -> str | None:
        """The header's only value (None when absent; a repeated header fails the test)."""
        found = self.values(name)
        assert len(found) <= 1, f"{name} repeated: {found}"
        return found[0] if found else None

    def json(self) -> Any:
        return json.loads(self.body)


def parse_responses(data: bytes, methods: Sequence[bytes], closed: bool) -> list[Response]:
    """The complete responses in ``data``, which answer requests of ``methods`` in order (a
    HEAD answer has no body); a response delimited by the close counts once ``closed``."""
    responses: list[Response] = []
    pos, answered = 0, 0
    while (end := data.find(b"\r\n\r\n", pos)) >= 0:
        lines = data[pos:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        status, reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
        headers = tuple(
            (name.strip(), value.strip())
            for name, _, value in (line.partition(":") for line in lines[1:])
        )
        start = end + 4
        response = partial(Response, status, reason, headers)
        fields = {k.lower(): v for k, v in headers}
        method = methods[answered] if answered < len(methods) else b""
        if status < 200:
            responses.append(response(b""))
            pos = start
            continue
        if method == b"HEAD" or status in (204, 304):
            body, pos = b"", start
        elif fields.get("transfer-encoding", "").lower() == "chunked":
            decoded = _dechunk(data, start)
            if decoded is None:
                break
            body, pos = decoded
        elif "content-length" in fields:
            pos = start + int(fields["content-length"])
            if pos > len(data):
                break
            body = data[start:pos]
        elif closed:
            body, pos = data[start:], len(data)
        else:
            break
        responses.append(response(body))
        answered += 1
    return responses


def _dechunk(data: bytes, pos: int) -> tuple[bytes, int] | None:
    body = b""
    while (eol := data.find(b"\r\n", pos)) >= 0:
        size = int(data[pos:eol].split(b";")[0], 16)
        if size == 0:
            end = data.find(b"\r\n\r\n", eol)  # no trailers are sent: "0\r\n\r\n"
            return (body, end + 4) if end >= 0 else None
        start = eol + 2
        if start + size + 2 > len(data):
            return None
        body += data[start : start + size]
        pos = start + size + 2
    return None


@define(eq=False)
class Connection:
    """One client connection to the in-memory receiver."""

    _receiver: InMemoryReceiver
    channel: Any  # a canner.web.channel.ReceiverChannel
    transport: ClientTransport
    methods: list[bytes] = field(factory=list)
    lost: bool = False
    # Sent by the client while the server paused reading (they wait in the socket).
    _unread: bytes = b""

    def send(self, data: bytes) -> None:
        """The client writes ``data`` (the server reads it unless it paused reading)."""
        self._unread += data
        self._receiver.settle()

    def send_head(
        self, method: str, path: str, headers: Iterable[Header] = (), host: bool = True
    ) -> None:
        """Send a request line and header block (a ``Host`` first unless ``host`` is False)."""
        lines = [f"{method} {path} HTTP/1.1".encode("latin-1")]
        if host:
            lines.append(b"Host: canner.test")
        for name, value in headers:
            raw = value if isinstance(value, bytes) else value.encode("latin-1")
            lines.append(name.encode("latin-1") + b": " + raw)
        self.methods.append(method.encode("ascii"))
        self.send(b"\r\n".join(lines) + b"\r\n\r\n")

    def feed(self) -> bool:
        """Deliver what the client sent and the server may read now; True if anything was."""
        if self.lost or not self._unread or self.transport.producerState != "producing":
            return False
        data, self._unread = self._unread, b""
        self.channel.dataReceived(data)
        return True

    def close(self) -> None:
        """The client drops the connection."""
        if not self.lost:
            self.lost = True
            self.channel.connectionLost(Failure(ConnectionLost("the client went away")))
        self._receiver.settle()

    def reap(self) -> bool:
        """Deliver ``connectionLost`` once the server asked to close; True if it did now."""
        if self.lost or not self.transport.disconnecting:
            return False
        self.lost = True
        reason = ConnectionAborted() if self.transport.aborted else ConnectionDone()
        self.channel.connectionLost(Failure(reason))
        return True

    @property
    def written(self) -> bytes:
        """Every byte the server wrote on this connection."""
        data: bytes = self.transport.value()
        return data

    @property
    def responses(self) -> list[Response]:
        """The complete responses the server wrote, interim ones included."""
        return parse_responses(self.written, self.methods, self.lost)

    @property
    def answers(self) -> list[Response]:
        """The final (non-1xx) responses."""
        return [r for r in self.responses if r.status >= 200]

    @property
    def closed(self) -> bool:
        """The server closed or aborted the connection."""
        return self.lost and self.transport.disconnecting

    def answer(self) -> Response:
        """The one final response on this connection (fails unless there is exactly one)."""
        answers = self.answers
        assert len(answers) == 1, f"{len(answers)} answers: {self.written[:300]!r}"
        return answers[0]


# -- the receiver ---------------------------------------------------------------------------------


@define(eq=False)
class InMemoryReceiver:
    """The receiver's real Site over ``data_dir``, with a fake clock and held-or-inline runners."""

    data_dir: Path
    config: Config
    clock: Clock
    io: HeldRunner
    hashing: HeldRunner
    site: ReceiverSite
    intake: UploadIntake
    enqueued: list[tuple[Receipt, Origin]]
    metrics: Metrics
    connections: list[Connection] = field(factory=list)
    _port: int = 40000

    @classmethod
    def build(
        cls, data_dir: Path, doors: Sequence[DoorFactory] = DOORS, **overrides: Any
    ) -> InMemoryReceiver:
        """A receiver for ``data_dir`` (which must exist) with the config the e2e receivers use
        (projects ``example`` and ``other``, 64 MiB uploads, ``min_free_bytes = 1``) and
        ``overrides``.  The objects are the daemon's (``canner.daemon.roots.receiver_parts``); what
        it adds around them (threads, listeners, timers, the delivery index) is left out:
        acceptance's enqueue records in ``enqueued``, and the connection caps are the
        configured ones (the open-file limit is not consulted).  ``doors`` are the doors over
        HTTP (a test adds its own)."""
        raw: dict[str, Any] = {
            "issuer": ISSUER,
            "data_dir": str(data_dir),
            "max_upload_bytes": MAX_UPLOAD,
            "min_free_bytes": 1,
            "partial_upload_retention": "30m",
            "projects": {"example": {}, "other": {}},
            **overrides,
        }
        config = parse_config(raw, data_dir)
        clock = Clock()
        clock.advance(START)
        io, hashing = HeldRunner(), HeldRunner()
        for sub in ("uploads", "receipts"):
            (config.data_dir / sub).mkdir(exist_ok=True)
        enqueued: list[tuple[Receipt, Origin]] = []
        metrics = Metrics(RECEIVER, config.projects)
        parts = receiver_parts(
            config,
            uploads=UploadStore(config.data_dir / "uploads"),
            receipts=ReceiptStore(config.data_dir / "receipts"),
            run=io,
            hashing=hashing,
            clock=clock,  # also the channels' timers: idle timeout, head deadline, linger
            enqueue=lambda receipt, origin: enqueued.append((receipt, origin)),
            index=None,
            metrics=metrics,
            problems=RecentProblems(),
            connection_limits=ConnectionLimits(
                config.connections.max, config.connections.max_per_client
            ),
            doors=doors,
        )
        site, intake = parts.site, parts.intake
        return cls(config.data_dir, config, clock, io, hashing, site, intake, enqueued, metrics)

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    # -- driving it -------------------------------------------------------------------------------

    def connect(self, host: str = "127.0.0.1") -> Connection:
        """A new client connection from ``host``."""
        self._port += 1
        peer = IPv4Address("TCP", host, self._port)
        channel = self.site.buildProtocol(peer)
        transport = ClientTransport(peerAddress=peer, lenient=True)
        connection = Connection(self, channel, transport)
        self.connections.append(connection)
        channel.makeConnection(transport)
        self.settle()
        return connection

    def settle(self) -> None:
        """Do what the reactor would until nothing changes: deliver the bytes the server may
        read and ``connectionLost`` to connections the server closed (bounded)."""
        for _ in range(10_000):
            if not any(c.reap() or c.feed() for c in self.connections):
                return
        raise AssertionError("the in-memory connections never settled")

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on the receiver's clock."""
        self.clock.advance(seconds)
        self.settle()

    def release(self, runner: HeldRunner) -> None:
        """Stop holding ``runner`` and run its held calls (and those they start) in order."""
        runner.held = False
        while runner.run_held():
            self.settle()
        self.settle()

    def exchange(
        self,
        method: str,
        path: str,
        headers: Iterable[Header] = (),
        body: bytes | None = None,
        host: bool = True,
        length: bool = True,
    ) -> Response:
        """One request on a fresh connection, sent as given (``Content-Length`` added for a
        ``body`` unless ``length`` is False: the headers frame it); its one answer, which must
        carry ``Tus-Resumable: 1.0.0``."""
        connection = self.connect()
        all_headers = list(headers)
        if body is not None and length:
            all_headers.append(("Content-Length", str(len(body))))
        connection.send_head(method, path, all_headers, host=host)
        if body:
            connection.send(body)
        response = connection.answer()
        assert response.header("Tus-Resumable") == TUS_VERSION, (
            f"{method} {path[:80]}: {response.status} without Tus-Resumable"
        )
        connection.close()
        return response

    # -- tus, as a client speaks it -------------------------------------------------------------

    def create(
        self,
        length: int,
        checksum: str,
        project: str = "example",
        filename: str | None = None,
        headers: Sequence[Header] = (),
        body: bytes | None = None,
    ) -> Response:
        given = {name.lower() for name, _ in headers}
        sent: list[Header] = [
            ("Tus-Resumable", TUS_VERSION),
            ("Upload-Length", str(length)),
            ("Upload-Metadata", upload_metadata(checksum, project, filename)),
        ]
        if body is not None and "content-type" not in given:
            sent.append(("Content-Type", OFFSET_TYPE))
        return self.exchange("POST", "/files/", [*sent, *headers], body)

    def new_upload(self, data: bytes, **kwargs: Any) -> str:
        """Create an upload for ``data`` (declaring its checksum); its object id."""
        kwargs.setdefault("checksum", blake3_hex(data))
        r = self.create(len(data), **kwargs)
        assert r.status == 201, f"creation answered {r.status}: {r.body!r}"
        return self.object_id(r)

    def object_id(self, response: Response) -> str:
        location = response.header("Location") or ""
        assert location.startswith("/files/") and len(location) == 39, location
        return location[len("/files/") :]

    def patch(self, object_id: str, offset: int, data: bytes) -> Response:
        headers = [
            ("Tus-Resumable", TUS_VERSION),
            ("Upload-Offset", str(offset)),
            ("Content-Type", OFFSET_TYPE),
        ]
        return self.exchange("PATCH", f"/files/{object_id}", headers, data)

    def patch_head(self, offset: int, length: int | None) -> list[Header]:
        """The headers of a PATCH (``length`` None: chunked)."""
        headers: list[Header] = [
            ("Tus-Resumable", TUS_VERSION),
            ("Upload-Offset", str(offset)),
            ("Content-Type", OFFSET_TYPE),
        ]
        if length is None:
            headers.append(("Transfer-Encoding", "chunked"))
        else:
            headers.append(("Content-Length", str(length)))
        return headers

    def open_patch(self, object_id: str, offset: int, length: int | None) -> Connection:
        """A PATCH whose head is sent; the caller sends the body."""
        connection = self.connect()
        connection.send_head("PATCH", f"/files/{object_id}", self.patch_head(offset, length))
        return connection

    def head(self, object_id: str) -> Response:
        return self.exchange("HEAD", f"/files/{object_id}", [("Tus-Resumable", TUS_VERSION)])

    def get_receipt(self, object_id: str) -> Response:
        return self.exchange("GET", f"/api/v1/receipts/{object_id}")

    def offset(self, object_id: str) -> int:
        r = self.head(object_id)
        assert r.status == 200, f"HEAD {object_id} answered {r.status}"
        return int(r.header("Upload-Offset") or "")

    # -- the data directory ---------------------------------------------------------------------

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "uploads"

    @property
    def receipts_dir(self) -> Path:
        return self.data_dir / "receipts"

    def stored(self, object_id: str) -> bytes:
        return (self.uploads_dir / object_id).read_bytes()

    def upload_entries(self) -> set[str]:
        return set(os.listdir(self.uploads_dir))

    def receipt_ids_on_disk(self) -> list[str]:
        return sorted(
            p.name.removesuffix(".json")
            for p in self.receipts_dir.glob("*.json")
            if not p.name.endswith(".meta.json")
        )

    def verify_receipt(self, header: str | None, object_id: str, data: bytes) -> dict[str, Any]:
        """Check an ``Artifact-Receipt`` as a worker would (against the lookup, the disk and
        ``data``); the receipt."""
        assert header, f"no Artifact-Receipt for {object_id}"
        raw = base64.urlsafe_b64decode(header + "=" * (-len(header) % 4))
        served = self.get_receipt(object_id)
        assert served.status == 200, f"GET receipt {object_id}: {served.status}"
        assert (served.header("Content-Type") or "").startswith("application/json")
        assert served.body == raw, "Artifact-Receipt differs from GET /api/v1/receipts/{id}"
        doc: dict[str, Any] = json.loads(raw)
        assert list(doc) == RECEIPT_FIELDS, f"receipt fields {list(doc)}"
        assert doc["id"] == f"receipt:{object_id}"
        assert doc["issuer"] == ISSUER
        assert doc["object_id"] == object_id
        assert doc["checksum"] == blake3_hex(data)
        assert doc["size_bytes"] == len(data)
        assert type(doc["accepted_at"]) is int
        assert START <= doc["accepted_at"] <= self.clock.seconds()
        assert (self.receipts_dir / f"{object_id}.json").read_bytes() == raw
        assert self.stored(object_id) == data, "stored bytes differ from the upload"
        return doc
