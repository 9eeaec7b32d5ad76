"""The receiver's status page (``GET /``): one self-contained HTML page for whoever is on call.

Its header says which canner runs, for how long, whether canner-deliver is alive (from its
heartbeat in ``delivery.sqlite``), and the verdict of ``canner status`` with its reasons
(:mod:`canner.ops.verdict`: the same words ``/readyz`` uses).  Then what needs doing: deliveries
waiting for an operator, the latest failures (with their next retry) and what this receiver
logged while starting; then free space, the deliveries in flight with their progress, 24-hour
trends drawn as inline SVG (:mod:`canner.ops.status_charts`), uploads still coming in, accepted and
pending bytes per project, delivery states, the latest deliveries (an IA item link, or the
file's path for a directory sink), and this process's recent warnings and errors
(:mod:`canner.ops.problems`).  :class:`StatusSource` takes a fresh survey in a thread for each
request; :func:`render_status` is pure and renders with ``twisted.web.template``.  The page
refreshes itself (``<meta http-equiv="refresh">``) and loads nothing else: no scripts, no
external styles, no images.

The page is served on the receiver's public port, so upload ids (which let their holder append
to an upload) are shortened to their first 8 characters, in tables and in log messages alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial

from attrs import define, field, frozen
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.template import Tag, flatten, tags

from canner.blocking import BlockingRunner
from canner.config import Config
from canner.delivery.liveness import Liveness, judge
from canner.delivery.queue import State
from canner.doors.rsync.incoming import count_waiting
from canner.ops.humane import human_bytes, human_duration, shorten_ids
from canner.ops.inventory import IndexSummary, InFlightScan, Survey, UploadsInFlight, take_survey
from canner.ops.node import WorkerCount, WorkerRoster
from canner.ops.problems import Problem, RecentProblems
from canner.ops.status_charts import Line, trend_chart
from canner.ops.trends import ALL, WINDOW, levels, per_minute
from canner.ops.trends import projects as trend_projects
from canner.ops.verdict import Verdict, assess, upload_refusals
from canner.sinks.directory import DirectoryDelivery, expand_path
from canner.sinks.ia.config import IADelivery
from canner.version import version

REFRESH_SECONDS = 10
# Requests within this many seconds of a survey are answered from it.
SURVEY_MAX_AGE = 2.0
# Requests within this many seconds of a survey are answered from it at once while a newer one
# is taken, so a slow survey (a busy disk) never holds the page; past it they wait for the new
# one (which shows its error when surveys keep failing).
SURVEY_STALE_AGE = 60.0
ACTIVE_UPLOADS_SHOWN = 50


@frozen
class DeliveryTarget:
    """Where a project's deliveries go, as the page shows them: an Internet Archive site (the
    base of its item pages) or a directory (the sink's root)."""

    item_url: str | None = None
    directory: str | None = None


def delivery_targets(config: Config) -> dict[str, DeliveryTarget]:
    """The :class:`DeliveryTarget` of each delivering project of ``config``."""
    targets = {}
    for pid, project in config.projects.items():
        delivery = project.delivery
        if delivery is None:
            continue
        if isinstance(delivery, DirectoryDelivery):
            targets[pid] = DeliveryTarget(directory=str(expand_path(delivery.path, pid)))
        elif isinstance(delivery, IADelivery):
            targets[pid] = DeliveryTarget(item_url=delivery.metadata_url)
    return targets


@frozen
class StatusView:
    """Everything the page shows."""

    issuer: str
    survey: Survey
    min_free_bytes: int
    problems: tuple[Problem, ...]
    refresh_s: int = REFRESH_SECONDS
    version: str = "-"
    started_at: float = 0.0  # when this receiver started
    # project -> where its deliveries go
    targets: Mapping[str, DeliveryTarget] = field(factory=dict)
    # Files rsync finished that wait for adoption (None: no rsync intake).
    rsync_waiting: int | None = None
    # whether some project delivers (then a stopped canner-deliver is critical)
    delivers: bool = False
    # warnings and errors this receiver logged while starting, oldest first
    at_start: tuple[Problem, ...] = ()
    # a receiver whose workers serve the socket: how many (None: it serves it itself)
    workers: WorkerCount | None = None

    @property
    def verdict(self) -> Verdict:
        """The verdict of ``canner status`` on this survey, and this receiver's start-up errors
        and missing workers."""
        errors = sum(1 for p in self.at_start if p.level in ("error", "critical"))
        return assess(
            self.survey,
            min_free_bytes=self.min_free_bytes,
            delivers=self.delivers,
            errors_at_start=errors,
            workers_missing=self.workers.missing if self.workers is not None else None,
        )

    @property
    def deliver(self) -> Liveness:
        beat = self.survey.index.heartbeat if self.survey.index is not None else None
        return judge(beat, self.survey.taken_at)


@define(eq=False, kw_only=True)
class StatusSource:
    """Builds a :class:`StatusView` with a survey taken in a thread.

    The page is public, so requests share work: a survey younger than ``max_age`` seconds is
    reused; one younger than ``stale_age`` is reused too while a new one is taken in the
    background; otherwise requests wait for the survey that runs (one at a time).
    """

    _run: BlockingRunner
    _take: Callable[[float], Survey]
    _clock: IReactorTime
    _problems: RecentProblems
    _issuer: str
    _min_free_bytes: int
    _max_age: float = SURVEY_MAX_AGE
    _stale_age: float = SURVEY_STALE_AGE
    _latest: Survey | None = None
    _waiting: list[Deferred[Survey]] | None = None
    _version: str = "-"
    _targets: Mapping[str, DeliveryTarget] = field(factory=dict)
    _delivers: bool = False
    _started_at: float | None = None
    # Counts the rsync files waiting for adoption (blocking), with each survey.
    _rsync_backlog: Callable[[], int] | None = None
    _rsync_waiting: int | None = None
    # A receiver whose workers serve the socket: its account of them.
    _roster: WorkerRoster | None = None

    @classmethod
    def for_config(
        cls,
        config: Config,
        *,
        run: BlockingRunner,
        clock: IReactorTime,
        problems: RecentProblems,
        roster: WorkerRoster | None = None,
        in_flight: UploadsInFlight | InFlightScan | None = None,
    ) -> StatusSource:
        """The receiver's status page source, started now: surveys with history, where each
        project delivers to, this version of canner and, with ``roster``, its workers.
        ``in_flight``: the receiver's uploads in flight (its promises), which the surveys look
        at instead of listing ``uploads/`` and ``receipts/``."""
        take = partial(
            take_survey, config.data_dir, config.object_ids, history=True, in_flight=in_flight
        )
        return cls(
            roster=roster,
            run=run,
            take=take,
            clock=clock,
            problems=problems,
            issuer=config.issuer,
            min_free_bytes=config.min_free_bytes,
            version=version(),
            targets=delivery_targets(config),
            delivers=any(p.delivery is not None for p in config.projects.values()),
            started_at=clock.seconds(),
            rsync_backlog=(
                partial(
                    count_waiting, config.rsync.incoming, tuple(config.projects), config.data_dir
                )
                if config.rsync is not None
                else None
            ),
        )

    def view(self) -> Deferred[StatusView]:
        if self._started_at is None:
            self._started_at = self._clock.seconds()

        def build(survey: Survey) -> StatusView:
            return StatusView(
                self._issuer,
                survey,
                self._min_free_bytes,
                self._problems.latest(),
                version=self._version,
                started_at=self._started_at or survey.taken_at,
                targets=self._targets,
                rsync_waiting=self._rsync_waiting,
                delivers=self._delivers,
                at_start=self._problems.at_start(),
                workers=WorkerCount.of(self._roster) if self._roster is not None else None,
            )

        return self._survey().addCallback(build)

    def _survey(self) -> Deferred[Survey]:
        now = self._clock.seconds()
        if self._latest is not None and 0 <= now - self._latest.taken_at < self._stale_age:
            if now - self._latest.taken_at >= self._max_age and self._waiting is None:
                self._refresh(now)
            return succeed(self._latest)
        waiter: Deferred[Survey] = Deferred()
        if self._waiting is not None:
            self._waiting.append(waiter)
        else:
            self._refresh(now, [waiter])
        return waiter

    def _refresh(self, now: float, waiting: list[Deferred[Survey]] | None = None) -> None:
        """Take a survey in a thread; it becomes the latest and answers the requests waiting
        for it (a failure fails those, and the next request tries again)."""
        self._waiting = waiting or []

        def done(result: Survey | Failure) -> None:
            waiting, self._waiting = self._waiting or [], None
            if isinstance(result, Survey):
                self._latest = result
            for d in waiting:
                if isinstance(result, Failure):
                    d.errback(result)
                else:
                    d.callback(result)

        self._run(self._take_all, now).addBoth(done)

    def _take_all(self, now: float) -> Survey:
        """The survey and, with it, the rsync backlog (blocking: in the survey's thread)."""
        if self._rsync_backlog is not None:
            self._rsync_waiting = self._rsync_backlog()
        return self._take(now)


# -- rendering (pure) --------------------------------------------------------------------------


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _count(name: str, value: int | None) -> Tag:
    shown = "-" if value is None else f"{value:,}"
    return tags.td(tags.b(shown), class_="num", **{"data-field": name})


def _bytes(name: str, value: int | None) -> Tag:
    if value is None:
        return tags.td(tags.b("-"), class_="num", **{"data-field": name})
    cell = tags.td(tags.b(f"{value:,}"), class_="num", **{"data-field": name})
    if abs(value) >= 1024:
        cell(" ", tags.small(human_bytes(value)))
    return cell


def _row(*cells: Tag | str, **attrs: str) -> Tag:
    return tags.tr(*cells, **attrs)


def _head(*names: str) -> Tag:
    return tags.tr(*(tags.th(n) for n in names))


def _bar(share: float) -> Tag:
    return tags.span(tags.span(style=f"width:{share:.0f}%"), class_="bar")


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
h3{font-size:1em;margin:.8em 0 .2em}
table{border-collapse:collapse;background:#fff;min-width:30em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
small{color:#666}.meta{color:#666}.bad{color:#a00;font-weight:bold}.ok{color:#070}
.banner{padding:.6em 1em;border:2px solid #a00;background:#fee;font-size:1.1em}
.bar{background:#e5e5e5;width:8em;height:.8em;display:inline-block}
.bar span{background:#4a8;height:100%;display:block}
.lvl-error,.lvl-critical{color:#a00}.lvl-warn,.lvl-warning{color:#a60}
td.msg{font-family:monospace;white-space:pre-wrap;max-width:60em}
.charts{display:flex;flex-wrap:wrap;gap:1em}
figure{margin:0;background:#fff;border:1px solid #ddd;padding:.4em}
figcaption{font-size:.9em;color:#444}
svg text{font:11px system-ui,sans-serif;fill:#666}
.key{display:inline-block;width:.8em;height:.8em;margin:0 .2em 0 .6em}
.verdict{padding:.4em 1em;margin:.6em 0;border:2px solid #070;background:#efe}
.verdict h2{margin:.1em 0 .3em}.verdict ul{margin:.2em 0;padding-left:1.2em}
.verdict.warning{border-color:#a60;background:#fff5e0}
.verdict.critical{border-color:#a00;background:#fee}
.verdict.draining{border-color:#36c;background:#eef3fc}.lvl-draining{color:#247}
"""


# -- trend charts (inline SVG) ----------------------------------------------------------------

# The charts' colours.
_RECEIVED, _DELIVERED, _BACKLOG, _FREE, _FLOOR = "#2a7", "#36c", "#c70", "#555", "#a00"


def _trends(view: StatusView) -> Tag:
    trends = view.survey.trends
    now = view.survey.taken_at
    total = trends.get(ALL, ())
    charts = tags.div(
        trend_chart(
            "trend-flow",
            "Bytes accepted and delivered per minute",
            [
                Line("accepted", _RECEIVED, tuple(per_minute(total, "accepted_bytes"))),
                Line("delivered", _DELIVERED, tuple(per_minute(total, "delivered_bytes"))),
            ],
            now,
        ),
        trend_chart(
            "trend-backlog-bytes",
            "Backlog (bytes not yet delivered)",
            [Line("backlog", _BACKLOG, tuple(levels(total, "pending_bytes")))],
            now,
        ),
        trend_chart(
            "trend-backlog-objects",
            "Backlog (objects not yet delivered)",
            [Line("objects", _BACKLOG, tuple(levels(total, "pending_objects")))],
            now,
            unit="objects",
        ),
        trend_chart(
            "trend-free",
            "Free space against the floor",
            [
                Line("free", _FREE, tuple(levels(total, "free_bytes"))),
                Line(
                    "floor",
                    _FLOOR,
                    ((now - WINDOW, float(view.min_free_bytes)), (now, float(view.min_free_bytes))),
                    dashed=True,
                ),
            ],
            now,
        ),
        class_="charts",
    )
    section = tags.section(tags.h2("Last 24 hours"), charts, id="trends")
    for project in trend_projects(trends):
        points = trends[project]
        section(
            tags.h3("project ", project),
            tags.div(
                trend_chart(
                    f"trend-flow-{project}",
                    f"{project}: accepted and delivered per minute",
                    [
                        Line("accepted", _RECEIVED, tuple(per_minute(points, "accepted_bytes"))),
                        Line("delivered", _DELIVERED, tuple(per_minute(points, "delivered_bytes"))),
                    ],
                    now,
                ),
                trend_chart(
                    f"trend-backlog-{project}",
                    f"{project}: backlog bytes",
                    [Line("backlog", _BACKLOG, tuple(levels(points, "pending_bytes")))],
                    now,
                ),
                class_="charts",
            ),
        )
    return section


# -- sections ---------------------------------------------------------------------------------


def _header(view: StatusView) -> list[Tag]:
    survey = view.survey
    now = survey.taken_at
    liveness = view.deliver
    beat = survey.index.heartbeat if survey.index is not None else None
    deliver = tags.span(liveness.state, id="deliver-state", class_="ok" if liveness.ok else "bad")
    if beat is not None and liveness.ok:
        deliver(
            f" (up {human_duration(now - beat.started_at)}, version {beat.version},"
            f" heartbeat {human_duration(liveness.age_s)} ago)"
        )
    meta = tags.p(
        view.issuer,
        " · canner ",
        tags.span(view.version, id="version"),
        " · receiver: ",
        tags.span("running", class_="ok", id="receiver-state"),
        f" (up {human_duration(now - view.started_at)}",
        *_workers(view.workers),
        ")",
        " · deliver: ",
        deliver,
        " · ",
        tags.span(_utc(now), id="taken-at", **{"data-time": f"{now:.0f}"}),
        f" · refreshes every {view.refresh_s}s · ",
        tags.a("metrics", href="/metrics"),
        " · ",
        tags.a("readiness", href="/readyz"),
        class_="meta",
    )
    # A drained node says so in its verdict ("Draining", with the drain and its retirement
    # among the reasons): the operator's own doing, no red banner.
    parts = [tags.h1("canner"), meta, _verdict(view)]
    if not liveness.ok:
        parts.append(
            tags.p(
                liveness.text + ": nothing is being delivered.",
                class_="banner",
                id="deliver-banner",
            )
        )
    return parts


def _workers(workers: WorkerCount | None) -> list[Tag | str]:
    """The receiver's workers, in its header: how many listen, and restarts if any."""
    if workers is None:
        return []
    count = tags.span(
        f"{workers.running} of {workers.configured} workers",
        id="workers",
        class_="ok" if workers.missing is None else "bad",
        **{"data-running": str(workers.running), "data-configured": str(workers.configured)},
    )
    parts: list[Tag | str] = [", ", count]
    if workers.restarts:
        restarts = "1 restart" if workers.restarts == 1 else f"{workers.restarts} restarts"
        parts += [", ", tags.span(restarts, id="worker-restarts")]
    return parts


_LABELS = {"ok": "OK", "warning": "Warning", "critical": "Critical", "draining": "Draining"}


def _verdict(view: StatusView) -> Tag:
    """The verdict and its reasons, worded as ``canner status`` and ``/readyz`` word them."""
    verdict = view.verdict
    section = tags.section(
        tags.h2(_LABELS[verdict.status], id="verdict-status"),
        id="verdict",
        class_=f"verdict {verdict.status}",
        **{"data-status": verdict.status},
    )
    if not verdict.reasons:
        return section(tags.p("Nothing needs attention.", id="no-reasons"))
    reasons = tags.ul(id="reasons")
    for reason in verdict.reasons:
        level = reason.split(":", 1)[0]
        reasons(tags.li(shorten_ids(reason), class_=f"lvl-{level}", **{"data-level": level}))
    return section(reasons)


def _storage(view: StatusView) -> Tag:
    survey = view.survey
    free = survey.free_bytes
    refusals = upload_refusals(
        free_bytes=free,
        free_error=survey.free_error,
        min_free_bytes=view.min_free_bytes,
        unusable=survey.unusable,
    )
    if refusals:
        verdict = tags.span("; ".join(refusals), class_="bad")
    else:
        verdict = tags.span("ok", class_="ok")
    return tags.section(
        tags.h2("Storage"),
        tags.table(
            _row(tags.th("free on the data filesystem"), _bytes("free_bytes", free)),
            _row(tags.th("floor (min_free_bytes)"), _bytes("min_free_bytes", view.min_free_bytes)),
            _row(tags.th("state"), tags.td(verdict, id="storage-state")),
            id="storage",
        ),
    )


def _in_flight(view: StatusView) -> Tag:
    section = tags.section(tags.h2("Deliveries in flight"))
    beat = view.survey.index.heartbeat if view.survey.index is not None else None
    if not view.deliver.ok or beat is None:
        return section(tags.p("None: ", view.deliver.text, ".", id="no-in-flight"))
    if not beat.in_flight:
        return section(tags.p("No delivery running right now.", id="no-in-flight"))
    now = view.survey.taken_at
    table = tags.table(
        _head("object", "project", "file", "attempt", "phase", "sent", "progress", "rate", "ETA"),
        id="in-flight",
    )
    for p in beat.in_flight:
        done = p.done if p.done is not None else p.sent
        share = min(100.0, 100.0 * done / p.size) if p.size else 100.0
        parts: list[Tag | str] = (
            [] if p.parts is None else [tags.br(), f"{p.parts_done} of {p.parts} parts at IA"]
        )
        table(
            _row(
                tags.td(tags.code(shorten_ids(p.object_id))),
                tags.td(p.project),
                tags.td(p.filename or "-"),
                tags.td(str(p.attempt), class_="num"),
                tags.td(
                    f"{p.phase} for {human_duration(now - p.started_at)}",
                    *(
                        [
                            tags.br(),
                            tags.span(f"no bytes for {human_duration(p.stalled_s)}", class_="bad"),
                        ]
                        if p.stalled_s
                        else []
                    ),
                ),
                _bytes("sent", p.sent),
                tags.td(_bar(share), f" {share:.0f}% of {human_bytes(p.size)}", *parts),
                tags.td(f"{human_bytes(int(p.rate))}/s" if p.rate else "-", class_="num"),
                tags.td(human_duration(p.eta_s), class_="num"),
                **{"data-object": p.object_id[:8]},
            )
        )
    return section(table)


def _uploads(survey: Survey, rsync_waiting: int | None) -> Tag:
    uploads = survey.active_uploads
    summary = tags.table(
        _row(tags.th("uploads without a receipt"), _count("active_uploads", len(uploads))),
        _row(
            tags.th("bytes stored so far"),
            _bytes("active_upload_bytes", survey.active_upload_bytes),
        ),
        _row(
            tags.th("promised to uploads in flight"),
            _bytes("promised_bytes", survey.promised_bytes),
        ),
        id="active-summary",
    )
    if rsync_waiting is not None:
        summary(
            _row(
                tags.th("rsync files waiting for adoption"),
                _count("rsync_waiting", rsync_waiting),
            )
        )
    section = tags.section(tags.h2("Active uploads"), summary)
    if not uploads:
        return section(tags.p("No uploads in progress."))
    table = tags.table(_head("upload", "project", "bytes", "progress", "idle"), id="active-uploads")
    for u in uploads[:ACTIVE_UPLOADS_SHOWN]:
        share = min(100.0, 100.0 * u.offset / u.size) if u.size else 100.0
        table(
            _row(
                tags.td(tags.code(shorten_ids(u.upload_id))),
                tags.td(u.project),
                tags.td(f"{u.offset:,} / {u.size:,}", class_="num"),
                tags.td(
                    _bar(share),
                    f" {share:.0f}%{' (awaiting acceptance)' if u.complete else ''}",
                ),
                tags.td(human_duration(u.idle_s), class_="num"),
            )
        )
    section(table)
    more = len(uploads) - ACTIVE_UPLOADS_SHOWN
    if more > 0:
        section(tags.p(f"… and {more} more."))
    return section


def _projects(survey: Survey) -> Tag:
    index = survey.index
    section = tags.section(tags.h2("Projects"))
    if index is None:
        return section(
            tags.p(f"The delivery index is unreadable: {survey.index_error or ''}", class_="bad")
        )
    table = tags.table(
        _head(
            "project",
            "accepted objects",
            "accepted bytes",
            "pending objects",
            "pending bytes",
            "delivered objects",
        ),
        id="projects",
    )
    for p in index.projects:
        table(
            _row(
                tags.td(p.project),
                _count("accepted_objects", p.accepted_objects),
                _bytes("accepted_bytes", p.accepted_bytes),
                _count("pending_objects", p.pending_objects),
                _bytes("pending_bytes", p.pending_bytes),
                _count("delivered_objects", p.delivered_objects),
                **{"data-project": p.project},
            )
        )
    if not index.projects:
        table(_row(tags.td("Nothing accepted yet.", colspan="6")))
    return section(table)


def _deliveries(view: StatusView) -> Tag | str:
    survey = view.survey
    index = survey.index
    if index is None:
        return ""
    states = tags.table(_head("state", "objects", "bytes"), id="states")
    for s in State:
        states(
            _row(
                tags.th(s.value),
                _count(f"state_{s.value}", index.states.get(s.value, 0)),
                _bytes(f"state_{s.value}_bytes", index.state_bytes.get(s.value, 0)),
                **{"data-state": s.value},
            )
        )
    summary = tags.table(
        _row(tags.th("pending objects"), _count("pending_objects", index.pending_objects)),
        _row(tags.th("pending bytes"), _bytes("pending_bytes", index.pending_bytes)),
        _row(
            tags.th("oldest undelivered"),
            tags.td(
                human_duration(survey.oldest_undelivered_age),
                class_="num",
                **{"data-field": "oldest_pending_age"},
            ),
        ),
        _row(tags.th("needing an operator"), _count("needs_operator", index.needs_operator)),
        _row(tags.th("purges overdue"), _count("purge_overdue", index.purge_overdue)),
        id="delivery-summary",
    )
    section = tags.section(tags.h2("Deliveries"), states, tags.p(), summary)
    if any(index.packages.values()):
        # Megawarc projects: batches filling, packages building, sealed, delivering, delivered.
        packages = tags.table(_head("package phase", "packages", "bytes"), id="packages")
        for phase, count in index.packages.items():
            packages(
                _row(
                    tags.th(phase.replace("_", " ")),
                    _count(f"packages_{phase}", count),
                    _bytes(f"packages_{phase}_bytes", index.package_bytes.get(phase, 0)),
                    **{"data-phase": phase},
                )
            )
        section(tags.h2("Packages"), packages)
    now = survey.taken_at
    if survey.dictionary_waits:
        waits = tags.table(
            _head("zstd dictionary", "project", "waiting", "attempts", "next try", "error"),
            id="dictionary-waits",
        )
        for w in survey.dictionary_waits:
            waits(
                _row(
                    tags.td(tags.code(w.dict_id)),
                    tags.td(w.project),
                    tags.td(human_duration(now - w.since), class_="num"),
                    tags.td(str(w.attempts), class_="num"),
                    tags.td(f"in {human_duration(max(0.0, w.next_attempt_at - now))}"),
                    tags.td(w.error, class_="msg"),
                    **{"data-dict-id": w.dict_id},
                )
            )
        section(tags.h2("Members waiting for a zstd dictionary"), waits)
    if index.recent_deliveries:
        recent = tags.table(
            _head("object", "project", "delivered", "verified", "destination"),
            id="recent-deliveries",
        )
        for r in index.recent_deliveries:
            item = _destination(view.targets.get(r.project), r.remote_identifier, r.remote_name)
            recent(
                _row(
                    tags.td(tags.code(shorten_ids(r.object_id))),
                    tags.td(r.project),
                    tags.td(_utc(r.delivered_at) if r.delivered_at else "-"),
                    tags.td("yes" if r.verified_at else "not yet"),
                    tags.td(item),
                )
            )
        section(tags.h2("Latest deliveries"), recent)
    return section


def _destination(
    target: DeliveryTarget | None, identifier: str | None, remote_name: str | None
) -> Tag | str:
    """Where a delivery went: the IA item linked for an IA project, the file's path for a
    directory sink, else the identifier as recorded."""
    if not identifier:
        return "-"
    if target is not None and target.item_url is not None:
        url = f"{target.item_url.rstrip('/')}/details/{identifier}"
        return tags.a(identifier, href=url, class_="ia-item")
    if target is not None and target.directory is not None:
        path = f"{target.directory.rstrip('/')}/{identifier}/{remote_name or ''}"
        return tags.code(path, class_="path")
    return identifier


def _attention(view: StatusView) -> list[Tag]:
    """What needs doing, above the charts: deliveries waiting for an operator, the latest
    failed deliveries and the errors this receiver logged while starting."""
    survey = view.survey
    index = survey.index
    parts = []
    if index is not None and index.needs_operator:
        flagged = [r for r in index.recent_failures if r.needs_operator]
        table = tags.table(_head("object", "project", "attempts", "last error"))
        for r in flagged:
            table(
                _row(
                    tags.td(tags.code(shorten_ids(r.object_id))),
                    tags.td(r.project),
                    tags.td(str(r.attempts), class_="num"),
                    tags.td(shorten_ids(r.last_error or ""), class_="msg"),
                    **{"data-object": r.object_id[:8]},
                )
            )
        parts.append(
            tags.section(
                tags.h2("Needing an operator"),
                tags.p(
                    _count_span("needs_operator", index.needs_operator),
                    " deliveries wait for an operator: fix the cause, then run ",
                    tags.code("canner retry --needs-operator"),
                    " (",
                    tags.code("canner deliveries --needs-operator"),
                    " lists them all).",
                ),
                table,
                id="needs-operator",
            )
        )
    if index is not None:
        parts.append(_failures(index, survey.taken_at))
    if view.at_start:
        table = tags.table(_head("time", "level", "message"), id="startup-problems")
        for p in view.at_start:
            table(_problem_row(p))
        parts.append(tags.section(tags.h2("Logged while starting"), table, id="at-start"))
    return parts


def _count_span(name: str, value: int) -> Tag:
    return tags.b(f"{value:,}", **{"data-field": name})


def _failures(index: IndexSummary, now: float) -> Tag:
    section = tags.section(tags.h2("Latest delivery failures"), id="failures")
    if not index.recent_failures:
        return section(tags.p("None.", id="no-failures"))
    failures = tags.table(
        _head("object", "project", "attempts", "needs operator", "next retry", "last error"),
        id="delivery-failures",
    )
    for r in index.recent_failures:
        wait = r.next_attempt_at - now
        failures(
            _row(
                tags.td(tags.code(shorten_ids(r.object_id))),
                tags.td(r.project),
                tags.td(str(r.attempts), class_="num"),
                tags.td("yes" if r.needs_operator else "no"),
                tags.td(
                    f"in {human_duration(wait)}" if wait > 0 else "due now",
                    tags.br(),
                    tags.small(_utc(r.next_attempt_at)),
                ),
                tags.td(shorten_ids(r.last_error or ""), class_="msg"),
            )
        )
    return section(failures)


def _problem_row(p: Problem) -> Tag:
    return _row(
        tags.td(_utc(p.time)),
        tags.td(p.level),
        tags.td(shorten_ids(p.text), class_="msg"),
        class_=f"lvl-{p.level}",
    )


def _problems(problems: tuple[Problem, ...], at_start: int) -> Tag:
    section = tags.section(tags.h2("Recent errors"))
    if not problems:
        text = "No warnings or errors since start."
        if at_start:
            text = f"No warnings or errors since start-up ({at_start} logged while starting:"
            text += " above)."
        return section(tags.p(text, id="no-problems"))
    table = tags.table(_head("time", "level", "message"), id="problems")
    for p in problems:
        table(_problem_row(p))
    return section(table)


def render_status(view: StatusView) -> bytes:
    """The whole page as UTF-8 HTML, built with ``twisted.web.template`` (which escapes every
    text and attribute by construction)."""
    page = tags.html(
        tags.head(
            tags.meta(charset="utf-8"),
            tags.meta(**{"http-equiv": "refresh", "content": str(view.refresh_s)}),
            tags.meta(name="viewport", content="width=device-width, initial-scale=1"),
            tags.title(f"canner: {view.issuer}"),
            tags.style(_STYLE),
        ),
        tags.body(
            *_header(view),
            *_attention(view),
            _storage(view),
            _in_flight(view),
            _trends(view),
            _uploads(view.survey, view.rsync_waiting),
            _projects(view.survey),
            _deliveries(view),
            _problems(view.problems, len(view.at_start)),
        ),
        lang="en",
    )
    out: list[bytes] = [b"<!DOCTYPE html>\n"]
    done = flatten(None, page, out.append)
    failures: list[Failure] = []
    done.addErrback(failures.append)
    if failures:  # nothing here waits, so flattening has finished
        failures[0].raiseException()
    out.append(b"\n")
    return b"".join(out)
