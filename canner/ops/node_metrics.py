"""One ``/metrics`` for a receiver that runs workers: the parent's registry merged with every
worker's, so that the node's counters add up.

:func:`merge` is pure.  Counters, histograms and summaries are summed by sample name and labels
(uploads accepted by two workers are the node's ``canner_uploads_accepted_total``).  The
process's gauges (resident and virtual memory, open and maximum file descriptors) are summed
into the node's; ``process_start_time_seconds`` is the parent's.  Every other gauge (the
survey's, ``canner_build_info``, the rsync backlog) is the parent's: it owns the data
directory and runs the survey; a gauge only workers have is the first one's.  Memory, CPU
seconds and open file descriptors are also given per process, in ``canner_process_*`` families
with a ``process`` label (``parent``, or the worker's index), where one worker's growth shows.

:class:`NodeMetrics` scrapes the workers for each request of the parent's ``/metrics`` (all at
once, each within a deadline) and merges.  A worker that does not answer is counted in
``canner_receiver_workers_unreachable`` and left out of the gauges, but its counters keep the
values of its last answer; a restarted worker's counters start again from 0, so what its
earlier run counted is carried.  The node's counters therefore never go backwards (a rate()
over them sees no false reset) while the same parent runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from attrs import define, field
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IResponse

from canner.ops.node import worker_metrics_address
from canner.web.proxy import unix_agent

log = Logger()

Families = list[Metric]
# Types whose samples count since the process started: the node's value is the sum.
CUMULATIVE = frozenset({"counter", "histogram", "summary"})
# The process's gauges that add up to the node's.
SUMMED_GAUGES = frozenset(
    {
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
    }
)
START_TIME = "process_start_time_seconds"
# family -> (its per-process family, type, help)
PER_PROCESS = {
    "process_resident_memory_bytes": (
        "canner_process_resident_memory_bytes",
        "gauge",
        "Resident memory of each process of the receiver, in bytes",
    ),
    "process_cpu_seconds": (
        "canner_process_cpu_seconds",
        "counter",
        "CPU seconds of each process of the receiver (user and system)",
    ),
    "process_open_fds": (
        "canner_process_open_fds",
        "gauge",
        "Open file descriptors of each process of the receiver",
    ),
}
PARENT = "parent"
UNREACHABLE = "canner_receiver_workers_unreachable"
# A worker's metrics page is some tens of kB; more than this is no metrics page.
MAX_SCRAPE_BYTES = 8 * 1024 * 1024


def parse(text: str) -> Families:
    """The metric families of a text exposition (raises ValueError when it is not one)."""
    return list(text_string_to_metric_families(text))


def _key(sample: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample.name, tuple(sorted(sample.labels.items()))


@define
class _Family:
    name: str
    documentation: str
    type: str
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = field(factory=dict)

    def add(self, sample: Sample) -> None:
        key = _key(sample)
        known = self.samples.get(key)
        if known is None:
            self.samples[key] = Sample(sample.name, dict(sample.labels), sample.value)
        else:
            self.samples[key] = known._replace(value=known.value + sample.value)

    def keep_first(self, sample: Sample) -> None:
        self.samples.setdefault(
            _key(sample), Sample(sample.name, dict(sample.labels), sample.value)
        )

    def metric(self) -> Metric:
        metric = Metric(self.name, self.documentation, self.type)
        metric.samples = list(self.samples.values())
        return metric


def _summed(metric: Metric) -> bool:
    return metric.type in CUMULATIVE or metric.name in SUMMED_GAUGES


def merge(
    parent: Families, workers: Sequence[Families | None], carried: Sequence[Families] = ()
) -> Families:
    """The node's families: ``parent``'s merged with each worker's (None: the worker did not
    answer; its index is its place), and the cumulative families of ``carried`` (what earlier
    runs of restarted workers counted, or an unreachable worker's last answer) added to the
    sums.  Families come in the order first seen, the parent's first."""
    out: dict[str, _Family] = {}

    def family(metric: Metric) -> _Family:
        known = out.get(metric.name)
        if known is None:
            known = out[metric.name] = _Family(metric.name, metric.documentation, metric.type)
        return known

    for source, is_parent in ((parent, True), *((w, False) for w in workers if w is not None)):
        for metric in source:
            into = family(metric)
            for sample in metric.samples:
                if _summed(metric):
                    into.add(sample)
                elif is_parent or metric.name != START_TIME:
                    into.keep_first(sample)  # the parent's, being first
    for source in carried:
        for metric in source:
            if metric.type in CUMULATIVE:
                for sample in metric.samples:
                    family(metric).add(sample)
    merged = [f.metric() for f in out.values()]
    return merged + _per_process(parent, workers)


def _per_process(parent: Families, workers: Sequence[Families | None]) -> Families:
    """The per-process families of :data:`PER_PROCESS`, labelled ``process``."""
    families = {name: Metric(target, doc, typ) for name, (target, typ, doc) in PER_PROCESS.items()}
    # Workers are numbered 1 ... N, as the parent numbers them in its log.
    sources = [(PARENT, parent), *((str(i), w) for i, w in enumerate(workers, 1) if w is not None)]
    for process, source in sources:
        for metric in source:
            target = families.get(metric.name)
            if target is None:
                continue
            for sample in metric.samples:
                name = target.name + ("_total" if target.type == "counter" else "")
                target.add_sample(name, {**sample.labels, "process": process}, sample.value)
    return [f for f in families.values() if f.samples]


def cumulative(families: Families) -> Families:
    """Only the families whose samples count since the process started."""
    return [f for f in families if f.type in CUMULATIVE]


def start_time(families: Families) -> float | None:
    """The process start time a worker's families give (None: not exported)."""
    for metric in families:
        if metric.name == START_TIME and metric.samples:
            return float(metric.samples[0].value)
    return None


@define(eq=False)
class _Fixed(Collector):
    _families: Families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def render(families: Families) -> bytes:
    """The text exposition format of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry)


# -- scraping the workers -------------------------------------------------------------------


@define
class WorkerSlot:
    """What the parent remembers of worker ``index``: its last answer and start time, and what
    its earlier runs counted."""

    last: Families | None = None
    started: float | None = None
    carried: Families = field(factory=list)

    def answered(self, families: Families) -> None:
        started = start_time(families)
        if self.last is not None and started != self.started:
            # A new run of this worker: its counters start again from 0; keep what it counted.
            self.carried = cumulative(merge([], [], [self.carried, self.last]))
        self.last, self.started = families, started


class _Collect(Protocol):
    """Reads a response body of at most ``limit`` bytes."""

    def __init__(self, done: Deferred[bytes], limit: int) -> None:
        self._done = done
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._limit:
            self._parts = []
            transport: Any = self.transport
            transport.stopProducing()
            return
        self._parts.append(data)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        if self._done.called:
            return
        if self._size > self._limit:
            self._done.errback(ValueError(f"over {self._limit} bytes"))
        elif reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback(b"".join(self._parts))
        else:
            self._done.errback(reason)


def _read(response: IResponse, limit: int) -> Deferred[bytes]:
    if response.code != 200:
        raise ValueError(f"answered {response.code}")
    collector: list[_Collect] = []

    def cancel(_: Deferred[bytes]) -> None:
        transport: Any = collector[0].transport if collector else None
        if transport is not None:
            transport.stopProducing()

    done: Deferred[bytes] = Deferred(cancel)
    protocol = _Collect(done, limit)
    collector.append(protocol)
    response.deliverBody(protocol)
    return done


@define(eq=False)
class UnixScraper:
    """``GET /metrics`` of the site on a unix socket, a connection per scrape (cheap on a unix
    socket; a worker that went away is never asked over a connection it left)."""

    _reactor: Any
    _agents: dict[str, Any] = field(factory=dict)
    _pools: list[Any] = field(factory=list)

    def __call__(self, address: str) -> Deferred[bytes]:
        agent = self._agents.get(address)
        if agent is None:
            agent, pool = unix_agent(self._reactor, address, persistent=False)
            self._agents[address] = agent
            self._pools.append(pool)
        asked: Deferred[IResponse] = agent.request(b"GET", b"http://canner-node/metrics")
        body: Deferred[bytes] = asked.addCallback(_read, MAX_SCRAPE_BYTES)
        return body

    def close(self) -> Deferred[Any]:
        return DeferredList([p.closeCachedConnections() for p in self._pools])


@define(eq=False)
class NodeMetrics:
    """The parent's ``/metrics``: its own registry (``own``, rendered) merged with the metrics
    of the workers at ``addresses`` (index order), each fetched by ``fetch`` within
    ``timeout`` seconds.  Reactor thread only."""

    _own: Callable[[], bytes]
    _addresses: Sequence[str]
    _fetch: Callable[[str], Deferred[bytes]]
    _reactor: Any
    timeout: float = 2.0
    _slots: list[WorkerSlot] = field(init=False)

    def __attrs_post_init__(self) -> None:
        self._slots = [WorkerSlot() for _ in self._addresses]

    @classmethod
    def for_parent(
        cls, own: Callable[[], bytes], private_dir: Path, workers: int, reactor: Any
    ) -> tuple[NodeMetrics, UnixScraper]:
        """The node's metrics with ``workers`` workers (1 ... N), each at its
        :func:`~canner.ops.node.worker_metrics_address` in the node's ``private_dir``, and the
        scraper to close on stop."""
        addresses = [worker_metrics_address(private_dir, i) for i in range(1, workers + 1)]
        scraper = UnixScraper(reactor)
        return cls(own, addresses, scraper, reactor), scraper

    def _one(self, address: str) -> Deferred[Families | None]:
        def failed(failure: Failure) -> None:
            log.warn(
                "worker metrics at {address} not read: {error}",
                address=address.replace("\0", "@"),
                error=str(failure.value) or type(failure.value).__name__,
            )

        fetched = self._fetch(address)
        fetched.addTimeout(self.timeout, self._reactor)
        parsed: Deferred[Families | None] = fetched.addCallback(
            lambda body: parse(body.decode("utf-8"))
        )
        return parsed.addErrback(failed)

    async def render(self) -> bytes:
        """The node's metrics, in the text exposition format."""
        answers = await DeferredList([self._one(a) for a in self._addresses], consumeErrors=True)
        current: list[Families | None] = []
        carried: list[Families] = []
        for slot, (_, families) in zip(self._slots, answers, strict=True):
            if families is None:
                if slot.last is not None:
                    carried.append(slot.last)
            else:
                slot.answered(families)
            current.append(families)
            carried.append(slot.carried)
        unreachable = sum(1 for f in current if f is None)
        merged = merge(parse(self._own().decode("utf-8")), current, carried)
        merged.append(
            GaugeMetricFamily(
                UNREACHABLE,
                "Worker processes whose metrics did not answer this scrape (left out of the"
                " gauges; their counters keep their last values)",
                value=unreachable,
            )
        )
        return render(merged)
