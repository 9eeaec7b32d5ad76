"""The delivery queue and the outbound service delivering objects, with a fake clock, a fake
sink and a real SQLite file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from attrs import define, field
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from canner.blocking import run_inline
from canner.delivery import index as sql
from canner.delivery import outbound
from canner.delivery.index import OBJECT, AcceptedObject
from canner.delivery.objects import ObjectOwner
from canner.delivery.outbound_service import OutboundService, lanes_of
from canner.delivery.queue import (
    ALLOWED,
    MAX_REDELIVERIES,
    MAX_RETRY,
    PURGE_RETRY,
    VERIFY_MAX,
    State,
    Unlisted,
    can_move,
    next_verify_at,
    retry_delay,
    unlisted,
)
from canner.ops.metrics import DELIVER, Metrics
from canner.sinks.base import RemoteCheck
from canner.store.journal import Journal, JournalLog, JournalLookup
from canner.store.receipts import DELIVERY, ORIGIN, Origin, ReceiptStore, delivery_of, origin_of
from canner.store.uploads import UploadStore
from tests.fakes import FakeSink, SyncIndex, fake_plan

RETENTION = 3600.0
VERIFY_TIMEOUT = 7200.0


@given(st.integers(1, 10_000), st.floats(0, 0.999))
def test_retry_delay_is_bounded_and_grows(attempt: int, jitter: float) -> None:
    """Delays start at 1 minute, double, cap at 1 hour, and jitter adds at most 10 %."""
    delay = retry_delay(attempt, jitter)
    base = min(60.0 * 2 ** min(attempt - 1, 20), MAX_RETRY)
    assert base <= delay <= base * 1.1
    assert retry_delay(attempt + 1, 0) >= retry_delay(attempt, 0)


def test_operator_errors_wait_the_maximum() -> None:
    """Errors that need a human retry at the 1-hour cap."""
    assert retry_delay(1, 0, needs_operator=True) == MAX_RETRY


def test_transition_table() -> None:
    """Only the documented transitions exist; delivered only goes back to retry_wait (to be
    delivered again)."""
    assert can_move(State.PENDING, State.DELIVERING)
    assert can_move(State.DELIVERING, State.RETRY_WAIT)
    assert can_move(State.RETRY_WAIT, State.DELIVERING)
    assert not can_move(State.PENDING, State.DELIVERED)
    assert ALLOWED[State.DELIVERED] == frozenset({State.RETRY_WAIT})


@given(
    st.floats(0, 10**6),
    st.floats(0, 10**5),
    st.floats(1, 10**5),
    st.integers(0, 10),
)
def test_unlisted_waits_for_the_timeout_then_redelivers_then_flags(
    delivered_at: float, waited: float, timeout: float, redeliveries: int
) -> None:
    """Unlisted within verify_timeout: wait; past it: deliver again, up to MAX_REDELIVERIES
    times, then flag.  The next look is never later than the moment the timeout passes."""
    now = delivered_at + waited
    decision = unlisted(now, delivered_at, timeout, redeliveries)
    if now - delivered_at < timeout:
        assert decision is Unlisted.WAIT
        assert now <= next_verify_at(now, delivered_at, timeout) <= delivered_at + timeout
    elif redeliveries < MAX_REDELIVERIES:
        assert decision is Unlisted.REDELIVER
    else:
        assert decision is Unlisted.FLAG
    assert next_verify_at(now, delivered_at, timeout) <= now + VERIFY_MAX


class Harness:
    def __init__(
        self, tmp_path: Path, concurrency: int = 2, verify_timeout: float = VERIFY_TIMEOUT
    ) -> None:
        (tmp_path / "uploads").mkdir()
        (tmp_path / "receipts").mkdir()
        self.uploads = UploadStore(tmp_path / "uploads")
        self.receipts = ReceiptStore(tmp_path / "receipts")
        self.journal = Journal(tmp_path / "journal")
        self.index = SyncIndex(tmp_path / "delivery.sqlite")
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.sink = FakeSink()
        self.metrics = Metrics(DELIVER, ["example"])
        self.owner = owner = ObjectOwner(
            index=self.index,
            uploads=self.uploads,
            receipts=self.receipts,
            journal=JournalLog(self.journal),
            sinks={"example": self.sink},
            planner=fake_plan,
            retention={"example": RETENTION},
            run=run_inline,
            hash=run_inline,
            clock=self.clock,
            verify_timeouts={"example": verify_timeout},
        )
        self.service = OutboundService(
            index=self.index,
            owners=lanes_of([owner]),
            clock=self.clock,
            concurrency=concurrency,
            random=lambda: 0.0,
            observer=self.metrics,
        )

    def accept(self, n: int, data: bytes = b"payload") -> list[str]:
        ids = []
        for i in range(n):
            oid = f"{i:032x}"
            self.uploads.data_path(oid).write_bytes(data)
            self.uploads.info_path(oid).write_bytes(b"{}")
            obj = AcceptedObject(
                oid, "example", None, len(data), "blake3:" + blake3.blake3(data).hexdigest(), i
            )
            self.index.run(sql.insert_objects, [obj], self.clock.seconds())
            self.clock.advance(1)
            ids.append(oid)
        return ids

    def row(self, oid: str) -> sql.ObjectRow:
        row = self.index.run(sql.get_row, oid).result
        assert row is not None
        return row

    def tick(self) -> None:
        self.service.tick()

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.index.close()


def test_concurrency_bounds_parallel_attempts_in_due_order(harness: Harness) -> None:
    """At most delivery_concurrency attempts run, oldest due first."""
    ids = harness.accept(5)
    harness.tick()
    assert sorted(harness.sink.pending) == ids[:2]
    assert harness.row(ids[0]).state == "delivering"
    assert harness.row(ids[2]).state == "pending"
    harness.sink.succeed(ids[0])
    harness.tick()
    assert sorted(harness.sink.pending) == [ids[1], ids[2]]


def test_failure_backs_off_and_retries_forever(harness: Harness) -> None:
    """Each failure schedules the next attempt 1, 2, 4 ... minutes later, capped at 1 hour."""
    [oid] = harness.accept(1)
    expected = [60, 120, 240, 480, 960, 1920, 3600, 3600]
    for attempt, delay in enumerate(expected, start=1):
        harness.tick()
        assert list(harness.sink.pending) == [oid], f"attempt {attempt} started"
        harness.sink.fail(oid)
        row = harness.row(oid)
        assert (row.state, row.attempts, row.last_error) == ("retry_wait", attempt, "503 SlowDown")
        assert row.next_attempt_at == pytest.approx(harness.clock.seconds() + delay)
        harness.clock.advance(delay - 1)
        harness.tick()
        assert harness.sink.pending == {}, "not due yet"
        harness.clock.advance(1)
    harness.tick()
    assert list(harness.sink.pending) == [oid]


def test_retries_are_not_starved_by_new_arrivals(tmp_path: Path) -> None:
    """A due retry is claimed before objects accepted after it became due."""
    h = Harness(tmp_path, concurrency=1)
    [old] = h.accept(1)
    h.tick()
    h.sink.fail(old)
    h.clock.advance(60)
    h.accept(3)  # newer arrivals, due at their acceptance time (after the retry became due)
    h.tick()
    assert list(h.sink.pending) == [old]
    h.index.close()


def test_operator_errors_are_flagged_and_keep_retrying(harness: Harness) -> None:
    """A 403 is flagged in the row and retried at the cap, never dropped."""
    [oid] = harness.accept(1)
    harness.tick()
    harness.sink.fail(oid, "403 Forbidden: check credentials", operator=True)
    row = harness.row(oid)
    assert row.needs_operator == 1 and row.state == "retry_wait"
    assert row.next_attempt_at == pytest.approx(harness.clock.seconds() + 3600)
    failed = {"project": "example", "needs_operator": "true", "reason": "other"}
    assert harness.metric("canner_delivery_failures_total", **failed, kind="object") == 1


def test_payload_that_no_longer_matches_its_receipt_is_never_sent(harness: Harness) -> None:
    """Local corruption is caught by BLAKE3 before the sink sees anything."""
    [oid] = harness.accept(1)
    harness.uploads.data_path(oid).write_bytes(b"paylOad")
    harness.tick()
    assert harness.sink.pending == {}
    row = harness.row(oid)
    assert row.needs_operator == 1 and "does not match its receipt" in (row.last_error or "")


def test_delivery_then_verification_then_purge_after_retention(harness: Harness) -> None:
    """Purge waits for both remote verification and the retention; the row stays delivered.
    The origin record moves into the journal with the purge: the receipt is the one file left."""
    [oid] = harness.accept(1)
    harness.receipts.record_origin(oid, Origin("example", None))
    harness.tick()
    harness.sink.succeed(oid)
    row = harness.row(oid)
    now = harness.clock.seconds()
    assert row.state == "delivered" and row.remote_identifier == f"item-{oid}"
    assert row.delivered_at == now and row.purge_after == now + RETENTION
    assert row.content_md5 is not None
    harness.tick()  # verification: not listed yet
    assert harness.row(oid).verified_at is None
    harness.sink.checks[oid] = RemoteCheck(True)
    harness.clock.advance(300)
    harness.tick()
    assert harness.row(oid).verified_at == harness.clock.seconds()
    assert harness.uploads.data_path(oid).exists(), "retention has not passed"
    harness.clock.advance(RETENTION - 300 - 1)
    harness.tick()
    assert harness.uploads.data_path(oid).exists()
    harness.clock.advance(1)
    harness.tick()
    assert not harness.uploads.data_path(oid).exists()
    assert not harness.uploads.info_path(oid).exists()
    row = harness.row(oid)
    assert row.state == "delivered" and row.purged_at == harness.clock.seconds()
    lookup = JournalLookup(harness.journal)
    record = delivery_of(lookup.get(oid, DELIVERY))
    origin = origin_of(lookup.get(oid, ORIGIN))
    lookup.close()
    assert record is not None
    assert (record.identifier, record.purged_at) == (f"item-{oid}", row.purged_at)
    assert origin == Origin("example", None)
    assert not harness.receipts.origin_path(oid).exists()
    # Each step counted once, for kind="object" only.
    obj = {"project": "example", "kind": "object"}
    assert harness.metric("canner_delivery_attempts_total", **obj) == 1
    assert harness.metric("canner_deliveries_completed_total", **obj) == 1
    assert harness.metric("canner_deliveries_verified_total", kind="object") == 1
    assert harness.metric("canner_purged_total", kind="object") == 1
    assert harness.metric("canner_deliveries_verified_total", kind="package") == 0


def _deliver(h: Harness, oid: str) -> None:
    h.tick()
    h.sink.succeed(oid)


def test_unlisted_delivery_is_delivered_again_after_verify_timeout(harness: Harness) -> None:
    """A delivered object the destination never lists is looked for again no later than
    verify_timeout after delivery; then it goes back to retry_wait, is claimed and delivered
    again, and counts one re-delivery; the payload is never purged meanwhile."""
    h = harness
    [oid] = h.accept(1)
    _deliver(h, oid)
    delivered_at = h.row(oid).delivered_at
    assert delivered_at is not None
    h.tick()  # first look: not listed
    row = h.row(oid)
    assert row.state == "delivered" and row.needs_operator == 0 and row.redeliveries == 0
    assert row.next_check_at is not None and row.next_check_at <= delivered_at + VERIFY_TIMEOUT
    h.clock.advance(VERIFY_TIMEOUT - 1)
    h.tick()
    assert h.row(oid).state == "delivered", "not before the timeout"
    h.clock.advance(1)
    h.index.run(
        outbound.record_check, OBJECT, oid, h.clock.seconds(), None, False, h.clock.seconds()
    )
    h.tick()  # the look at the deadline: back to retry_wait, due now
    assert h.row(oid).state == "retry_wait"
    h.tick()
    row = h.row(oid)
    assert row.state == "delivering" and row.redeliveries == 1 and row.attempts == 2, row
    assert row.delivered_at is None and row.purge_after is None
    assert "delivering again (re-delivery 1 of 3)" in (row.last_error or "")
    assert h.uploads.data_path(oid).exists()
    h.sink.succeed(oid)
    h.sink.checks[oid] = RemoteCheck(True)
    h.tick()
    row = h.row(oid)
    assert row.state == "delivered" and row.verified_at == h.clock.seconds()
    assert row.redeliveries == 1 and row.last_error is None and row.needs_operator == 0
    assert h.metric("canner_redeliveries_total", project="example", kind="object") == 1
    assert h.metric("canner_delivery_retries_total", project="example", kind="object") == 1


def test_repeatedly_lost_delivery_is_flagged_not_redelivered(harness: Harness) -> None:
    """After MAX_REDELIVERIES re-deliveries the next timeout flags the row instead: it stays
    delivered (unverified, payload kept) and is still looked for; an operator retry re-queues
    it with the count reset."""
    h = harness
    [oid] = h.accept(1)
    for n in range(1, MAX_REDELIVERIES + 1):
        _deliver(h, oid)
        h.clock.advance(VERIFY_TIMEOUT)
        h.index.run(
            outbound.record_check, OBJECT, oid, h.clock.seconds(), None, False, h.clock.seconds()
        )
        h.tick()  # back to retry_wait, due now
        assert h.row(oid).redeliveries == n
        assert h.row(oid).state == "retry_wait"
    _deliver(h, oid)
    h.clock.advance(VERIFY_TIMEOUT)
    h.index.run(
        outbound.record_check, OBJECT, oid, h.clock.seconds(), None, False, h.clock.seconds()
    )
    h.tick()
    row = h.row(oid)
    assert row.state == "delivered" and row.needs_operator == 1, row
    assert "after 3 re-deliveries" in (row.last_error or "") and "canner retry" in (
        row.last_error or ""
    )
    assert row.next_check_at is not None and row.next_check_at <= h.clock.seconds() + VERIFY_MAX
    h.clock.advance(RETENTION)
    h.tick()
    assert h.uploads.data_path(oid).exists() and h.row(oid).state == "delivered"
    assert h.sink.pending == {}
    assert h.index.run(sql.operator_retry, oid, h.clock.seconds()).result
    h.tick()
    row = h.row(oid)
    assert row.state == "delivering" and row.redeliveries == 0 and row.needs_operator == 0
    assert row.attempts == MAX_REDELIVERIES + 2


def test_a_remote_mismatch_is_flagged_and_never_redelivered_alone(harness: Harness) -> None:
    """A listed file that differs (or a read-back mismatch) is flagged and kept flagged past
    verify_timeout: overwriting it is an operator's decision; a bad copy marks force_upload."""
    h = harness
    [oid] = h.accept(1)
    _deliver(h, oid)
    h.sink.checks[oid] = RemoteCheck(
        False, "read-back differs at offsets 0", needs_operator=True, bad_copy=True
    )
    h.tick()
    row = h.row(oid)
    assert (
        row.needs_operator == 1 and row.force_upload == 1 and "offsets 0" in (row.last_error or "")
    )
    h.clock.advance(VERIFY_TIMEOUT + RETENTION)
    h.tick()
    row = h.row(oid)
    assert row.state == "delivered" and row.redeliveries == 0 and row.purged_at is None
    assert h.uploads.data_path(oid).exists()
    assert h.index.run(sql.operator_retry, oid, h.clock.seconds()).result
    h.tick()
    assert h.row(oid).force_upload == 1, "the re-delivery must upload"
    assert h.sink.overwrites[oid] is True, "the sink is told to upload over the listing"
    plan = h.sink.plans[oid]
    assert plan.checksum == h.row(oid).checksum and plan.content_md5 == h.row(oid).content_md5
    h.sink.succeed(oid)
    assert h.row(oid).force_upload == 0


def test_a_failed_lookup_is_never_read_as_absent(harness: Harness) -> None:
    """A lookup that failed (not an absence) never triggers a re-delivery."""
    h = harness
    [oid] = h.accept(1)
    _deliver(h, oid)
    h.sink.checks[oid] = RemoteCheck(False, "metadata API answered 500")
    h.clock.advance(VERIFY_TIMEOUT * 3)
    h.tick()
    row = h.row(oid)
    assert row.state == "delivered" and row.redeliveries == 0 and row.needs_operator == 0


def test_rebuilt_index_keeps_purged_objects_delivered(tmp_path: Path) -> None:
    """After purge, a rescan into an empty index brings the object back delivered, not pending."""
    from canner.checksum import Checksum
    from canner.delivery.rescan import read_accepted
    from canner.ids import ObjectIds
    from canner.store.receipts import Receipt

    h = Harness(tmp_path)
    [oid] = h.accept(1)
    h.receipts.record_origin(oid, Origin("example", None))
    row = h.row(oid)
    h.receipts.commit(Receipt(oid, "https://i", Checksum(row.checksum[7:]), 7, 1))
    h.tick()
    h.sink.succeed(oid)
    h.sink.checks[oid] = RemoteCheck(True)
    h.tick()
    h.clock.advance(RETENTION)
    h.tick()
    h.index.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"delivery.sqlite{suffix}").unlink(missing_ok=True)
    rebuilt = SyncIndex(tmp_path / "rebuilt.sqlite")
    journal = JournalLookup(Journal(tmp_path / "journal"))
    found = read_accepted(h.receipts, h.uploads, journal, list(h.receipts.object_ids()))
    journal.close()
    assert ObjectIds().is_valid(oid) and found.problems == []
    rebuilt.run(sql.insert_objects, found.objects, h.clock.seconds())
    again = rebuilt.run(sql.get_row, oid).result
    assert again.state == "delivered" and again.purged_at is not None
    assert again.remote_identifier == f"item-{oid}"
    # The origin came from the journal: the purge took its file.
    assert again.project == "example" and not h.receipts.origin_path(oid).exists()
    assert rebuilt.run(sql.claim_due, h.clock.seconds() + 10**6, 10, ["example"]).result == []
    rebuilt.close()


def test_failed_purge_retries_after_a_minute(harness: Harness) -> None:
    """A purge that fails is retried PURGE_RETRY seconds later."""
    [oid] = harness.accept(1)
    harness.tick()
    harness.sink.succeed(oid)
    harness.sink.checks[oid] = RemoteCheck(True)
    harness.tick()
    harness.clock.advance(RETENTION)
    os.chmod(harness.uploads.directory, 0o500)
    try:
        if os.access(harness.uploads.data_path(oid), os.W_OK) and os.geteuid() == 0:
            # root ignores directory permissions; make the delete fail another way
            harness.uploads.data_path(oid).unlink()
            harness.uploads.data_path(oid).mkdir()
            (harness.uploads.data_path(oid) / "x").write_bytes(b"")
        harness.tick()
    finally:
        os.chmod(harness.uploads.directory, 0o700)
    row = harness.row(oid)
    assert row.purged_at is None and (row.last_error or "").startswith("purge:")
    assert row.next_check_at == pytest.approx(harness.clock.seconds() + PURGE_RETRY)


def test_restart_turns_delivering_rows_into_due_retries(harness: Harness) -> None:
    """On start every delivering row becomes retry_wait, due at once."""
    [oid] = harness.accept(1)
    harness.tick()
    assert harness.row(oid).state == "delivering"
    changed = harness.index.run(sql.reset_delivering, harness.clock.seconds()).result
    assert changed == 1
    row = harness.row(oid)
    assert row.state == "retry_wait" and row.next_attempt_at == harness.clock.seconds()


def test_stop_cancels_attempts_and_records_them_due(harness: Harness) -> None:
    """stopService cancels in-flight attempts; they are recorded as due again."""
    [oid] = harness.accept(1)
    harness.service.startService()
    assert list(harness.sink.pending) == [oid]
    harness.service.stopService()
    row = harness.row(oid)
    assert row.state == "retry_wait" and row.last_error == "interrupted by shutdown"
    assert row.next_attempt_at == harness.clock.seconds()
    assert harness.clock.getDelayedCalls() == []


def test_projects_without_a_sink_stay_pending(harness: Harness) -> None:
    """Rows of projects with no delivery config are never claimed."""
    obj = AcceptedObject("f" * 32, "local-only", None, 1, "blake3:" + "0" * 64, 1)
    harness.index.run(sql.insert_objects, [obj], 0.0)
    harness.tick()
    assert harness.sink.pending == {}
    assert harness.row("f" * 32).state == "pending"


def test_rows_of_projects_without_a_sink_never_stall_verification_and_purge(
    harness: Harness,
) -> None:
    """Four delivered, unpurged rows of a project whose delivery section was removed sit due
    first; the project with a sink still gets its objects verified and purged."""
    orphans = [
        AcceptedObject(f"e{i:031x}", "removed", None, 1, "blake3:" + "0" * 64, 0) for i in range(4)
    ]
    harness.index.run(sql.insert_objects, orphans, 0.0)
    for obj in orphans:
        harness.index.run(sql.claim_due, 1.0, 10, ["removed"])
        harness.index.run(sql.record_delivered, obj.object_id, "item", "f", 1.0, 0.0)
    [oid] = harness.accept(1)
    harness.tick()
    harness.sink.succeed(oid)
    harness.sink.checks[oid] = RemoteCheck(True)
    harness.tick()
    assert harness.row(oid).verified_at is not None
    harness.clock.advance(RETENTION)
    harness.tick()
    assert harness.row(oid).purged_at is not None
    assert not harness.uploads.data_path(oid).exists()
    assert all(harness.row(o.object_id).purged_at is None for o in orphans)


def test_verification_backs_off_with_time_since_delivery() -> None:
    """Remote checks start after 10 s and slow to every 10 minutes."""
    from canner.delivery.queue import verify_delay

    assert verify_delay(100.0, 100.0) == 10.0
    assert verify_delay(160.0, 100.0) == 30.0
    assert verify_delay(100_000.0, 100.0) == 600.0


def test_a_stalled_verification_does_not_hold_up_new_deliveries(tmp_path: Path) -> None:
    """While a metadata lookup hangs, the tick still claims and starts new deliveries."""
    from twisted.internet.defer import Deferred

    h = Harness(tmp_path, concurrency=1)
    first, second = h.accept(2)
    h.tick()
    assert list(h.sink.pending) == [first]
    hanging: Deferred[RemoteCheck] = Deferred()
    h.sink.hanging_verify = hanging
    h.sink.succeed(first)
    h.tick()  # starts the (hanging) verification of first, and claims second
    assert list(h.sink.pending) == [second]
    hanging.callback(RemoteCheck(True))
    assert h.row(first).verified_at is not None
    h.index.close()


def test_a_finished_attempt_frees_its_slot_at_once(tmp_path: Path) -> None:
    """When an attempt ends, the next due row starts without waiting for the next tick."""
    h = Harness(tmp_path, concurrency=1)
    first, second, third = h.accept(3)
    h.service.startService()
    assert list(h.sink.pending) == [first]
    h.sink.succeed(first)
    assert list(h.sink.pending) == [second]
    h.sink.fail(second)
    assert list(h.sink.pending) == [third]
    h.service.stopService()
    h.index.close()


def test_rows_left_delivering_without_an_attempt_are_released(harness: Harness) -> None:
    """A row stuck in delivering (its outcome could not be recorded) is retried, not stranded."""
    [oid] = harness.accept(1)
    harness.index.query(
        "UPDATE outbound SET state = 'delivering' WHERE kind = 'object' AND ref = ?",
        oid,
    )
    harness.tick()
    assert list(harness.sink.pending) == [oid]
    assert harness.row(oid).last_error == "the outcome of an attempt could not be recorded"
    harness.clock.advance(30)
    harness.tick()  # a running attempt is never released
    assert harness.row(oid).state == "delivering"
    harness.clock.advance(60)
    harness.tick()
    assert harness.row(oid).state == "delivering" and list(harness.sink.pending) == [oid]


def test_a_version_0_1_delivery_side_file_still_rebuilds_a_purged_object(tmp_path: Path) -> None:
    """Data directories of 0.1 hold a purged object's delivery record in
    ``receipts/{id}.delivery.json`` instead of the journal: a rescan still reads it."""
    from canner.checksum import Checksum
    from canner.delivery.rescan import read_accepted
    from canner.store.receipts import Origin, Receipt

    receipts = ReceiptStore(tmp_path / "receipts")
    receipts.directory.mkdir()
    oid = "ab" * 16
    receipts.record_origin(oid, Origin("example", "f.warc"))
    receipts.commit(Receipt(oid, "https://i", Checksum("cd" * 32), 7, 1))
    # Byte for byte what 0.1 wrote before a purge.
    receipts.delivery_path(oid).write_bytes(
        b'{"object_id":"%s","identifier":"item-%s","remote_name":"f.warc",'
        b'"content_md5":"00112233445566778899aabbccddeeff","delivered_at":10.0,'
        b'"verified_at":20.0,"purge_after":30.0,"purged_at":40.0}' % (oid.encode(), oid.encode())
    )
    journal = JournalLookup(Journal(tmp_path / "journal"))
    found = read_accepted(receipts, UploadStore(tmp_path / "uploads"), journal, [oid])
    journal.close()
    assert found.problems == []
    [accepted] = found.objects
    assert accepted.delivery is not None
    assert (accepted.delivery.identifier, accepted.delivery.purged_at) == (f"item-{oid}", 40.0)
    rebuilt = SyncIndex(tmp_path / "rebuilt.sqlite")
    rebuilt.run(sql.insert_objects, found.objects, 50.0)
    row = rebuilt.run(sql.get_row, oid).result
    assert row.state == "delivered" and row.purged_at == 40.0
    rebuilt.close()


@define
class HeldIndex:
    """A :class:`SyncIndex` whose queries wait until :meth:`answer` runs them."""

    inner: SyncIndex
    held: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = field(factory=list)

    def run(self, f: Any, *args: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.held.append((d, f, args))
        return d

    def answer(self) -> None:
        held, self.held = self.held, []
        for d, f, args in held:
            self.inner.run(f, *args).chainDeferred(d)


def test_stop_while_starting_waits_for_the_start_up_query(tmp_path: Path) -> None:
    """Stopped before its start-up query (interrupted attempts become due) has answered, the
    scheduler has not stopped until that query has, and it never starts ticking."""
    h = Harness(tmp_path)
    held = HeldIndex(h.index)
    h.service._index = held  # the same service, its index answering late
    h.service.startService()
    stopped = h.service.stopService()
    assert not stopped.called, "stopped while its start-up query was still running"
    held.answer()
    assert stopped.called
    h.clock.advance(5)
    assert held.held == [], "a tick ran after stop"


def _look_again_now(h: Harness, oid: str) -> None:
    """The object's next look at the destination is due now (a lookup found nothing yet)."""
    now = h.clock.seconds()
    h.index.run(outbound.record_check, OBJECT, oid, now, None, False, now)
