"""HQ's API on the receiver: delivery-status queries (anonymous) and releases (bearer token).

``GET /api/v1/objects/{id}``, ``POST /api/v1/objects:query`` and ``GET
/api/v1/objects:by-origin`` (by project, file name and optional downloader, through the index)
answer from :class:`~canner.hq.objects.ObjectReader` in a thread.  ``POST /api/v1/releases``
authenticates the client against the ``[hq] tokens`` file, then :class:`Releases` records
``released_at`` in the side files and the index before answering.  Errors are JSON:
``{"error": code, "message": text}``.
``docs/hq-api.yaml`` (OpenAPI 3.1) describes every answer.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from attrs import define, field
from klein import Klein
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from werkzeug.exceptions import HTTPException

from canner.blocking import BlockingRunner
from canner.config import Config, ConfigError
from canner.delivery.index import DeliveryIndex
from canner.hq import releases as rel
from canner.hq.objects import MAX_QUERY, IndexUnavailable, ObjectReader
from canner.ids import ObjectIds
from canner.ledger.files import ArchivedIds
from canner.store.journal import Journal

log = Logger()

# Status lookups waiting together are answered by one thread call (at most this many at once).
LOOKUP_BATCH = 256


class APIError(Exception):
    """An expected refusal with its HTTP status, rendered as a JSON error body."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def _json(request: IRequest, doc: Any, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader("Content-Type", "application/json")
    request.setHeader("Cache-Control", "no-store")
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def _client(request: IRequest) -> str:
    address = request.getClientAddress()
    return str(getattr(address, "host", None) or address)


@define(eq=False, kw_only=True)
class Lookups:
    """Status lookups in batches: the lookups that arrive while one thread call runs are all
    answered by the next, so under load a query costs a fraction of a thread hop."""

    _reader: ObjectReader
    _run: BlockingRunner
    _waiting: list[tuple[str, Deferred[dict[str, Any] | None]]] = field(factory=list)
    _busy: bool = False

    def lookup(self, object_id: str) -> Deferred[dict[str, Any] | None]:
        d: Deferred[dict[str, Any] | None] = Deferred()
        self._waiting.append((object_id, d))
        if not self._busy:
            self._next()
        return d

    def _next(self) -> None:
        batch, self._waiting = self._waiting[:LOOKUP_BATCH], self._waiting[LOOKUP_BATCH:]
        self._busy = True

        def answer(docs: list[dict[str, Any] | None]) -> None:
            for (_, d), doc in zip(batch, docs, strict=True):
                d.callback(doc)

        def fail(failure: Any) -> None:
            for _, d in batch:
                d.errback(failure)

        def after(_: object) -> None:
            self._busy = False
            if self._waiting:
                self._next()

        running = self._run(self._reader.lookup_many, [oid for oid, _ in batch])
        running.addCallbacks(answer, fail).addBoth(after)


@define(eq=False, kw_only=True)
class Releases:
    """Records releases: in the index and the facts journal, in one index transaction."""

    _index: DeliveryIndex | None
    _journal: Journal
    _archived: ArchivedIds
    _ids: ObjectIds
    _run: BlockingRunner
    _clock: IReactorTime

    async def release(self, receipt_ids: list[str], client: str) -> list[rel.ReleaseResult]:
        if self._index is None:
            raise APIError(
                503, "index_unavailable", "delivery.sqlite is unusable", {"Retry-After": "5"}
            )
        now = self._clock.seconds()
        oids = [o for o in (rel.object_id_of(r) for r in receipt_ids) if self._ids.is_valid(o)]
        candidates, released = await self._index.run(
            rel.release_known, self._journal, oids, now, client
        )
        missing = [o for o in oids if o not in candidates]
        archived = await self._run(self._archived_times, missing) if missing else {}
        answers, _ = rel.classify(receipt_ids, candidates, archived, self._ids.is_valid)
        return rel.finish_answers(receipt_ids, answers, released, now)

    def _archived_times(self, object_ids: list[str]) -> dict[str, float]:
        found = {}
        for oid in object_ids:
            where = self._archived.find(oid)
            if where is not None:
                found[oid] = where.released_at
        return found


@define(eq=False, kw_only=True)
class HQRoutes:
    """``/api/v1/objects...`` and ``/api/v1/releases``."""

    app: ClassVar[Klein] = Klein()
    _lookups: Lookups
    _reader: ObjectReader
    _releases: Releases
    _tokens: rel.TokenFile | None
    _run: BlockingRunner
    _failures: dict[str, int] = field(factory=dict)

    @app.handle_errors(APIError)
    def refusal(self, request: IRequest, failure: Any) -> bytes:
        error: APIError = failure.value
        for name, value in error.headers.items():
            request.setHeader(name, value)
        return _json(request, {"error": error.code, "message": error.message}, error.status)

    @app.handle_errors(IndexUnavailable)
    def index_unavailable(self, request: IRequest, failure: Any) -> bytes:
        request.setHeader("Retry-After", "5")
        doc = {"error": "index_unavailable", "message": f"delivery index: {failure.value}"}
        return _json(request, doc, 503)

    @app.handle_errors(HTTPException)
    def no_route(self, request: IRequest, failure: Any) -> bytes:
        error: HTTPException = failure.value
        status = error.code or 404
        if status == 405:
            allowed = ", ".join(getattr(error, "valid_methods", None) or ())
            request.setHeader("Allow", allowed)
            doc = {"error": "method_not_allowed", "message": "method not allowed here"}
        else:
            doc = {"error": "not_found", "message": "no such endpoint"}
        return _json(request, doc, status)

    @app.handle_errors(Exception)
    def internal(self, request: IRequest, failure: Any) -> bytes:
        log.failure("answering {path}", failure, path=request.path.decode("ascii", "replace"))
        return _json(request, {"error": "internal", "message": "internal error"}, 500)

    @app.route("/api/v1/objects/<object_id>", methods=["GET"])
    async def object_status(self, request: IRequest, object_id: str) -> bytes:
        doc = await self._lookups.lookup(object_id)
        if doc is None:
            raise APIError(404, "not_found", "no such object on this node")
        return _json(request, doc)

    @app.route("/api/v1/objects:query", methods=["POST"])
    async def query(self, request: IRequest) -> bytes:
        ids = _id_list(request.content.read(), "object_ids", MAX_QUERY)
        docs = await self._run(self._reader.lookup_many, ids)
        results = [
            {"object_id": oid, "found": doc is not None, "object": doc}
            for oid, doc in zip(ids, docs, strict=True)
        ]
        return _json(request, {"results": results})

    @app.route("/api/v1/objects:by-origin", methods=["GET"])
    async def by_origin(self, request: IRequest) -> bytes:
        """Where is item X: the objects of ``project`` named ``filename`` (of ``downloader``
        when given), as ``GET /api/v1/objects/{id}`` describes each."""
        project, filename = _argument(request, "project"), _argument(request, "filename")
        if project is None or filename is None:
            raise APIError(400, "bad_request", "project and filename are required")
        downloader = _argument(request, "downloader")
        docs, more = await self._run(self._reader.by_origin, project, filename, downloader)
        return _json(request, {"results": docs, "truncated": more})

    @app.route("/api/v1/releases", methods=["POST"])
    async def release(self, request: IRequest) -> bytes:
        client = await self._authenticate(request)
        try:
            ids = rel.parse_release_request(request.content.read())
        except ValueError as e:
            raise APIError(400, "bad_request", str(e)) from None
        results = await self._releases.release(ids, client)
        released = sum(1 for r in results if r.status == rel.RELEASED)
        if released:
            log.info(
                "{hq_client} released {count} receipts",
                hq_client=client,
                client=_client(request),
                count=released,
            )
        return _json(request, {"results": [r.as_dict() for r in results]})

    async def _authenticate(self, request: IRequest) -> str:
        address = _client(request)
        unauthorized = APIError(
            401, "unauthorized", "a valid bearer token is required", {"WWW-Authenticate": "Bearer"}
        )
        if self._tokens is None:
            log.warn("release refused from {client}: no [hq] tokens configured", client=address)
            raise unauthorized
        token = rel.bearer_token(request.getHeader("authorization"))
        try:
            name = await self._run(self._tokens.authenticate, token)
        except (OSError, rel.TokenFileError) as e:
            log.error("the [hq] tokens file is unusable: {error}", error=str(e))
            raise APIError(503, "tokens_unavailable", "the tokens file is unusable") from None
        if name is None:
            count = self._failures[address] = self._failures.get(address, 0) + 1
            if len(self._failures) > 10_000:  # bounded: forget the oldest addresses
                self._failures.pop(next(iter(self._failures)))
            log.warn(
                "release refused from {client}: {reason} (failure {count} from this address)",
                client=address,
                reason="missing bearer token" if token is None else "wrong bearer token",
                count=count,
            )
            raise unauthorized
        self._failures.pop(address, None)
        return name


def _argument(request: IRequest, name: str) -> str | None:
    """The one value of query argument ``name`` (UTF-8; None when absent or empty)."""
    values = request.args.get(name.encode("ascii"), [])
    if len(values) > 1:
        raise APIError(400, "bad_request", f"{name} given more than once")
    if not values or not values[0]:
        return None
    try:
        return str(values[0].decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "bad_request", f"{name} is not UTF-8") from None


def _id_list(body: bytes, key: str, limit: int) -> list[str]:
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "bad_request", f'the body must be JSON: {{"{key}": [...]}}') from None
    ids = raw.get(key) if isinstance(raw, dict) else raw
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise APIError(400, "bad_request", f'the body must be {{"{key}": [strings]}}')
    if not ids or len(ids) > limit:
        raise APIError(400, "bad_request", f"between 1 and {limit} ids per request")
    return ids


def hq_tokens(config: Config) -> rel.TokenFile | None:
    """The ``[hq] tokens`` file, read once now: an unreadable or malformed one refuses to start."""
    if config.hq is None:
        return None
    tokens = rel.TokenFile(config.hq.tokens)
    try:
        tokens.current()
    except OSError as e:
        raise ConfigError("hq.tokens", f"cannot read {config.hq.tokens}: {e.strerror}") from None
    except rel.TokenFileError as e:
        raise ConfigError("hq.tokens", f"{config.hq.tokens}: {e}") from None
    return tokens
