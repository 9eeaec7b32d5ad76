"""The Internet Archive sink: IA behind the :class:`~canner.sinks.base.Sink` protocol.

:class:`IASink` maps an attempt of its :class:`~canner.sinks.ia.client.IAClient` to
``Delivered`` or ``DeliveryFailed``, and verifies a delivered row against IA's metadata API and a
read-back.  The destination is planned from stable row values only (:mod:`canner.sinks.plan`),
so a retry always resolves to the same item and name.  :func:`internet_archive_sink` builds one
project's sink from its delivery table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

from attrs import evolve, frozen
from treq.client import HTTPClient
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from canner.blocking import BlockingRunner
from canner.config import ConfigError
from canner.observe import Destination
from canner.sinks.base import Delivered, DeliveryFailed, RemoteCheck
from canner.sinks.ia.client import IAClient
from canner.sinks.ia.config import IADelivery
from canner.sinks.ia.credentials import CredentialsError, loose_permissions
from canner.sinks.ia.multipart import PartJournal
from canner.sinks.ia.pacing import PutGate
from canner.sinks.ia.wire import RemoteFile, failure_class
from canner.sinks.plan import ItemPlan

log = Logger()


@frozen
class IASink:
    """One Internet Archive destination (a project's, or the ledger's): the
    :class:`~canner.sinks.base.Sink` adapter of an :class:`IAClient`."""

    destination: ClassVar[Destination] = Destination.IA

    # How much of a verified copy is read back: bytes sampled, or READBACK_ALL.
    _readback_bytes: int | Literal["all"]
    _client: IAClient

    def deliver(
        self,
        plan: ItemPlan,
        path: Path,
        progress: Callable[[int], None],
        *,
        overwrite: bool = False,
    ) -> Deferred[Delivered]:
        """One attempt (see :class:`~canner.sinks.base.Sink`); ``overwrite``: upload even when
        the metadata API lists a matching file."""
        return Deferred.fromCoroutine(self._deliver(plan, path, progress, overwrite))

    async def _deliver(
        self, plan: ItemPlan, path: Path, progress: Callable[[int], None], overwrite: bool
    ) -> Delivered:
        result = await self._client.deliver(plan, path, progress, overwrite=overwrite)
        if result.delivered:
            return Delivered(plan.identifier, plan.remote_name)
        raise DeliveryFailed(
            result.outcome.reason,
            needs_operator=result.outcome.needs_operator,
            retry_after=result.outcome.retry_after,
            kind=failure_class(result.status, result.outcome.reason),
        )

    def verify(self, plan: ItemPlan, path: Path) -> Deferred[RemoteCheck]:
        """Is the file at IA with its size and MD5, and do the bytes IA serves match the local
        copy at ``path``?"""
        return Deferred.fromCoroutine(self._verify(plan, path))

    async def _verify(self, plan: ItemPlan, path: Path) -> RemoteCheck:
        listed = await self._verify_file(
            plan.identifier, plan.remote_name, plan.size, plan.content_md5 or None
        )
        if not listed.verified:
            return listed
        return await self._read_back(
            plan.identifier, plan.remote_name, path, plan.size, plan.content_md5
        )

    async def _verify_file(
        self, identifier: str, remote_name: str, size: int, content_md5: str | None
    ) -> RemoteCheck:
        found = await self._client.lookup(identifier, remote_name)
        if isinstance(found, RemoteFile):
            if content_md5 is not None and found.matches(size, content_md5):
                return RemoteCheck(True)
            return RemoteCheck(
                False,
                f"remote file differs: {found.size} bytes, md5 {found.md5}",
                needs_operator=True,
            )
        if found is None:
            return RemoteCheck(False, "not listed by the metadata API yet", absent=True)
        return RemoteCheck(False, found.reason, needs_operator=found.needs_operator)

    async def _read_back(
        self, identifier: str, remote_name: str, path: Path, size: int, md5: str
    ) -> RemoteCheck:
        """The metadata matches; before a purge may follow, check the bytes IA serves against
        the local copy at ``path`` (a few ranges), or against its MD5 (``"all"``)."""
        budget = self._readback_bytes
        if isinstance(budget, str):  # READBACK_ALL
            result = await self._client.read_back_all(identifier, remote_name, size, md5)
        elif budget <= 0:
            return RemoteCheck(True)
        else:
            result = await self._client.read_back(identifier, remote_name, path, size, budget)
        if result.ok:
            return RemoteCheck(True)
        if result.mismatch:
            return RemoteCheck(
                False,
                result.detail + "; the payload is kept, `canner retry` uploads it again",
                needs_operator=True,
                bad_copy=True,
            )
        if result.needs_operator:
            return RemoteCheck(
                False,
                result.detail + "; set readback_bytes = 0 to verify by the metadata API alone",
                needs_operator=True,
            )
        log.warn(
            "read-back of {identifier}/{remote_name} failed, trying again later: {error}",
            identifier=identifier,
            remote_name=remote_name,
            error=result.detail,
        )
        return RemoteCheck(False, result.detail)


def internet_archive_sink(
    project_id: str,
    delivery: IADelivery,
    http: HTTPClient,
    reactor: Any,
    run: BlockingRunner,
    journal: PartJournal | None = None,
    gates: dict[str, PutGate] | None = None,
) -> IASink:
    """One project's IA sink; reads its credentials (blocking).

    ``run`` is the blocking runner that reads payloads off the reactor thread; ``journal``
    holds the parts of multipart uploads (the data directory's ``multipart/``).  ``gates``,
    by access key, is shared by every project's client: IA rations tasks per account, so projects
    that upload with the same keys are paced together.  Raises
    :class:`ConfigError` naming the key when the credentials are unusable, so a bad project
    refuses to start instead of failing every attempt later (``parse_config`` checked the rest).
    """
    try:
        client = IAClient.for_delivery(
            delivery,
            http,
            reactor,
            run,
            journal=journal,
        )
    except CredentialsError as e:
        raise ConfigError(f"projects.{project_id}.delivery.credentials", str(e)) from None
    if loose := loose_permissions(delivery.credentials):
        log.warn(
            "projects.{project}.delivery.credentials: {problem}", project=project_id, problem=loose
        )
    if gates is not None:
        client = evolve(client, gate=gates.setdefault(client.account, client.gate))
    return IASink(delivery.readback_bytes, client)
