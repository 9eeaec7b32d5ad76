"""The node's one view, in pieces: the proxy's header rules, which routes show the node, the
merge of the parent's and workers' metrics, the scrape's memory of unreachable and restarted
workers, and what readiness and the status page say about the workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, ensureDeferred, fail, succeed
from twisted.internet.task import Clock
from twisted.web.http_headers import Headers

from canner.ids import ObjectIds
from canner.ops.inventory import take_survey
from canner.ops.node import WorkerCount, listen_description
from canner.ops.node_metrics import NodeMetrics, merge, parse, render
from canner.ops.readiness import Readiness, with_workers
from canner.ops.status_page import StatusView, render_status
from canner.web.proxy import answer_headers, forwarded_client, forwarded_headers
from canner.web.routing import Kind, route
from tests.fakes import succeeded

NOW = 1784764800.0


# -- the proxy's headers ----------------------------------------------------------------------


def test_forwarded_headers_keep_end_to_end_ones_and_name_the_client() -> None:
    """Host and end-to-end headers go on; hop-by-hop ones, those Connection names, and the
    body's framing do not; the client is appended to X-Forwarded-For."""
    sent = Headers(
        {
            b"Host": [b"canner.example:8080"],
            b"Authorization": [b"Bearer t"],
            b"Connection": [b"keep-alive, X-Private"],
            b"Keep-Alive": [b"timeout=5"],
            b"X-Private": [b"1"],
            b"Transfer-Encoding": [b"chunked"],
            b"TE": [b"trailers"],
            b"Upgrade": [b"h2c"],
            b"Proxy-Authorization": [b"Basic x"],
            b"Content-Length": [b"12"],
            b"Expect": [b"100-continue"],
            b"Accept": [b"application/json"],
        }
    )
    out = forwarded_headers(sent, "192.0.2.7")
    names = {name.lower() for name, _ in out.getAllRawHeaders()}
    assert names == {b"host", b"authorization", b"accept", b"x-forwarded-for"}
    assert out.getRawHeaders(b"host") == [b"canner.example:8080"]
    assert out.getRawHeaders(b"x-forwarded-for") == [b"192.0.2.7"]
    chained = forwarded_headers(Headers({b"X-Forwarded-For": [b"10.0.0.1, 10.0.0.2"]}), "::1")
    assert chained.getRawHeaders(b"x-forwarded-for") == [b"10.0.0.1, 10.0.0.2, ::1"]


def test_answer_headers_drop_hop_by_hop_and_the_length() -> None:
    """An answer's own headers reach the client; its connection's and its length do not."""
    got = Headers(
        {
            b"Content-Type": [b"text/html"],
            b"Retry-After": [b"5"],
            b"Connection": [b"close"],
            b"Transfer-Encoding": [b"chunked"],
            b"Content-Length": [b"3"],
        }
    )
    names = {name.lower() for name, _ in answer_headers(got).getAllRawHeaders()}
    assert names == {b"content-type", b"retry-after"}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([b"203.0.113.5"], IPv4Address("TCP", "203.0.113.5", 0)),
        ([b"10.1.1.1, 203.0.113.5"], IPv4Address("TCP", "203.0.113.5", 0)),
        ([b"10.1.1.1", b"2001:db8::1"], IPv6Address("TCP", "2001:db8::1", 0)),
        ([b"not-an-address"], None),
        ([], None),
    ],
)
def test_the_forwarded_client_is_the_last_entry(
    values: list[bytes], expected: IPv4Address | IPv6Address | None
) -> None:
    """The entry the worker added (the last) is the client; anything not an address is none."""
    headers = Headers({b"X-Forwarded-For": values} if values else {})
    assert forwarded_client(headers) == expected


def test_the_node_wide_routes_are_the_view_and_hq() -> None:
    """Status page, readiness, metrics and HQ's API are the node's; health, receipts and doors
    are each worker's."""
    wide = {
        (b"GET", b"/"),
        (b"GET", b"/readyz"),
        (b"GET", b"/metrics"),
        (b"POST", b"/api/v1/releases"),
        (b"GET", b"/api/v1/objects/" + b"0" * 32),
        (b"POST", b"/api/v1/objects:query"),
    }
    own = {
        (b"GET", b"/healthz"),
        (b"GET", b"/api/v1/receipts/" + b"0" * 32),
        (b"POST", b"/files/"),
        (b"PATCH", b"/files/abc"),
        (b"PUT", b"/seesaw/p/d/f"),
        (b"GET", b"/nothing"),
    }
    assert all(route(m, p).node_wide for m, p in wide)
    assert not any(route(m, p).node_wide for m, p in own)
    assert route(b"GET", b"/readyz").kind is Kind.READY


def test_listen_description_escapes_the_address() -> None:
    assert listen_description("\0a:b=c") == "unix:\0a\\:b\\=c:lockfile=0"


# -- the merge --------------------------------------------------------------------------------


def _process(
    accepted: int,
    rss: float,
    started: float,
    free: float,
    seconds: tuple[float, ...] = (),
    worker_only: bool = False,
) -> str:
    """One process's exposition: a counter, a histogram, process gauges and a survey gauge."""
    registry = CollectorRegistry()
    counter = Counter("canner_uploads_accepted", "Accepted", ["project"], registry=registry)
    if accepted:
        counter.labels("example").inc(accepted)
    histogram = Histogram("canner_acceptance_seconds", "s", buckets=(0.1, 1), registry=registry)
    for s in seconds:
        histogram.observe(s)
    Gauge("process_resident_memory_bytes", "rss", registry=registry).set(rss)
    Gauge("process_start_time_seconds", "start", registry=registry).set(started)
    Gauge("canner_data_free_bytes", "free", registry=registry).set(free)
    if worker_only:
        Gauge("canner_worker_only", "w", registry=registry).set(7)
    cpu = Counter("process_cpu_seconds", "cpu", registry=registry)
    cpu.inc(rss / 1000)
    return generate_latest(registry).decode()


def _values(families: list[object]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = render(families)  # type: ignore[arg-type]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parse(text.decode())
        for s in family.samples
    }


ACCEPTED = ("canner_uploads_accepted_total", (("project", "example"),))


def test_counters_and_histograms_sum_and_the_parents_gauges_stand() -> None:
    """Counters and histogram buckets add up over the parent and the workers; process memory
    sums; start time and the survey's gauges are the parent's; each process shows apart."""
    parent = parse(_process(1, 1000, 50.0, 999, (0.05,)))
    one = parse(_process(2, 2000, 60.0, 5, (0.5, 2.0), worker_only=True))
    two = parse(_process(3, 3000, 70.0, 6, (0.05,)))
    got = _values(merge(parent, [one, two]))
    assert got[ACCEPTED] == 6
    assert got[("canner_acceptance_seconds_bucket", (("le", "0.1"),))] == 2
    assert got[("canner_acceptance_seconds_bucket", (("le", "1.0"),))] == 3
    assert got[("canner_acceptance_seconds_bucket", (("le", "+Inf"),))] == 4
    assert got[("canner_acceptance_seconds_count", ())] == 4
    assert got[("canner_acceptance_seconds_sum", ())] == pytest.approx(2.6)
    assert got[("process_resident_memory_bytes", ())] == 6000
    assert got[("process_cpu_seconds_total", ())] == pytest.approx(6)
    assert got[("process_start_time_seconds", ())] == 50.0
    assert got[("canner_data_free_bytes", ())] == 999
    assert got[("canner_worker_only", ())] == 7
    per = "canner_process_resident_memory_bytes"
    assert got[(per, (("process", "parent"),))] == 1000
    assert got[(per, (("process", "1"),))] == 2000
    assert got[(per, (("process", "2"),))] == 3000
    assert got[("canner_process_cpu_seconds_total", (("process", "2"),))] == pytest.approx(3)


def test_an_absent_worker_is_left_out_but_carried_counts_are_added() -> None:
    """A worker that did not answer adds no gauge; counts carried (its last answer, an earlier
    run) add to the counters only."""
    parent = parse(_process(1, 1000, 50.0, 999))
    last = parse(_process(4, 4000, 60.0, 5))
    got = _values(merge(parent, [None], [last]))
    assert got[ACCEPTED] == 5
    assert got[("process_resident_memory_bytes", ())] == 1000
    assert ("canner_process_resident_memory_bytes", (("process", "1"),)) not in got


# -- scraping over time ---------------------------------------------------------------------


def _node(answers: dict[str, list[Deferred[bytes]]], parent: str) -> tuple[NodeMetrics, Clock]:
    clock = Clock()

    def fetch(address: str) -> Deferred[bytes]:
        return answers[address].pop(0)

    node = NodeMetrics(lambda: parent.encode(), ["w0", "w1"], fetch, clock)
    return node, clock


def _scrape(node: NodeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = succeeded(ensureDeferred(node.render()))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parse(text.decode())
        for s in family.samples
    }


def _answer(accepted: int, started: float) -> Deferred[bytes]:
    return succeed(_process(accepted, 100, started, 0).encode())


def test_the_nodes_counters_never_go_back_when_a_worker_fails_or_restarts() -> None:
    """Unreachable: counted, its last counts kept.  Restarted (a new start time, counters from
    0): what the earlier run counted is carried.  The node's counter only rises."""
    parent = _process(1, 1000, 50.0, 999)
    answers = {
        "w0": [_answer(2, 60.0), fail(ConnectionRefusedError()), _answer(1, 90.0)],
        "w1": [_answer(3, 70.0), _answer(4, 70.0), _answer(5, 70.0)],
    }
    node, _ = _node(answers, parent)
    first = _scrape(node)
    assert first[ACCEPTED] == 6
    assert first[("canner_receiver_workers_unreachable", ())] == 0
    second = _scrape(node)
    assert second[ACCEPTED] == 7  # w0 unreachable: its 2 kept; w1 now 4
    assert second[("canner_receiver_workers_unreachable", ())] == 1
    assert ("canner_process_resident_memory_bytes", (("process", "1"),)) not in second
    third = _scrape(node)
    assert third[ACCEPTED] == 1 + 2 + 1 + 5  # w0 restarted: its earlier 2 carried
    assert third[("canner_receiver_workers_unreachable", ())] == 0


def test_a_worker_slower_than_the_deadline_is_unreachable() -> None:
    """A worker that does not answer within the timeout is left out; the page still comes."""
    parent = _process(1, 1000, 50.0, 999)
    answers = {"w0": [Deferred()], "w1": [_answer(3, 70.0)]}
    node, clock = _node(answers, parent)
    page = ensureDeferred(node.render())
    clock.advance(node.timeout + 0.1)
    text = succeeded(page).decode()
    got = {s.name: s.value for f in parse(text) for s in f.samples if not s.labels}
    assert got["canner_receiver_workers_unreachable"] == 1
    assert clock.getDelayedCalls() == []


# -- readiness and the status page --------------------------------------------------------------


class _Roster:
    def __init__(self, configured: int, running: int, restarts: int = 0) -> None:
        self._c, self._r, self._x = configured, running, restarts

    def configured(self) -> int:
        return self._c

    def running(self) -> int:
        return self._r

    def restarts(self) -> int:
        return self._x


def test_readiness_is_not_ready_while_workers_are_missing() -> None:
    """Every worker listening: as the check says, with the count.  One missing: not ready,
    naming it, beside the check's own reasons."""
    ok = Readiness(True, (), 100, 0)
    assert with_workers(lambda: ok, _Roster(2, 2))().as_dict() == {
        **ok.as_dict(),
        "workers": {"configured": 2, "running": 2, "restarts": 0},
    }
    short = with_workers(lambda: Readiness(False, ("draining",), 100), _Roster(2, 1, 3))()
    assert not short.ready
    assert short.reasons == ("draining", "1 of 2 receiver workers are listening")
    assert short.as_dict()["workers"] == {"configured": 2, "running": 1, "restarts": 3}
    assert "workers" not in ok.as_dict()  # one process: the answer of today


def test_the_status_page_counts_the_workers(tmp_path: Path) -> None:
    """The header says how many workers listen (and restarts); missing ones are a warning."""
    survey = take_survey(tmp_path, ObjectIds(), NOW)
    alone = render_status(StatusView("i", survey, 1, ())).decode()
    assert 'id="workers"' not in alone
    full = render_status(StatusView("i", survey, 1, (), workers=WorkerCount(2, 2))).decode()
    assert "2 of 2 workers" in full and "restart" not in full
    short = render_status(StatusView("i", survey, 1, (), workers=WorkerCount(2, 1, 1))).decode()
    assert "1 of 2 workers" in short and "1 restart" in short
    assert "warning: 1 of 2 receiver workers are listening" in short
