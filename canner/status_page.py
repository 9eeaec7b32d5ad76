"""The receiver's status page (``GET /``): one self-contained HTML page for whoever is on call.

It shows uploads still coming in, accepted and pending bytes per project, delivery states (read
from the index), free space, the latest delivery failures and this process's recent warnings
and errors.  :class:`StatusSource` takes a fresh survey in a thread for each request;
:func:`render_status` is pure.  The page refreshes itself (``<meta http-equiv="refresh">``) and
loads nothing else: no scripts, no external styles, no images.

The page is served on the receiver's public port, so upload ids (which let their holder append
to an upload) are shortened to their first 8 characters, in tables and in log messages alike.
"""

from __future__ import annotations

import html
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from attrs import define, field, frozen
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import LogLevel, formatEvent
from twisted.python.failure import Failure

from canner.blocking import BlockingRunner
from canner.delivery.queue import State
from canner.inventory import Survey

REFRESH_SECONDS = 10
# Requests within this many seconds of a survey are answered from it.
SURVEY_MAX_AGE = 2.0
RECENT_PROBLEMS = 20
ACTIVE_UPLOADS_SHOWN = 50
_PROBLEM_LEVELS = (LogLevel.warn, LogLevel.error, LogLevel.critical)
_ID = re.compile(r"(?<![0-9a-f])([0-9a-f]{8})[0-9a-f]{24}(?![0-9a-f])")


@frozen
class Problem:
    """One warning or error logged by this process."""

    time: float
    level: str
    namespace: str
    text: str


@define(eq=False)
class RecentProblems:
    """An ``ILogObserver`` that keeps the latest warnings and errors in memory."""

    size: int = RECENT_PROBLEMS
    _lines: deque[Problem] = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._lines = deque(maxlen=self.size)

    def observe(self, event: Mapping[str, Any]) -> None:
        level = event.get("log_level")
        if level not in _PROBLEM_LEVELS:
            return
        text = formatEvent(dict(event))
        failure = event.get("log_failure")
        if failure is not None and hasattr(failure, "getErrorMessage"):
            text = f"{text}: {failure.type.__name__}: {failure.getErrorMessage()}"
        when = event.get("log_time")
        # deque.append is atomic: events logged from worker threads need no lock.
        self._lines.append(
            Problem(
                when if isinstance(when, float) else 0.0,
                str(getattr(level, "name", level)),
                str(event.get("log_namespace", "")),
                text,
            )
        )

    def latest(self) -> tuple[Problem, ...]:
        """Newest first."""
        return tuple(reversed(self._lines))


@frozen
class StatusView:
    """Everything the page shows."""

    issuer: str
    survey: Survey
    min_free_bytes: int
    problems: tuple[Problem, ...]
    refresh_s: int = REFRESH_SECONDS


@define(eq=False)
class StatusSource:
    """Builds a :class:`StatusView` with a survey taken in a thread.

    The page is public, so requests share work: a survey younger than ``max_age`` seconds is
    reused, and requests that arrive while one runs wait for it instead of starting another.
    """

    _run: BlockingRunner
    _take: Callable[[float], Survey]
    _clock: IReactorTime
    _problems: RecentProblems
    _issuer: str
    _min_free_bytes: int
    _max_age: float = SURVEY_MAX_AGE
    _latest: Survey | None = None
    _waiting: list[Deferred[Survey]] | None = None

    def view(self) -> Deferred[StatusView]:
        def build(survey: Survey) -> StatusView:
            return StatusView(self._issuer, survey, self._min_free_bytes, self._problems.latest())

        return self._survey().addCallback(build)

    def _survey(self) -> Deferred[Survey]:
        now = self._clock.seconds()
        if self._latest is not None and 0 <= now - self._latest.taken_at < self._max_age:
            return succeed(self._latest)
        waiter: Deferred[Survey] = Deferred()
        if self._waiting is not None:
            self._waiting.append(waiter)
            return waiter
        self._waiting = [waiter]

        def done(result: Survey | Failure) -> None:
            waiting, self._waiting = self._waiting or [], None
            if isinstance(result, Survey):
                self._latest = result
            for d in waiting:
                if isinstance(result, Failure):
                    d.errback(result)
                else:
                    d.callback(result)

        self._run(self._take, now).addBoth(done)
        return waiter


# -- rendering (pure) --------------------------------------------------------------------------


def shorten_ids(text: str) -> str:
    """``text`` with every 32-hex object id cut to its first 8 characters and an ellipsis."""
    return _ID.sub(r"\1…", text)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m {s % 60}s"
    if s < 172800:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _count(name: str, value: int | None) -> str:
    shown = "-" if value is None else f"{value:,}"
    return f'<td class="num" data-field="{_e(name)}"><b>{shown}</b></td>'


def _bytes(name: str, value: int | None) -> str:
    if value is None:
        return f'<td class="num" data-field="{_e(name)}"><b>-</b></td>'
    human = f" <small>{_e(human_bytes(value))}</small>" if abs(value) >= 1024 else ""
    return f'<td class="num" data-field="{_e(name)}"><b>{value:,}</b>{human}</td>'


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff;min-width:30em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
small{color:#666}.meta{color:#666}.bad{color:#a00;font-weight:bold}.ok{color:#070}
.bar{background:#e5e5e5;width:8em;height:.8em;display:inline-block}
.bar span{background:#4a8;height:100%;display:block}
.lvl-error,.lvl-critical{color:#a00}.lvl-warn{color:#a60}
td.msg{font-family:monospace;white-space:pre-wrap;max-width:60em}
"""


def _storage(view: StatusView) -> str:
    survey = view.survey
    free = survey.free_bytes
    if free is None:
        verdict = f'<span class="bad">unknown: {_e(survey.free_error or "")}</span>'
    elif free < view.min_free_bytes:
        verdict = '<span class="bad">below the floor: new uploads are refused (429)</span>'
    else:
        verdict = '<span class="ok">ok</span>'
    return (
        '<h2>Storage</h2><table id="storage">'
        f"<tr><th>free on the data filesystem</th>{_bytes('free_bytes', free)}</tr>"
        f"<tr><th>floor (min_free_bytes)</th>{_bytes('min_free_bytes', view.min_free_bytes)}</tr>"
        f'<tr><th>state</th><td id="storage-state">{verdict}</td></tr></table>'
    )


def _uploads(survey: Survey) -> str:
    uploads = survey.active_uploads
    head = (
        f'<h2>Active uploads</h2><table id="active-summary"><tr><th>uploads without a receipt</th>'
        f"{_count('active_uploads', len(uploads))}</tr>"
        "<tr><th>bytes stored so far</th>"
        + _bytes("active_upload_bytes", survey.active_upload_bytes)
        + "</tr></table>"
    )
    if not uploads:
        return head + "<p>No uploads in progress.</p>"
    rows = []
    for u in uploads[:ACTIVE_UPLOADS_SHOWN]:
        share = min(100.0, 100.0 * u.offset / u.size) if u.size else 100.0
        rows.append(
            f"<tr><td><code>{_e(shorten_ids(u.upload_id))}</code></td><td>{_e(u.project)}</td>"
            f'<td class="num">{u.offset:,} / {u.size:,}</td>'
            f'<td><span class="bar"><span style="width:{share:.0f}%"></span></span>'
            f" {share:.0f}%{' (awaiting acceptance)' if u.complete else ''}</td>"
            f'<td class="num">{_e(human_duration(u.idle_s))}</td></tr>'
        )
    more = len(uploads) - ACTIVE_UPLOADS_SHOWN
    tail = f"<p>… and {more} more.</p>" if more > 0 else ""
    return (
        head + '<table id="active-uploads"><tr><th>upload</th><th>project</th><th>bytes</th>'
        "<th>progress</th><th>idle</th></tr>" + "".join(rows) + "</table>" + tail
    )


def _projects(survey: Survey) -> str:
    index = survey.index
    if index is None:
        return (
            "<h2>Projects</h2>"
            f'<p class="bad">The delivery index is unreadable: {_e(survey.index_error or "")}</p>'
        )
    rows = [
        f'<tr data-project="{_e(p.project)}"><td>{_e(p.project)}</td>'
        + _count("accepted_objects", p.accepted_objects)
        + _bytes("accepted_bytes", p.accepted_bytes)
        + _count("pending_objects", p.pending_objects)
        + _bytes("pending_bytes", p.pending_bytes)
        + _count("delivered_objects", p.delivered_objects)
        + "</tr>"
        for p in index.projects
    ]
    if not rows:
        rows = ['<tr><td colspan="6">Nothing accepted yet.</td></tr>']
    return (
        '<h2>Projects</h2><table id="projects"><tr><th>project</th><th>accepted objects</th>'
        "<th>accepted bytes</th><th>pending objects</th><th>pending bytes</th>"
        "<th>delivered objects</th></tr>" + "".join(rows) + "</table>"
    )


def _deliveries(survey: Survey) -> str:
    index = survey.index
    if index is None:
        return ""
    states = "".join(
        f'<tr data-state="{s.value}"><th>{s.value}</th>'
        + _count(f"state_{s.value}", index.states.get(s.value, 0))
        + _bytes(f"state_{s.value}_bytes", index.state_bytes.get(s.value, 0))
        + "</tr>"
        for s in State
    )
    oldest = survey.oldest_undelivered_age
    summary = (
        '<table id="delivery-summary">'
        f"<tr><th>pending objects</th>{_count('pending_objects', index.pending_objects)}</tr>"
        f"<tr><th>pending bytes</th>{_bytes('pending_bytes', index.pending_bytes)}</tr>"
        f'<tr><th>oldest undelivered</th><td class="num" data-field="oldest_pending_age">'
        f"{_e(human_duration(oldest))}</td></tr>"
        f"<tr><th>needing an operator</th>{_count('needs_operator', index.needs_operator)}</tr>"
        f"<tr><th>purges overdue</th>{_count('purge_overdue', index.purge_overdue)}"
        f"</tr></table>"
    )
    failures = ""
    if index.recent_failures:
        rows = "".join(
            f"<tr><td><code>{_e(shorten_ids(r.object_id))}</code></td><td>{_e(r.project)}</td>"
            f'<td>{_e(r.state)}</td><td class="num">{r.attempts}</td>'
            f"<td>{'yes' if r.needs_operator else 'no'}</td>"
            f'<td class="msg">{_e(shorten_ids(r.last_error or ""))}</td></tr>'
            for r in index.recent_failures
        )
        failures = (
            '<h2>Latest delivery failures</h2><table id="delivery-failures"><tr><th>object</th>'
            "<th>project</th><th>state</th><th>attempts</th><th>needs operator</th>"
            "<th>last error</th></tr>" + rows + "</table>"
        )
    return (
        '<h2>Deliveries</h2><table id="states"><tr><th>state</th><th>objects</th><th>bytes</th>'
        "</tr>" + states + "</table><p></p>" + summary + failures
    )


def _problems(problems: tuple[Problem, ...]) -> str:
    if not problems:
        return '<h2>Recent errors</h2><p id="no-problems">No warnings or errors since start.</p>'
    rows = "".join(
        f'<tr class="lvl-{_e(p.level)}"><td>{_e(_utc(p.time))}</td><td>{_e(p.level)}</td>'
        f'<td class="msg">{_e(shorten_ids(p.text))}</td></tr>'
        for p in problems
    )
    return (
        '<h2>Recent errors</h2><table id="problems"><tr><th>time</th><th>level</th>'
        "<th>message</th></tr>" + rows + "</table>"
    )


def render_status(view: StatusView) -> bytes:
    """The whole page as UTF-8 HTML."""
    survey = view.survey
    body = (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{view.refresh_s}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>canner receiver: {_e(view.issuer)}</title><style>{_STYLE}</style></head><body>"
        f'<h1>canner receiver</h1><p class="meta">{_e(view.issuer)} · '
        f'<span id="taken-at" data-time="{survey.taken_at:.0f}">{_e(_utc(survey.taken_at))}</span>'
        f' · refreshes every {view.refresh_s}s · <a href="/metrics">metrics</a></p>'
        + _storage(view)
        + _uploads(survey)
        + _projects(survey)
        + _deliveries(survey)
        + _problems(view.problems)
        + "</body></html>\n"
    )
    return body.encode("utf-8")
