"""What a request to the receiver is, decided once, from its method and path (and whether its
host can be served at all: :func:`bindable_host`).

:func:`route` is pure and is the only place that matches receiver paths outside the Klein apps:
the streaming seam asks it, as soon as a request's head is in, whether the body goes to an upload
(creation or append); the root resource asks it which app serves the request (tus, HQ's API or
the rest, or the node's parent for what :attr:`Route.node_wide` names); the metrics ask it
whether a response answered a creation.  Within an app, Klein keeps
matching the routes it serves (and validating ids); nothing here touches the filesystem.  A door
this module does not know declares its own :class:`DoorPath` (``canner.doors.router`` hands the
site every declared one): requests under its prefix are its, without an edit here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

from attrs import frozen
from twisted.web.http_headers import Headers

from canner.web.errors import HTTPError


class Surface(enum.Enum):
    """Which app serves a request."""

    TUS = "tus"  # /files...: canner.doors.tus.routes
    SEESAW = "seesaw"  # /seesaw/...: canner.doors.seesaw (Archive Team's curl uploads)
    HQ = "hq"  # /api/v1/objects..., /api/v1/releases: canner.hq.routes
    RECEIVER = "receiver"  # everything else: receipts, health, status page, metrics
    DOOR = "door"  # /{prefix}/...: a door that declared its DoorPath (Route.door names it)


class Kind(enum.Enum):
    """What a request is."""

    CREATE = "create"  # POST /files/ (or /files): a new upload, maybe with its first bytes
    APPEND = "append"  # PATCH /files/{id}: bytes for an upload
    PUT = "put"  # PUT /seesaw/{project}/{downloader}/{filename}: a whole file
    BODY = "body"  # a body method of a declared DoorPath: an upload body
    UPLOAD = "upload"  # another method on /files/{id} (HEAD, OPTIONS)
    COLLECTION = "collection"  # another method on /files/ (OPTIONS)
    RECEIPT = "receipt"  # /api/v1/receipts/{id}
    HQ = "hq"
    HEALTH = "health"  # /healthz
    READY = "ready"  # /readyz
    STATUS_PAGE = "status_page"  # /
    METRICS = "metrics"  # /metrics
    OTHER = "other"  # nothing canner serves (a 404 from the app of its surface)


@frozen
class Route:
    """A request's route: its kind, the app that serves it and the id its path names (the
    percent-decoded last segment for uploads and receipts, unvalidated; for ``/seesaw/`` the
    rest of the path after it, still percent-encoded, as after a declared door's prefix; ""
    otherwise) and, on a door's declared path, that door's prefix."""

    kind: Kind
    surface: Surface
    target: str = ""
    door: str = ""

    @property
    def node_wide(self) -> bool:
        """True when the answer is the node's, not one process's: the status page, ``/readyz``,
        ``/metrics`` and HQ's API.  A receiver running workers serves these from its parent
        process (HQ's releases append to the journal, which has one writer); ``/healthz``,
        receipts and every door stay each worker's own."""
        return self.kind in _NODE_WIDE

    @property
    def streams_body(self) -> bool:
        """True when the body is an upload's bytes, streamed to disk as it arrives."""
        return self.kind in (Kind.CREATE, Kind.APPEND, Kind.PUT, Kind.BODY)


@frozen
class DoorPath:
    """The requests of a door this module does not know: ``/{prefix}`` and below, where
    ``body_methods`` carry an upload body (:attr:`Kind.BODY`); never a path routed otherwise."""

    prefix: str
    body_methods: frozenset[bytes]


_FIXED = {
    b"/": Kind.STATUS_PAGE,
    b"/healthz": Kind.HEALTH,
    b"/readyz": Kind.READY,
    b"/metrics": Kind.METRICS,
}
OTHER = Route(Kind.OTHER, Surface.RECEIVER)
_NODE_WIDE = frozenset({Kind.STATUS_PAGE, Kind.READY, Kind.METRICS, Kind.HQ})


def route(method: bytes, path: bytes, declared: Sequence[DoorPath] = ()) -> Route:
    """The route of a request with ``method`` (after ``X-HTTP-Method-Override``) to ``path``
    (the request target without its query), under the ``declared`` paths of doors too."""
    found = _known_route(method, path)
    if found != OTHER:
        return found
    first, _, rest = path[1:].partition(b"/")
    for door in declared:
        if first == door.prefix.encode("ascii"):
            kind = Kind.BODY if method in door.body_methods else Kind.OTHER
            return Route(kind, Surface.DOOR, rest.decode("latin-1"), door.prefix)
    return OTHER


def _known_route(method: bytes, path: bytes) -> Route:
    segments = path.split(b"/")
    # segments[0] is "" for every path that starts with "/".
    if len(segments) >= 2 and segments[1] == b"files":
        rest = segments[2:]
        if not rest or rest == [b""]:
            kind = Kind.CREATE if method == b"POST" else Kind.COLLECTION
            return Route(kind, Surface.TUS)
        if len(rest) == 1:
            kind = Kind.APPEND if method == b"PATCH" else Kind.UPLOAD
            return Route(kind, Surface.TUS, _segment(rest[0]))
        return Route(Kind.OTHER, Surface.TUS)
    if len(segments) >= 2 and segments[1] == b"seesaw":
        target = path[len(b"/seesaw/") :].decode("latin-1")
        return Route(Kind.PUT if method == b"PUT" else Kind.OTHER, Surface.SEESAW, target)
    if len(segments) >= 4 and segments[1:3] == [b"api", b"v1"]:
        if segments[3] == b"releases" or segments[3].startswith(b"objects"):
            return Route(Kind.HQ, Surface.HQ)
        if segments[3] == b"receipts" and len(segments) == 5:
            return Route(Kind.RECEIPT, Surface.RECEIVER, _segment(segments[4]))
    fixed = _FIXED.get(path)
    return OTHER if fixed is None else Route(fixed, Surface.RECEIVER)


def _segment(raw: bytes) -> str:
    return unquote_to_bytes(raw).decode("utf-8", "replace")


# The answer (400) to a request whose host is not :func:`bindable_host`.
BAD_HOST_MESSAGE = "bad Host header: not a host name"


def bindable_host(hostname: bytes) -> bool:
    """True when ``hostname`` (the request's host as twisted.web reads it from ``Host``, without
    its port and IPv6 brackets: ``Request.getRequestHostname``) can be served.

    Klein binds werkzeug's URL map with it, and werkzeug fails (an exception from outside every
    route, so a 500 and a critical traceback, or Klein's own 400 with a logged traceback) for a
    name that is not UTF-8 or not IDNA-encodable: an empty label (``a..b``, ``.example``) or one
    over 63 characters.  This is the same test (werkzeug encodes the name up to its first colon,
    the port Klein appends or the rest of an IPv6 literal being left out), so a request it
    refuses is answered 400 before any app sees it; every other name is served as before."""
    try:
        name = hostname.decode("utf-8").lower().partition(":")[0]
        name.encode("idna")
    except UnicodeError:
        return False
    return True


def single_header(headers: Headers, name: str) -> str | None:
    """The one value of header ``name``, None when absent; 400 when repeated or not ASCII."""
    values = headers.getRawHeaders(name.encode("ascii"))
    if not values:
        return None
    if len(values) > 1:
        raise HTTPError(400, f"{name} must be sent once")
    try:
        return values[0].decode("ascii")
    except UnicodeDecodeError:
        raise HTTPError(400, f"{name} must be ASCII") from None


def method_override(method: bytes, headers: Headers) -> bytes:
    """The effective method: ``X-HTTP-Method-Override`` when present, else the request line's."""
    values = headers.getRawHeaders(b"X-HTTP-Method-Override")
    if values and len(values) == 1 and values[0].strip():
        return values[0].strip().upper()
    return method
