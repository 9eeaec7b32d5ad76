"""canner-deliver's heartbeat, its attempts in flight, the attempt history and the 24 h trends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from canner.delivery import index as sql
from canner.delivery.liveness import (
    CHANGING,
    NEVER,
    RUNNING,
    STALE,
    STOPPED,
    UPLOADING,
    Heartbeat,
    HeartbeatService,
    judge,
    rate_and_eta,
    read_heartbeat,
)
from canner.ids import ObjectIds
from canner.ops import inventory
from canner.ops.inventory import take_survey
from canner.ops.status_charts import Line, trend_chart
from canner.ops.status_page import DeliveryTarget, StatusView, render_status
from canner.ops.trends import ALL, WINDOW, per_minute, read_trends, sample_trends
from canner.sinks.base import RemoteCheck
from tests.fakes import SyncIndex
from tests.unit.test_object_delivery import Harness

IDS = ObjectIds()


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def test_in_flight_attempts_report_phase_bytes_rate_and_eta(harness: Harness) -> None:
    """While the sink streams, ``scheduler.active`` shows the attempt uploading with its bytes,
    rate and ETA; IA bytes are counted as they are sent; a finished attempt leaves the list."""
    [oid] = harness.accept(1, data=b"x" * 1000)
    in_flight = harness.service.in_flight
    assert in_flight is not None
    harness.tick()
    [progress] = harness.service.active
    assert progress["object_id"] == oid and progress["phase"] == UPLOADING
    assert progress["sent"] == 0 and progress["rate"] is None
    report = harness.sink.progress[oid]
    report(300)
    harness.clock.advance(3)
    report(300)
    [progress] = harness.service.active
    assert progress["sent"] == 600 and progress["size"] == 1000
    assert progress["rate"] == pytest.approx(200.0) and progress["eta_s"] == pytest.approx(2.0)
    assert in_flight.total_sent == 600
    sent = harness.metrics.registry.get_sample_value(
        "canner_ia_sent_bytes_total", {"kind": "object"}
    )
    assert sent == 600
    assert in_flight.bytes_in_flight == 600
    harness.sink.succeed(oid)
    assert harness.service.active == [] and in_flight.bytes_in_flight == 0


def test_rate_and_eta_are_unknown_before_bytes_move() -> None:
    """No rate before the upload started; no ETA while nothing moves."""
    assert rate_and_eta(100, 0, None, 10.0) == (None, None)
    assert rate_and_eta(100, 0, (9.8, 0), 10.0) == (None, None)
    assert rate_and_eta(100, 50, (5.0, 0), 10.0) == (10.0, 5.0)
    assert rate_and_eta(100, 50, (5.0, 50), 10.0) == (0.0, None)


def test_a_stalled_upload_shows_no_rate_and_how_long_it_stalled(harness: Harness) -> None:
    """Bytes stop: the rate over the last 30 s falls to 0 and the attempt says for how long."""
    [oid] = harness.accept(1, data=b"x" * 1000)
    harness.tick()
    harness.sink.progress[oid](500)
    for _ in range(9):
        harness.clock.advance(5)
        [progress] = harness.service.active
    assert progress["rate"] == 0.0 and progress["eta_s"] is None
    assert progress["stalled_s"] == pytest.approx(45.0)


def test_heartbeat_is_written_periodically_and_marked_stopped(harness: Harness) -> None:
    """The heartbeat row is rewritten every 5 s with the attempts in flight; a clean stop marks
    it stopped and empties the list."""
    in_flight = harness.service.in_flight
    assert in_flight is not None
    beat = HeartbeatService(harness.index, in_flight, harness.clock, pid=42)
    [oid] = harness.accept(1)
    harness.tick()
    beat.startService()
    first = harness.index.run(read_heartbeat).result
    assert first.pid == 42 and first.stopped_at is None
    assert [p.object_id for p in first.in_flight] == [oid]
    harness.clock.advance(5)
    second = harness.index.run(read_heartbeat).result
    assert second.beat_at == first.beat_at + 5
    assert judge(second, harness.clock.seconds()).state == RUNNING
    beat.stopService()
    last = harness.index.run(read_heartbeat).result
    assert last.stopped_at == harness.clock.seconds() and last.in_flight == ()
    assert judge(last, harness.clock.seconds()).state == STOPPED
    harness.clock.advance(10)
    assert harness.index.run(read_heartbeat).result == last, "no beats after stop"


def test_judge_tells_running_stale_stopped_and_never_apart() -> None:
    """A heartbeat older than 30 s without a clean stop is stale."""
    beat = Heartbeat(1, "1.0", 100.0, 200.0, None)
    assert judge(None, 200.0).state == NEVER
    assert judge(beat, 229.0).state == RUNNING
    stale = judge(beat, 231.0)
    assert stale.state == STALE and "31s old" in stale.text and not stale.ok


def test_judge_never_calls_deliver_stopped_while_its_lock_is_held() -> None:
    """A heartbeat marked stopped (or none yet) while deliver.lock is held is a deliver starting
    or stopping; once the lock is free it is a clean stop."""
    stopped = Heartbeat(1, "1.0", 100.0, 200.0, 200.0)
    for beat in (stopped, None):
        held = judge(beat, 201.0, lock_held=True)
        assert held.state == CHANGING and not held.ok and "stopped cleanly" not in held.text
    assert judge(stopped, 201.0, lock_held=False).state == STOPPED
    assert judge(None, 201.0, lock_held=False).state == NEVER
    running = Heartbeat(1, "1.0", 100.0, 200.0, None)
    assert judge(running, 201.0, lock_held=True).state == RUNNING


def test_attempt_history_and_verified_rows_are_no_failures(harness: Harness) -> None:
    """Every attempt's outcome is kept for ``canner show``; a delivery that ends verified has no
    last_error, and the failures list holds only objects whose latest attempt failed."""
    [oid, other] = harness.accept(2)
    harness.tick()
    harness.sink.fail(oid, "503 SlowDown")
    harness.sink.fail(other, "403 Forbidden", operator=True)
    harness.clock.advance(61)
    harness.tick()
    harness.sink.succeed(oid)
    harness.tick()  # verification: "not listed yet" is noted on the row
    assert harness.row(oid).last_error == "not listed yet"
    harness.sink.checks[oid] = RemoteCheck(True)
    harness.clock.advance(300)
    harness.tick()
    row = harness.row(oid)
    assert row.verified_at is not None and row.last_error is None and row.needs_operator == 0
    history = harness.index.run(sql.attempt_history, oid).result
    assert [(a["attempt"], a["outcome"], a["error"]) for a in history] == [
        (1, "failed", "503 SlowDown"),
        (2, "delivered", None),
    ]
    assert history[0]["ended_at"] >= history[0]["started_at"]
    summary = inventory.read_index(harness.index.path, inventory.summarize_index, 0.0)
    assert [r.object_id for r in summary.recent_failures] == [other]
    assert [r.object_id for r in summary.recent_deliveries] == [oid]
    shown = inventory.lookup_object(harness.index.path.parent, oid)
    assert [a["outcome"] for a in shown["attempts"]] == ["failed", "delivered"]


def test_trend_samples_are_bounded_to_a_day_and_give_rates(tmp_path: Path) -> None:
    """A sample per minute per project and for all; samples past 24 h are deleted; rates per
    minute are differences of the cumulative columns."""
    index = SyncIndex(tmp_path / "delivery.sqlite")
    now = 1_784_764_800.0
    objects = [
        sql.AcceptedObject(f"{n:032x}", "example" if n % 2 else "other", None, 100, "c", 1)
        for n in range(4)
    ]
    index.run(sample_trends, 5000, now - WINDOW - 120)
    index.run(sql.insert_objects, objects[:2], now)
    index.run(sample_trends, 4000, now - 60)
    index.run(sql.insert_objects, objects[2:], now)
    assert index.run(sample_trends, 3000, now).result == 3
    trends = index.run(read_trends, now).result
    assert set(trends) == {ALL, "example", "other"}
    total = trends[ALL]
    assert [p.accepted_bytes for p in total] == [200, 400]
    assert [p.free_bytes for p in total] == [4000, 3000]
    assert per_minute(total, "accepted_bytes") == [(now // 60 * 60, 200.0)]
    assert index.query("SELECT count(*) FROM trends WHERE minute < ?", (now - WINDOW) // 60) == [
        (0,)
    ]
    index.close()


def test_trend_chart_draws_points_and_says_when_empty() -> None:
    """Each chart is inline SVG that says how many points it drew."""
    now = 1_784_764_800.0
    drawn = trend_chart(
        "c", "t", [Line("a", "#000", ((now - 120, 1.0), (now - 60, 2.0), (now, 3.0)))], now
    )
    empty = trend_chart("e", "t", [Line("a", "#000", ())], now)
    assert drawn.children[0].attributes["data-points"] == "3"
    assert empty.children[0].attributes["data-points"] == "0"


def test_status_page_says_when_deliver_is_not_running(tmp_path: Path) -> None:
    """Without a fresh heartbeat the page carries a banner; with one it shows the attempts in
    flight and the trend charts have points."""
    index = SyncIndex(tmp_path / "delivery.sqlite")
    now = 1_784_764_800.0
    index.run(sample_trends, 10**9, now - 60)
    index.run(sample_trends, 10**9, now)
    survey = take_survey(tmp_path, IDS, now, history=True)
    page = render_status(StatusView("i", survey, 1, ())).decode()
    assert 'id="deliver-banner"' in page and "never run" in page
    assert re.search(r'id="trend-free".*?data-points="[1-9]', page)
    from canner.delivery.liveness import AttemptSnapshot, write_heartbeat

    moving = AttemptSnapshot(
        "7" * 32, "example", "a.warc", 1000, 1, UPLOADING, 400, now - 10, now - 8, 50.0, 12.0
    )
    index.run(write_heartbeat, Heartbeat(9, "1.2.3", now - 3600, now - 2, None, (moving,)))
    survey = take_survey(tmp_path, IDS, now, history=True)
    page = render_status(StatusView("i", survey, 1, ())).decode()
    assert 'id="deliver-banner"' not in page
    assert re.search(r'id="deliver-state" class="ok">running', page)
    assert 'id="in-flight"' in page and "77777777…" in page and "40%" in page
    index.run(write_heartbeat, Heartbeat(9, "1.2.3", now - 3600, now - 45, None, (moving,)))
    page = render_status(StatusView("i", take_survey(tmp_path, IDS, now), 1, ())).decode()
    assert 'id="deliver-banner"' in page and "heartbeat is 45s old" in page
    index.close()


def test_latest_deliveries_link_to_their_ia_items(harness: Harness) -> None:
    """A delivered object is listed with a link to its item on the project's IA site."""
    [oid] = harness.accept(1)
    harness.tick()
    harness.sink.succeed(oid)
    data_dir = harness.index.path.parent
    survey = take_survey(data_dir, IDS, harness.clock.seconds())
    view = StatusView(
        "i", survey, 1, (), targets={"example": DeliveryTarget(item_url="https://archive.example/")}
    )
    page = render_status(view).decode()
    link = f'<a href="https://archive.example/details/item-{oid}" class="ia-item">item-{oid}</a>'
    assert re.search(r'<table id="recent-deliveries">.*' + re.escape(link), page, re.S)
    assert 'id="no-failures"' in page
