"""Sinks the scheduler can deliver to: the Internet Archive, one per project.

:class:`IADeliverySink` adapts :class:`canner.ia.IASink` to the scheduler's ``Sink`` protocol: it
plans the destination from stable row values only (so a retry always resolves to the same item
and name), maps the attempt's outcome to ``Delivered`` or ``DeliveryFailed``, and verifies a
delivered row against IA's metadata API.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import frozen
from twisted.internet.defer import Deferred

from canner import ia
from canner.config import Config, ConfigError, DeliveryConfig
from canner.delivery.index import QueueRow
from canner.delivery.scheduler import Delivered, DeliveryFailed, RemoteCheck, Sink


def failure_class(status: int | None, reason: str) -> str:
    """The class of a failed IA attempt, for metrics and alerts (pure).

    ``forbidden`` (credentials or permissions: an operator must act), ``rate_limited``,
    ``server_error``, ``client_error``, ``local_payload`` or ``network`` (no HTTP answer:
    connection, DNS, timeouts)."""
    if status is None:
        if reason.startswith("local file"):
            return "local_payload"
        if reason.startswith(("503 SlowDown", "429")):
            return "rate_limited"
        if reason.startswith(("401", "403")):
            return "forbidden"
        return "network"
    if status in (401, 403):
        return "forbidden"
    if status in (429, 503):
        return "rate_limited"
    if status >= 500:
        return "server_error"
    if status >= 400:
        return "client_error"
    return "other"


@frozen
class IADeliverySink:
    """One project's Internet Archive destination."""

    _delivery: DeliveryConfig
    _sink: ia.IASink

    def plan(self, row: QueueRow) -> ia.ItemPlan:
        assert row.content_md5 is not None, "the scheduler computes the MD5 before delivering"
        return ia.plan_upload(
            self._delivery,
            row.project,
            row.object_id,
            row.filename,
            row.accepted_at,
            row.size_bytes,
            row.content_md5,
        )

    def deliver(
        self, row: QueueRow, path: Path, progress: Callable[[int], None]
    ) -> Deferred[Delivered]:
        return Deferred.fromCoroutine(self._deliver(row, path, progress))

    async def _deliver(
        self, row: QueueRow, path: Path, progress: Callable[[int], None]
    ) -> Delivered:
        plan = self.plan(row)
        result = await self._sink.deliver(plan, path, progress)
        if result.delivered:
            return Delivered(plan.identifier, plan.remote_name)
        raise DeliveryFailed(
            result.outcome.reason,
            needs_operator=result.outcome.needs_operator,
            retry_after=result.outcome.retry_after,
            kind=failure_class(result.status, result.outcome.reason),
        )

    def verify(self, row: QueueRow) -> Deferred[RemoteCheck]:
        return Deferred.fromCoroutine(self._verify(row))

    async def _verify(self, row: QueueRow) -> RemoteCheck:
        assert row.remote_identifier is not None and row.remote_name is not None
        found = await self._sink.lookup(row.remote_identifier, row.remote_name)
        if isinstance(found, ia.RemoteFile):
            if row.content_md5 is not None and found.matches(row.size_bytes, row.content_md5):
                return RemoteCheck(True)
            return RemoteCheck(
                False,
                f"remote file differs: {found.size} bytes, md5 {found.md5}",
                needs_operator=True,
            )
        if found is None:
            return RemoteCheck(False, "not listed by the metadata API yet")
        return RemoteCheck(False, found.reason, needs_operator=found.needs_operator)


def internet_archive_sinks(config: Config, reactor: Any) -> dict[str, Sink]:
    """A sink per project with a delivery table; validates templates and reads credentials.

    Raises :class:`ConfigError` naming the key when a template or the credentials are unusable,
    so a bad project refuses to start instead of failing every attempt later.
    """
    sinks: dict[str, Sink] = {}
    http = None
    for project_id, project in config.projects.items():
        delivery = project.delivery
        if delivery is None:
            continue
        ia.validate_delivery(project_id, delivery)
        if http is None:
            http = ia.make_http_client(reactor)
        try:
            sink = ia.IASink.for_delivery(delivery, http, reactor)
        except ia.CredentialsError as e:
            raise ConfigError(f"projects.{project_id}.delivery.credentials", str(e)) from None
        sinks[project_id] = IADeliverySink(delivery, sink)
    return sinks
