"""Fakes typed to canner's seams, for synchronous unit tests."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, ClassVar, ParamSpec, TypeVar

import blake3
from attrs import define, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from canner.delivery.index import CursorFunction, ObjectRow, configure_connection, upgrade_schema
from canner.observe import Destination
from canner.sinks.base import Delivered, DeliveryFailed, RemoteCheck
from canner.sinks.plan import ItemPlan

P = ParamSpec("P")
T = TypeVar("T")


@define(eq=False)
class SyncIndex:
    """The delivery index over a real SQLite file, run synchronously (no adbapi threads)."""

    path: Path
    conn: sqlite3.Connection = field(init=False)

    def __attrs_post_init__(self) -> None:
        upgrade_schema(self.path)
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        configure_connection(self.conn)

    def run(self, f: CursorFunction[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        cur = self.conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            result = f(cur, *args, **kwargs)
        except Exception:
            cur.execute("ROLLBACK")
            return fail()
        cur.execute("COMMIT")
        return succeed(result)

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, args).fetchall()

    def close(self) -> None:
        self.conn.close()


@define(eq=False)
class FakeSink:
    """A Sink whose answers the test scripts; each deliver() waits until the test resolves it.

    With ``answers``, deliver() answers at once as a destination would (the sink contract's
    mode): it keeps the file's size and checksum at the plan's place, fails for an operator when
    the local file is missing and transiently while ``reachable`` is false; verify() compares
    what it keeps with the plan.  Scripted, a copy is listed only once the test says so
    (``checks``), like IA's metadata lag."""

    destination: ClassVar[Destination] = Destination.IA

    pending: dict[str, Deferred[Delivered]] = field(factory=dict)
    delivered: list[str] = field(factory=list)
    checks: dict[str, RemoteCheck] = field(factory=dict)
    hanging_verify: Deferred[RemoteCheck] | None = None
    # each attempt's progress callback: the test reports bytes sent through it
    progress: dict[str, Any] = field(factory=dict)
    # the plan and overwrite flag of each object's latest attempt
    plans: dict[str, ItemPlan] = field(factory=dict)
    overwrites: dict[str, bool] = field(factory=dict)
    answers: bool = False
    reachable: bool = True
    # what the destination holds: (identifier, remote name) -> (size, checksum)
    copies: dict[tuple[str, str], tuple[int, str]] = field(factory=dict)

    def deliver(
        self, plan: ItemPlan, path: Path, progress: Any = None, *, overwrite: bool = False
    ) -> Deferred[Delivered]:
        self.progress[plan.object_id] = progress
        self.plans[plan.object_id] = plan
        self.overwrites[plan.object_id] = overwrite
        if self.answers:
            return self._answer(plan, path, progress, overwrite)
        d: Deferred[Delivered] = Deferred()
        self.pending[plan.object_id] = d
        return d

    def _answer(
        self, plan: ItemPlan, path: Path, progress: Any, overwrite: bool
    ) -> Deferred[Delivered]:
        if not self.reachable:
            return fail(DeliveryFailed("the fake destination is unreachable", kind="network"))
        if not overwrite and holds(self.copies.get((plan.identifier, plan.remote_name)), plan):
            return succeed(Delivered(plan.identifier, plan.remote_name))
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return fail(
                DeliveryFailed("local file missing", needs_operator=True, kind="local_payload")
            )
        self.copies[(plan.identifier, plan.remote_name)] = (len(data), blake3_digest(data))
        if progress is not None:
            progress(len(data))
        self.delivered.append(plan.object_id)
        return succeed(Delivered(plan.identifier, plan.remote_name))

    def succeed(self, object_id: str) -> None:
        """The pending attempt of ``object_id`` arrived at its plan's place."""
        self.delivered.append(object_id)
        plan = self.plans[object_id]
        self.pending.pop(object_id).callback(Delivered(plan.identifier, plan.remote_name))

    def fail(self, object_id: str, reason: str = "503 SlowDown", operator: bool = False) -> None:
        self.pending.pop(object_id).errback(DeliveryFailed(reason, needs_operator=operator))

    def verify(self, plan: ItemPlan, path: Path | None = None) -> Deferred[RemoteCheck]:
        if self.hanging_verify is not None:
            return self.hanging_verify
        default = RemoteCheck(False, "not listed yet", absent=True)
        if self.answers:
            default = self._check(plan)
        return succeed(self.checks.get(plan.object_id, default))

    def _check(self, plan: ItemPlan) -> RemoteCheck:
        copy = self.copies.get((plan.identifier, plan.remote_name))
        if copy is None:
            return RemoteCheck(False, "not listed", absent=True)
        if not holds(copy, plan):
            return RemoteCheck(False, f"remote file differs: {copy}", needs_operator=True)
        return RemoteCheck(True)


def holds(copy: tuple[int, str] | None, plan: ItemPlan) -> bool:
    """Whether ``copy`` (size, checksum) is the planned file."""
    return copy == (plan.size, plan.checksum)


def blake3_digest(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def fake_plan(row: ObjectRow) -> ItemPlan:
    """A planner for FakeSink: the place FakeSink.succeed reports."""
    return ItemPlan(
        project=row.project,
        object_id=row.object_id,
        identifier=f"item-{row.object_id}",
        remote_name=f"{row.object_id}.warc",
        size=row.size_bytes,
        content_md5=row.content_md5 or "",
        size_hint=row.size_bytes,
        headers=(),
        checksum=row.checksum,
    )


def succeeded(d: Deferred[Any]) -> Any:
    """The result of a Deferred that must already have fired (its failure is raised)."""
    results: list[Any] = []
    d.addBoth(results.append)
    assert results, "the Deferred has not fired"
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]
