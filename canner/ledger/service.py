"""The ledger in canner-deliver: assign released records to ledgers, then write, upload, verify
and delete, one guarded step at a time.

Each ledger moves ``writing -> written -> uploaded -> deleting -> done`` in ``delivery.sqlite``
(a guarded update per step), so after a SIGKILL the next tick resumes where it stopped: a
``writing`` ledger is rewritten from its assigned records (the same bytes), a ``written`` one is
uploaded (the sink first looks for an identical remote file), an ``uploaded`` one is verified
through the metadata API (size and MD5) and then read back whole (the MD5 of the bytes IA
serves), and a ``deleting`` one deletes again (missing is done).  The manifest
(``ledger/<name>.json``) is written once the remote copy verified, before anything is deleted:
it is what makes the ledger the owner of its records' local state, also for a rebuilt index
(:meth:`LedgerService.adopt`).  A remote copy that differs (in the listing or in the bytes
served) is flagged (``needs_operator``) and uploaded again; nothing local is deleted meanwhile.
A ledger still not listed :data:`VERIFY_TIMEOUT` after its upload (IA lost it after its 200)
goes back to ``written`` and is uploaded again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import Factory, define, evolve, field
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, DeferredLock, FirstError, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner import fs
from canner.blocking import BlockingRunner
from canner.config import ConfigError, LedgerConfig
from canner.delivery.index import DeliveryIndex
from canner.delivery.jobs import Ticker
from canner.delivery.liveness import Attempt, InFlight
from canner.delivery.queue import DEFAULT_VERIFY_TIMEOUT, MAX_RETRY, retry_delay
from canner.ids import ObjectIds
from canner.journal import JournalLog
from canner.ledger import store
from canner.ledger.files import (
    SUFFIX,
    ArchivedIds,
    LedgerDir,
    Manifest,
    expand,
    template_placeholders,
)
from canner.ledger.steps import (
    LedgerError,
    id_batches,
    leftovers,
    remove_leftovers,
    remove_receipts,
    write_ledger,
)
from canner.observe import UNOBSERVED, Destination, Outbound, OutboundObserver, counting_sent
from canner.receipts import ReceiptStore
from canner.sinks.internet_archive import IASink
from canner.sinks.metadata import metadata_headers, metadata_key_problem
from canner.sinks.plan import ItemPlan, identifier_problem
from canner.sinks.wire import RemoteFile, Unknown, failure_class

log = Logger()

LEDGER = Outbound.LEDGER

TICK = 1.0
ASSIGN_INTERVAL = 60.0
VERIFY_MIN, VERIFY_MAX = 2.0, 600.0
# How long an uploaded ledger may stay unlisted before it is uploaded again: objects' default
# verify_timeout (IA's archive tasks can lag for hours).  No redelivery limit: a ledger is small,
# and it is sent again at most once per timeout.
VERIFY_TIMEOUT = DEFAULT_VERIFY_TIMEOUT
WRITE_RETRY = 600.0
DELETE_RETRY = 60.0
DELETE_THREADS = 32
DELETE_BATCH = 4000


def validate_ledger(config: LedgerConfig) -> None:
    """Refuse a ``[ledger]`` whose identifier or metadata could break IA's rules."""
    try:
        used = template_placeholders(config.identifier)
    except ValueError as e:
        raise ConfigError("ledger.identifier", str(e)) from None
    if "period" not in used:
        raise ConfigError("ledger.identifier", "must contain {period}: one item per period")
    for period in ("2026-11-30", "2026-11"):
        problem = identifier_problem(expand(config.identifier, config.node, period))
        if problem is not None:
            raise ConfigError("ledger.identifier", problem)
    for key, values in config.metadata.items():
        problem = metadata_key_problem(key)
        if problem is not None:
            raise ConfigError(f"ledger.metadata.{key}", problem)
        for value in values:
            try:
                template_placeholders(value)
            except ValueError as e:
                raise ConfigError(f"ledger.metadata.{key}", str(e)) from None


def ledger_plan(config: LedgerConfig, row: store.LedgerRow) -> ItemPlan:
    """Where a written ledger goes: ``identifier`` (per period), its file name, and headers."""
    assert row.bytes is not None and row.md5 is not None
    identifier = expand(config.identifier, config.node, row.period)
    metadata = {
        key: [expand(v, config.node, row.period) for v in values]
        for key, values in config.metadata.items()
    }
    headers = [
        ("content-md5", row.md5),
        ("x-archive-auto-make-bucket", "1"),
        ("x-archive-size-hint", str(row.bytes)),
        *metadata_headers(metadata),
    ]
    return ItemPlan(
        project="",
        object_id=row.name,
        identifier=identifier,
        remote_name=row.name + SUFFIX,
        size=row.bytes,
        content_md5=row.md5,
        size_hint=row.bytes,
        headers=tuple(headers),
    )


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
    _sink: IASink
    _run: BlockingRunner
    _clock: IReactorTime
    # Unlinks wait on the disk, not the CPU: a pool of their own keeps many in flight.
    _unlink: BlockingRunner | None = None
    # Shared with the receipt rescan: a rescan must never re-insert records being deleted.
    guard: DeferredLock = field(factory=DeferredLock)
    observer: OutboundObserver = UNOBSERVED
    # canner-deliver's attempts in flight: a ledger's upload shows there under its name.
    in_flight: InFlight = field(
        default=Factory(lambda self: InFlight(self._clock), takes_self=True)
    )
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
            # An upload a crash cut short is due again; then the ledgers verified on disk.
            await self._index.run(store.reset_uploads, self._clock.seconds())
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
        elif row.state == "written":
            if not await self._upload(row, now):
                return None
        elif row.state in ("uploaded", "verified"):
            if not await self._verify(row, now):
                return None
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
        return updated  # type: ignore[no-any-return]

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
        identifier = expand(self._config.identifier, self._config.node, row.period)
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

    async def _upload(self, row: store.LedgerRow, now: float) -> bool:
        if not await self._index.run(store.begin_upload, row.ledger_id, now):
            return False
        plan = ledger_plan(self._config, row)
        # ``attempts`` counts the failed ones (uploads and verifications) so far.
        self.observer.attempt_started(LEDGER, "", row.attempts + 1)
        with self.in_flight.running(
            Attempt(row.name, "", plan.remote_name, plan.size, row.attempts + 1)
        ):
            sent = self.in_flight.uploading(row.name)
            # A ledger found wrong at IA is uploaded even if IA's listing matches: a read-back
            # found other bytes behind a matching listing.
            result = await self._sink.deliver(
                plan,
                self._ledgers.ledger_path(row.name),
                counting_sent(sent, self.observer, LEDGER, Destination.IA),
                overwrite=bool(row.force_upload),
            )
        if not result.delivered:
            self.observer.delivery_failed(
                LEDGER,
                "",
                failure_class(result.status, result.outcome.reason),
                result.outcome.needs_operator,
            )
            delay = retry_delay(row.attempts, 0.5, needs_operator=result.outcome.needs_operator)
            # IA's Retry-After is a lower bound, within the backoff's cap (as for objects).
            delay = max(delay, min(result.outcome.retry_after or 0.0, MAX_RETRY))
            await self._index.run(
                store.record_upload_failure,
                row.ledger_id,
                f"upload: {result.outcome.reason}",
                now + delay,
                result.outcome.needs_operator,
                self._clock.seconds(),
            )
            log.warn(
                "uploading ledger {ledger} failed, retry in {delay:.0f}s: {error}",
                ledger=row.name,
                delay=delay,
                error=result.outcome.reason,
            )
            return False
        await self._index.run(
            store.record_uploaded, row.ledger_id, plan.identifier, self._clock.seconds()
        )
        self.observer.delivered(LEDGER, "")
        log.info(
            "uploaded ledger {ledger} to {identifier}", ledger=row.name, identifier=plan.identifier
        )
        return True

    async def _verify(self, row: store.LedgerRow, now: float) -> bool:
        assert row.identifier and row.remote_name and row.bytes is not None and row.md5
        found = await self._sink.lookup(row.identifier, row.remote_name)
        if isinstance(found, RemoteFile) and found.matches(row.bytes, row.md5):
            # The listing is what IA believes it stores; the bytes it serves decide.
            served = await self._sink.read_back_all(
                row.identifier, row.remote_name, row.bytes, row.md5
            )
            if served.mismatch:
                await self._upload_again(row, now, served.detail)
                return False
            if not served.ok:
                await self._retry_verify(row, now, served.detail, served.needs_operator)
                return False
            manifest = Manifest(
                name=row.name,
                period=row.period,
                records=row.records,
                size=row.bytes,
                md5=row.md5,
                blake3=row.blake3 or "",
                identifier=row.identifier,
                remote_name=row.remote_name,
                url=self._sink_url(row),
                verified_at=now,
            )
            # The manifest first: from here on the ledger owns its records' local state.
            await self._run(self._ledgers.write_manifest, manifest)
            await self._index.run(store.record_verified, row.ledger_id, now)
            self.observer.verified(LEDGER)
            log.info(
                "verified ledger {ledger} at {identifier}",
                ledger=row.name,
                identifier=row.identifier,
            )
            return True
        if isinstance(found, RemoteFile):
            await self._upload_again(
                row, now, f"remote copy differs: {found.size} bytes, md5 {found.md5}"
            )
            return False
        if found is None and now - (row.uploaded_at or now) >= VERIFY_TIMEOUT:
            # IA answered 200 and then lost the file (its archive task failed): send it again.
            # The upload's own lookup comes first, so a copy that shows up meanwhile is kept.
            error = (
                f"not listed by the metadata API {VERIFY_TIMEOUT:g}s after its upload;"
                " uploading again"
            )
            log.warn("ledger {ledger}: {error}", ledger=row.name, error=error)
            self.observer.redelivered(LEDGER, "")
            await self._index.run(store.send_again, row.ledger_id, error, now, now, False)
            return False
        if isinstance(found, Unknown):
            await self._retry_verify(row, now, found.reason, found.needs_operator)
        else:
            await self._retry_verify(row, now, "not listed by the metadata API yet", False)
        return False

    async def _upload_again(self, row: store.LedgerRow, now: float, detail: str) -> None:
        """IA holds other bytes than the ledger: flag it and send it again (nothing deleted)."""
        error = f"{detail}; uploading again"
        log.error("ledger {ledger}: {error}", ledger=row.name, error=error)
        # The first mismatch uploads again at once (the copy may have been damaged on the
        # way); a mismatch that persists backs off like a failed delivery.
        again = now if not row.needs_operator else now + retry_delay(row.attempts, 0.5)
        await self._index.run(store.send_again, row.ledger_id, error, now, again, True)

    async def _retry_verify(
        self, row: store.LedgerRow, now: float, reason: str, needs_operator: bool
    ) -> None:
        """Not verified yet (not listed, or a lookup or read-back failed): look again later,
        sooner the more recent the upload."""
        waited = now - (row.uploaded_at or now)
        delay = min(max(waited / 2.0, VERIFY_MIN), VERIFY_MAX)
        if waited < VERIFY_TIMEOUT:
            # Look once more exactly when the timeout passes, so it acts on time.
            delay = min(delay, VERIFY_TIMEOUT - waited)
        await self._index.run(
            store.verify_later, row.ledger_id, f"verify: {reason}", now + delay, needs_operator, now
        )

    def _sink_url(self, row: store.LedgerRow) -> str:
        base = self._config.metadata_url.rstrip("/")
        return f"{base}/download/{row.identifier}/{row.remote_name}"

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
