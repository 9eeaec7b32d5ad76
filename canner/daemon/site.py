"""The receiver's HTTP surface: its doors, receipt lookup, health, status, metrics.

A small root resource hands each request to the app of its route: a door's route (``/files...``
for tus, ``/seesaw/...`` for Archive Team's curl uploads, a path a door declared) to that door's
resource (:class:`~canner.doors.router.DoorRouter`), HQ's API to ``canner.hq.routes`` and
everything else to :class:`ReceiverRoutes` (``GET /api/v1/receipts/{id}``, ``GET /healthz``,
``GET /readyz``, the status page at ``GET /`` and Prometheus metrics at ``GET /metrics``).
:func:`receiver_site` builds the streaming :class:`~canner.web.channel.ReceiverSite` around it,
with the router of doors as its body router, and reports every finished request to the metrics.
On a node whose workers serve the socket, a worker forwards the node's view to the parent
(:class:`~canner.web.proxy.NodeProxy`), whose own site answers it (:func:`receiver_site`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

from attrs import define, frozen
from klein import Klein
from prometheus_client import CONTENT_TYPE_LATEST
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from canner import fs
from canner.accept.intake import UploadIntake
from canner.blocking import BlockingRunner
from canner.doors.router import DoorRouter
from canner.ids import ObjectIds
from canner.ops.humane import shorten_ids
from canner.ops.metrics import Metrics
from canner.ops.node import WorkerRoster
from canner.ops.node_metrics import NodeMetrics
from canner.ops.readiness import Readiness
from canner.ops.status_page import StatusSource, render_status
from canner.web.answer import render_error
from canner.web.channel import BodyRouter, ReceiverSite
from canner.web.connections import ConnectionCaps
from canner.web.errors import HTTPError
from canner.web.routing import OTHER, Kind, Surface

log = Logger()

# Idle connections are dropped after this long; a stalled upload body counts as idle.
HTTP_IDLE_TIMEOUT = 300


@frozen
class NodeParent:
    """What the parent of workers adds to its own site (served on its private socket, to its
    workers only): its account of the workers (readiness and the status page count them) and
    the node's metrics (its own and every worker's)."""

    roster: WorkerRoster
    metrics: NodeMetrics


@define(eq=False)
class ReceiverRoutes:
    """Receipt lookup, health, the status page and metrics."""

    app: ClassVar[Klein] = Klein()
    _intake: UploadIntake
    _ids: ObjectIds
    _data_dir: Path
    _run: BlockingRunner
    _metrics: Metrics
    _status: StatusSource
    _ready: Callable[[], Readiness]
    # The node's metrics (a parent of workers: its own and theirs); None: this process's.
    _metrics_page: Callable[[], Awaitable[bytes]] | None = None

    @app.handle_errors(HTTPError)
    def refusal(self, request: IRequest, failure: Any) -> bytes:
        return render_error(request, failure.value)

    @app.route("/api/v1/receipts/<object_id>", methods=["GET"])
    async def receipt(self, request: IRequest, object_id: str) -> bytes:
        if not self._ids.is_valid(object_id):
            raise HTTPError(404, "no such receipt")
        # Waits for an acceptance of this object that is running now: a receipt is served only
        # once committed, and a worker whose final response was lost gets it instead of a 404.
        data = await self._intake.receipt(object_id)
        if data is None:
            raise HTTPError(404, "no such receipt")
        request.setHeader("Content-Type", "application/json")
        return data

    @app.route("/healthz", methods=["GET"])
    async def health(self, request: IRequest) -> bytes:
        request.setHeader("Content-Type", "application/json")
        try:
            free = await self._run(fs.free_bytes, self._data_dir)
        except OSError as e:
            request.setResponseCode(503)
            return json.dumps({"status": "unhealthy", "error": e.strerror}).encode()
        return json.dumps({"status": "ok", "free_bytes": free}).encode()

    @app.route("/readyz", methods=["GET"])
    async def readiness(self, request: IRequest) -> bytes:
        """200 while uploads would be accepted; 503 with every reason while they would not."""
        request.setHeader("Content-Type", "application/json")
        request.setHeader("Cache-Control", "no-store")
        ready = await self._run(self._ready)
        if not ready.ready:
            request.setResponseCode(503)
        return json.dumps(ready.as_dict()).encode()

    @app.route("/", methods=["GET"])
    async def status_page(self, request: IRequest) -> bytes:
        view = await self._status.view()
        request.setHeader("Content-Type", "text/html; charset=utf-8")
        request.setHeader("Cache-Control", "no-store")
        # The page loads nothing: no scripts, no external styles or images.
        request.setHeader(
            "Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"
        )
        request.setHeader("X-Content-Type-Options", "nosniff")
        return render_status(view)

    @app.route("/metrics", methods=["GET"])
    async def metrics(self, request: IRequest) -> bytes:
        request.setHeader("Content-Type", CONTENT_TYPE_LATEST)
        if self._metrics_page is not None:
            return await self._metrics_page()
        return self._metrics.render()


class _Root(Resource):
    """Sends each request to the app of its route (``canner.web.routing``): the node's parent
    (``node``, on a worker: what :attr:`~canner.web.routing.Route.node_wide` names), its door's
    resource, HQ's API or :class:`ReceiverRoutes`."""

    def __init__(
        self,
        doors: DoorRouter,
        rest: IResource,
        hq: IResource | None = None,
        node: IResource | None = None,
    ) -> None:
        super().__init__()
        self._doors = doors
        self._rest = rest
        self._hq = hq
        self._node = node

    def getChildWithDefault(self, path: bytes, request: IRequest) -> IResource:
        route = getattr(request, "route", OTHER)
        if self._node is not None and route.node_wide:
            return self._node  # a leaf: it forwards the request's whole target
        door = self._doors.resource_of(route)
        if door is not None:
            return door  # a leaf mounted at the route's first segment: it renders from the route
        # Undo the traversal step so the Klein app sees the whole path.
        request.postpath.insert(0, request.prepath.pop())
        if route.surface is Surface.HQ and self._hq is not None:
            return self._hq
        return self._rest


access = Logger(namespace="canner.access")


class MeteredSite(ReceiverSite):
    """A :class:`ReceiverSite` that reports each finished request to :class:`Metrics` and, with
    ``access_log``, logs it as one structured event (namespace ``canner.access``).  A site of
    ``forwarded`` requests does neither: the worker that answered the client counts and logs
    each one, so the node's stream and ``canner_http_responses`` have it once."""

    def __init__(
        self,
        resource: Any,
        body_router: BodyRouter,
        metrics: Metrics,
        access_log: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(resource, body_router, **kwargs)
        self._metrics = metrics
        self._access_log = access_log

    def log(self, request: Any) -> None:
        # Twisted calls this from Request.finish for every answered request (never for one
        # whose connection dropped first).
        super().log(request)
        if self.forwarded:
            return
        try:
            # request.method is already the overridden one (ReceiverRequest).
            method = request.method
            self._metrics.observe_response(
                method.decode("ascii", "replace"), request.route.kind is Kind.CREATE, request.code
            )
        except Exception:
            log.failure("counting a response")
            return
        if self._access_log:
            try:
                self._log_access(request, method)
            except Exception:
                log.failure("logging a response")

    def _log_access(self, request: Any, method: bytes) -> None:
        started = getattr(request, "started", None)
        duration = self.reactor.seconds() - started if started is not None else None
        client = request.getClientAddress()
        access.info(
            "{method} {path} {status}",
            client=getattr(client, "host", None) or str(client),
            method=method.decode("ascii", "replace"),
            path=shorten_ids(request.uri.decode("utf-8", "replace")),
            status=request.code,
            bytes=request.sentLength,
            duration_s=round(duration, 6) if duration is not None else None,
        )


def receiver_site(
    *,
    intake: UploadIntake,
    doors: DoorRouter,
    ids: ObjectIds,
    data_dir: Path,
    run: BlockingRunner,
    metrics: Metrics,
    status: StatusSource,
    ready: Callable[[], Readiness],
    access_log: bool = True,
    connection_limits: ConnectionCaps | None = None,
    header_timeout: float | None = None,
    hq: IResource | None = None,
    reactor: IReactorTime | None = None,
    node: IResource | None = None,
    metrics_page: Callable[[], Awaitable[bytes]] | None = None,
    forwarded: bool = False,
) -> ReceiverSite:
    """The receiver's site; ``reactor`` (the global one when None) times its connections.
    ``doors`` route, open and answer every door's requests (its body router); ``intake``
    serves the receipt lookup.

    On a node whose workers serve the socket: a worker's site forwards the node's view (the
    status page, ``/readyz``, ``/metrics``, HQ's API) to ``node`` (a
    :class:`~canner.web.proxy.NodeProxy` to the parent); the parent's own site, on its private
    socket, is ``forwarded`` (it trusts ``X-Forwarded-For``, and neither counts nor logs the
    requests the workers count and log) and answers ``/metrics`` with ``metrics_page`` (the
    node's: :class:`~canner.ops.node_metrics.NodeMetrics`).  All None/False: one process, as
    without workers."""
    routes = ReceiverRoutes(intake, ids, data_dir, run, metrics, status, ready, metrics_page)
    root = _Root(doors, routes.app.resource(), hq, node)
    site = MeteredSite(
        root,
        doors,
        metrics,
        access_log,
        connection_limits=connection_limits,
        header_timeout=header_timeout,
        door_paths=doors.paths,
        forwarded=forwarded,
        timeout=HTTP_IDLE_TIMEOUT,
        reactor=reactor,
    )
    site.displayTracebacks = False
    return site
