"""The packaging pipeline with a fake clock, a real SQLite file, real files and a fake sink:
batching, building, the verification pass, source purge, delivery, purge and rebuild."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any, ClassVar

import zstandard
from attrs import define, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from canner.blocking import run_inline
from canner.config import parse_config
from canner.delivery import index as dsql
from canner.delivery.index import AcceptedObject
from canner.delivery.liveness import InFlight
from canner.delivery.outbound_service import OutboundService, lanes_of
from canner.delivery.queue import DEFAULT_VERIFY_TIMEOUT, MAX_REDELIVERIES
from canner.ids import ObjectIds
from canner.observe import Destination
from canner.ops.inventory import survey_json, take_survey
from canner.ops.metrics import DELIVER, Metrics, SurveyCache, SurveyCollector
from canner.ops.status_page import StatusView, render_status
from canner.packaging import batches as sql
from canner.packaging.dictionaries import DictionaryStore, dictionary_frame
from canner.packaging.dictionary_api import Dictionaries, DictionaryUnavailable
from canner.packaging.megawarc import (
    INDEX,
    TAR,
    WARC_GZ,
    WARC_ZST,
    index_files,
    read_index,
    verify_package,
)
from canner.packaging.package_owner import PackageOwner
from canner.packaging.pipeline import PackagingService
from canner.packaging.store import PackageStore
from canner.sinks.base import Delivered, DeliveryFailed, RemoteCheck
from canner.sinks.plan import ItemPlan
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore
from tests.fakes import SyncIndex, succeeded
from tests.packaging_support import (
    checksum,
    restore_package,
    train_dictionary,
    warc_bytes,
    zst_warc,
)

RETENTION = 3600.0


@define(eq=False)
class FakeItems:
    """A Sink that keeps what it was sent, by item and name."""

    destination: ClassVar[Destination] = Destination.IA

    files: dict[tuple[str, str], bytes] = field(factory=dict)
    puts: list[str] = field(factory=list)
    fail_next: int = 0
    retry_after: float | None = None  # IA's Retry-After on the failures fail_next makes
    watch: Any = None  # called during each upload (tests look at what is in flight)
    broken_verify: int = 0
    overwrites: list[bool] = field(factory=list)
    losing: bool = False  # acknowledge uploads without keeping them (IA lost them after a 200)

    def deliver(
        self, plan: ItemPlan, path: Path, progress: Any, *, overwrite: bool = False
    ) -> Deferred[Delivered]:
        self.overwrites.append(overwrite)
        progress(plan.size)
        if self.watch is not None:
            self.watch()
        if self.fail_next:
            self.fail_next -= 1
            failure = DeliveryFailed(
                "503 SlowDown", retry_after=self.retry_after, kind="rate_limited"
            )
            return fail(failure)
        key = (plan.identifier, plan.remote_name)
        data = path.read_bytes()
        assert hashlib.md5(data).hexdigest() == plan.content_md5 and len(data) == plan.size
        if key not in self.files:
            self.puts.append(plan.remote_name)
        if not self.losing:  # IA answers 200 either way
            self.files[key] = data
        return succeed(Delivered(plan.identifier, plan.remote_name))

    def verify(self, plan: ItemPlan, path: Path) -> Deferred[RemoteCheck]:
        if self.broken_verify:
            self.broken_verify -= 1
            return fail(RuntimeError("a bug in the sink"))
        data = self.files.get((plan.identifier, plan.remote_name))
        if data is None:
            return succeed(RemoteCheck(False, "not listed", absent=True))
        if hashlib.md5(data).hexdigest() != plan.content_md5:
            detail = "the read-back found other bytes"
            return succeed(RemoteCheck(False, detail, needs_operator=True, bad_copy=True))
        return succeed(RemoteCheck(True))


def project_config(
    tmp_path: Path, target: str, max_wait: str = "1h", dictionary_url: str | None = None
) -> Any:
    packaging = {"mode": "megawarc", "target_bytes": target, "max_wait": max_wait}
    if dictionary_url is not None:
        packaging["zstd_dictionary_url"] = dictionary_url
    raw = {
        "issuer": "https://c.test",
        "min_free_bytes": 1,
        "data_dir": str(tmp_path),
        "projects": {
            "example": {
                "packaging": packaging,
                "delivery": {
                    "sink": "internet_archive",
                    "credentials": "ia.ini",
                    "identifier": "example-{batch_date}-{package}",
                    "local_artifact_retention": "1h",
                },
            }
        },
    }
    return parse_config(raw, tmp_path).projects


class Harness:
    def __init__(
        self,
        tmp_path: Path,
        target: str = "3000",
        max_wait: str = "1h",
        in_flight: Any = None,
        dictionary_api: Any = None,
    ) -> None:
        self.metrics = Metrics(DELIVER, ["example"])
        self.tmp = tmp_path
        for sub in ("uploads", "receipts"):
            (tmp_path / sub).mkdir(exist_ok=True)
        self.uploads = UploadStore(tmp_path / "uploads")
        self.receipts = ReceiptStore(tmp_path / "receipts")
        self.store = PackageStore(tmp_path / "packages")
        self.store.prepare()
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        # The daemon's attempts in flight (a test may bring its own to look at).
        self.in_flight = in_flight if in_flight is not None else InFlight(self.clock)
        self.items = FakeItems()
        url = "https://dicts.test/api" if dictionary_api is not None else None
        self.projects = project_config(tmp_path, target, max_wait, url)
        self.dictionary_store = DictionaryStore(tmp_path / "dictionaries")
        self.dictionary_api = dictionary_api
        self.open_index()
        self.accepted: dict[str, bytes] = {}
        # Ids a verified ledger owns (ArchivedIds.contains in production).
        self.archived: set[str] = set()

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def open_index(self) -> None:
        self.index = SyncIndex(self.tmp / "delivery.sqlite")
        self.service = PackagingService(
            index=self.index,
            uploads=self.uploads,
            receipts=self.receipts,
            store=self.store,
            projects=self.projects,
            run=run_inline,
            pack=run_inline,
            clock=self.clock,
            build_concurrency=2,
            min_free_bytes=1,
            random=lambda: 0.0,
            archived=lambda oid: oid in self.archived,
            dictionaries=Dictionaries(
                store=self.dictionary_store,
                api=self.dictionary_api,
                run=run_inline,
                now=self.clock.seconds,
                observer=self.metrics,
            ),
        )

        # The packages' owner, and the one outbound service that sends them.
        self.owner = PackageOwner(
            index=self.index,
            store=self.store,
            projects=self.projects,
            sinks={"example": self.items},
            run=run_inline,
        )
        self.outbound = OutboundService(
            index=self.index,
            owners=lanes_of([self.owner]),
            clock=self.clock,
            concurrency=1,
            in_flight=self.in_flight,
            random=lambda: 0.0,
            observer=self.metrics,
        )

    def accept(self, data: bytes, name: str = "a.warc.gz") -> str:
        oid = f"{len(self.accepted):032x}"
        self.uploads.data_path(oid).write_bytes(data)
        self.uploads.info_path(oid).write_bytes(b"{}")
        (self.receipts.directory / f"{oid}.json").write_bytes(b"{}")
        obj = AcceptedObject(
            oid, "example", name, len(data), checksum(data), int(self.clock.seconds())
        )
        self.index.run(dsql.insert_objects, [obj], self.clock.seconds())
        self.accepted[oid] = data
        self.clock.advance(1)
        return oid

    def assign(self) -> dict[str, int]:
        packaging = {"example": self.projects["example"].packaging}
        result: dict[str, int] = succeeded(
            self.index.run(sql.assign_batches, packaging, self.clock.seconds())
        )
        return result

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            succeeded(self.service.tick())
            succeeded(self.outbound.tick())

    def packages(self) -> list[sql.PackageRow]:
        return succeeded(self.index.run(sql.all_packages))


def test_batches_close_by_size_and_by_wait(tmp_path: Path) -> None:
    """Objects join the open batch in acceptance order; a batch closes once it reaches the
    target; an object above the target forms its own batch; a small batch closes after
    max_wait; closing decisions are durable rows."""
    h = Harness(tmp_path, target="1000", max_wait="10m")
    for size in (400, 400, 300, 5000, 100):
        h.accept(b"x" * size, "f.bin")
    counts = succeeded(
        h.index.run(
            sql.assign_batches, {"example": h.projects["example"].packaging}, h.clock.seconds()
        )
    )
    assert counts == {"assigned": 5, "closed": 2}
    rows = h.packages()
    assert [(r.state, r.members, r.bytes, r.close_reason) for r in rows] == [
        ("closed", 3, 1100, "size"),
        ("closed", 1, 5000, "size"),
        ("open", 1, 100, None),
    ]
    h.clock.advance(600)
    counts = succeeded(
        h.index.run(
            sql.assign_batches, {"example": h.projects["example"].packaging}, h.clock.seconds()
        )
    )
    assert counts == {"assigned": 0, "closed": 1}
    assert h.packages()[2].close_reason == "max_wait"


def test_a_package_goes_from_batch_to_ia_and_sources_then_package_are_purged(
    tmp_path: Path,
) -> None:
    """Build, seal, verify, purge the sources (each receipt names its package), deliver every
    file to one item, verify it there, and purge the package after retention."""
    h = Harness(tmp_path, target="1GB", max_wait="1s")
    ids = [h.accept(warc_bytes(i)) for i in range(3)] + [h.accept(b"notes\n" * 300, "n.txt")]
    h.tick()
    (row,) = h.packages()
    assert row.state == "verified" and row.sources_purged_at is not None
    assert row.package_id == sql.package_id_of(
        "example", succeeded(h.index.run(sql.batch_members, row.batch_id))
    )
    for oid in ids:
        assert not h.uploads.data_path(oid).exists()
        side = h.receipts.read_package(oid)
        assert side is not None and side["package"] == row.package_id
    # The synchronous runners let one tick go all the way to IA and back.
    files = {p.name for p in h.store.directory(row.package_id).iterdir()}
    assert files == {row.package_id + s for s in (WARC_GZ, TAR, INDEX, ".delivery.json")}
    assert row.delivery_state == "delivered"
    assert row.remote_identifier == f"example-{row.batch_date}-{row.package_id}"
    assert sorted(h.items.puts) == sorted(row.package_id + s for s in (WARC_GZ, TAR, INDEX))
    assert row.remote_verified_at is not None and row.purged_at is None
    obj = succeeded(h.index.run(dsql.get_row, ids[0]))
    assert obj.state == "delivered" and obj.remote_identifier == row.remote_identifier
    assert obj.remote_name == row.package_id + WARC_GZ and obj.purged_at is not None
    h.tick()
    assert h.packages()[0].purged_at is None  # retention has not passed
    h.clock.advance(RETENTION + 1)
    h.tick()
    (row,) = h.packages()
    assert row.purged_at is not None
    left = {p.name for p in h.store.directory(row.package_id).iterdir()}
    assert left == {row.package_id + INDEX, row.package_id + ".delivery.json"}
    # Counted like objects, under kind="package" (one attempt, delivery, verification and
    # purge for the package; every byte of its three files).
    package = {"project": "example", "kind": "package"}
    assert h.metric("canner_delivery_attempts_total", **package) == 1
    assert h.metric("canner_deliveries_completed_total", **package) == 1
    assert h.metric("canner_deliveries_verified_total", kind="package") == 1
    assert h.metric("canner_purged_total", kind="package") == 1
    sent = sum(len(h.items.files[key]) for key in h.items.files)
    assert h.metric("canner_ia_sent_bytes_total", kind="package") == sent > 0
    assert h.metric("canner_delivery_attempts_total", project="example", kind="object") == 0


def test_a_member_corrupted_after_acceptance_is_flagged_and_the_batch_goes_on(
    tmp_path: Path,
) -> None:
    """A member whose bytes changed on disk stops its package: it is flagged for an operator
    with both hashes, its upload is left in place, and the batch is built without it."""
    h = Harness(tmp_path, target="1GB", max_wait="1s")
    good = [h.accept(warc_bytes(i)) for i in range(2)]
    bad = h.accept(warc_bytes(7))
    good.append(h.accept(warc_bytes(8)))
    h.uploads.data_path(bad).write_bytes(b"tampered" + h.accepted[bad][8:])
    h.tick()
    flagged = succeeded(h.index.run(dsql.get_row, bad))
    assert flagged.needs_operator == 1 and checksum(h.accepted[bad]) in (flagged.last_error or "")
    assert h.uploads.data_path(bad).exists()
    h.tick()
    rows = h.packages()
    assert [r.state for r in rows] == ["verified"]
    members = succeeded(h.index.run(sql.batch_members, rows[0].batch_id))
    assert [m.object_id for m in members] == good
    assert all(not h.uploads.data_path(oid).exists() for oid in good)
    # The operator puts the right bytes back and retries: it is packed on its own.
    h.uploads.data_path(bad).write_bytes(h.accepted[bad])
    assert succeeded(h.index.run(sql.readmit, bad, h.clock.seconds()))
    h.clock.advance(2)
    h.tick()
    assert [r.members for r in h.packages()] == [3, 1]
    assert not h.uploads.data_path(bad).exists()


def test_failed_deliveries_retry_with_backoff_and_nothing_is_sent_twice(tmp_path: Path) -> None:
    """A failed PUT puts the package in retry_wait; the next attempt completes the item."""
    h = Harness(tmp_path, target="100")
    h.accept(warc_bytes(1))
    h.items.fail_next = 1
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "retry_wait" and row.last_error == "503 SlowDown"
    assert row.next_attempt_at == h.clock.seconds() + 60
    h.tick()
    assert h.packages()[0].delivery_state == "retry_wait"
    h.clock.advance(61)
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "delivered" and len(h.items.puts) == 2
    assert row.attempts == 2
    failed = {"project": "example", "needs_operator": "false", "reason": "rate_limited"}
    assert h.metric("canner_delivery_failures_total", **failed, kind="package") == 1
    assert h.metric("canner_delivery_retries_total", project="example", kind="package") == 1


def test_rebuild_from_disk_brings_back_packages_before_and_after_purge(tmp_path: Path) -> None:
    """With delivery.sqlite deleted, packages on disk come back with their members and
    delivery facts, and nothing is packed or uploaded again."""
    h = Harness(tmp_path, target="100")
    first = h.accept(warc_bytes(1))
    h.tick(3)
    h.clock.advance(RETENTION + 1)
    h.tick()
    second = h.accept(warc_bytes(2))
    h.tick()
    third = h.accept(warc_bytes(3))
    h.items.fail_next = 10**6  # sealed, verified, sources purged, never delivered
    h.tick()
    h.items.fail_next = 0
    before = {r.package_id: r for r in h.packages()}
    assert [r.delivery_state for r in before.values()] == ["delivered", "delivered", "retry_wait"]
    assert before[next(iter(before))].purged_at is not None
    h.index.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"delivery.sqlite{suffix}").unlink(missing_ok=True)
    h.open_index()
    assert succeeded(h.service.restore_packages()) == 3
    puts = list(h.items.puts)
    h.tick(3)
    after = {r.package_id: r for r in h.packages()}
    assert set(after) == set(before)
    # Only the package that never reached IA is uploaded, once.
    assert len(h.items.puts) == len(puts) + 2  # its WARC and its index
    for oid in (first, second, third):
        row = succeeded(h.index.run(dsql.get_row, oid))
        assert row is not None and row.state == "delivered"
    purged = [r for r in after.values() if r.purged_at is not None]
    assert len(purged) == 1 and purged[0].remote_verified_at is not None
    assert len([r for r in after.values() if r.delivery_state == "delivered"]) == 3
    assert not h.uploads.data_path(third).exists()


def test_a_restored_package_counts_its_archived_members_but_does_not_bring_them_back(
    tmp_path: Path,
) -> None:
    """A package restored from disk after its ledger archived one member keeps that member in
    its member count and bytes, but only the other member comes back as an object."""
    h = Harness(tmp_path, target="100000", max_wait="10s")
    archived, live = h.accept(warc_bytes(1)), h.accept(warc_bytes(2))
    h.clock.advance(11)
    h.tick(3)
    (before,) = h.packages()
    assert before.remote_verified_at is not None and before.members == 2
    h.index.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"delivery.sqlite{suffix}").unlink(missing_ok=True)
    h.open_index()
    h.archived.add(archived)
    assert succeeded(h.service.restore_packages()) == 1
    (after,) = h.packages()
    assert (after.package_id, after.members, after.bytes) == (before.package_id, 2, before.bytes)
    assert after.remote_verified_at is not None
    assert succeeded(h.index.run(dsql.get_row, archived)) is None
    row = succeeded(h.index.run(dsql.get_row, live))
    assert row is not None and row.state == "delivered" and row.verified_at is not None


def test_start_removes_unfinished_builds_and_restarts_them(tmp_path: Path) -> None:
    """A temp directory left by a killed build is removed at start and the batch, left
    building, is built again from the start."""
    h = Harness(tmp_path, target="100")
    h.accept(warc_bytes(1))
    succeeded(
        h.index.run(
            sql.assign_batches, {"example": h.projects["example"].packaging}, h.clock.seconds()
        )
    )
    succeeded(h.index.run(sql.claim_builds, h.clock.seconds(), 1))
    orphan = h.store.root / ".tmp-deadbeef-000000"
    orphan.mkdir()
    (orphan / "x").write_bytes(b"partial")
    h.service.startService()
    assert not orphan.exists()
    (row,) = h.packages()
    assert row.state == "verified"
    succeeded(h.service.stopService())


def test_package_id_depends_only_on_members() -> None:
    """The same members give the same id; another member or checksum gives another."""
    a = sql.Member("a" * 32, "p", None, 5, "blake3:" + "0" * 64, 1)
    b = sql.Member("b" * 32, "p", None, 6, "blake3:" + "1" * 64, 2)
    assert sql.package_id_of("p", [a, b]) == sql.package_id_of("p", [a, b])
    assert sql.package_id_of("p", [a]) != sql.package_id_of("p", [a, b])
    assert sql.package_id_of("q", [a, b]) != sql.package_id_of("p", [a, b])


def test_operators_see_batches_and_packages_by_phase(tmp_path: Path) -> None:
    """The survey, the metrics and the status page count batches filling and packages by
    phase, from the index."""
    h = Harness(tmp_path, target="100")
    h.accept(warc_bytes(1))
    h.tick()
    h.clock.advance(RETENTION + 1)
    h.tick()
    h.projects = project_config(tmp_path, "1GB")  # the next object waits in an open batch
    h.open_index()
    h.accept(warc_bytes(2))
    h.tick()
    survey = take_survey(tmp_path, ObjectIds(""), h.clock.seconds())
    assert survey.index is not None
    assert survey.index.packages["purged"] == 1 and survey.index.packages["open"] == 1
    assert survey_json(survey)["packages"]["open"] == 1
    cache = SurveyCache(run_inline, lambda now: survey, h.clock)
    succeeded(cache.refresh())
    metrics = Metrics(DELIVER, ["example"])
    metrics.register(SurveyCollector(cache, 1))
    get = metrics.registry.get_sample_value
    assert get("canner_packages", {"phase": "purged"}) == 1
    assert get("canner_packages", {"phase": "open"}) == 1
    assert get("canner_packages_bytes", {"phase": "open"}) == len(h.accepted[f"{1:032x}"])
    page = render_status(StatusView("https://c.test", survey, 1, ())).decode()
    assert re.search(r'data-field="packages_open"><b>1</b>', page)


def test_package_uploads_show_in_flight(tmp_path: Path) -> None:
    """While a package file uploads, the in-flight list (heartbeat, status page, metrics)
    shows it under the package id with the file's name and the bytes sent."""
    clock = Clock()
    in_flight = InFlight(clock)
    h = Harness(tmp_path, target="100", in_flight=in_flight)
    seen: list[Any] = []
    h.items.watch = lambda: seen.extend(in_flight.snapshot())
    h.accept(warc_bytes(1))
    h.tick()
    (row,) = h.packages()
    assert {p.object_id for p in seen} == {row.package_id}
    assert {p.filename for p in seen} == {row.package_id + s for s in (WARC_GZ, INDEX)}
    assert all(p.sent == p.size for p in seen)
    assert in_flight.snapshot() == [] and in_flight.total_sent > 0


def test_a_job_that_crashes_is_retried_a_minute_later(tmp_path: Path) -> None:
    """An unexpected error in a follow-up is logged and the package checked again after a
    minute, not at every tick."""
    h = Harness(tmp_path, target="100")
    h.items.broken_verify = 1
    h.accept(warc_bytes(1))
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "delivered" and row.remote_verified_at is None
    assert row.next_check_at == h.clock.seconds() + 60
    assert "a bug in the sink" in (row.last_error or "")
    h.tick()
    assert h.packages()[0].remote_verified_at is None
    h.clock.advance(61)
    h.tick()
    assert h.packages()[0].remote_verified_at is not None


def test_a_package_ia_loses_is_delivered_again_then_flagged_and_an_operator_retry_sends_it(
    tmp_path: Path,
) -> None:
    """As for objects: a package whose files IA never lists is delivered again each time
    verify_timeout passes, MAX_REDELIVERIES times, then flagged (payload kept, counted as needing
    an operator); ``canner retry PACKAGE`` sends it again and it completes."""
    h = Harness(tmp_path, target="100")
    h.accept(warc_bytes(1))
    h.items.losing = True
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "delivered" and row.remote_verified_at is None
    assert row.needs_operator == 0
    for n in range(1, MAX_REDELIVERIES + 1):
        h.clock.advance(DEFAULT_VERIFY_TIMEOUT)
        h.tick()  # the look after the timeout: back to retry_wait, due now
        (row,) = h.packages()
        assert row.delivery_state == "retry_wait" and row.redeliveries == n, row
        assert f"re-delivery {n} of {MAX_REDELIVERIES}" in (row.last_error or "")
        h.tick()  # delivered again (and lost again)
        assert h.packages()[0].delivery_state == "delivered"
    h.clock.advance(DEFAULT_VERIFY_TIMEOUT)
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "delivered" and row.needs_operator == 1
    assert f"canner retry {row.package_id}" in (row.last_error or "")
    assert row.purged_at is None and h.store.directory(row.package_id or "").exists()
    summary = take_survey(tmp_path, ObjectIds(""), h.clock.seconds()).index
    assert summary is not None and summary.needs_operator == 1
    redelivered = {"project": "example", "kind": "package"}
    assert h.metric("canner_redeliveries_total", **redelivered) == MAX_REDELIVERIES
    # The operator's retry: due now, count reset; IA keeps it this time.
    h.items.losing = False
    before = succeeded(h.index.run(sql.operator_retry, row.package_id, h.clock.seconds()))
    assert before is not None and before.needs_operator == 1
    (row,) = h.packages()
    assert row.delivery_state == "retry_wait" and row.redeliveries == 0
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "delivered" and row.remote_verified_at is not None
    assert row.needs_operator == 0


def test_a_package_ia_serves_wrong_is_flagged_and_a_retry_uploads_it_over_the_listing(
    tmp_path: Path,
) -> None:
    """A read-back that finds other bytes flags the package (never purged, never verified);
    the operator's retry delivers it again with overwrite, so the metadata API's listing of a
    matching file cannot skip the upload."""
    h = Harness(tmp_path, target="100")
    h.accept(warc_bytes(1))
    h.items.losing = True
    h.tick()
    (row,) = h.packages()
    key = next(k for k in h.items.puts)
    # IA stores every file, one of them with a byte flipped.
    for parcel in succeeded(Deferred.fromCoroutine(h.owner._parcels(row))):
        plan, path = parcel.plan, parcel.path
        data = bytearray(path.read_bytes())
        if plan.remote_name == key:
            data[len(data) // 2] ^= 1
        h.items.files[(plan.identifier, plan.remote_name)] = bytes(data)
    h.items.losing = False
    h.clock.advance(60)
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "delivered" and row.needs_operator == 1 and row.force_upload == 1
    assert "other bytes" in (row.last_error or "") and row.remote_verified_at is None
    h.clock.advance(RETENTION + 1)
    h.tick()
    assert h.packages()[0].purged_at is None
    h.items.overwrites.clear()
    assert succeeded(h.index.run(sql.operator_retry, row.package_id, h.clock.seconds()))
    h.tick()
    (row,) = h.packages()
    assert h.items.overwrites and all(h.items.overwrites), "the retry must upload over IA's copy"
    assert row.remote_verified_at is not None and row.force_upload == 0


def test_a_package_delivery_waits_at_least_ias_retry_after(tmp_path: Path) -> None:
    """As for objects: IA's Retry-After is a lower bound on the backoff (within its 1 h cap),
    and the failure is counted by its reason class."""
    h = Harness(tmp_path, target="100")
    h.accept(warc_bytes(1))
    h.items.fail_next, h.items.retry_after = 2, 900.0
    h.tick()
    (row,) = h.packages()
    assert row.delivery_state == "retry_wait"
    assert row.next_attempt_at == h.clock.seconds() + 900, "not the 60 s backoff"
    h.clock.advance(900)
    h.items.retry_after = 7200.0  # more than the cap: the cap wins
    h.tick()
    (row,) = h.packages()
    assert row.next_attempt_at == h.clock.seconds() + 3600
    failed = {"project": "example", "needs_operator": "false", "reason": "rate_limited"}
    assert h.metric("canner_delivery_failures_total", **failed, kind="package") == 2


def to_combined_index(directory: Path, package_id: str) -> None:
    """Rewrite a package's indexes as packages were before the zstd megawarcs were apart: one
    index for every member, whose zstd lines say "zst"."""
    lines = []
    for path in index_files(directory, package_id):
        zst = path.name != package_id + INDEX
        for line in read_index(path):
            if zst and line["target"]["container"] == "warc":
                line["target"]["container"] = "zst"
            lines.append(line)
        path.unlink()
    lines.sort(key=lambda line: (line["canner"]["accepted_at"], line["canner"]["object_id"]))
    with gzip.open(directory / (package_id + INDEX), "wb") as f:
        for line in lines:
            f.write(json.dumps(line).encode() + b"\n")


def test_zstd_megawarcs_keep_their_indexes_and_come_back_from_disk(tmp_path: Path) -> None:
    """A package of gzip and zstd members delivers one index and one WARC per megawarc, keeps
    every index when it is purged, and comes back from disk with all its members, as does a
    package written with the one combined index of earlier versions."""
    h = Harness(tmp_path, target="100000", max_wait="10s")
    dictionary = train_dictionary(7)
    zst = [h.accept(zst_warc(i, dictionary, compress_dict=True), f"z{i}.warc.zst") for i in (1, 2)]
    gz = h.accept(warc_bytes(3))
    h.clock.advance(11)
    h.tick(3)
    (row,) = h.packages()
    assert row.package_id is not None and row.remote_verified_at is not None
    d = f".{dictionary.dict_id()}"
    sent = {name[len(row.package_id) :] for _, name in h.items.files}
    assert sent == {WARC_GZ, INDEX, d + WARC_ZST, d + INDEX}
    h.clock.advance(RETENTION + 1)
    h.tick()
    directory = h.store.directory(row.package_id)
    left = {p.name[len(row.package_id) :] for p in directory.iterdir()}
    assert left == {INDEX, d + INDEX, ".delivery.json"}
    for combined in (False, True):
        if combined:
            to_combined_index(directory, row.package_id)
        h.index.close()
        for suffix in ("", "-wal", "-shm"):
            (tmp_path / f"delivery.sqlite{suffix}").unlink(missing_ok=True)
        h.open_index()
        assert succeeded(h.service.restore_packages()) == 1
        (after,) = h.packages()
        assert (after.package_id, after.members, after.batch_date) == (
            row.package_id,
            3,
            row.batch_date,
        )
        for oid in (*zst, gz):
            obj = succeeded(h.index.run(dsql.get_row, oid))
            assert obj is not None and obj.state == "delivered"
        placed = succeeded(h.index.run(dsql.get_row, zst[0]))
        assert placed.remote_name == row.package_id + d + WARC_ZST


def test_a_package_with_the_combined_index_of_earlier_versions_still_verifies(
    tmp_path: Path,
) -> None:
    """The verification pass reads a sealed package written with one combined index."""
    h = Harness(tmp_path, target="100000", max_wait="10s")
    dictionary = train_dictionary(8)
    h.accept(zst_warc(1, dictionary, compress_dict=False), "z.warc.zst")
    h.accept(warc_bytes(2))
    h.clock.advance(11)
    h.items.fail_next = 10**6
    h.tick()
    (row,) = h.packages()
    assert row.package_id is not None
    directory = h.store.directory(row.package_id)
    to_combined_index(directory, row.package_id)
    ids = [m.object_id for m in succeeded(h.index.run(sql.batch_members, row.batch_id))]
    md5s = verify_package(directory, row.package_id, threading.Event(), expected=ids)
    assert set(md5s) == {p.name[len(row.package_id) :] for p in directory.iterdir()}


@define(eq=False)
class ScriptedDictionaries:
    """A dictionary source that serves ``served`` by id, or fails while ``failing``."""

    served: dict[str, bytes]
    failing: bool = True
    calls: list[tuple[str, str, str]] = field(factory=list)

    async def fetch(self, url: str, project: str, dict_id: str) -> bytes:
        self.calls.append((url, project, dict_id))
        if self.failing:
            raise DictionaryUnavailable(project, dict_id, "api", "GET: answered 503")
        return self.served[dict_id]


def dictless_zst(seed: int, dictionary: zstandard.ZstdCompressionDict) -> bytes:
    """A Wget-AT ``--warc-zstd-dict-no-include`` member: record frames, no dictionary frame."""
    compressor = zstandard.ZstdCompressor(dict_data=dictionary)
    return b"".join(
        compressor.compress(warc_bytes(seed * 10 + i, records=1, gz=False)) for i in range(3)
    )


def test_members_wait_for_a_dictionary_the_api_cannot_give_then_pack_behind_it(
    tmp_path: Path,
) -> None:
    """A batch whose dictionary-less members name a dictionary the API cannot give waits (no
    package, nothing in a tar), counted, on the status page and in canner status; once the API
    answers, the dictionary is kept and the members are packed behind its frame; a later batch
    naming it fetches nothing."""
    dict_id = "1234567890"
    dictionary = train_dictionary(9)
    api = ScriptedDictionaries({dict_id: dictionary.as_bytes()})
    h = Harness(tmp_path, target="100000", max_wait="10s", dictionary_api=api)
    named = [
        h.accept(dictless_zst(i, dictionary), f"item{i}.urls.{dict_id}.warc.zst") for i in (1, 2)
    ]
    h.accept(warc_bytes(3))
    h.clock.advance(11)
    h.tick()
    (row,) = h.packages()
    assert row.state == "closed" and row.package_id is None
    assert row.build_error is not None and dict_id in row.build_error
    assert api.calls == [("https://dicts.test/api", "urls", dict_id)]
    assert list(h.store.package_ids()) == []
    assert all(h.uploads.data_path(oid).exists() for oid in named)
    assert h.metric("canner_zstd_dictionary_failures_total", project="example", reason="api") == 1
    survey = take_survey(tmp_path, ObjectIds(), h.clock.seconds())
    (wait,) = survey.dictionary_waits
    assert (wait.dict_id, wait.project, wait.attempts) == (dict_id, "urls", 1)
    assert survey_json(survey)["dictionary_waits"][0]["dict_id"] == dict_id
    page = render_status(StatusView("https://c.test", survey, 1, ())).decode()
    assert 'id="dictionary-waits"' in page and dict_id in page
    # The next tries wait for the dictionary's backoff, not for every tick.
    h.clock.advance(5)
    h.tick()
    assert len(api.calls) == 1
    api.failing = False
    h.clock.advance(wait.next_attempt_at - h.clock.seconds())
    h.tick(3)
    (row,) = h.packages()
    assert row.package_id is not None and row.remote_verified_at is not None
    assert len(api.calls) == 2
    # Every megawarc's index (the dictionary's too) goes after every container of the item.
    kinds = [name.endswith(INDEX) for name in h.items.puts]
    assert kinds == sorted(kinds) and kinds.count(True) == 2, h.items.puts
    assert h.metric("canner_zstd_dictionaries_fetched_total", project="example") == 1
    assert take_survey(tmp_path, ObjectIds(), h.clock.seconds()).dictionary_waits == ()
    assert h.dictionary_store.load(dict_id) == dictionary.as_bytes()
    directory = h.store.directory(row.package_id)
    zst = (directory / f"{row.package_id}.{dict_id}{WARC_ZST}").read_bytes()
    frame = dictionary_frame(dictionary.as_bytes())
    assert zst.startswith(frame) and frame[8:12] == b"\x28\xb5\x2f\xfd"
    restored = restore_package(directory, row.package_id, tmp_path / "restore")
    assert sorted(restored.values()) == sorted(h.accepted.values())
    # Kept by id: a later batch naming it (after a restart: a new service) fetches nothing.
    h.open_index()
    h.accept(dictless_zst(4, dictionary), f"item4.urls.{dict_id}.warc.zst")
    h.clock.advance(11)
    h.tick(3)
    assert len(api.calls) == 2
    assert all(r.remote_verified_at is not None for r in h.packages())


def test_a_dictionary_without_an_api_or_with_a_bad_one_is_never_a_tar_member(
    tmp_path: Path,
) -> None:
    """Without a zstd_dictionary_url the members naming a dictionary wait (reason
    unconfigured); members that hold their dictionary are packed meanwhile in other batches."""
    h = Harness(tmp_path, target="100000", max_wait="10s")
    dictionary = train_dictionary(10)
    h.accept(dictless_zst(1, dictionary), "a.urls.0000000042.warc.zst")
    h.clock.advance(11)
    h.tick()
    (row,) = h.packages()
    assert row.state == "closed" and row.build_error is not None
    assert "zstd_dictionary_url" in row.build_error
    assert (
        h.metric("canner_zstd_dictionary_failures_total", project="example", reason="unconfigured")
        == 1
    )
    assert h.dictionary_store.wait("0000000042") is not None
