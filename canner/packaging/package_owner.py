"""Megawarc packages as the outbound service sees them: every file of a package goes into one
item in one attempt (the indexes last) and is verified with the others; the package's files are
deleted once every one is verified, its retention has passed and its members' uploads are gone.

The package owns its files: only it deletes them, and it writes its delivery record beside its
index first (what a rebuilt index learns the delivery from).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import define
from twisted.logger import Logger

from canner.blocking import BlockingRunner
from canner.config import ProjectConfig
from canner.delivery import follow_up, outbound
from canner.delivery.index import Index
from canner.delivery.outbound_service import Copy, Parcel, Shipment, Unshippable
from canner.delivery.queue import DEFAULT_VERIFY_TIMEOUT, PURGE_RETRY
from canner.observe import Outbound
from canner.packaging import batches as sql
from canner.packaging.batches import PackageRow
from canner.packaging.megawarc import is_index
from canner.packaging.store import PackageStore
from canner.sinks.base import Delivered, DeliveryFailed, Sink
from canner.sinks.plan import PlanError, plan_package_file

log = Logger()

PACKAGE = Outbound.PACKAGE


@define(eq=False, kw_only=True)
class PackageOwner:
    """The packages of the megawarc projects (each with a delivery table and a sink)."""

    kind = PACKAGE

    _index: Index
    _store: PackageStore
    _projects: Mapping[str, ProjectConfig]
    _sinks: Mapping[str, Sink]
    _run: BlockingRunner

    def sink(self, project: str) -> Sink:
        return self._sinks[project]

    def projects(self) -> Sequence[str]:
        return [pid for pid in self._projects if pid in self._sinks]

    async def shipment(self, ref: str, stopping: threading.Event) -> Shipment:
        row = await self._index.run(sql.get_package, int(ref))
        if row is None:
            failure = DeliveryFailed("the package is gone", needs_operator=True)
            raise Unshippable(f"package batch {ref}", "", failure)
        subject = f"package {row.package_id}"
        try:
            files = await self._parcels(row)
        except PlanError as e:
            raise Unshippable(subject, row.project, e) from None
        return Shipment(
            ref=ref,
            project=row.project,
            subject=subject,
            # One file of a package is in flight at a time, shown under the package id.
            key=row.package_id or ref,
            files=files,
            overwrite=bool(row.force_upload),
        )

    async def _parcels(self, row: PackageRow) -> tuple[Parcel, ...]:
        """Every file of the package, planned; the indexes (one per megawarc, a zstd
        dictionary's too) last: an item whose indexes are listed has every container."""
        assert row.package_id is not None and row.batch_date is not None
        delivery = self._projects[row.project].delivery
        assert delivery is not None
        files = await self._index.run(sql.package_files, row.batch_id)
        files.sort(key=lambda f: (is_index(f.suffix), f.suffix))
        item_bytes = sum(f.size_bytes for f in files)
        directory = self._store.directory(row.package_id)
        parcels = []
        for f in files:
            assert f.content_md5 is not None, "verified packages have their files' MD5s"
            plan = plan_package_file(
                delivery,
                row.project,
                row.package_id,
                row.batch_date,
                f.suffix,
                f.size_bytes,
                f.content_md5,
                item_bytes,
            )
            parcels.append(Parcel(plan, directory / (row.package_id + f.suffix), plan.remote_name))
        return tuple(parcels)

    async def delivered(self, shipment: Shipment, sent: Sequence[Delivered], now: float) -> None:
        names = {
            _suffix(parcel, shipment.key): where.remote_name
            for parcel, where in zip(shipment.files, sent, strict=True)
        }
        identifier = sent[-1].identifier if sent else ""
        delivery = self._projects[shipment.project].delivery
        assert delivery is not None
        await self._index.run(
            sql.record_delivered,
            int(shipment.ref),
            identifier,
            names,
            now,
            delivery.local_artifact_retention,
        )
        log.info(
            "delivered {subject} as {identifier}",
            subject=shipment.subject,
            package=shipment.key,
            project=shipment.project,
            identifier=identifier,
            files=len(names),
        )

    def record_failure(
        self, cur: sqlite3.Cursor, ref: str, error: str, at: float, needs_operator: bool, now: float
    ) -> bool:
        return sql.record_delivery_failure(cur, int(ref), error, at, needs_operator, now)

    async def copy(self, ref: str) -> Copy | None:
        row = await self._index.run(sql.get_package, int(ref))
        if row is None or row.delivery_state != "delivered" or row.package_id is None:
            return None
        delivery = self._projects[row.project].delivery
        return Copy(
            facts=delivered_copy(row),
            files=await self._parcels(row),
            verified=row.remote_verified_at is not None,
            verify_timeout=delivery.verify_timeout if delivery else DEFAULT_VERIFY_TIMEOUT,
        )

    async def verified(self, copy: Copy, now: float) -> None:
        """The delivery record beside the index first, then the row (and its members)."""
        row = await self._index.run(sql.get_package, int(copy.facts.ref))
        assert row is not None and row.package_id is not None
        record = delivery_record(row, copy.files, now, None)
        await self._run(self._store.record_delivery, row.package_id, record)
        await self._index.run(sql.record_remote_verified, row.batch_id, now)

    def redeliver(self, cur: sqlite3.Cursor, ref: str, reason: str, now: float) -> bool:
        return sql.redeliver(cur, int(ref), reason, now)

    async def settle(self, copy: Copy, now: float) -> bool:
        """Delete the package's files once its retention has passed and its members' uploads
        are gone (they were purged once the package was sealed and verified locally); an
        ``OSError`` is the service's."""
        row = await self._index.run(sql.get_package, int(copy.facts.ref))
        if row is None or row.package_id is None or row.remote_verified_at is None:
            return False
        if row.purge_after is None or row.purge_after > now or row.sources_purged_at is None:
            again = max(now + PURGE_RETRY, row.purge_after or 0)
            await self._index.run(
                outbound.record_check, PACKAGE, str(row.batch_id), again, None, False, now
            )
            return False
        suffixes = [_suffix(parcel, row.package_id) for parcel in copy.files]
        await self._run(self._store.purge, row.package_id, suffixes)
        record = delivery_record(row, copy.files, row.remote_verified_at, now)
        await self._run(self._store.record_delivery, row.package_id, record)
        await self._index.run(sql.record_purged, row.batch_id, now)
        return True


def _suffix(parcel: Parcel, package_id: str) -> str:
    return parcel.path.name[len(package_id) :]


def delivery_record(
    row: PackageRow, files: Sequence[Parcel], verified_at: float | None, purged_at: float | None
) -> dict[str, Any]:
    """The package's delivery record, kept beside its index for rebuilds."""
    pid = row.package_id or ""
    return {
        "package": pid,
        "project": row.project,
        "identifier": row.remote_identifier,
        "delivered_at": row.delivered_at,
        "remote_verified_at": verified_at,
        "purge_after": row.purge_after,
        "sources_purged_at": row.sources_purged_at,
        "purged_at": purged_at,
        "remote_names": {_suffix(p, pid): p.plan.remote_name for p in files},
        "md5": {_suffix(p, pid): p.plan.content_md5 for p in files},
        "sizes": {_suffix(p, pid): p.plan.size for p in files},
    }


def delivered_copy(row: PackageRow) -> follow_up.DeliveredCopy:
    """A delivered package as its follow-up sees it."""
    return follow_up.DeliveredCopy.of(
        row,
        PACKAGE,
        str(row.batch_id),
        f"package {row.package_id}",
        f"canner retry {row.package_id}",
    )
