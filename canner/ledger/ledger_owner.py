"""Ledgers as the outbound service sees them: a written ledger is one file to the ledger's IA
item, read back whole before it counts as verified; its manifest is written then, and from that
moment the ledger owns its records' local state (:class:`~canner.ledger.service.LedgerService`
deletes it in its own step).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence

from attrs import define
from twisted.internet.defer import Deferred, DeferredLock
from twisted.logger import Logger

from canner import templates
from canner.blocking import BlockingRunner
from canner.config import LedgerConfig
from canner.delivery import follow_up, outbound
from canner.delivery.index import Index
from canner.delivery.outbound_service import Copy, Parcel, Shipment, Unshippable
from canner.delivery.queue import DEFAULT_VERIFY_TIMEOUT
from canner.ledger import store
from canner.ledger.files import SUFFIX, LedgerDir, Manifest
from canner.observe import Outbound
from canner.sinks.base import Delivered, DeliveryFailed, Sink
from canner.sinks.ia.metadata import metadata_headers
from canner.sinks.plan import ItemPlan

log = Logger()

LEDGER = Outbound.LEDGER
# The project of every ledger's outbound row (a ledger belongs to the node, not to a project).
NO_PROJECT = ""


def ledger_plan(config: LedgerConfig, row: store.LedgerRow) -> ItemPlan:
    """Where a written ledger goes: ``identifier`` (per period), its file name, and headers."""
    assert row.bytes is not None and row.md5 is not None
    identifier = config.identifier_for(row.period)
    values = config.template_values(row.period)
    metadata = {
        key: [templates.expand(v, values) for v in value_templates]
        for key, value_templates in config.metadata.items()
    }
    headers = [
        ("content-md5", row.md5),
        ("x-archive-auto-make-bucket", "1"),
        ("x-archive-size-hint", str(row.bytes)),
        *metadata_headers(metadata),
    ]
    return ItemPlan(
        project=NO_PROJECT,
        object_id=row.name,
        identifier=identifier,
        remote_name=row.name + SUFFIX,
        size=row.bytes,
        content_md5=row.md5,
        size_hint=row.bytes,
        headers=tuple(headers),
    )


@define(eq=False, kw_only=True)
class LedgerOwner:
    """The written ledgers of one data directory, sent through the ledger's own sink (which
    reads every ledger back whole: they are small)."""

    kind = LEDGER

    _config: LedgerConfig
    _index: Index
    _ledgers: LedgerDir
    _sink: Sink
    _run: BlockingRunner
    # The ledger's guard, shared with the receipt rescan: a manifest appears under it.
    _guard: DeferredLock

    def sink(self, project: str) -> Sink:
        return self._sink

    def projects(self) -> Sequence[str]:
        return [NO_PROJECT]

    async def _row(self, ref: str) -> store.LedgerRow | None:
        return await self._index.run(store.get_ledger, int(ref))

    async def shipment(self, ref: str, stopping: threading.Event) -> Shipment:
        row = await self._row(ref)
        if row is None or row.bytes is None:
            failure = DeliveryFailed("the ledger is gone or not written", needs_operator=True)
            raise Unshippable(f"ledger {ref}", NO_PROJECT, failure)
        plan = ledger_plan(self._config, row)
        return Shipment(
            ref=ref,
            project=NO_PROJECT,
            subject=f"ledger {row.name}",
            key=row.name,
            files=(Parcel(plan, self._ledgers.ledger_path(row.name), plan.remote_name),),
            overwrite=bool(row.force_upload),
        )

    async def delivered(self, shipment: Shipment, sent: Sequence[Delivered], now: float) -> None:
        (where,) = sent
        await self._index.run(store.record_uploaded, int(shipment.ref), where.identifier, now)
        log.info(
            "uploaded {subject} to {identifier}",
            subject=shipment.subject,
            ledger=shipment.key,
            identifier=where.identifier,
        )

    def record_failure(
        self, cur: sqlite3.Cursor, ref: str, error: str, at: float, needs_operator: bool, now: float
    ) -> bool:
        return store.record_upload_failure(cur, int(ref), error, at, needs_operator, now)

    async def copy(self, ref: str) -> Copy | None:
        row = await self._row(ref)
        facts = await self._index.run(outbound.row_of, LEDGER, ref)
        if row is None or facts is None or facts.state != "delivered" or row.bytes is None:
            return None
        plan = ledger_plan(self._config, row)
        return Copy(
            facts=follow_up.DeliveredCopy(
                kind=LEDGER,
                ref=ref,
                subject=f"ledger {row.name}",
                project=NO_PROJECT,
                identifier=facts.remote_identifier,
                delivered_at=facts.delivered_at,
                redeliveries=facts.redeliveries,
                needs_operator=bool(facts.needs_operator),
                retry=f"canner retry {row.name}",
            ),
            files=(Parcel(plan, self._ledgers.ledger_path(row.name), plan.remote_name),),
            verified=facts.verified_at is not None,
            verify_timeout=DEFAULT_VERIFY_TIMEOUT,
        )

    async def verified(self, copy: Copy, now: float) -> None:
        """The manifest first: from then on the ledger owns its records' local state."""

        async def record() -> None:
            row = await self._row(copy.facts.ref)
            assert row is not None and row.identifier and row.remote_name and row.bytes
            manifest = Manifest(
                name=row.name,
                period=row.period,
                records=row.records,
                size=row.bytes,
                md5=row.md5 or "",
                blake3=row.blake3 or "",
                identifier=row.identifier,
                remote_name=row.remote_name,
                url=self._download_url(row),
                verified_at=now,
            )
            await self._run(self._ledgers.write_manifest, manifest)
            await self._index.run(store.record_verified, row.ledger_id, now)

        await self._guard.run(lambda: Deferred.fromCoroutine(record()))

    def _download_url(self, row: store.LedgerRow) -> str:
        base = self._config.metadata_url.rstrip("/")
        return f"{base}/download/{row.identifier}/{row.remote_name}"

    def redeliver(self, cur: sqlite3.Cursor, ref: str, reason: str, now: float) -> bool:
        return store.send_again(cur, int(ref), reason, now, now, False)

    async def settle(self, copy: Copy, now: float) -> bool:
        """Nothing: a verified ledger's local state is deleted by the ledger's own step."""
        return False
