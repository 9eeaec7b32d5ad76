"""A fake Internet Archive that speaks IA's HTTP protocol over a real socket.

It implements what ``docs/reference/internet-archive.md`` describes, independently of
``canner.sinks``:

* ``PUT /{identifier}/{remote name}``: S3-style upload with ``authorization: LOW access:secret``,
  ``x-archive-auto-make-bucket`` (or ``x-amz-``), ``Content-MD5`` (32 lowercase hex; a mismatch is
  ``400 BadDigest`` and stores nothing), a mandatory ``Content-Length`` (chunked is ``411``),
  ``x-archive-meta[NN]-*`` headers applied when the PUT creates the item, ``x-archive-filemeta-*``.
  Bodies stream to disk as they arrive (hashing on the way), so gigabyte bodies cost no memory.
* ``GET /metadata/{identifier}``: ``{}`` for an unknown item, else JSON with ``files[]`` whose
  ``name``/``size``/``md5``/``sha1`` show a stored file only ``metadata_lag`` seconds after it
  was stored (IA's archive task lag); until then an overwritten file still shows its old version.
* ``GET /?check_limit=1&accesskey=..&bucket=..``: ``{"over_limit": 0|1, "detail": {...}}``.
* ``GET /download/{identifier}/{remote name}``: like IA, a ``302`` to a "datanode" URL,
  ``/datanode/items/{identifier}/{remote name}``, which serves the stored bytes and honours a
  single ``Range: bytes=...`` (``206`` with ``Content-Range``, ``416`` when unsatisfiable).
* Fault injection, each for the next N matching requests: on PUT ``slowdown`` (503 SlowDown),
  ``error500``, ``reset`` (RST after ``after_bytes`` body bytes, nothing stored),
  ``lost_response`` (store, then drop the connection without answering), ``stall`` (stop reading
  after ``after_bytes`` bytes, never answer), ``forbidden`` (403), ``redirect`` (307 to the same
  path, or to ``location`` + path), ``spam`` (503 "appears to be spam"), ``vanish`` (answer 200
  but lose the file: it is never listed nor served); on the metadata API ``error500``,
  ``slowdown``, ``garbage`` (not JSON), ``stall``, ``dark``; on check_limit ``over_limit``,
  ``error500``, ``garbage``; on the datanode download ``altered`` (serve other bytes than
  stored, every byte inverted, while the metadata API still shows the stored size and MD5),
  ``flip_byte`` (the same, but only the byte in the middle of the file, ``size // 2``, is
  inverted, in whatever range covers it), ``error500``, ``forbidden``; on the metadata API also
  ``wrong_md5`` (every file listed with an MD5 that is not its content's).  A ``slowdown`` fault
  with ``retry_after`` (seconds) answers with that ``Retry-After`` header.
* S3 multipart uploads on ``/{identifier}/{remote name}``: ``POST ?uploads`` (initiate, with the
  PUT's auth and metadata headers; answers namespaced XML, as S3 does),
  ``PUT ?partNumber=N&uploadId=ID`` (``Content-MD5`` checked, ``ETag`` = the part's MD5),
  ``GET ?uploadId=ID`` (ListParts),
  ``POST ?uploadId=ID`` (complete: the parts listed, namespaced or not, are joined and stored like
  a PUT's body), ``DELETE ?uploadId=ID`` (abort).  Every part body byte received is counted
  (``GET /_fake/multipart``).  Part faults (target ``part``, optionally only for part number
  ``part``): ``reset``, ``stall``, ``error500``, ``slowdown``, ``forget`` (IA lost the upload:
  ``404 NoSuchUpload`` from then on).
* Admin endpoints for tests in another process: ``GET /_fake/objects``, ``GET /_fake/items``,
  ``GET|POST|DELETE /_fake/faults`` (POST a JSON fault or list of faults),
  ``GET /_fake/requests``, ``POST /_fake/settings`` (``{"metadata_lag": s}``),
  ``GET /_fake/health``.

In-process: ``fake = FakeIA(root, clock=reactor); port = fake.listen(reactor)``.  As a process:
``python tests/fake_ia.py --port 0 --dir DIR --port-file FILE [--metadata-lag S]
[--fault KIND[:COUNT[:TARGET]]]...`` prints and writes the bound port.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import uuid
import weakref
from collections.abc import Iterable
from io import BytesIO
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, quote, unquote

from attrs import define, field
from twisted.internet.interfaces import IListeningPort, IReactorTCP, IReactorTime
from twisted.protocols.basic import FileSender
from twisted.python.failure import Failure
from twisted.web.server import Request, Site

PUT_FAULTS = frozenset(
    {
        "slowdown",
        "error500",
        "reset",
        "lost_response",
        "stall",
        "forbidden",
        "redirect",
        "spam",
        "vanish",
    }
)
METADATA_FAULTS = frozenset({"error500", "slowdown", "garbage", "stall", "dark", "wrong_md5"})
CHECK_LIMIT_FAULTS = frozenset({"over_limit", "error500", "garbage"})
DOWNLOAD_FAULTS = frozenset({"altered", "flip_byte", "error500", "forbidden"})
PART_FAULTS = frozenset({"reset", "stall", "error500", "slowdown", "forget"})
TARGETS = {
    "part": PART_FAULTS,
    "put": PUT_FAULTS,
    "metadata": METADATA_FAULTS,
    "check_limit": CHECK_LIMIT_FAULTS,
    "download": DOWNLOAD_FAULTS,
}
_DEFAULT_TARGET = {
    "over_limit": "check_limit",
    "garbage": "metadata",
    "dark": "metadata",
    "altered": "download",
    "flip_byte": "download",
    "wrong_md5": "metadata",
    "forget": "part",
}
S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
RANGE = re.compile(r"bytes=(\d*)-(\d*)")

IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{4,99}")
META_HEADER = re.compile(r"x-archive-meta(\d\d)?-(.+)")
META_KEY = re.compile(r"[a-z][a-z0-9_.-]*")
HEX32 = re.compile(r"[0-9a-f]{32}")
READ_SIZE = 1 << 20
REQUEST_LOG_MAX = 2000


@define
class Fault:
    """One injected fault, applied to the next ``count`` requests of its ``target`` kind."""

    kind: str
    count: int = 1
    target: str = ""
    after_bytes: int = 64 * 1024
    location: str | None = None
    retry_after: int | None = None
    part: int | None = None  # target "part": only this part number

    def __attrs_post_init__(self) -> None:
        if not self.target:
            self.target = _DEFAULT_TARGET.get(self.kind, "put")
        if self.target not in TARGETS or self.kind not in TARGETS[self.target]:
            raise ValueError(f"unknown fault {self.kind!r} for {self.target!r}")
        if self.count < 1:
            raise ValueError("a fault needs count >= 1")

    @classmethod
    def from_json(cls, raw: Any) -> Fault:
        if not isinstance(raw, dict):
            raise ValueError("a fault is a JSON object")
        return cls(
            kind=str(raw["kind"]),
            count=int(raw.get("count", 1)),
            target=str(raw.get("target", "")),
            after_bytes=int(raw.get("after_bytes", 64 * 1024)),
            location=raw.get("location"),
            retry_after=raw.get("retry_after"),
            part=raw.get("part"),
        )

    @classmethod
    def from_arg(cls, text: str) -> Fault:
        """``KIND[:COUNT[:TARGET]]`` as given to ``--fault``."""
        parts = text.split(":")
        return cls(
            kind=parts[0],
            count=int(parts[1]) if len(parts) > 1 and parts[1] else 1,
            target=parts[2] if len(parts) > 2 else "",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "count": self.count,
            "target": self.target,
            "after_bytes": self.after_bytes,
            "location": self.location,
            "retry_after": self.retry_after,
            "part": self.part,
        }


@define
class Version:
    size: int
    md5: str
    sha1: str
    mtime: float


@define
class StoredFile:
    """A file in an item: the newest stored bytes, and what the metadata API shows."""

    name: str
    data: str  # file name of the bytes inside the item's directory
    current: Version | None = None
    visible_at: float = 0.0
    shown: Version | None = None  # what the metadata API showed before ``current`` was visible
    filemeta: dict[str, str] = field(factory=dict)
    stores: int = 0  # PUTs that stored the bytes

    def visible(self, now: float) -> Version | None:
        if self.current is not None and now >= self.visible_at:
            return self.current
        return self.shown


@define
class Item:
    identifier: str
    created_at: float
    metadata: dict[str, list[str]] = field(factory=dict)
    files: dict[str, StoredFile] = field(factory=dict)


def _xml_error(code: str, message: str, resource: str = "") -> bytes:
    def esc(text: str) -> str:
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{esc(code)}</Code><Message>{esc(message)}</Message>"
        f"<Resource>{esc(resource)}</Resource><RequestId>{uuid.uuid4().hex}</RequestId></Error>"
    ).encode()


def _decode_meta_value(value: str) -> str:
    if value.startswith("uri(") and value.endswith(")"):
        return unquote(value[4:-1])
    return value


def _name_problem(name: str) -> str | None:
    if not name or name.startswith("/") or name.endswith("/"):
        return "bad remote name"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        return "control characters in the remote name"
    segments = name.split("/")
    if any(s in ("", ".", "..") for s in segments):
        return "empty, '.' or '..' segment"
    if segments[0] == "history" and len(segments) > 1:
        return "history/ is reserved"
    return None


@define(eq=False)
class Upload:
    """One PUT body on its way to disk, with the decision about it made at the headers."""

    fake: FakeIA
    request: FakeRequest
    identifier: str
    name: str
    length: int | None
    error: tuple[int, str, str] | None = None  # (status, Code, Message) decided up front
    fault: Fault | None = None
    content_md5: str | None = None
    metadata: dict[str, list[str]] = field(factory=dict)
    filemeta: dict[str, str] = field(factory=dict)
    temp: Path | None = None
    stream: IO[bytes] | None = None
    md5: Any = field(factory=lambda: hashlib.md5(usedforsecurity=False))
    sha1: Any = field(factory=lambda: hashlib.sha1(usedforsecurity=False))
    received: int = 0
    dead: bool = False  # reset or stalled: ignore everything that still arrives
    part: int | None = None  # a multipart part PUT: its number ...
    upload_id: str | None = None  # ... and upload

    def open(self) -> None:
        incoming = self.fake.root / "incoming"
        incoming.mkdir(parents=True, exist_ok=True)
        self.temp = incoming / uuid.uuid4().hex
        self.stream = open(self.temp, "wb")

    def chunk(self, data: bytes) -> None:
        if self.dead:
            return
        self.received += len(data)
        if self.part is not None:
            key = f"{self.identifier}/{self.name}"
            self.fake.part_bytes[key] = self.fake.part_bytes.get(key, 0) + len(data)
        if self.stream is not None:
            self.stream.write(data)
            self.md5.update(data)
            self.sha1.update(data)
        fault = self.fault
        if fault is not None and fault.kind in ("reset", "stall"):
            if self.received >= fault.after_bytes:
                self.dead = True
                extra = {} if self.part is None else {"part": self.part}
                self.fake.note(self.request, 0, fault=fault.kind, received=self.received, **extra)
                transport: Any = self.request.channel.transport
                if fault.kind == "reset":
                    # abortConnection closes with SO_LINGER 0: the peer sees a reset.
                    transport.abortConnection()
                else:
                    transport.pauseProducing()
                self.close(keep=False)

    def close(self, keep: bool) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if not keep and self.temp is not None:
            self.temp.unlink(missing_ok=True)
            self.temp = None

    def finish(self) -> None:
        """The whole body is in: answer (or, for lost_response, store and hang up)."""
        request, fake = self.request, self.fake
        if self.dead:
            return
        resource = f"/{self.identifier}/{self.name}"
        if self.error is not None:
            self.close(keep=False)
            request.respond_error(*self.error, resource=resource)
            return
        fault = self.fault
        if fault is not None and fault.kind == "vanish":
            # IA answered 200, then its archive task failed: the file never shows.
            self.close(keep=False)
            request.setResponseCode(200)
            request.setHeader(b"content-length", b"0")
            fake.note(request, 200, fault=fault.kind)
            request.finish()
            return
        if fault is not None and fault.kind != "lost_response":
            self.close(keep=False)
            request.respond_fault(fault)
            return
        digest = self.md5.hexdigest()
        if self.content_md5 is not None and self.content_md5 != digest:
            self.close(keep=False)
            request.respond_error(
                400, "BadDigest", "The Content-MD5 you specified did not match what we received."
            )
            return
        self.close(keep=True)
        if self.part is not None:
            assert self.temp is not None and self.upload_id is not None
            fake.store_part(self, digest, self.temp)
            self.temp = None
            request.setHeader(b"etag", f'"{digest}"'.encode())
            fake.note(request, 200, part=self.part, received=self.received)
            request.setResponseCode(200)
            request.setHeader(b"content-length", b"0")
            request.finish()
            return
        assert self.temp is not None
        fake.store(self, digest, self.sha1.hexdigest(), self.temp)
        self.temp = None
        if fault is not None:  # lost_response: stored, but the answer never arrives
            fake.note(request, 0, fault=fault.kind)
            request.channel.transport.abortConnection()  # type: ignore[union-attr]
            return
        request.respond(200, b"")


class FakeRequest(Request):
    """A Request that streams S3 PUT bodies into an :class:`Upload` and routes everything."""

    upload: Upload | None = None
    parked: bool = False

    def __init__(self, channel: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(channel, *args, **kwargs)
        # Kept here because Request drops .channel once the response is finished.
        self.fake: FakeIA = channel.site.fake
        self.fake.connections.add(channel)

    def gotLength(self, length: int | None) -> None:
        channel: Any = self.channel
        # The request line reaches a Request only after its body; until then the channel keeps
        # it in _command/_path (private, stable since Twisted 16).
        method, (raw_path, _, query) = channel._command, channel._path.partition(b"?")
        if method == b"PUT" and not raw_path.startswith(b"/_fake/"):
            args = parse_qs(query.decode("latin-1"))
            if "partNumber" in args or "uploadId" in args:
                self.upload = self.fake.begin_part(self, raw_path, length, args)
            else:
                self.upload = self.fake.begin_put(self, raw_path, length)
            self.content = BytesIO()
            if self.transport is not None:
                self.transport.bufferSize = READ_SIZE  # type: ignore[attr-defined]
        else:
            super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self.upload is not None:
            self.upload.chunk(data)
        else:
            super().handleContentChunk(data)

    def process(self) -> None:
        try:
            self.fake.route(self)
        except Exception:
            self.fake.errors.append(Failure().getTraceback())
            if not self.finished and not self._disconnected:
                self.setResponseCode(500)
                self.write(b"fake IA bug\n")
                self.finish()

    def connectionLost(self, reason: Failure) -> None:
        super().connectionLost(reason)
        if self.upload is not None:
            self.upload.dead = True
            self.upload.close(keep=False)

    # -- answers -------------------------------------------------------------------------

    def respond(self, status: int, body: bytes, content_type: bytes = b"text/plain") -> None:
        if self._disconnected:
            return
        self.setResponseCode(status)
        self.setHeader(b"content-type", content_type)
        self.setHeader(b"content-length", str(len(body)).encode())
        self.fake.note(self, status)
        self.write(body)
        self.finish()

    def respond_json(self, value: Any, status: int = 200) -> None:
        self.respond(status, json.dumps(value).encode(), b"application/json")

    def respond_error(self, status: int, code: str, message: str, resource: str = "") -> None:
        self.respond(status, _xml_error(code, message, resource), b"application/xml")

    def respond_fault(self, fault: Fault) -> None:
        if fault.kind == "slowdown":
            if fault.retry_after is not None:
                self.setHeader(b"retry-after", str(fault.retry_after).encode())
            self.respond_error(503, "SlowDown", "Please reduce your request rate.")
        elif fault.kind == "spam":
            self.respond_error(
                503, "SlowDown", "Your upload of this item appears to be spam. Contact IA staff."
            )
        elif fault.kind == "error500":
            self.respond(500, b"Internal Server Error\n")
        elif fault.kind == "forbidden":
            self.respond_error(403, "AccessDenied", "Access Denied")
        elif fault.kind == "redirect":
            base = fault.location or ("http://" + (self.getHeader("host") or "127.0.0.1"))
            self.setHeader(b"location", (base.rstrip("/") + self.uri.decode()).encode())
            self.respond_error(307, "TemporaryRedirect", "Please re-send this request.")
        elif fault.kind == "garbage":
            self.respond(200, b"<html>not json</html>", b"text/html")
        elif fault.kind == "stall":
            self.park()
        else:  # pragma: no cover - Fault validates kinds
            raise AssertionError(fault.kind)

    def park(self) -> None:
        """Never answer; the connection stays open until the client gives up."""
        self.parked = True
        self.fake.note(self, 0, fault="stall")


@define(eq=False)
class FakeIA:
    """The fake's state: items on disk under ``root``, faults, and a request log."""

    root: Path
    clock: IReactorTime
    access: str = "fake-access"
    secret: str = "fake-secret"
    metadata_lag: float = 0.0
    items: dict[str, Item] = field(factory=dict)
    faults: list[Fault] = field(factory=list)
    requests: list[dict[str, Any]] = field(factory=list)
    errors: list[str] = field(factory=list)
    put_counts: dict[tuple[str, str], int] = field(factory=dict)
    # Multipart: open uploads by id, and part body bytes received per "identifier/name".
    multipart: dict[str, dict[str, Any]] = field(factory=dict)
    part_bytes: dict[str, int] = field(factory=dict)
    connections: weakref.WeakSet[Any] = field(factory=weakref.WeakSet)

    def __attrs_post_init__(self) -> None:
        (self.root / "incoming").mkdir(parents=True, exist_ok=True)
        self._load()

    # -- public API for in-process tests ---------------------------------------------------

    def add_fault(
        self,
        kind: str,
        count: int = 1,
        target: str = "",
        after_bytes: int = 64 * 1024,
        location: str | None = None,
        retry_after: int | None = None,
    ) -> Fault:
        fault = Fault(kind, count, target, after_bytes, location, retry_after)
        self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self.faults.clear()

    def objects(self) -> list[dict[str, Any]]:
        now = self.clock.seconds()
        out = []
        for item in self.items.values():
            for f in item.files.values():
                shown = f.visible(now)
                out.append(
                    {
                        "identifier": item.identifier,
                        "name": f.name,
                        "path": str(self._item_dir(item.identifier) / f.data),
                        "size": f.current.size if f.current else None,
                        "md5": f.current.md5 if f.current else None,
                        "sha1": f.current.sha1 if f.current else None,
                        "puts": self.put_counts.get((item.identifier, f.name), 0),
                        "stores": f.stores,
                        "visible": shown is not None and shown == f.current,
                        "visible_at": f.visible_at,
                        "filemeta": f.filemeta,
                    }
                )
        return out

    def object(self, identifier: str, name: str) -> dict[str, Any] | None:
        for o in self.objects():
            if o["identifier"] == identifier and o["name"] == name:
                return o
        return None

    def site(self) -> Site:
        site = _FakeSite(_Nowhere(), requestFactory=FakeRequest)
        site.fake = self
        return site

    def listen(
        self, reactor: IReactorTCP, port: int = 0, interface: str = "127.0.0.1"
    ) -> IListeningPort:
        factory: Any = self.site()
        return reactor.listenTCP(port, factory, interface=interface)

    def drop_connections(self) -> None:
        """Abort every server-side connection (a stalled one never notices its client left)."""
        for channel in list(self.connections):
            transport = getattr(channel, "transport", None)
            if transport is not None and getattr(transport, "connected", False):
                transport.abortConnection()
        self.connections.clear()

    # -- request handling ------------------------------------------------------------------

    def note(self, request: Request, status: int, **extra: Any) -> None:
        """Append to the request log (status 0: no answer was sent)."""
        auth = request.getHeader(b"authorization")
        channel: Any = getattr(request, "channel", None)
        method = getattr(request, "method", None) or getattr(channel, "_command", b"?")
        uri = getattr(request, "uri", None) or getattr(channel, "_path", b"?")
        assert isinstance(method, bytes) and isinstance(uri, bytes)
        entry = {
            "method": method.decode("latin-1"),
            "uri": uri.decode("latin-1"),
            "status": status,
            "auth": None if auth is None else auth.split(b":", 1)[0].decode("latin-1"),
            "headers": {
                k.decode("latin-1").lower(): v[0].decode("latin-1")
                for k, v in request.requestHeaders.getAllRawHeaders()
                if k.lower() != b"authorization"
            },
            "at": self.clock.seconds(),
            **extra,
        }
        self.requests.append(entry)
        del self.requests[:-REQUEST_LOG_MAX]

    def _take_fault(self, target: str) -> Fault | None:
        for fault in self.faults:
            if fault.target == target:
                fault.count -= 1
                if fault.count <= 0:
                    self.faults.remove(fault)
                return fault
        return None

    def _auth_error(self, request: Request) -> tuple[int, str, str] | None:
        auth = request.getHeader(b"authorization")
        if auth is None:
            return 403, "AccessDenied", "Access Denied (no authorization header)"
        if not auth.startswith(b"LOW ") or b":" not in auth:
            return 403, "InvalidAccessKeyId", "Expected 'LOW access:secret'"
        access, secret = auth[4:].split(b":", 1)
        if access.decode("latin-1") != self.access:
            return 403, "InvalidAccessKeyId", "The access key you provided does not exist."
        if secret.decode("latin-1") != self.secret:
            return 403, "SignatureDoesNotMatch", "The secret key you provided is wrong."
        return None

    def begin_put(
        self, request: FakeRequest, raw_path: bytes, length: int | None, part: bool = False
    ) -> Upload:
        path = raw_path.decode("ascii", "replace").lstrip("/")
        identifier_part, _, name_part = path.partition("/")
        identifier = unquote(identifier_part)
        name = unquote(name_part, errors="strict") if name_part else ""
        upload = Upload(self, request, identifier, name, length)
        upload.fault = None if part else self._take_fault("put")
        headers = {
            k.decode("latin-1").lower(): v[-1].decode("latin-1")
            for k, v in request.requestHeaders.getAllRawHeaders()
        }
        upload.error = self._put_error(request, upload, headers, length)
        if upload.error is None and (
            upload.fault is None or upload.fault.kind in ("lost_response", "vanish")
        ):
            upload.open()
        if not part:
            key = (identifier, name)
            self.put_counts[key] = self.put_counts.get(key, 0) + 1
        return upload

    def _put_error(
        self, request: Request, upload: Upload, headers: dict[str, str], length: int | None
    ) -> tuple[int, str, str] | None:
        if not IDENTIFIER.fullmatch(upload.identifier):
            return 400, "InvalidBucketName", "The specified bucket is not valid."
        if upload.name:
            problem = _name_problem(upload.name)
            if problem is not None:
                return 400, "InvalidURI", problem
        denied = self._auth_error(request)
        if denied is not None:
            return denied
        if length is None:
            return 411, "MissingContentLength", "You must provide the Content-Length HTTP header."
        md5 = headers.get("content-md5")
        if md5 is not None:
            if not HEX32.fullmatch(md5):
                return 400, "InvalidDigest", "The Content-MD5 you specified was invalid."
            upload.content_md5 = md5
        auto = headers.get("x-archive-auto-make-bucket") or headers.get("x-amz-auto-make-bucket")
        if upload.identifier not in self.items and auto != "1":
            return 404, "NoSuchBucket", "The specified bucket does not exist."
        indexed: dict[str, list[tuple[int, str]]] = {}
        for name, value in headers.items():
            match = META_HEADER.fullmatch(name)
            if match is not None:
                key = match.group(2).replace("--", "_")
                if not META_KEY.fullmatch(key) or key.startswith("xml"):
                    return 400, "InvalidArgument", f"bad metadata key {key!r}"
                index = int(match.group(1)) if match.group(1) else 0
                indexed.setdefault(key, []).append((index, _decode_meta_value(value)))
            elif name.startswith("x-archive-filemeta-"):
                key = name[len("x-archive-filemeta-") :].replace("--", "_")
                upload.filemeta[key] = _decode_meta_value(value)
        upload.metadata = {k: [v for _, v in sorted(vs)] for k, vs in indexed.items()}
        return None

    def store(self, upload: Upload, md5: str, sha1: str, temp: Path) -> None:
        now = self.clock.seconds()
        item = self.items.get(upload.identifier)
        if item is None:
            item = Item(upload.identifier, now, upload.metadata)
            self.items[upload.identifier] = item
        if not upload.name:
            temp.unlink(missing_ok=True)
            self._save(item)
            return
        stored = item.files.get(upload.name)
        if stored is None:
            data = hashlib.sha256(upload.name.encode()).hexdigest()[:40] + ".data"
            stored = StoredFile(upload.name, data)
            item.files[upload.name] = stored
        directory = self._item_dir(item.identifier)
        directory.mkdir(parents=True, exist_ok=True)
        os.replace(temp, directory / stored.data)
        stored.shown = stored.visible(now)
        stored.current = Version(upload.received, md5, sha1, now)
        stored.visible_at = now + self.metadata_lag
        stored.filemeta = upload.filemeta
        stored.stores += 1
        self._save(item)

    # -- S3 multipart ---------------------------------------------------------------------

    def _take_part_fault(self, number: int) -> Fault | None:
        for fault in self.faults:
            if fault.target == "part" and fault.part in (None, number):
                fault.count -= 1
                if fault.count <= 0:
                    self.faults.remove(fault)
                return fault
        return None

    def _multipart_dir(self, upload_id: str) -> Path:
        return self.root / "multipart" / upload_id

    def begin_part(
        self, request: FakeRequest, raw_path: bytes, length: int | None, args: dict[str, list[str]]
    ) -> Upload:
        upload = self.begin_put(request, raw_path, length, part=True)
        upload.upload_id = args.get("uploadId", [""])[0]
        try:
            upload.part = int(args.get("partNumber", [""])[0])
        except ValueError:
            upload.part = 0
        known = self.multipart.get(upload.upload_id)
        if upload.error is not None and upload.error[0] == 404:
            upload.error = None  # a part needs no auto-make-bucket
        if upload.error is None and not 1 <= upload.part <= 10000:
            upload.error = (400, "InvalidArgument", "Part number must be 1 to 10000.")
        if upload.error is None and (
            known is None
            or (known["identifier"], known["name"]) != (upload.identifier, upload.name)
        ):
            upload.error = (404, "NoSuchUpload", "The specified upload does not exist.")
        upload.fault = None
        if upload.error is None:
            fault = self._take_part_fault(upload.part)
            if fault is not None and fault.kind == "forget":
                self.forget_upload(upload.upload_id)
                upload.error = (404, "NoSuchUpload", "The specified upload does not exist.")
            else:
                upload.fault = fault
        if upload.error is None and upload.fault is None and upload.stream is None:
            upload.open()
        return upload

    def forget_upload(self, upload_id: str) -> None:
        self.multipart.pop(upload_id, None)
        directory = self._multipart_dir(upload_id)
        for entry in directory.glob("*") if directory.exists() else ():
            entry.unlink()

    def store_part(self, upload: Upload, md5: str, temp: Path) -> None:
        assert upload.upload_id is not None and upload.part is not None
        known = self.multipart.get(upload.upload_id)
        if known is None:
            temp.unlink(missing_ok=True)
            return
        directory = self._multipart_dir(upload.upload_id)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{upload.part:05d}"
        os.replace(temp, target)
        known["parts"][upload.part] = {"size": upload.received, "md5": md5, "path": str(target)}

    def _multipart_request(
        self, request: FakeRequest, path: str, query: dict[str, list[str]]
    ) -> None:
        rest = path.lstrip("/")
        identifier_part, _, name_part = rest.partition("/")
        identifier, name = unquote(identifier_part), unquote(name_part)
        method = request.method
        if method == b"POST" and "uploads" in query:
            self._initiate(request, identifier, name)
            return
        upload_id = query.get("uploadId", [""])[0]
        denied = self._auth_error(request)
        if denied is not None:
            request.respond_error(*denied)
            return
        known = self.multipart.get(upload_id)
        if known is None or (known["identifier"], known["name"]) != (identifier, name):
            request.respond_error(404, "NoSuchUpload", "The specified upload does not exist.")
            return
        if method == b"GET":
            parts = "".join(
                f"<Part><PartNumber>{n}</PartNumber><ETag>&quot;{p['md5']}&quot;</ETag>"
                f"<Size>{p['size']}</Size></Part>"
                for n, p in sorted(known["parts"].items())
            )
            request.respond(
                200,
                f'<?xml version="1.0" encoding="UTF-8"?><ListPartsResult xmlns="{S3_NS}">'
                f"<UploadId>{upload_id}</UploadId><IsTruncated>false</IsTruncated>{parts}"
                "</ListPartsResult>".encode(),
                b"application/xml",
            )
        elif method == b"DELETE":
            self.forget_upload(upload_id)
            request.respond(204, b"")
        elif method == b"POST":
            self._complete(request, upload_id, known)
        else:
            request.respond_error(405, "MethodNotAllowed", "Not for multipart uploads.")

    def _initiate(self, request: FakeRequest, identifier: str, name: str) -> None:
        upload = Upload(self, request, identifier, name, 0)
        headers = {
            k.decode("latin-1").lower(): v[-1].decode("latin-1")
            for k, v in request.requestHeaders.getAllRawHeaders()
        }
        error = self._put_error(request, upload, headers, 0)
        if error is not None:
            request.respond_error(*error)
            return
        upload_id = uuid.uuid4().hex
        self.multipart[upload_id] = {
            "identifier": identifier,
            "name": name,
            "metadata": upload.metadata,
            "filemeta": upload.filemeta,
            "parts": {},
        }
        request.respond(
            200,
            f'<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult xmlns="{S3_NS}">'
            f"<Bucket>{identifier}</Bucket><Key>{name}</Key><UploadId>{upload_id}</UploadId>"
            "</InitiateMultipartUploadResult>".encode(),
            b"application/xml",
        )

    def _complete(self, request: FakeRequest, upload_id: str, known: dict[str, Any]) -> None:
        body = _body(request)
        numbers = [int(n) for n in re.findall(rb"<(?:\w+:)?PartNumber>\s*(\d+)\s*<", body)]
        etags = [
            e.decode().strip().strip('"').replace("&quot;", "")
            for e in re.findall(rb"<(?:\w+:)?ETag>([^<]*)<", body)
        ]
        if not numbers or numbers != sorted(numbers) or len(numbers) != len(etags):
            request.respond_error(400, "InvalidPartOrder", "The list of parts was not in order.")
            return
        parts = known["parts"]
        for n, etag in zip(numbers, etags, strict=True):
            if n not in parts or parts[n]["md5"] != etag:
                request.respond_error(400, "InvalidPart", f"Part {n} was not uploaded.")
                return
        for n in numbers[:-1]:
            if parts[n]["size"] < 5 << 20:
                request.respond_error(400, "EntityTooSmall", "A part is smaller than 5 MiB.")
                return
        incoming = self.root / "incoming"
        incoming.mkdir(parents=True, exist_ok=True)
        temp = incoming / uuid.uuid4().hex
        md5 = hashlib.md5(usedforsecurity=False)
        sha1 = hashlib.sha1(usedforsecurity=False)
        size = 0
        with open(temp, "wb") as out:
            for n in numbers:
                with open(parts[n]["path"], "rb") as f:
                    while chunk := f.read(READ_SIZE):
                        out.write(chunk)
                        md5.update(chunk)
                        sha1.update(chunk)
                        size += len(chunk)
        upload = Upload(self, request, known["identifier"], known["name"], size)
        upload.received = size
        upload.metadata = known["metadata"]
        upload.filemeta = known["filemeta"]
        self.store(upload, md5.hexdigest(), sha1.hexdigest(), temp)
        self.forget_upload(upload_id)
        key = (known["identifier"], known["name"])
        self.put_counts[key] = self.put_counts.get(key, 0) + 1
        request.respond(
            200,
            f'<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult xmlns="{S3_NS}">'
            f"<Key>{known['name']}</Key><ETag>&quot;multipart-{len(numbers)}&quot;</ETag>"
            "</CompleteMultipartUploadResult>".encode(),
            b"application/xml",
        )

    def route(self, request: FakeRequest) -> None:
        if request.upload is not None:
            request.upload.finish()
            return
        path = request.path.decode("latin-1")
        method = request.method
        if path.startswith("/_fake/"):
            self._admin(request, method, path[len("/_fake/") :])
            return
        if method == b"GET" and path.startswith("/metadata/"):
            self._metadata(request, unquote(path[len("/metadata/") :]))
            return
        if method == b"GET" and path == "/" and b"check_limit" in request.args:
            self._check_limit(request)
            return
        if method in (b"GET", b"HEAD") and path.startswith("/download/"):
            self._download(request, path[len("/download/") :])
            return
        if method in (b"GET", b"HEAD") and path.startswith("/datanode/items/"):
            self._serve(request, path[len("/datanode/items/") :])
            return
        query = parse_qs(request.uri.decode("latin-1").partition("?")[2], keep_blank_values=True)
        if "uploads" in query or "uploadId" in query:
            self._multipart_request(request, path, query)
            return
        request.respond_error(404, "NoSuchKey", "Not found in the fake IA.")

    def _metadata(self, request: FakeRequest, identifier: str) -> None:
        fault = self._take_fault("metadata")
        if fault is not None and fault.kind not in ("dark", "wrong_md5"):
            request.respond_fault(fault)
            return
        wrong_md5 = fault is not None and fault.kind == "wrong_md5"
        if wrong_md5:
            fault = None
        now = self.clock.seconds()
        item = self.items.get(identifier)
        visible = []
        if item is not None:
            for f in item.files.values():
                version = f.visible(now)
                if version is not None:
                    entry = {
                        "name": f.name,
                        "source": "original",
                        "size": str(version.size),
                        "md5": ("f" * 32 if version.md5 != "f" * 32 else "0" * 32)
                        if wrong_md5
                        else version.md5,
                        "sha1": version.sha1,
                        "crc32": "00000000",
                        "mtime": str(int(version.mtime)),
                        "format": "Unknown",
                    }
                    entry.update(f.filemeta)
                    visible.append(entry)
        if item is None or not visible:
            # IA shows an item only once its first archive task ran; a dark one says only that.
            request.respond_json({"is_dark": True} if fault is not None else {})
            return
        doc: dict[str, Any] = {
            "created": int(item.created_at),
            "d1": "fake-ia",
            "dir": f"/fake/{identifier}",
            "files": [
                {
                    "name": f"{identifier}_meta.xml",
                    "source": "metadata",
                    "format": "Metadata",
                    "size": "512",
                    "md5": "0" * 32,
                },
                {
                    "name": f"{identifier}_files.xml",
                    "source": "original",
                    "format": "Metadata",
                    "summation": "md5",
                },
                *visible,
            ],
            "files_count": len(visible) + 2,
            "item_size": sum(int(e["size"]) for e in visible),
            "metadata": {
                "identifier": identifier,
                **{k: v[0] if len(v) == 1 else v for k, v in item.metadata.items()},
            },
            "server": "fake-ia",
        }
        if fault is not None:
            doc["is_dark"] = True
        request.respond_json(doc)

    def _check_limit(self, request: FakeRequest) -> None:
        fault = self._take_fault("check_limit")
        if fault is not None and fault.kind != "over_limit":
            request.respond_fault(fault)
            return
        args = parse_qs(request.uri.decode("latin-1").partition("?")[2])
        over = 1 if fault is not None else 0
        request.respond_json(
            {
                "bucket": args.get("bucket", [""])[0],
                "accesskey": args.get("accesskey", [""])[0],
                "over_limit": over,
                "detail": {"accesskey_ration": 100, "bucket_ration": 40, "total_tasks_queued": 0},
            }
        )

    def _stored(self, rest: str) -> tuple[Item, StoredFile] | None:
        identifier, _, name = rest.partition("/")
        item = self.items.get(unquote(identifier))
        stored = item.files.get(unquote(name)) if item else None
        if item is None or stored is None or stored.current is None:
            return None
        return item, stored

    def _download(self, request: FakeRequest, rest: str) -> None:
        """IA's front end answers a download with a redirect to the datanode holding the item."""
        if self._stored(rest) is None:
            request.respond_error(404, "NoSuchKey", "No such file.")
            return
        host = (request.getHeader("host") or "127.0.0.1").rstrip("/")
        request.setHeader(b"location", f"http://{host}/datanode/items/{rest}".encode())
        request.respond(302, b"")

    def _serve(self, request: FakeRequest, rest: str) -> None:
        found = self._stored(rest)
        if found is None:
            request.respond_error(404, "NoSuchKey", "No such file.")
            return
        fault = self._take_fault("download")
        if fault is not None and fault.kind not in ("altered", "flip_byte"):
            request.respond_fault(fault)
            return
        item, stored = found
        data = self._item_dir(item.identifier) / stored.data
        size = data.stat().st_size
        first, last = 0, size - 1
        header = request.getHeader("range")
        if header is not None:
            match = RANGE.fullmatch(header.strip())
            if match is None or not (match.group(1) or match.group(2)):
                request.respond(416, b"bad range\n")
                return
            if match.group(1):
                first = int(match.group(1))
                last = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            else:  # bytes=-N: the last N bytes
                first = max(size - int(match.group(2)), 0)
            if first >= size or last < first:
                request.setHeader(b"content-range", f"bytes */{size}".encode())
                request.respond(416, b"range not satisfiable\n")
                return
            request.setResponseCode(206)
            request.setHeader(b"content-range", f"bytes {first}-{last}/{size}".encode())
        length = last - first + 1
        self.note(request, 206 if header is not None else 200, fault=fault and fault.kind)
        request.setHeader(b"content-type", b"application/octet-stream")
        request.setHeader(b"accept-ranges", b"bytes")
        request.setHeader(b"content-length", str(length).encode())
        if request.method == b"HEAD":
            request.finish()
            return
        body = None
        if header is not None or length <= 64 * READ_SIZE:
            # Ranges (canner's read-backs are small) and small files are served from memory;
            # a whole big file streams (and is never altered).
            with open(data, "rb") as f:
                f.seek(first)
                body = f.read(length)
        if body is not None:
            if fault is not None and fault.kind == "altered":
                # Other bytes, same length, metadata untouched.
                body = bytes(b ^ 0xFF for b in body)
            elif fault is not None and first <= size // 2 <= last:  # flip_byte
                middle = size // 2 - first
                body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
            request.write(body)
            request.finish()
            return
        stream = open(data, "rb")

        def done(result: object) -> None:
            stream.close()
            if not request._disconnected:
                request.finish()

        FileSender().beginFileTransfer(stream, request).addBoth(done)

    def _admin(self, request: FakeRequest, method: bytes, what: str) -> None:
        if what == "health":
            request.respond_json({"ok": True})
        elif what == "objects" and method == b"GET":
            request.respond_json(self.objects())
        elif what == "items" and method == b"GET":
            request.respond_json(
                {
                    i.identifier: {"created_at": i.created_at, "metadata": i.metadata}
                    for i in self.items.values()
                }
            )
        elif what == "requests" and method == b"GET":
            request.respond_json(self.requests)
        elif what == "faults" and method == b"GET":
            request.respond_json([f.to_json() for f in self.faults])
        elif what == "faults" and method == b"DELETE":
            self.clear_faults()
            request.respond_json([])
        elif what == "faults" and method == b"POST":
            try:
                raw = json.loads(_body(request) or b"null")
                new = [Fault.from_json(r) for r in (raw if isinstance(raw, list) else [raw])]
            except (ValueError, KeyError, TypeError) as e:
                request.respond_json({"error": str(e)}, 400)
                return
            self.faults.extend(new)
            request.respond_json([f.to_json() for f in self.faults])
        elif what == "multipart" and method == b"GET":
            request.respond_json(
                {
                    "part_bytes": self.part_bytes,
                    "uploads": {
                        uid: {
                            "identifier": u["identifier"],
                            "name": u["name"],
                            "parts": {str(n): p["size"] for n, p in u["parts"].items()},
                        }
                        for uid, u in self.multipart.items()
                    },
                }
            )
        elif what == "settings" and method == b"POST":
            raw = json.loads(_body(request) or b"{}")
            if "metadata_lag" in raw:
                self.metadata_lag = float(raw["metadata_lag"])
            request.respond_json({"metadata_lag": self.metadata_lag})
        else:
            request.respond_json({"error": "unknown admin endpoint"}, 404)

    # -- persistence (so a restarted fake process keeps what it stored) --------------------

    def _item_dir(self, identifier: str) -> Path:
        return self.root / "items" / identifier

    def _save(self, item: Item) -> None:
        directory = self._item_dir(item.identifier)
        directory.mkdir(parents=True, exist_ok=True)

        def version(v: Version | None) -> dict[str, Any] | None:
            return (
                None
                if v is None
                else {"size": v.size, "md5": v.md5, "sha1": v.sha1, "mtime": v.mtime}
            )

        doc = {
            "identifier": item.identifier,
            "created_at": item.created_at,
            "metadata": item.metadata,
            "files": [
                {
                    "name": f.name,
                    "data": f.data,
                    "current": version(f.current),
                    "shown": version(f.shown),
                    "visible_at": f.visible_at,
                    "filemeta": f.filemeta,
                    "puts": self.put_counts.get((item.identifier, f.name), 0),
                    "stores": f.stores,
                }
                for f in item.files.values()
            ],
        }
        temp = directory / "_item.json.tmp"
        temp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(temp, directory / "_item.json")

    def _load(self) -> None:
        def version(raw: dict[str, Any] | None) -> Version | None:
            return None if raw is None else Version(**raw)

        for index in sorted((self.root / "items").glob("*/_item.json")):
            doc = json.loads(index.read_text(encoding="utf-8"))
            item = Item(doc["identifier"], doc["created_at"], doc["metadata"])
            for f in doc["files"]:
                item.files[f["name"]] = StoredFile(
                    name=f["name"],
                    data=f["data"],
                    current=version(f["current"]),
                    visible_at=f["visible_at"],
                    shown=version(f["shown"]),
                    filemeta=f["filemeta"],
                    stores=f["stores"],
                )
                self.put_counts[(item.identifier, f["name"])] = f["puts"]
            self.items[item.identifier] = item


class _Nowhere:
    """Site wants a resource; FakeRequest.process routes everything itself."""


def _body(request: Request) -> bytes:
    return request.content.read() if request.content is not None else b""


class _FakeSite(Site):
    fake: FakeIA
    noisy = False

    def log(self, request: Any) -> None:
        """No access log: the fake keeps its own request log (``/_fake/requests``)."""


def url_of(port: IListeningPort) -> str:
    """``http://127.0.0.1:PORT`` for a port from :meth:`FakeIA.listen`."""
    address: Any = port.getHost()
    return f"http://{address.host}:{address.port}"


def quote_path(identifier: str, name: str) -> str:
    return "/" + quote(identifier, safe="") + "/" + quote(name, safe="/")


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--interface", default="127.0.0.1")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--metadata-lag", type=float, default=0.0)
    parser.add_argument("--access", default="fake-access")
    parser.add_argument("--secret", default="fake-secret")
    parser.add_argument("--fault", action="append", default=[], help="KIND[:COUNT[:TARGET]]")
    args = parser.parse_args(list(argv) if argv is not None else None)

    from twisted.internet import reactor

    clock: Any = reactor
    fake = FakeIA(args.dir, clock, args.access, args.secret, args.metadata_lag)
    for spec in args.fault:
        fake.faults.append(Fault.from_arg(spec))
    port = fake.listen(clock, args.port, args.interface)
    address: Any = port.getHost()
    bound = address.port
    if args.port_file is not None:
        temp = args.port_file.with_name(args.port_file.name + ".tmp")
        temp.write_text(f"{bound}\n", encoding="utf-8")
        os.replace(temp, args.port_file)
    print(f"fake-ia listening on {args.interface}:{bound}", flush=True)
    clock.run()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
