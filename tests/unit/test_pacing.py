"""Pacing by IA's task limits: ``check_limit``'s detail near, at and over the rations changes how
many PUTs run at once (the pure policy, the gate, and the IA sink in memory with a fake clock);
a broken probe never stops delivery."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from treq.client import HTTPClient
from treq.testing import RequestTraversalAgent
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from canner.blocking import run_inline
from canner.sinks.base import Verdict
from canner.sinks.ia.attempt import PACE_RECHECK, DeliveryResult
from canner.sinks.ia.client import IAClient
from canner.sinks.ia.credentials import Credentials
from canner.sinks.ia.pacing import LimitReading, Pace, PutGate, pace, parse_check_limit
from canner.sinks.ia.sink import internet_archive_sink
from canner.sinks.plan import ItemPlan, plan_upload
from tests.integration.test_ia import ACCEPTED, OID, delivery


def reading(**detail: Any) -> LimitReading:
    return parse_check_limit({"over_limit": 0, "detail": detail})


# -- the policy --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("queued", "allowed"),
    [(0, 40), (10, 30), (29, 11), (30, 1), (39, 1), (40, 0), (41, 0), (500, 0)],
)
def test_an_items_tasks_near_at_and_over_its_ration(queued: int, allowed: int) -> None:
    """Far: no more PUTs than the room left; from 3/4 of the ration one; at or over it none."""
    got = pace(reading(bucket_tasks_queued=queued, bucket_ration=40))
    assert got.item == allowed and got.account is None
    assert got.stopped == (allowed == 0)
    if allowed <= 1:
        assert "item's tasks are " + ("over" if allowed == 0 else "near") in got.reason


@pytest.mark.parametrize(("queued", "allowed"), [(0, 100), (74, 26), (75, 1), (100, 0)])
def test_an_accounts_tasks_near_at_and_over_its_ration(queued: int, allowed: int) -> None:
    """The account's ration bounds every PUT of the sink the same way."""
    got = pace(reading(accesskey_tasks_queued=queued, accesskey_ration=100))
    assert got.account == allowed and got.item is None


@pytest.mark.parametrize(("queued", "allowed"), [(100, 11899), (9000, 1), (11999, 0)])
def test_the_global_limit_bounds_the_account(queued: int, allowed: int) -> None:
    """IA's queues as a whole near or over the global limit slow or stop every PUT."""
    got = pace(reading(total_tasks_queued=queued, total_global_limit=11999))
    assert got.account == allowed


def test_the_tightest_bound_wins_and_over_limit_stops_everything() -> None:
    """Item, account and global bounds combine; IA's own over_limit stops PUTs even without
    detail."""
    got = pace(
        reading(
            bucket_tasks_queued=1,
            bucket_ration=40,
            accesskey_tasks_queued=80,
            accesskey_ration=100,
            total_tasks_queued=10,
            total_global_limit=11999,
        )
    )
    assert got == Pace(item=39, account=1, reason=got.reason) and "account" in got.reason
    over = pace(parse_check_limit({"over_limit": 1}))
    assert over.stopped and over.reason == "check_limit reports over_limit"


@pytest.mark.parametrize(
    "doc",
    [
        None,
        [],
        "over",
        {},
        {"over_limit": 0},
        {"over_limit": 0, "detail": "none"},
        {"over_limit": 0, "detail": {"bucket_ration": 40}},  # a ration without a count
        {"over_limit": 0, "detail": {"bucket_tasks_queued": "many", "bucket_ration": 40}},
        {"over_limit": 0, "detail": {"bucket_tasks_queued": 50, "bucket_ration": 0}},
        {"over_limit": 0, "detail": {"bucket_tasks_queued": -1, "bucket_ration": 40}},
        {"over_limit": 0, "detail": {"bucket_tasks_queued": True, "bucket_ration": 1}},
        {"over_limit": 0, "detail": {"rationing_engaged": 1, "limit_reason": "??"}},
    ],
)
def test_unknown_or_missing_fields_never_block(doc: object) -> None:
    """Whatever check_limit says that is not a usable count leaves PUTs unbounded."""
    assert pace(parse_check_limit(doc)) == Pace()
    assert pace(None) == Pace()


def test_counts_given_as_strings_are_read() -> None:
    """A count IA sends as a decimal string counts like a number."""
    assert pace(reading(bucket_tasks_queued="40", bucket_ration="40")).item == 0


@given(queued=st.integers(0, 10**6), ration=st.integers(1, 10**6))
def test_paced_puts_never_push_a_queue_past_its_ration(queued: int, ration: int) -> None:
    """Each PUT queues one task: the PUTs allowed never exceed the room the ration leaves."""
    allowed = pace(reading(bucket_tasks_queued=queued, bucket_ration=ration)).item
    assert allowed is not None and 0 <= allowed <= max(ration - queued, 0)


def test_the_gate_counts_puts_per_item_and_in_all() -> None:
    """enter() admits while the pace has room, for the item and for the account."""
    gate = PutGate(Clock())
    one_each = Pace(item=1, account=2)
    assert gate.enter("a", one_each) and not gate.enter("a", one_each)
    assert gate.enter("b", one_each) and not gate.enter("c", one_each)
    assert gate.running() == 2 and gate.running("a") == 1
    gate.leave("a")
    assert gate.enter("c", one_each)
    assert gate.enter("a", Pace()), "an unbounded pace always admits"
    assert gate.running("a") == 1 and gate.running() == 3


# -- the sink in memory ------------------------------------------------------------------------


class ScriptedIA(Resource):
    """check_limit answers ``limit`` (None: 500; bytes: sent as is); the metadata API knows no
    item; every PUT is held until the test answers it."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.limit: dict[str, Any] | bytes | None = {"over_limit": 0}
        self.probes = 0
        self.held: list[Request] = []
        self.puts = 0

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if request.args.get(b"check_limit"):
            self.probes += 1
            if self.limit is None:
                request.setResponseCode(500)
                return b"internal error"
            return self.limit if isinstance(self.limit, bytes) else json.dumps(self.limit).encode()
        return b"{}"

    def render_PUT(self, request: Request) -> int:
        self.puts += 1
        self.held.append(request)
        return NOT_DONE_YET

    def answer_one(self) -> None:
        request = self.held.pop(0)
        request.setResponseCode(200)
        request.finish()


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.ia = ScriptedIA()
        self.agent = RequestTraversalAgent(self.ia)
        self.clock = Clock()
        self.sink = IAClient(
            http=HTTPClient(self.agent),
            clock=self.clock,
            credentials=Credentials("AKEY", "SECRET"),
            s3_url="https://ia",
            metadata_url="https://ia",
            run=run_inline,
        )
        self.path = tmp_path / "artifact"
        self.path.write_bytes(b"hello")
        self.results: list[Any] = []

    def plan(self, n: int, identifier: str = "item-a") -> ItemPlan:
        config = delivery(identifier=identifier)
        md5 = hashlib.md5(b"hello").hexdigest()
        return plan_upload(config, "example", OID[:-2] + f"{n:02d}", f"f{n}", ACCEPTED, 5, md5)

    def start(self, count: int, identifier: str = "item-a") -> list[Deferred[DeliveryResult]]:
        started = []
        for n in range(count):
            d = self.sink.deliver(self.plan(n, identifier), self.path)
            d.addBoth(self.results.append)
            started.append(d)
        self.settle()
        return started

    def settle(self) -> None:
        for _ in range(50):
            self.clock.advance(0)
            self.agent.flush()

    def answer_all(self) -> None:
        while self.ia.held:
            self.ia.answer_one()
            self.settle()

    def delivered(self) -> int:
        return sum(1 for r in self.results if isinstance(r, DeliveryResult) and r.delivered)


def detail(queued: int, ration: int = 40) -> dict[str, Any]:
    return {"over_limit": 0, "detail": {"bucket_tasks_queued": queued, "bucket_ration": ration}}


def test_far_from_the_ration_puts_run_side_by_side(tmp_path: Path) -> None:
    """With room in the item's ration, three deliveries PUT at once."""
    h = Harness(tmp_path)
    h.ia.limit = detail(5)
    h.start(3)
    assert len(h.ia.held) == 3 and h.sink.gate.running("item-a") == 3
    h.answer_all()
    assert h.delivered() == 3 and h.sink.gate.running() == 0


def test_near_the_ration_puts_to_the_item_go_one_at_a_time(tmp_path: Path) -> None:
    """Near the item's ration only one PUT runs; the next starts when it ends, after a new
    probe; PUTs to another item are not held back by it."""
    h = Harness(tmp_path)
    h.ia.limit = detail(35)
    h.start(3)
    assert len(h.ia.held) == 1, "more than one PUT near the ration"
    h.start(1, identifier="item-b")
    assert len(h.ia.held) == 2, "another item's PUT was held back"
    probes = h.ia.probes
    h.ia.answer_one()
    h.settle()
    assert h.ia.probes > probes, "no new probe once a PUT ended"
    assert len(h.ia.held) == 2 and h.ia.puts == 3
    h.answer_all()
    assert h.delivered() == 4 and h.ia.puts == 4


def test_at_the_ration_nothing_is_sent_and_delivery_resumes_by_itself(tmp_path: Path) -> None:
    """At (or over) the ration the attempt ends as a SlowDown retry without a PUT; once the
    queue drains the next attempt goes through."""
    h = Harness(tmp_path)
    h.ia.limit = detail(40)
    h.start(2)
    assert h.ia.puts == 0 and len(h.results) == 2
    for result in h.results:
        assert result.outcome.verdict is Verdict.TRANSIENT
        assert result.outcome.reason.startswith("503 SlowDown: the item's tasks are over")
    h.results.clear()
    h.ia.limit = detail(3)
    h.start(1)
    h.answer_all()
    assert h.delivered() == 1


def test_a_waiting_put_probes_again_and_resumes_when_the_queue_drains(tmp_path: Path) -> None:
    """Held back near the ration with a PUT running, an attempt probes again every
    PACE_RECHECK seconds and starts as soon as IA's queue has room."""
    h = Harness(tmp_path)
    h.ia.limit = detail(30)
    h.start(2)
    assert len(h.ia.held) == 1
    h.clock.advance(PACE_RECHECK)
    h.settle()
    assert len(h.ia.held) == 1, "still near: still one at a time"
    h.ia.limit = detail(2)
    h.clock.advance(PACE_RECHECK)
    h.settle()
    assert len(h.ia.held) == 2, "the drained queue did not let the waiting PUT start"
    h.answer_all()
    assert h.delivered() == 2


def test_the_account_ration_paces_puts_to_every_item(tmp_path: Path) -> None:
    """Near the account's ration one PUT runs, whatever item it goes to."""
    h = Harness(tmp_path)
    h.ia.limit = {
        "over_limit": 0,
        "detail": {"accesskey_tasks_queued": 90, "accesskey_ration": 100},
    }
    h.start(1, identifier="item-a")
    h.start(1, identifier="item-b")
    assert len(h.ia.held) == 1
    h.answer_all()
    assert h.delivered() == 2


@pytest.mark.parametrize("answer", [None, b"not json", b"[1, 2]", b"{}"])
def test_a_broken_probe_never_stops_delivery(tmp_path: Path, answer: bytes | None) -> None:
    """A probe that fails or says nothing usable lets every PUT go."""
    h = Harness(tmp_path)
    h.ia.limit = answer
    h.start(3)
    assert len(h.ia.held) == 3
    h.answer_all()
    assert h.delivered() == 3


def test_a_cancelled_wait_leaves_the_gate_and_the_clock_clean(tmp_path: Path) -> None:
    """Cancelling attempts, waiting or PUTting, leaves no count in the gate and no timer."""
    h = Harness(tmp_path)
    h.ia.limit = detail(35)
    started = h.start(2)
    for d in started:
        d.cancel()
    h.settle()
    assert h.sink.gate.running() == 0
    assert h.clock.getDelayedCalls() == []


def test_projects_with_the_same_keys_share_one_gate(tmp_path: Path) -> None:
    """IA rations tasks per account: sinks built with the same access key count their PUTs
    together, other keys apart."""
    keys = {"one": "AKEY1\nSECRET1\n", "two": "AKEY2\nSECRET2\n"}
    for name, text in keys.items():
        (tmp_path / name).write_text(text)
    gates: dict[str, PutGate] = {}
    sinks = [
        internet_archive_sink(
            f"p{n}",
            delivery(credentials=tmp_path / key),
            HTTPClient(RequestTraversalAgent(ScriptedIA())),
            Clock(),
            run_inline,
            gates=gates,
        )
        for n, key in enumerate(("one", "one", "two"))
    ]
    gate_of = [s._client.gate for s in sinks]
    assert gate_of[0] is gate_of[1] and gate_of[0] is not gate_of[2]
    assert set(gates) == {"AKEY1", "AKEY2"}
