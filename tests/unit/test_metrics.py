"""Metrics, the survey behind the gauges, the status page and the log observers that feed them."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

import blake3
import pytest
from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger, LogLevel, LogPublisher, globalLogPublisher
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest

from canner.accept.acceptance import Acceptance
from canner.blocking import run_inline
from canner.config import parse_config
from canner.daemon.services import LogObservers
from canner.daemon.site import MeteredSite, ReceiverRoutes
from canner.delivery import index as sql
from canner.delivery.index import AcceptedObject
from canner.ids import ObjectIds
from canner.observe import UNOBSERVED, Destination, Outbound, OutboundObserver, UploadObserver
from canner.ops import inventory
from canner.ops.humane import human_bytes, human_duration, shorten_ids
from canner.ops.inventory import Survey, take_survey
from canner.ops.metrics import (
    DELIVER,
    DICTIONARY_FAILURES,
    FAILURE_CLASSES,
    RECEIVER,
    Metrics,
    MetricsPage,
    SurveyCache,
    SurveyCollector,
    metrics_site,
    process_metrics,
)
from canner.ops.problems import RecentProblems
from canner.ops.readiness import FloorWatch, check_readiness
from canner.ops.status_page import StatusSource, StatusView, render_status
from canner.periodic import PeriodicService
from canner.store.receipts import Receipt, ReceiptStore
from canner.store.uploads import UploadInfo, UploadStore
from canner.web.routing import route
from tests.fakes import SyncIndex, succeeded

NOW = 1_784_764_800.0
IDS = ObjectIds()


def oid(n: int) -> str:
    return f"{n:032x}"


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# -- the receiver's facts ----------------------------------------------------------------------


def test_upload_facts_are_counted_by_project_and_reason() -> None:
    """Creations and accepted objects and bytes per configured project (anything else is ""),
    hash and acceptance time, checksum rejections, storage failures, sweeps, bytes stored."""
    m = Metrics(RECEIVER, ["example"])
    m.upload_created("example")
    m.upload_created("not configured")
    m.bytes_stored(100)
    m.bytes_stored(250)
    m.upload_accepted("example", 100, 0.25, 0.5)
    m.upload_accepted("example", 50, 0.5, 1.0)
    m.checksum_mismatch("example")
    m.acceptance_failed()
    m.stale_removed(3)
    assert sample(m, "canner_uploads_created_total", project="example") == 1
    assert sample(m, "canner_uploads_created_total", project="") == 1
    assert sample(m, "canner_received_bytes_total") == 350
    assert sample(m, "canner_uploads_accepted_total", project="example") == 2
    assert sample(m, "canner_accepted_bytes_total", project="example") == 150
    assert sample(m, "canner_hash_seconds_count") == 2
    assert sample(m, "canner_hash_seconds_sum") == 0.75
    assert sample(m, "canner_acceptance_seconds_sum") == 1.5
    assert sample(m, "canner_uploads_rejected_total", reason="checksum_mismatch") == 1
    assert sample(m, "canner_acceptance_failures_total") == 1
    assert sample(m, "canner_stale_uploads_removed_total") == 3


def test_rsync_adoption_facts_are_counted() -> None:
    """The waiting gauge follows the intake; adoptions count per configured project, and only
    those with a known arrival time go into the latency histogram."""
    m = Metrics(RECEIVER, ["example"])
    m.adoption_waiting(3)
    m.adopted("example", 0.2)
    m.adopted("elsewhere", None)
    m.adoption_waiting(1)
    assert sample(m, "canner_rsync_waiting_files") == 1
    assert sample(m, "canner_rsync_adopted_total", project="example") == 1
    assert sample(m, "canner_rsync_adopted_total", project="") == 1
    assert sample(m, "canner_rsync_adoption_seconds_count") == 1
    assert sample(m, "canner_rsync_adoption_seconds_sum") == 0.2


@pytest.mark.parametrize("kind", list(Outbound))
def test_outbound_facts_are_counted_the_same_for_every_kind(kind: Outbound) -> None:
    """Objects, package files and ledgers: attempts after the first are retries, failures are
    counted by reason class (an unknown class is "other"), bytes by destination, and
    deliveries, verifications, purges and re-deliveries, each under its own kind only."""
    m = Metrics(DELIVER, ["example"])
    project = "" if kind is Outbound.LEDGER else "example"
    m.attempt_started(kind, project, 1)
    m.delivery_failed(kind, project, "forbidden", True)
    m.delivery_failed(kind, project, "<made up>", False)
    m.attempt_started(kind, project, 2)
    m.bytes_sent(kind, Destination.IA, 1000)
    m.bytes_sent(kind, Destination.IA, 234)
    m.bytes_sent(kind, Destination.DIRECTORY, 99)
    m.delivered(kind, project)
    m.verified(kind)
    m.purged(kind)
    m.redelivered(kind, project)
    labels = {"project": project, "kind": kind.value}
    assert sample(m, "canner_delivery_attempts_total", **labels) == 2
    assert sample(m, "canner_delivery_retries_total", **labels) == 1
    assert sample(m, "canner_redeliveries_total", **labels) == 1
    assert sample(m, "canner_deliveries_completed_total", **labels) == 1
    failed = "canner_delivery_failures_total"
    assert sample(m, failed, **labels, needs_operator="true", reason="forbidden") == 1
    assert sample(m, failed, **labels, needs_operator="false", reason="other") == 1
    assert sample(m, "canner_ia_sent_bytes_total", kind=kind.value) == 1234
    assert sample(m, "canner_directory_copied_bytes_total", kind=kind.value) == 99
    assert sample(m, "canner_deliveries_verified_total", kind=kind.value) == 1
    assert sample(m, "canner_purged_total", kind=kind.value) == 1
    for other in set(Outbound) - {kind}:
        assert sample(m, "canner_deliveries_verified_total", kind=other.value) == 0


def test_every_kind_is_exported_from_the_start() -> None:
    """A fresh deliver process already shows a zero for each kind, so rate() and the
    dashboards see the first package or ledger attempt."""
    body = Metrics(DELIVER, ["example"]).render().decode()
    for kind, project in (("object", "example"), ("package", "example"), ("ledger", "")):
        line = f'canner_delivery_attempts_total{{kind="{kind}",project="{project}"}} 0.0'
        assert line in body
        assert f'canner_ia_sent_bytes_total{{kind="{kind}"}} 0.0' in body


def test_each_role_exports_only_its_own_families() -> None:
    """The receiver has no delivery counters and the deliver process no upload counters."""
    receiver = Metrics(RECEIVER, ["example"]).render().decode()
    deliver = Metrics(DELIVER, ["example"]).render().decode()
    assert "canner_uploads_accepted_total" in receiver
    assert "canner_delivery_attempts_total" not in receiver
    assert "canner_delivery_attempts_total" in deliver
    assert "canner_uploads_accepted_total" not in deliver


def test_the_metrics_implement_both_observers() -> None:
    """Metrics is what the domain's observer seams are typed against (a method renamed on
    either side fails here and in mypy)."""
    upload: UploadObserver = Metrics(RECEIVER, [])
    outbound: OutboundObserver = Metrics(DELIVER, [])
    for protocol, observer in ((UploadObserver, upload), (OutboundObserver, outbound)):
        for name, member in vars(protocol).items():
            if callable(member) and not name.startswith("_"):
                assert callable(getattr(observer, name)), name
                assert callable(getattr(UNOBSERVED, name)), name


def test_real_acceptance_feeds_the_metrics(tmp_path: Path) -> None:
    """Driving the real acceptance code updates the accepted, hash, timing and rejection series
    through its observer; only an acceptance that ends with a receipt is timed."""
    (tmp_path / "uploads").mkdir()
    (tmp_path / "receipts").mkdir()
    uploads, receipts = UploadStore(tmp_path / "uploads"), ReceiptStore(tmp_path / "receipts")
    clock = Clock()
    clock.advance(NOW)
    m = Metrics(RECEIVER, ["example"])
    acceptance = Acceptance(
        uploads=uploads,
        receipts=receipts,
        run=run_inline,
        hash=run_inline,
        clock=clock,
        issuer="https://canner.test",
        enqueue=lambda r, o: None,
        observer=m,
    )

    def complete(object_id: str, data: bytes, declared: bytes) -> Any:
        digest = blake3.blake3(declared).hexdigest()
        meta = {"project": "example", "checksum": f"blake3:{digest}"}
        info = UploadInfo(object_id, len(data), meta, 1)
        uploads.create(info)
        upload = uploads.open_locked(info)
        upload.write([data])
        return upload

    receipt = succeeded(acceptance.accept(complete(oid(1), b"hello", b"hello")))
    bad = acceptance.accept(complete(oid(2), b"hello", b"other"))
    bad.addErrback(lambda f: None)
    assert isinstance(receipt, Receipt)
    assert sample(m, "canner_uploads_accepted_total", project="example") == 1
    assert sample(m, "canner_accepted_bytes_total", project="example") == 5
    assert sample(m, "canner_hash_seconds_count") == 1
    assert sample(m, "canner_acceptance_seconds_count") == 1
    assert sample(m, "canner_uploads_rejected_total", reason="checksum_mismatch") == 1


# -- HTTP responses ----------------------------------------------------------------------------


def test_responses_count_methods_codes_and_refused_creations() -> None:
    """Every answer by method and code; a creation answered 4xx/5xx is a refusal by reason."""
    m = Metrics(RECEIVER, ["example"])
    m.observe_response("POST", True, 201)
    m.observe_response("POST", True, 400)
    m.observe_response("POST", True, 429)
    m.observe_response("POST", True, 418)
    m.observe_response("PATCH", False, 204)
    m.observe_response("PATCH", False, 204)
    m.observe_response("PATCH", False, 409)
    m.observe_response("BREW", False, 405)
    assert sample(m, "canner_uploads_rejected_total", reason="invalid_request") == 1
    assert sample(m, "canner_uploads_rejected_total", reason="insufficient_storage") == 1
    assert sample(m, "canner_uploads_rejected_total", reason="http_418") == 1
    assert sample(m, "canner_uploads_rejected_total", reason="unsupported_media_type") == 0
    assert sample(m, "canner_http_responses_total", method="PATCH", code="204") == 2
    assert sample(m, "canner_http_responses_total", method="other", code="405") == 1
    # Creations are the intake's fact, not a 201's.
    assert sample(m, "canner_uploads_created_total", project="example") == 0


def test_metered_site_reports_finished_requests() -> None:
    """The receiver's site hands each finished request, with its method and route as the
    ReceiverRequest set them, to metrics."""
    m = Metrics(RECEIVER, ["example"])
    site = MeteredSite(Resource(), object(), m)  # type: ignore[arg-type]
    request = DummyRequest([b"files"])
    request.method = b"POST"
    request.path = b"/files/"
    request.route = route(b"POST", request.path)  # type: ignore[attr-defined]
    request.code = 413  # a real Request's attribute (DummyRequest has responseCode)
    site.log(request)
    assert sample(m, "canner_http_responses_total", method="POST", code="413") == 1
    assert sample(m, "canner_uploads_rejected_total", reason="too_large") == 1


# -- the survey --------------------------------------------------------------------------------


def accepted(n: int, project: str = "example", size: int = 100, at: int = 1000) -> AcceptedObject:
    return AcceptedObject(oid(n), project, None, size, "blake3:" + "0" * 64, at)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    for sub in ("uploads", "receipts"):
        (tmp_path / sub).mkdir()
    return tmp_path


@pytest.fixture
def index(data_dir: Path) -> Any:
    idx = SyncIndex(data_dir / "delivery.sqlite")
    yield idx
    idx.close()


def populate(index: SyncIndex) -> None:
    """Six objects: 2 pending, 1 delivering, 2 in retry_wait (one stuck), 1 delivered."""
    objects = [
        accepted(1, size=10, at=500),
        accepted(2, size=20, at=900),
        accepted(3, size=30),
        accepted(4, size=40),
        accepted(5, project="other", size=50, at=400),
        accepted(6, size=60, at=100),
    ]
    succeeded(index.run(sql.insert_objects, objects, NOW - 100))
    index.query(
        "UPDATE outbound SET state = 'delivering' WHERE kind = 'object' AND ref = ?",
        oid(3),
    )
    index.query(
        "UPDATE outbound SET state = 'retry_wait', attempts = 2, last_error = 'boom'"
        " WHERE kind = 'object' AND ref = ?",
        oid(4),
    )
    index.query(
        "UPDATE outbound SET state = 'retry_wait', attempts = 9, last_error = '403',"
        " needs_operator = 1 WHERE kind = 'object' AND ref = ?",
        oid(5),
    )
    index.query(
        "UPDATE outbound SET state = 'delivered', delivered_at = ? WHERE kind = 'object'"
        " AND ref = ?",
        NOW - 50,
        oid(6),
    )
    index.query("UPDATE objects SET purge_after = ? WHERE object_id = ?", NOW - 30, oid(6))
    index.conn.commit()


def test_index_summary_counts_states_projects_and_lags(data_dir: Path, index: SyncIndex) -> None:
    """Counts and bytes by state and project, the oldest undelivered object, overdue purges."""
    populate(index)
    summary = inventory.read_index(data_dir / "delivery.sqlite", inventory.summarize_index, NOW)
    assert dict(summary.states) == {"pending": 2, "delivering": 1, "retry_wait": 2, "delivered": 1}
    assert summary.pending_objects == 5
    assert summary.pending_bytes == 10 + 20 + 30 + 40 + 50
    assert summary.delivered_bytes == 60
    assert summary.oldest_undelivered_at == 400.0
    assert summary.needs_operator == 1
    assert summary.purge_overdue == 1 and summary.oldest_purge_due == NOW - 30
    projects = {p.project: p for p in summary.projects}
    assert projects["example"].accepted_objects == 5
    assert projects["example"].pending_bytes == 100
    assert projects["example"].delivered_objects == 1
    assert projects["other"].pending_bytes == 50
    assert {r.object_id for r in summary.recent_failures} == {oid(4), oid(5)}


def test_stuck_rows_are_flagged_or_retried_too_often(data_dir: Path, index: SyncIndex) -> None:
    """Only retry_wait rows needing an operator or past the attempt threshold are stuck."""
    populate(index)
    path = data_dir / "delivery.sqlite"
    assert [r.object_id for r in inventory.read_index(path, inventory.stuck_rows)] == [oid(5)]
    found = inventory.read_index(path, inventory.stuck_rows, 1)
    assert {r.object_id for r in found} == {oid(4), oid(5)}


def test_flagged_unverified_deliveries_are_stuck(data_dir: Path, index: SyncIndex) -> None:
    """A delivered row flagged before verification (IA lost it, or serves other bytes) is
    stuck too; once verified it is not."""
    populate(index)
    path = data_dir / "delivery.sqlite"
    index.query("UPDATE outbound SET needs_operator = 1 WHERE kind = 'object' AND ref = ?", oid(6))
    index.conn.commit()
    found = inventory.read_index(path, inventory.stuck_rows)
    assert [r.object_id for r in found] == [oid(6), oid(5)]
    index.query(
        "UPDATE outbound SET verified_at = ? WHERE kind = 'object' AND ref = ?",
        NOW,
        oid(6),
    )
    index.conn.commit()
    assert [r.object_id for r in inventory.read_index(path, inventory.stuck_rows)] == [oid(5)]


def make_upload(uploads: UploadStore, n: int, size: int, stored: int, **extra: Any) -> None:
    info = UploadInfo(oid(n), size, {"project": "example", "checksum": "blake3:" + "0" * 64}, 1)
    uploads.create(info)
    upload = uploads.open_locked(info)
    upload.write([b"x" * stored])
    upload.close()
    if extra.get("rejected"):
        locked = uploads.open_locked(info)
        uploads.reject(locked, "mismatch")
        locked.close()


def test_survey_lists_uploads_without_receipts(data_dir: Path, index: SyncIndex) -> None:
    """Partial and complete-but-unaccepted uploads are active; accepted, rejected and unreadable
    ones are not (the last are counted)."""
    uploads, receipts = UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")
    make_upload(uploads, 1, 100, 40)
    make_upload(uploads, 2, 10, 10)
    make_upload(uploads, 3, 10, 10)
    receipts.receipt_path(oid(3)).write_text("{}")
    make_upload(uploads, 4, 10, 10, rejected=True)
    (data_dir / "uploads" / f"{oid(5)}.info").write_text("not json")
    survey = take_survey(data_dir, IDS, NOW)
    assert {u.upload_id: (u.offset, u.complete) for u in survey.active_uploads} == {
        oid(1): (40, False),
        oid(2): (10, True),
    }
    assert survey.active_upload_bytes == 50
    assert survey.unreadable_uploads == 1
    assert survey.free_bytes is not None and survey.free_bytes > 0
    assert survey.index is not None and survey.index_error is None


def test_the_uploads_in_flight_are_the_receivers_gauges_not_delivers(
    data_dir: Path, index: SyncIndex
) -> None:
    """The receiver's metrics count the uploads in flight; canner-deliver's survey does not list
    uploads/ or receipts/ (their names grow with every object held) and its metrics leave those
    gauges out, while the index's gauges are the same in both."""
    populate(index)
    make_upload(UploadStore(data_dir / "uploads"), 1, 100, 40)
    config = parse_config(
        {
            "issuer": "https://canner.test",
            "data_dir": str(data_dir),
            "min_free_bytes": 1,
            "max_upload_bytes": 1 << 20,
            "partial_upload_retention": "30m",
            "projects": {"example": {}},
        },
        data_dir,
    )
    clock = Clock()
    clock.advance(NOW)
    scraped = {}
    for role in (RECEIVER, DELIVER):
        metrics, cache = process_metrics(config, role, run_inline, clock)
        succeeded(cache.refresh())
        scraped[role] = metrics
    assert sample(scraped[RECEIVER], "canner_active_uploads") == 1
    assert sample(scraped[RECEIVER], "canner_active_upload_bytes") == 40
    for name in ("canner_active_uploads", "canner_active_upload_bytes", "canner_promised_bytes"):
        assert scraped[DELIVER].registry.get_sample_value(name) is None, name
    pending = {"state": "pending"}
    assert sample(scraped[DELIVER], "canner_deliveries", **pending) == sample(
        scraped[RECEIVER], "canner_deliveries", **pending
    )


def test_survey_without_an_index_reports_the_error(tmp_path: Path) -> None:
    """A data directory without delivery.sqlite still gives free space, and says why no counts."""
    survey = take_survey(tmp_path, IDS, NOW)
    assert survey.index is None and "does not exist" in (survey.index_error or "")
    assert survey.free_bytes is not None
    doc = inventory.survey_json(survey)
    assert doc["states"] is None and doc["index_error"]


# -- gauges ------------------------------------------------------------------------------------


def test_gauges_read_the_cached_survey_refreshed_periodically(
    data_dir: Path, index: SyncIndex
) -> None:
    """The periodic job refreshes the cache through the blocking runner; scrapes only read it."""
    populate(index)
    clock = Clock()
    clock.advance(NOW)
    taken: list[float] = []

    def take(now: float) -> Survey:
        taken.append(now)
        return take_survey(data_dir, IDS, now)

    cache = SurveyCache(run_inline, take, clock)
    m = Metrics(DELIVER, ["example", "other"])
    m.register(SurveyCollector(cache, 1234))
    assert sample(m, "canner_min_free_bytes") == 1234
    assert m.registry.get_sample_value("canner_deliveries", {"state": "pending"}) is None
    job = PeriodicService(clock=clock, interval=15.0, job=cache.refresh, label="metrics survey")
    job.startService()
    assert taken == [NOW]
    m.render()
    m.render()
    assert taken == [NOW], "a scrape never surveys"
    assert sample(m, "canner_deliveries", state="retry_wait") == 2
    assert sample(m, "canner_deliveries_bytes", state="pending") == 30
    assert sample(m, "canner_pending_bytes", project="other") == 50
    assert sample(m, "canner_delivered_bytes") == 60
    assert sample(m, "canner_oldest_undelivered_age_seconds") == NOW - 400
    assert sample(m, "canner_purge_lag_seconds") == 30
    assert sample(m, "canner_deliveries_needing_operator") == 1
    assert sample(m, "canner_index_readable") == 1
    assert sample(m, "canner_data_free_bytes") > 0
    clock.advance(15)
    assert taken == [NOW, NOW + 15]
    succeeded(job.stopService())
    assert clock.getDelayedCalls() == []


def test_a_failing_refresh_is_logged_and_keeps_the_last_survey(data_dir: Path) -> None:
    """A survey that raises leaves the previous values and the loop alive."""
    clock = Clock()
    calls: list[float] = []

    def take(now: float) -> Survey:
        calls.append(now)
        if len(calls) > 1:
            raise OSError("disk gone")
        return take_survey(data_dir, IDS, now)

    cache = SurveyCache(run_inline, take, clock)
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    job = PeriodicService(clock=clock, interval=1.0, job=cache.refresh, label="metrics survey")
    try:
        job.startService()
        first = cache.latest
        clock.advance(1)
        clock.advance(1)
    finally:
        globalLogPublisher.removeObserver(events.append)
        job.stopService()
    assert cache.latest is first and len(calls) == 3
    assert any(e.get("label") == "metrics survey" and "log_failure" in e for e in events)


def test_failure_counters_exist_at_zero_for_every_known_reason() -> None:
    """Before anything fails, every failure series is there at 0 (so ``increase() > 0`` fires
    on the first failure): each reason, operator flag and kind, and each dictionary reason."""
    m = Metrics(DELIVER, ["example"])
    for reason in FAILURE_CLASSES:
        for flag in ("true", "false"):
            for kind, project in (("object", "example"), ("package", "example"), ("ledger", "")):
                labels = {"project": project, "needs_operator": flag, "reason": reason}
                value = m.registry.get_sample_value(
                    "canner_delivery_failures_total", {**labels, "kind": kind}
                )
                assert value == 0.0, (reason, flag, kind)
    for reason in (*DICTIONARY_FAILURES, "other"):
        labels = {"project": "example", "reason": reason}
        assert m.registry.get_sample_value("canner_zstd_dictionary_failures_total", labels) == 0
    m.delivery_failed(Outbound.OBJECT, "example", "forbidden", True)
    labels = {"project": "example", "needs_operator": "true", "reason": "forbidden"}
    assert sample(m, "canner_delivery_failures_total", **labels, kind="object") == 1


def test_deliver_metrics_page_serves_the_exposition_format() -> None:
    """GET /metrics on the deliver listener answers in Prometheus text format."""
    m = Metrics(DELIVER, ["example"])
    treq = StubTreq(MetricsPage(m).app.resource())
    response = succeeded(treq.get("http://localhost/metrics"))
    assert response.code == 200
    assert response.headers.getRawHeaders("content-type")[0].startswith("text/plain")
    body = succeeded(response.text())
    assert 'canner_delivery_attempts_total{kind="object",project="example"} 0.0' in body


def _get_metrics(site: Any, host: bytes) -> bytes:
    """What ``site`` writes back for ``GET /metrics`` with ``Host: host``, over an in-memory
    connection."""
    peer = IPv4Address("TCP", "127.0.0.1", 40001)
    channel = site.buildProtocol(peer)
    transport = StringTransport(peerAddress=peer)
    channel.makeConnection(transport)
    channel.dataReceived(b"GET /metrics HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
    data: bytes = transport.value()
    channel.connectionLost(Failure(ConnectionDone()))
    return data


@pytest.mark.parametrize("host", [b"a" * 64 + b".example", b"a..b", b"\xff.example"])
def test_deliver_metrics_page_answers_a_host_that_cannot_be_bound_with_400(host: bytes) -> None:
    """canner-deliver's metrics listener answers a Host werkzeug cannot bind with 400 and a
    short reason, without logging a traceback; an ordinary Host (with a port, an IPv6 literal)
    is served."""
    site = metrics_site(Metrics(DELIVER, ["example"]))
    failures: list[Any] = []

    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event or event.get("log_level", LogLevel.info) >= LogLevel.warn:
            failures.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        answer = _get_metrics(site, host)
    finally:
        globalLogPublisher.removeObserver(observe)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert answer.endswith(b"\r\n\r\nbad Host header: not a host name\n"), answer[-300:]
    assert failures == []
    for good in (b"127.0.0.1:9464", b"[::1]:9464", b"metrics.example"):
        answer = _get_metrics(site, good)
        assert answer.startswith(b"HTTP/1.1 200 "), (good, answer[:300])
        assert b"canner_delivery_attempts_total" in answer


def test_metrics_use_a_private_registry() -> None:
    """Two Metrics objects never share series (nor touch prometheus_client's global registry)."""
    a, b = Metrics(RECEIVER, ["example"]), Metrics(RECEIVER, ["example"])
    a.upload_accepted("example", 1, 0.0, 0.0)
    assert sample(a, "canner_uploads_accepted_total", project="example") == 1
    assert sample(b, "canner_uploads_accepted_total", project="example") == 0
    assert isinstance(a.registry, CollectorRegistry)


# -- log observers -----------------------------------------------------------------------------


def test_log_observers_are_attached_only_while_running() -> None:
    """The service adds its observers on start and removes them on stop."""
    publisher = LogPublisher()
    seen: list[Any] = []
    service = LogObservers(publisher, [seen.append])
    logger = Logger(namespace="canner.test", observer=publisher)
    logger.info("before")
    service.startService()
    logger.info("during")
    service.stopService()
    logger.info("after")
    assert [e["log_format"] for e in seen] == ["during"]


def test_recent_problems_keep_the_latest_warnings_and_errors() -> None:
    """Info is ignored; warnings, errors and failures are kept newest first, bounded."""
    publisher = LogPublisher()
    problems = RecentProblems(size=3)
    publisher.addObserver(problems.observe)
    logger = Logger(namespace="canner.test", observer=publisher)
    logger.info("fine {n}", n=0)
    for n in range(1, 5):
        logger.warn("careful {n}", n=n)
    try:
        raise ValueError("bad value")
    except ValueError:
        logger.failure("crashed {what}", what="tick")
    latest = problems.latest()
    assert [p.text for p in latest[1:]] == ["careful 4", "careful 3"]
    assert latest[0].level == "critical"
    assert latest[0].text == "crashed tick: ValueError: bad value"
    assert latest[0].namespace == "canner.test"


# -- the status page ---------------------------------------------------------------------------


def test_status_page_shows_the_survey_numbers(data_dir: Path, index: SyncIndex) -> None:
    """The page carries the survey's numbers in labelled cells, refreshes itself and loads
    nothing from elsewhere."""
    populate(index)
    make_upload(UploadStore(data_dir / "uploads"), 7, 1000, 400)
    survey = take_survey(data_dir, IDS, NOW)
    page = render_status(StatusView("https://canner.test", survey, 1, ())).decode()

    def cell(name: str, within: str = page) -> int:
        match = re.search(rf'data-field="{name}"><b>([0-9,]+)</b>', within)
        assert match, f"no cell {name}"
        return int(match.group(1).replace(",", ""))

    assert '<meta http-equiv="refresh" content="10" />' in page
    assert cell("free_bytes") == survey.free_bytes
    assert cell("active_uploads") == 1 and cell("active_upload_bytes") == 400
    summary = re.search(r'<table id="delivery-summary">.*?</table>', page)
    assert summary and cell("pending_bytes", summary.group(0)) == 150
    assert cell("state_retry_wait") == 2
    row = re.search(r'<tr data-project="other">.*?</tr>', page)
    assert row and cell("pending_bytes", row.group(0)) == 50
    assert oid(7) not in page and oid(7)[:8] + "…" in page
    assert not re.search(r"<script|<link|<img|src=|@import|url\(", page)


def test_status_page_escapes_log_text_and_shortens_ids(data_dir: Path) -> None:
    """Log messages are HTML-escaped and upload ids in them cut to 8 characters."""
    survey = take_survey(data_dir, IDS, NOW)
    problems = RecentProblems()
    problems.observe(
        {
            "log_level": LogLevel.error,
            "log_format": "writing {object_id} failed: {error}",
            "object_id": oid(9),
            "error": "<script>alert(1)</script>",
            "log_time": NOW,
            "log_namespace": "canner.web.stream",
        }
    )
    page = render_status(StatusView("i", survey, 1, problems.latest())).decode()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert oid(9) not in page and oid(9)[:8] in page
    assert "delivery index is unreadable" in page


def test_receiver_serves_status_page_and_metrics(data_dir: Path, index: SyncIndex) -> None:
    """GET / renders a fresh survey (taken through the runner); GET /metrics the registry."""
    populate(index)
    clock = Clock()
    clock.advance(NOW)
    m = Metrics(RECEIVER, ["example"])
    status = StatusSource(
        run=run_inline,
        take=lambda now: take_survey(data_dir, IDS, now),
        clock=clock,
        problems=RecentProblems(),
        issuer="https://canner.test",
        min_free_bytes=10,
    )
    routes = ReceiverRoutes(
        ReceiptStore(data_dir / "receipts"),
        IDS,
        data_dir,
        run_inline,
        m,
        status,
        partial(check_readiness, data_dir, 10, FloorWatch(10)),
    )
    treq = StubTreq(routes.app.resource())
    page = succeeded(treq.get("http://localhost/"))
    assert page.code == 200
    assert page.headers.getRawHeaders("content-type") == ["text/html; charset=utf-8"]
    assert "default-src 'none'" in page.headers.getRawHeaders("content-security-policy")[0]
    body = succeeded(page.text())
    assert 'data-field="state_pending"><b>2</b>' in body
    metrics = succeeded(treq.get("http://localhost/metrics"))
    assert "canner_uploads_accepted_total" in succeeded(metrics.text())


def test_human_units() -> None:
    """Byte counts and durations read naturally."""
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 * 1024**4) == "5.0 TiB"
    assert human_duration(None) == "-"
    assert human_duration(59) == "59s"
    assert human_duration(3 * 3600 + 120) == "3h 2m"
    assert human_duration(3 * 86400) == "3d 0h"
    assert shorten_ids(f"x {oid(1)} y") == "x 00000000… y"
    assert shorten_ids("a" * 40) == "a" * 40


def test_take_survey_records_unreadable_free_space(tmp_path: Path) -> None:
    """A data directory that vanished gives errors, not exceptions."""
    survey = take_survey(tmp_path / "missing", IDS, NOW)
    assert survey.free_bytes is None and survey.free_error
    assert survey.active_uploads == ()


def test_status_requests_share_surveys(data_dir: Path) -> None:
    """Concurrent requests wait for one survey; a survey younger than 2 s is reused; one
    younger than a minute answers at once while a new one is taken (one at a time, a failed one
    tried again by the next request); past a minute requests wait for the new one, and a failed
    survey fails every waiting request and the next request tries again.

    (Issue 37 changed this: a request past 2 s used to wait for the new survey, so a slow one
    held the page.)"""
    clock = Clock()
    clock.advance(NOW)
    runs: list[Deferred[Any]] = []

    def run_later(f: Any, *args: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        runs.append(d)
        d.addCallback(lambda _: f(*args))
        return d

    source = StatusSource(
        run=run_later,
        take=lambda now: take_survey(data_dir, IDS, now),
        clock=clock,
        problems=RecentProblems(),
        issuer="https://canner.test",
        min_free_bytes=1,
    )
    first, second = source.view(), source.view()
    assert len(runs) == 1 and not first.called
    runs[0].callback(None)
    survey = succeeded(first).survey
    assert succeeded(second).survey is survey
    clock.advance(1.5)
    assert succeeded(source.view()).survey is survey and len(runs) == 1
    clock.advance(1.0)
    assert succeeded(source.view()).survey is survey and len(runs) == 2
    assert succeeded(source.view()).survey is survey and len(runs) == 2
    runs[1].callback(None)
    newer = succeeded(source.view()).survey
    assert newer is not survey and newer.taken_at == NOW + 2.5 and len(runs) == 2
    clock.advance(3.0)
    assert succeeded(source.view()).survey is newer and len(runs) == 3
    runs[2].errback(OSError("disk gone"))
    assert succeeded(source.view()).survey is newer and len(runs) == 4
    runs[3].errback(OSError("disk gone"))
    clock.advance(60.0)
    failing, waiting = source.view(), source.view()
    assert len(runs) == 5 and not failing.called
    runs[4].errback(OSError("disk gone"))
    for d in (failing, waiting):
        with pytest.raises(OSError):
            succeeded(d)
    source.view()
    assert len(runs) == 6
