"""Prometheus metrics of one canner process, in a private registry.

Two sources feed them, and neither does I/O when Prometheus scrapes:

* **The domain's observers.**  :class:`Metrics` implements :class:`~canner.observe.UploadObserver`
  and :class:`~canner.observe.OutboundObserver`: the upload intake, acceptance, the sweep and
  the three outbound pipelines (objects, megawarc packages, ledgers) call it as facts happen.
  The receiver also reports each answered HTTP request (:meth:`Metrics.observe_response`),
  which gives responses by method and code and refused creations by reason.  No metric is
  derived from log wording or from re-parsed headers.
* **The survey.**  Gauges that need the disk or the index (free bytes, deliveries by state,
  oldest undelivered object, purge lag, ...) are read from the latest :class:`SurveyCache` value,
  which a periodic job recomputes in a thread.

Outbound counters carry a ``kind`` label (``object``, ``package``, ``ledger``): one set of
series for everything that leaves the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import ClassVar

from attrs import define, field
from klein import Klein
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.server import Request, Site

from canner.blocking import BlockingRunner
from canner.config import Config
from canner.delivery.liveness import RUNNING, InFlight, judge
from canner.delivery.queue import State
from canner.observe import Destination, Outbound
from canner.ops.inventory import InFlightScan, Survey, UploadsInFlight, take_survey
from canner.version import version
from canner.web.routing import BAD_HOST_MESSAGE, bindable_host

log = Logger()

# No "<counter>_created" series: they double every family and no dashboard or alert reads them.
disable_created_metrics()

RECEIVER = "receiver"
DELIVER = "deliver"

SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# HTTP answers to an upload creation (POST /files/) that refuse it, by reason.
CREATION_REFUSALS = {
    400: "invalid_request",
    412: "unsupported_tus_version",
    413: "too_large",
    415: "unsupported_media_type",
    429: "insufficient_storage",
    503: "storage_unavailable",
}
CHECKSUM_MISMATCH = "checksum_mismatch"
# DictionaryUnavailable.reason values (anything else is counted as "other").
DICTIONARY_FAILURES = frozenset({"unconfigured", "api", "download", "mismatch", "invalid"})
# DeliveryFailed.kind values (anything else is counted as "other").
FAILURE_CLASSES = frozenset(
    {
        "forbidden",
        "rate_limited",
        "server_error",
        "client_error",
        "network",
        "local_payload",
        "timeout",
        "internal",
        "other",
    }
)
# Label values come from clients: anything else is counted as "other", bounding the series.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PATCH", "OPTIONS", "DELETE", "PUT"})


@define(eq=False, slots=False)
class Metrics:
    """The metrics of one process (``role`` is ``"receiver"`` or ``"deliver"``).

    Both roles count every event they see; only their own families are registered, so each
    process exports what it can know.
    """

    role: str
    projects: Iterable[str] = ()
    registry: CollectorRegistry = field(factory=CollectorRegistry)
    _known_projects: frozenset[str] = field(init=False)

    def __attrs_post_init__(self) -> None:
        self.projects = tuple(self.projects)
        self._known_projects = frozenset(self.projects)
        rcv = self.registry if self.role == RECEIVER else None
        dlv = self.registry if self.role == DELIVER else None
        self.uploads_created = Counter(
            "canner_uploads_created", "Uploads created (tus POST)", ["project"], registry=rcv
        )
        self.uploads_accepted = Counter(
            "canner_uploads_accepted",
            "Uploads accepted (receipt committed)",
            ["project"],
            registry=rcv,
        )
        self.accepted_bytes = Counter(
            "canner_accepted_bytes", "Bytes of accepted uploads", ["project"], registry=rcv
        )
        self.uploads_rejected = Counter(
            "canner_uploads_rejected",
            "Uploads refused at creation (by HTTP meaning) or rejected for their checksum",
            ["reason"],
            registry=rcv,
        )
        self.received_bytes = Counter(
            "canner_received_bytes",
            "Bytes of upload bodies written to the store (a dropped PATCH counts what it wrote)",
            registry=rcv,
        )
        self.http_responses = Counter(
            "canner_http_responses",
            "HTTP responses of the receiver",
            ["method", "code"],
            registry=rcv,
        )
        self.acceptance_seconds = Histogram(
            "canner_acceptance_seconds",
            "Seconds from an upload's last byte to its durable receipt",
            buckets=SECONDS_BUCKETS,
            registry=rcv,
        )
        self.hash_seconds = Histogram(
            "canner_hash_seconds",
            "Seconds spent hashing an upload (BLAKE3)",
            buckets=SECONDS_BUCKETS,
            registry=rcv,
        )
        self.acceptance_failures = Counter(
            "canner_acceptance_failures",
            "Acceptances that failed on storage and will be retried",
            registry=rcv,
        )
        self.stale_uploads_removed = Counter(
            "canner_stale_uploads_removed", "Abandoned partial uploads removed", registry=rcv
        )
        self.rsync_waiting = Gauge(
            "canner_rsync_waiting_files",
            "Files rsync has finished that wait for adoption (none accepted yet)",
            registry=rcv,
        )
        self.rsync_adopted = Counter(
            "canner_rsync_adopted",
            "rsync files adopted (receipt committed)",
            ["project"],
            registry=rcv,
        )
        self.rsync_adoption_seconds = Histogram(
            "canner_rsync_adoption_seconds",
            "Seconds from rsync's rename of a file into place to its durable receipt",
            buckets=SECONDS_BUCKETS,
            registry=rcv,
        )
        kind = ["kind"]
        self.delivery_attempts = Counter(
            "canner_delivery_attempts",
            "Outbound attempts started (objects, package files, ledgers)",
            ["project", *kind],
            registry=dlv,
        )
        self.delivery_retries = Counter(
            "canner_delivery_retries",
            "Outbound attempts after the first for the same file",
            ["project", *kind],
            registry=dlv,
        )
        self.delivery_failures = Counter(
            "canner_delivery_failures",
            "Failed outbound attempts, by reason class (forbidden, rate_limited, network, ...)",
            ["project", "needs_operator", "reason", *kind],
            registry=dlv,
        )
        self.deliveries_completed = Counter(
            "canner_deliveries_completed",
            "Files delivered (objects, package files, ledgers)",
            ["project", *kind],
            registry=dlv,
        )
        self.ia_sent_bytes = Counter(
            "canner_ia_sent_bytes",
            "Payload bytes sent to the Internet Archive (counted while a PUT streams)",
            kind,
            registry=dlv,
        )
        self.ia_parts = Counter(
            "canner_ia_parts",
            "Parts of multipart uploads the Internet Archive acknowledged",
            kind,
            registry=dlv,
        )
        self.copied_bytes = Counter(
            "canner_directory_copied_bytes",
            "Payload bytes copied by directory sinks (counted while a copy runs)",
            kind,
            registry=dlv,
        )
        self.verified_files = Counter(
            "canner_deliveries_verified",
            "Deliveries verified at their destination",
            kind,
            registry=dlv,
        )
        self.purged_files = Counter(
            "canner_purged",
            "Local copies purged after verified delivery",
            kind,
            registry=dlv,
        )
        self.redeliveries = Counter(
            "canner_redeliveries",
            "Delivered files sent to be delivered again: still unlisted after verify_timeout",
            ["project", *kind],
            registry=dlv,
        )
        self.dictionaries_fetched = Counter(
            "canner_zstd_dictionaries_fetched",
            "zstd dictionaries fetched from a project's dictionary API and kept",
            ["project"],
            registry=dlv,
        )
        self.dictionary_failures = Counter(
            "canner_zstd_dictionary_failures",
            "Attempts to get a zstd dictionary that members name which failed: they wait",
            ["project", "reason"],
            registry=dlv,
        )
        for project in self.projects:
            for family in (self.uploads_created, self.uploads_accepted, self.accepted_bytes):
                family.labels(project)
            self.dictionaries_fetched.labels(project)
        # Every kind's series exist from the start, so rate() sees the first event.
        for outbound in Outbound:
            projects = ("",) if outbound is Outbound.LEDGER else self.projects
            for project in projects:
                for family in (
                    self.delivery_attempts,
                    self.delivery_retries,
                    self.redeliveries,
                    self.deliveries_completed,
                ):
                    family.labels(project, outbound.value)
            for family in (
                self.ia_sent_bytes,
                self.ia_parts,
                self.copied_bytes,
                self.verified_files,
                self.purged_files,
            ):
                family.labels(outbound.value)
        for reason in (*CREATION_REFUSALS.values(), CHECKSUM_MISMATCH):
            self.uploads_rejected.labels(reason)
        # Failure counters too, at 0 for every known reason: increase(...[15m]) > 0 then fires
        # on the first failure, where a series born at 1 has no earlier sample to rise from.
        for outbound in Outbound:
            projects = ("",) if outbound is Outbound.LEDGER else self.projects
            for project in projects:
                for needs_operator in ("true", "false"):
                    for reason in sorted(FAILURE_CLASSES):
                        self.delivery_failures.labels(
                            project, needs_operator, reason, outbound.value
                        )
        for project in self.projects:
            for reason in (*sorted(DICTIONARY_FAILURES), "other"):
                self.dictionary_failures.labels(project, reason)
        build = Gauge(
            "canner_build_info",
            "Always 1; the labels say which canner this process runs",
            ["version", "role"],
            registry=self.registry,
        )
        build.labels(version(), self.role).set(1)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def register(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        """The text exposition format of every registered metric."""
        return _generate_latest(self.registry)

    # -- the receiver's facts (UploadObserver) ------------------------------------------------

    def upload_created(self, project: str) -> None:
        self.uploads_created.labels(self._project(project)).inc()

    def bytes_stored(self, count: int) -> None:
        self.received_bytes.inc(count)

    def upload_accepted(self, project: str, size: int, hash_seconds: float, seconds: float) -> None:
        project = self._project(project)
        self.uploads_accepted.labels(project).inc()
        self.accepted_bytes.labels(project).inc(size)
        self.hash_seconds.observe(hash_seconds)
        self.acceptance_seconds.observe(seconds)

    def checksum_mismatch(self, project: str) -> None:
        self.uploads_rejected.labels(CHECKSUM_MISMATCH).inc()

    def acceptance_failed(self) -> None:
        self.acceptance_failures.inc()

    def stale_removed(self, count: int) -> None:
        self.stale_uploads_removed.inc(count)

    def adoption_waiting(self, count: int) -> None:
        self.rsync_waiting.set(count)

    def adopted(self, project: str, seconds: float | None) -> None:
        self.rsync_adopted.labels(self._project(project)).inc()
        if seconds is not None:
            self.rsync_adoption_seconds.observe(seconds)

    def observe_response(self, method: str, creation: bool, code: int) -> None:
        """Count one answered receiver request (``method`` after tus's method override;
        ``creation`` when its route was a creation)."""
        label = method if method in HTTP_METHODS else "other"
        self.http_responses.labels(label, str(code) if 100 <= code <= 599 else "other").inc()
        if creation and code >= 400:
            self.uploads_rejected.labels(CREATION_REFUSALS.get(code, f"http_{code}")).inc()

    def _project(self, project: str) -> str:
        # Label values stay bounded: only configured projects (the intake admits no other).
        return project if project in self._known_projects else ""

    # -- every transfer that leaves the node (OutboundObserver) ---------------------------------

    def attempt_started(self, kind: Outbound, project: str, attempt: int) -> None:
        project = self._project(project)
        self.delivery_attempts.labels(project, kind.value).inc()
        if attempt > 1:
            self.delivery_retries.labels(project, kind.value).inc()

    def bytes_sent(self, kind: Outbound, destination: Destination, count: int) -> None:
        family = self.ia_sent_bytes if destination is Destination.IA else self.copied_bytes
        family.labels(kind.value).inc(count)

    def part_sent(self, kind: Outbound) -> None:
        self.ia_parts.labels(kind.value).inc()

    def delivered(self, kind: Outbound, project: str) -> None:
        self.deliveries_completed.labels(self._project(project), kind.value).inc()

    def delivery_failed(
        self, kind: Outbound, project: str, reason: str, needs_operator: bool
    ) -> None:
        self.delivery_failures.labels(
            self._project(project),
            "true" if needs_operator else "false",
            reason if reason in FAILURE_CLASSES else "other",
            kind.value,
        ).inc()

    def verified(self, kind: Outbound) -> None:
        self.verified_files.labels(kind.value).inc()

    def purged(self, kind: Outbound) -> None:
        self.purged_files.labels(kind.value).inc()

    def redelivered(self, kind: Outbound, project: str) -> None:
        self.redeliveries.labels(self._project(project), kind.value).inc()

    # -- zstd dictionaries (DictionaryObserver) -------------------------------------------------

    def dictionary_fetched(self, project: str) -> None:
        self.dictionaries_fetched.labels(self._project(project)).inc()

    def dictionary_unavailable(self, project: str, reason: str) -> None:
        reason = reason if reason in DICTIONARY_FAILURES else "other"
        self.dictionary_failures.labels(self._project(project), reason).inc()


# -- the survey gauges ----------------------------------------------------------------------


@define(eq=False)
class SurveyCache:
    """The latest :class:`~canner.ops.inventory.Survey`, recomputed in a thread by
    :meth:`refresh`."""

    _run: BlockingRunner
    _take: Callable[..., Survey]
    _clock: IReactorTime
    latest: Survey | None = None
    # The receiver's uploads in flight (its promises): surveys look only at those.
    in_flight: UploadsInFlight | InFlightScan | None = None

    def refresh(self) -> Deferred[None]:
        """Take a new survey off the reactor thread and keep it (a periodic job's body)."""

        def keep(survey: Survey) -> None:
            self.latest = survey

        now = self._clock.seconds()
        if self.in_flight is None:
            return self._run(self._take, now).addCallback(keep)
        return self._run(self._take, now, in_flight=self.in_flight).addCallback(keep)

    def refresh_and_tell(self, free_space_seen: Callable[[int | None], None]) -> Deferred[None]:
        """:meth:`refresh`, then tell ``free_space_seen`` the free bytes the survey found (the
        receiver's floor watch, so crossing the floor is logged even while no upload arrives)."""

        def observe(_: object) -> None:
            if self.latest is not None:
                free_space_seen(self.latest.free_bytes)

        return self.refresh().addCallback(observe)


def _gauge(name: str, doc: str, value: float | None) -> Iterable[Metric]:
    if value is None:
        return []
    return [GaugeMetricFamily(name, doc, value=value)]


@define(eq=False)
class SurveyCollector(Collector):
    """Gauges from the cached survey; a scrape reads memory only."""

    _cache: SurveyCache
    _min_free_bytes: int
    # canner-deliver's own attempts; elsewhere the attempts in flight come from its heartbeat.
    _in_flight: InFlight | None = None
    # The gauges of the uploads in flight: the receiver's, which knows them (canner-deliver
    # would list every name in uploads/ and receipts/ per survey to count them).
    _uploads: bool = True

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "canner_min_free_bytes", "Configured free-space floor", value=self._min_free_bytes
        )
        survey = self._cache.latest
        if self._in_flight is not None:
            yield from _in_flight_gauges(
                len(self._in_flight.snapshot()), self._in_flight.bytes_in_flight
            )
        elif survey is not None and survey.index is not None:
            beat = survey.index.heartbeat
            alive = beat is not None and judge(beat, survey.taken_at).state == RUNNING
            attempts = beat.in_flight if beat is not None and alive else ()
            yield from _in_flight_gauges(len(attempts), sum(p.sent for p in attempts))
        if survey is None:
            return
        yield GaugeMetricFamily(
            "canner_survey_timestamp_seconds",
            "When the gauges below were computed",
            value=survey.taken_at,
        )
        yield from _gauge(
            "canner_data_free_bytes", "Bytes available on the data filesystem", survey.free_bytes
        )
        yield GaugeMetricFamily(
            "canner_draining",
            "1 while the node is drained (canner drain): it takes no new uploads",
            value=1 if survey.draining is not None else 0,
        )
        yield GaugeMetricFamily(
            "canner_retirable",
            "1 while the node is drained and holds nothing undelivered",
            value=1 if survey.retirement is not None and survey.retirement.retirable else 0,
        )
        yield GaugeMetricFamily(
            "canner_zstd_dictionary_waits",
            "zstd dictionaries that members name and that could not be had: their batches wait",
            value=len(survey.dictionary_waits),
        )
        if self._uploads:
            yield from _upload_gauges(survey)
        index = survey.index
        yield GaugeMetricFamily(
            "canner_index_readable",
            "1 when the last survey could read delivery.sqlite",
            value=0 if index is None else 1,
        )
        if index is None:
            return
        by_state = GaugeMetricFamily(
            "canner_deliveries", "Objects in the delivery index by state", labels=["state"]
        )
        bytes_by_state = GaugeMetricFamily(
            "canner_deliveries_bytes",
            "Bytes of objects in the delivery index by state",
            labels=["state"],
        )
        for state in State:
            by_state.add_metric([state.value], index.states.get(state.value, 0))
            bytes_by_state.add_metric([state.value], index.state_bytes.get(state.value, 0))
        packages = GaugeMetricFamily(
            "canner_packages",
            "Megawarc batches and packages by phase (open ... purged)",
            labels=["phase"],
        )
        package_bytes = GaugeMetricFamily(
            "canner_packages_bytes", "Member bytes of megawarc packages by phase", labels=["phase"]
        )
        for phase, count in index.packages.items():
            packages.add_metric([phase], count)
            package_bytes.add_metric([phase], index.package_bytes.get(phase, 0))
        yield packages
        yield package_bytes
        yield by_state
        yield bytes_by_state
        pending = GaugeMetricFamily(
            "canner_pending_bytes",
            "Bytes accepted and not yet delivered, by project",
            labels=["project"],
        )
        for totals in index.projects:
            pending.add_metric([totals.project], totals.pending_bytes)
        yield pending
        yield GaugeMetricFamily(
            "canner_delivered_bytes",
            "Bytes of delivered objects (sent to IA)",
            value=index.delivered_bytes,
        )
        yield GaugeMetricFamily(
            "canner_oldest_undelivered_age_seconds",
            "Age of the oldest accepted object not yet delivered (0: none)",
            value=survey.oldest_undelivered_age or 0.0,
        )
        yield GaugeMetricFamily(
            "canner_deliveries_needing_operator",
            "Deliveries flagged for an operator",
            value=index.needs_operator,
        )
        yield GaugeMetricFamily(
            "canner_purge_overdue",
            "Delivered objects whose local purge is overdue",
            value=index.purge_overdue,
        )
        yield GaugeMetricFamily(
            "canner_purge_lag_seconds",
            "How late the most overdue local purge is (0: none)",
            value=survey.purge_lag,
        )
        beat = index.heartbeat
        liveness = judge(beat, survey.taken_at)
        yield GaugeMetricFamily(
            "canner_deliver_up",
            "1 when canner-deliver's heartbeat in delivery.sqlite is fresh",
            value=1 if liveness.state == RUNNING else 0,
        )
        if beat is not None:
            yield GaugeMetricFamily(
                "canner_deliver_heartbeat_timestamp_seconds",
                "When canner-deliver last wrote its heartbeat",
                value=beat.beat_at,
            )


def _in_flight_gauges(attempts: int, sent: int) -> Iterable[Metric]:
    yield GaugeMetricFamily(
        "canner_delivery_attempts_in_flight", "Delivery attempts running now", value=attempts
    )
    yield GaugeMetricFamily(
        "canner_delivery_bytes_in_flight",
        "Payload bytes sent so far by the delivery attempts running now",
        value=sent,
    )


@define(eq=False)
class MetricsPage:
    """``GET /metrics`` on its own listener (canner-deliver's ``[metrics] deliver_listen``)."""

    app: ClassVar[Klein] = Klein()
    _metrics: Metrics

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        request.setHeader("Content-Type", CONTENT_TYPE_LATEST)
        return self._metrics.render()


class _MetricsRequest(Request):
    """A request to canner-deliver's metrics listener: one whose Host no route could be served
    with (:func:`~canner.web.routing.bindable_host`) is answered 400 before Klein sees it, as the
    receiver's requests are (``canner.web.channel.ReceiverRequest``)."""

    def process(self) -> None:
        if bindable_host(self.getRequestHostname()):
            super().process()
            return
        body = BAD_HOST_MESSAGE.encode() + b"\n"
        self.setResponseCode(400)
        self.setHeader(b"Content-Type", b"text/plain; charset=utf-8")
        self.setHeader(b"Content-Length", b"%d" % len(body))
        self.write(body)
        self.finish()


def metrics_site(metrics: Metrics) -> Site:
    """The site of canner-deliver's metrics listener: :class:`MetricsPage`."""
    site = Site(MetricsPage(metrics).app.resource(), requestFactory=_MetricsRequest)
    site.displayTracebacks = False
    return site


def process_metrics(
    config: Config,
    role: str,
    run: BlockingRunner,
    clock: IReactorTime,
    in_flight: InFlight | None = None,
) -> tuple[Metrics, SurveyCache]:
    """The metrics of a ``role`` process and the survey cache behind their gauges (refreshed
    by whoever runs the process).  canner-deliver's surveys leave the uploads in flight out
    (no listing of ``uploads/`` and ``receipts/``, whose names grow with every object held) and
    its metrics their gauges: the receiver's ``/metrics`` has them."""
    metrics = Metrics(role, config.projects)
    take = partial(take_survey, config.data_dir, config.object_ids)
    uploads = role != DELIVER
    if not uploads:
        take = partial(take, in_flight=_no_uploads)
    cache = SurveyCache(run, take, clock)
    metrics.register(SurveyCollector(cache, config.min_free_bytes, in_flight, uploads))
    return metrics, cache


def _no_uploads() -> tuple[str, ...]:
    return ()


def _upload_gauges(survey: Survey) -> Iterable[Metric]:
    yield GaugeMetricFamily(
        "canner_active_uploads",
        "Uploads on disk without a receipt",
        value=len(survey.active_uploads),
    )
    yield GaugeMetricFamily(
        "canner_active_upload_bytes",
        "Bytes stored so far of uploads without a receipt",
        value=survey.active_upload_bytes,
    )
    yield GaugeMetricFamily(
        "canner_promised_bytes",
        "Bytes promised to uploads in flight: declared sizes minus bytes stored; new uploads"
        " are admitted against free space minus these",
        value=survey.promised_bytes,
    )
