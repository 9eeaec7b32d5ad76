"""The receiver's HTTP surface: tus at ``/files/``, receipt lookup, health.

A small root resource hands ``/files...`` to :class:`TusRoutes` and everything else to
:class:`ReceiverRoutes` (``GET /api/v1/receipts/{id}``, ``GET /healthz``).
:func:`receiver_site` builds the streaming :class:`~canner.tus.stream.ReceiverSite` around it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from attrs import define
from klein import Klein
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from canner import fs
from canner.blocking import BlockingRunner
from canner.ids import ObjectIds
from canner.receipts import ReceiptStore
from canner.tus.intake import UploadIntake
from canner.tus.protocol import TusError
from canner.tus.routes import TusRoutes, render_error
from canner.tus.stream import ReceiverSite

# Idle connections are dropped after this long; a stalled upload body counts as idle.
HTTP_IDLE_TIMEOUT = 300


@define(eq=False)
class ReceiverRoutes:
    """Receipt lookup and health."""

    app: ClassVar[Klein] = Klein()
    _receipts: ReceiptStore
    _ids: ObjectIds
    _data_dir: Path
    _run: BlockingRunner

    @app.handle_errors(TusError)
    def refusal(self, request: IRequest, failure: Any) -> bytes:
        return render_error(request, failure.value)

    @app.route("/api/v1/receipts/<object_id>", methods=["GET"])
    async def receipt(self, request: IRequest, object_id: str) -> bytes:
        if not self._ids.is_valid(object_id):
            raise TusError(404, "no such receipt")
        data = await self._run(self._receipts.read_bytes, object_id)
        if data is None:
            raise TusError(404, "no such receipt")
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


class _Root(Resource):
    """Sends ``/files...`` to the tus app and everything else to :class:`ReceiverRoutes`."""

    def __init__(self, tus: IResource, rest: IResource) -> None:
        super().__init__()
        self._tus = tus
        self._rest = rest

    def getChildWithDefault(self, path: bytes, request: IRequest) -> IResource:
        if path == b"files":
            return self._tus
        # Undo the traversal step so the Klein app sees the whole path.
        request.postpath.insert(0, request.prepath.pop())
        return self._rest


def receiver_site(
    intake: UploadIntake,
    tus: TusRoutes,
    receipts: ReceiptStore,
    ids: ObjectIds,
    data_dir: Path,
    run: BlockingRunner,
) -> ReceiverSite:
    routes = ReceiverRoutes(receipts, ids, data_dir, run)
    root = _Root(tus.app.resource(), routes.app.resource())
    site = ReceiverSite(root, intake, timeout=HTTP_IDLE_TIMEOUT)
    site.displayTracebacks = False
    return site
