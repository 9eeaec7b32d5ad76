"""The ledger in canner-deliver: assign released records to ledgers, write them, and delete
the local state of the verified ones, one guarded step at a time.

Each ledger moves ``writing -> written -> uploaded -> deleting -> done`` in ``delivery.sqlite``
(a guarded update per step), so after a SIGKILL the next tick resumes where it stopped: a
``writing`` ledger is rewritten from its assigned records (the same bytes), and a ``deleting``
one deletes again (missing is done).  Between the two, a written ledger is an outbound row: the
outbound service uploads it, verifies it (metadata, then the whole file read back) and hands it
to :class:`~canner.ledger.ledger_owner.LedgerOwner`, which writes the manifest
(``ledger/<name>.json``) before anything is deleted: it is what makes the ledger the owner of
its records' local state, also for a rebuilt index (:meth:`LedgerService.adopt`).  A copy that
differs, or that IA lost after its 200, follows the one failure policy of every outbound file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import define, evolve, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, DeferredLock, FirstError, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner import fs
from canner.blocking import BlockingRunner
from canner.config import LedgerConfig
from canner.delivery.index import DeliveryIndex
from canner.delivery.jobs import Ticker
from canner.ids import ObjectIds
from canner.ledger import store
from canner.ledger.files import SUFFIX, ArchivedIds, LedgerDir, Manifest
from canner.ledger.steps import (
    LedgerError,
    id_batches,
    leftovers,
    remove_leftovers,
    remove_receipts,
    write_ledger,
)
from canner.observe import UNOBSERVED, Outbound, OutboundObserver
from canner.store.journal import JournalLog
from canner.store.receipts import ReceiptStore

log = Logger()

LEDGER = Outbound.LEDGER

TICK = 1.0
ASSIGN_INTERVAL = 60.0
WRITE_RETRY = 600.0
DELETE_RETRY = 60.0
DELETE_THREADS = 32
DELETE_BATCH = 4000


@define(eq=False, kw_only=True)
class LedgerService(Service):
    """Runs the ledger of one data directory (in canner-deliver, which owns the data dir);
    collaborators by keyword."""

    _config: LedgerConfig
    _ids: ObjectIds
    _index: DeliveryIndex
    _db: Path
    _ledgers: LedgerDir
    _receipts: ReceiptStore
    _journal: JournalLog
    _uploads: Path
    _run: BlockingRunner
    _clock: IReactorTime
    # Unlinks wait on the disk, not the CPU: a pool of their own keeps many in flight.
    _unlink: BlockingRunner | None = None
    # Shared with the receipt rescan: a rescan must never re-insert records being deleted.
    guard: DeferredLock = field(factory=DeferredLock)
    observer: OutboundObserver = UNOBSERVED
    _adopted: bool = False
    _assigned_at: float = float("-inf")
    _ticker: Ticker = field(init=False)

    def __attrs_post_init__(self) -> None:
        # Each tick holds the guard the receipt rescan shares (see ``guard``).
        self._ticker = Ticker(
            self._clock,
            TICK,
            lambda: self.guard.run(lambda: Deferred.fromCoroutine(self.tick())),
            "ledger",
        )

    def startService(self) -> None:
        super().startService()
        self._ticker.start(lambda: succeed(None))  # the first tick adopts verified ledgers

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        return self._ticker.stop()

    def _full_id(self, tail: str) -> str:
        prefix = self._ids.prefix
        return f"{prefix}-{tail}" if prefix else tail

    async def tick(self) -> None:
        if not self._adopted:
            await self.adopt()
            self._adopted = True
        now = self._clock.seconds()
        flush = await self._index.run(store.pending_flush)
        if flush is not None or now - self._assigned_at >= ASSIGN_INTERVAL:
            self._assigned_at = now
            taken = [m.name for m in await self._run(self._ledgers.manifests)]
            made = await self._index.run(
                store.assign_records,
                now,
                self._config.delay,
                self._config.period,
                self._config.node,
                flush is not None,
                taken,
            )
            if made:
                log.info("{count} new ledgers to archive", count=len(made))
            if flush is not None:
                await self._index.run(store.flush_handled, flush, now)
        for row in await self._index.run(store.due_ledgers, now):
            while self.running and row.state != "done":
                advanced = await self._step(row)
                if advanced is None:
                    break
                row = advanced

    async def adopt(self) -> None:
        """Bring every verified ledger on disk into the index (after the index was lost, or a
        crash between writing a manifest and recording it)."""
        for manifest in await self._run(self._ledgers.manifests):
            facts = {
                "bytes": manifest.size,
                "md5": manifest.md5,
                "blake3": manifest.blake3,
                "identifier": manifest.identifier,
                "remote_name": manifest.remote_name,
                "verified_at": manifest.verified_at,
                "done_at": manifest.done_at,
            }
            changed = await self._index.run(
                store.adopt_manifest,
                manifest.name,
                manifest.period,
                manifest.records,
                facts,
                manifest.done_at is not None,
            )
            if changed:
                log.info("adopted verified ledger {ledger} from disk", ledger=manifest.name)

    async def _step(self, row: store.LedgerRow) -> store.LedgerRow | None:
        """Run the ledger's next step; the updated row, or None when it must wait."""
        now = self._clock.seconds()
        if row.state == "writing":
            await self._write(row, now)
        elif row.state != "deleting":
            return None  # written: sent and verified by the outbound service
        elif row.state == "deleting":
            try:
                await self._delete(row, now)
            except (OSError, FirstError) as failed:
                e = failed.subFailure.value if isinstance(failed, FirstError) else failed
                if not isinstance(e, OSError):
                    raise
                log.error(
                    "deleting the local state of ledger {ledger} failed, retrying: {error}",
                    ledger=row.name,
                    error=str(e),
                )
                await self._index.run(
                    store.record_ledger_failure,
                    row.ledger_id,
                    f"delete: {e}",
                    now + DELETE_RETRY,
                    False,
                )
                return None
        updated = await self._index.run(store.get_ledger, row.ledger_id)
        if updated is None or updated.state == row.state:
            return None
        return updated

    async def _write(self, row: store.LedgerRow, now: float) -> None:
        try:
            written = await self._run(
                write_ledger, self._db, self._ledgers, self._receipts, row.ledger_id, row.name
            )
        except (LedgerError, OSError, ValueError) as e:
            log.error("writing ledger {ledger} failed: {error}", ledger=row.name, error=str(e))
            await self._index.run(
                store.record_ledger_failure, row.ledger_id, f"write: {e}", now + WRITE_RETRY, True
            )
            return
        identifier = self._config.identifier_for(row.period)
        values = {
            "records": written.records,
            "bytes": written.size,
            "md5": written.md5,
            "blake3": written.blake3,
            "identifier": identifier,
            "remote_name": row.name + SUFFIX,
            "written_at": self._clock.seconds(),
        }
        await self._index.run(store.record_written, row.ledger_id, values, self._clock.seconds())
        log.info(
            "wrote ledger {ledger}: {count} records, {size} bytes",
            ledger=row.name,
            count=written.records,
            size=written.size,
        )

    async def _delete(self, row: store.LedgerRow, now: float) -> None:
        archived = ArchivedIds(self._ledgers)
        extra = await self._run(leftovers, self._receipts, self._uploads, archived.contains)
        await self._run(remove_leftovers, self._receipts, self._uploads, extra)
        batches = id_batches(self._ledgers, row.name, self._full_id, DELETE_BATCH)
        deleted = 0
        # A batch's rows are deleted while the next batch's files are: files first, rows
        # after, for every batch (a rebuilt index skips these ids: the manifest says so).
        rows: Deferred[int] | None = None
        try:
            while (batch := await self._run(next, batches, None)) is not None:
                # Unlinks wait on the disk: several threads at once keep it busy.
                step = -(-len(batch) // DELETE_THREADS)
                unlink = self._unlink or self._run
                await DeferredList(
                    [
                        unlink(remove_receipts, self._receipts, batch[i : i + step])
                        for i in range(0, len(batch), step)
                    ],
                    fireOnOneErrback=True,
                    consumeErrors=True,
                )
                await self._run(fs.fsync_dir, self._receipts.directory)
                if rows is not None:
                    previous, rows = rows, None
                    deleted += await previous
                rows = self._index.run(store.delete_records, row.ledger_id, batch)
        finally:
            if rows is not None:
                deleted += await rows
        # Journal segments whose every record is archived go too (before the ledger is done: a
        # crash in between repeats this step).
        spent = await self._run(self._journal.remove_spent, archived.contains)
        manifest = await self._run(self._read_manifest, row.name)
        await self._run(
            self._ledgers.write_manifest, evolve(manifest, done_at=self._clock.seconds())
        )
        await self._index.run(
            store.update_ledger,
            row.ledger_id,
            "deleting",
            {"state": "done", "done_at": self._clock.seconds()},
        )
        # The ledger's local purge: the records it archived are gone from this node.
        self.observer.purged(LEDGER)
        log.info(
            "ledger {ledger} done: local state of its {count} records deleted",
            ledger=row.name,
            count=row.records,
            rows=deleted,
            segments=spent,
        )

    def _read_manifest(self, name: str) -> Manifest:
        return Manifest.from_json(self._ledgers.manifest_path(name).read_bytes())
