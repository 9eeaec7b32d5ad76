"""The one outbound service over several kinds of row: shared slots, one failure policy, one
follow-up policy, whatever the owner.  Fake owners and a fake sink over a real SQLite file."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from attrs import define, field
from twisted.internet.task import Clock

from canner.delivery import outbound
from canner.delivery.follow_up import DeliveredCopy
from canner.delivery.outbound_service import (
    ATTEMPT_LIMIT,
    Copy,
    OutboundService,
    Parcel,
    Shipment,
    Unshippable,
    lanes_of,
)
from canner.delivery.queue import MAX_RETRY, PURGE_RETRY
from canner.observe import Outbound
from canner.ops.metrics import DELIVER, Metrics
from canner.sinks.base import Delivered, DeliveryFailed, RemoteCheck, Sink
from canner.sinks.plan import ItemPlan, PlanError
from tests.fakes import FakeSink, SyncIndex


@define
class FakeOwner:
    """Rows of one kind, each one file named after its ref; records through ``outbound``."""

    kind: Outbound
    sink_: Sink
    project: str
    index: SyncIndex
    refused: set[str] = field(factory=set)
    settled: list[str] = field(factory=list)
    broken_disk: bool = False

    def sink(self, project: str) -> Sink:
        return self.sink_

    def projects(self) -> Sequence[str]:
        return [self.project]

    def _plan(self, ref: str) -> ItemPlan:
        return ItemPlan(
            project=self.project,
            object_id=ref,
            identifier=f"item-{ref}",
            remote_name=f"{ref}.warc",
            size=10,
            content_md5="0" * 32,
            size_hint=10,
            headers=(),
        )

    async def shipment(self, ref: str, stopping: threading.Event) -> Shipment:
        if ref in self.refused:
            raise Unshippable(ref, self.project, PlanError("the item would be too large"))
        return Shipment(
            ref=ref,
            project=self.project,
            subject=f"{self.kind.value} {ref}",
            key=ref,
            files=(Parcel(self._plan(ref), Path("/nonexistent"), ref),),
            overwrite=False,
        )

    async def delivered(self, shipment: Shipment, sent: Sequence[Delivered], now: float) -> None:
        await self.index.run(
            outbound.record_delivered, self.kind, shipment.ref, sent[0].identifier, now
        )

    def record_failure(
        self, cur: sqlite3.Cursor, ref: str, error: str, at: float, needs_operator: bool, now: float
    ) -> bool:
        return outbound.record_failure(cur, self.kind, ref, error, at, needs_operator, now)

    async def copy(self, ref: str) -> Copy | None:
        row = await self.index.run(outbound.row_of, self.kind, ref)
        facts = DeliveredCopy(
            kind=self.kind,
            ref=ref,
            subject=f"{self.kind.value} {ref}",
            project=self.project,
            identifier=row.remote_identifier,
            delivered_at=row.delivered_at,
            redeliveries=row.redeliveries,
            needs_operator=bool(row.needs_operator),
            retry=f"canner retry {ref}",
        )
        parcel = Parcel(self._plan(ref), Path("/nonexistent"), ref)
        return Copy(
            facts=facts, files=(parcel,), verified=row.verified_at is not None, verify_timeout=60
        )

    async def verified(self, copy: Copy, now: float) -> None:
        await self.index.run(outbound.record_verified, self.kind, copy.facts.ref, now, now)

    def redeliver(self, cur: sqlite3.Cursor, ref: str, reason: str, now: float) -> bool:
        return outbound.redeliver(cur, self.kind, ref, reason, now)

    async def settle(self, copy: Copy, now: float) -> bool:
        if self.broken_disk:
            raise OSError(5, "Input/output error")
        self.settled.append(copy.facts.ref)
        await self.index.run(outbound.settle, self.kind, copy.facts.ref, now)
        return True


@define
class World:
    index: SyncIndex
    clock: Clock
    sink: FakeSink
    objects: FakeOwner
    ledgers: FakeOwner
    service: OutboundService
    metrics: Metrics

    def add(self, kind: Outbound, ref: str, project: str, due: float) -> None:
        self.index.run(outbound.add, kind, [(ref, project)], due)

    def row(self, kind: Outbound, ref: str) -> outbound.OutboundRow:
        row = self.index.run(outbound.row_of, kind, ref).result
        assert row is not None
        return row

    def next_attempt(self, kind: Outbound, ref: str) -> float:
        cur = self.index.conn.execute(
            "SELECT next_attempt_at, last_error FROM outbound WHERE kind = ? AND ref = ?",
            (kind.value, ref),
        )
        return float(cur.fetchone()[0])

    def next_check(self, kind: Outbound, ref: str) -> tuple[float, str]:
        cur = self.index.conn.execute(
            "SELECT next_check_at, last_error FROM outbound WHERE kind = ? AND ref = ?",
            (kind.value, ref),
        )
        at, error = cur.fetchone()
        return float(at), str(error)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    index = SyncIndex(tmp_path / "delivery.sqlite")
    clock = Clock()
    clock.advance(1_000_000)
    sink = FakeSink()
    objects = FakeOwner(Outbound.OBJECT, sink, "example", index)
    ledgers = FakeOwner(Outbound.LEDGER, sink, "", index)
    metrics = Metrics(DELIVER, ["example"])
    service = OutboundService(
        index=index,
        owners=lanes_of([objects, ledgers]),
        clock=clock,
        concurrency=1,
        random=lambda: 0.0,
        observer=metrics,
    )
    service.startService()  # a running service fills a freed slot at once
    yield World(index, clock, sink, objects, ledgers, service, metrics)
    service.stopService()
    index.close()


def test_every_kind_shares_the_slots_oldest_due_first(world: World) -> None:
    """One slot: the ledger due first goes first, then the object; never both at once."""
    now = world.clock.seconds()
    world.add(Outbound.OBJECT, "obj", "example", now - 5)
    world.add(Outbound.LEDGER, "led", "", now - 10)
    world.service.tick()
    assert list(world.sink.pending) == ["led"]
    assert world.row(Outbound.OBJECT, "obj").state == "pending"
    world.sink.succeed("led")
    assert list(world.sink.pending) == ["obj"], "the freed slot is filled at once"
    assert world.row(Outbound.LEDGER, "led").state == "delivered"


def test_one_failure_policy_for_every_kind(world: World) -> None:
    """A ledger's failure backs off like an object's; Retry-After is a lower bound within the
    cap; an error that needs an operator waits the cap and flags the row."""
    now = world.clock.seconds()
    world.add(Outbound.LEDGER, "led", "", now)
    world.service.tick()
    world.sink.pending.pop("led").errback(DeliveryFailed("503 SlowDown", retry_after=1800.0))
    row = world.row(Outbound.LEDGER, "led")
    assert (row.state, row.needs_operator) == ("retry_wait", 0)
    assert world.next_attempt(Outbound.LEDGER, "led") == pytest.approx(now + 1800)
    world.clock.advance(1800)
    world.service.tick()
    world.sink.fail("led", "403 Forbidden", operator=True)
    row = world.row(Outbound.LEDGER, "led")
    assert row.needs_operator == 1 and row.attempts == 2
    assert world.next_attempt(Outbound.LEDGER, "led") == pytest.approx(now + 1800 + MAX_RETRY)
    failures = world.metrics.registry.get_sample_value(
        "canner_delivery_failures_total",
        {"kind": "ledger", "project": "", "reason": "other", "needs_operator": "true"},
    )
    assert failures == 1


def test_a_refused_plan_needs_an_operator_and_sends_nothing(world: World) -> None:
    """A row its owner cannot plan (an item that would be too large) is flagged, never sent."""
    world.objects.refused.add("big")
    world.add(Outbound.OBJECT, "big", "example", world.clock.seconds())
    world.service.tick()
    assert world.sink.pending == {}
    row = world.row(Outbound.OBJECT, "big")
    assert (row.state, row.needs_operator) == ("retry_wait", 1)


def test_verified_copies_go_back_to_their_owner_which_deletes(world: World) -> None:
    """Delivered, then verified by the sink, then the owner's delete; a delete the disk
    refuses is tried again a minute later, with why."""
    now = world.clock.seconds()
    world.add(Outbound.LEDGER, "led", "", now)
    world.service.tick()
    world.sink.checks["led"] = RemoteCheck(True)
    world.ledgers.broken_disk = True
    world.sink.succeed("led")
    world.service.tick()  # verified (and its delete due at once)
    assert world.row(Outbound.LEDGER, "led").verified_at is not None
    world.service.tick()  # the delete fails on the disk
    at, error = world.next_check(Outbound.LEDGER, "led")
    assert at == pytest.approx(now + PURGE_RETRY) and error.startswith("purge: ")
    world.ledgers.broken_disk = False
    world.clock.advance(PURGE_RETRY)
    world.service.tick()
    assert world.ledgers.settled == ["led"]


def test_an_unlisted_copy_of_any_kind_is_delivered_again_after_verify_timeout(
    world: World,
) -> None:
    """The one verification policy: a ledger still unlisted after its verify_timeout goes back
    to be delivered again, a re-delivery counted."""
    world.add(Outbound.LEDGER, "led", "", world.clock.seconds())
    world.service.tick()
    world.sink.succeed("led")
    world.service.tick()
    assert world.row(Outbound.LEDGER, "led").state == "delivered"
    world.clock.advance(61)
    world.service.tick()
    row = world.row(Outbound.LEDGER, "led")
    assert row.redeliveries == 1
    assert "led" in world.sink.pending, "sent again at once"


def test_an_attempt_cut_off_counts_under_its_project(world: World) -> None:
    """An attempt past the 24-hour bound goes back to retry_wait, and its failure is counted
    under the row's project, like any other failure of that row."""
    world.add(Outbound.OBJECT, "obj", "example", world.clock.seconds())
    world.service.tick()
    assert list(world.sink.pending) == ["obj"]
    world.clock.advance(ATTEMPT_LIMIT)
    row = world.row(Outbound.OBJECT, "obj")
    assert row.state == "retry_wait"
    failures = world.metrics.registry.get_sample_value(
        "canner_delivery_failures_total",
        {"kind": "object", "project": "example", "reason": "timeout", "needs_operator": "false"},
    )
    assert failures == 1
