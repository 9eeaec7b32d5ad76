"""Composition roots: the only place that knows the whole object graph of each daemon.

``receiver_service(config, reactor)`` and ``deliver_service(config, reactor)`` build each
daemon's :class:`DaemonRoot`.  Work that can fail at
start-up (directories, the delivery index schema, the manhole's keys) happens here, so a failure
aborts the launch with a clear message.  Services stop in reverse order of addition, the listener
first; the thread pools (and deliver's heartbeat) only once every other service has stopped, and
the index and the lock after them.  Metrics and the status page's recent errors are fed by log
observers (:class:`LogObservers`) added to the process's log publisher while the daemon runs.
"""

from __future__ import annotations

import errno
import gc
import grp
import os
import pwd
import signal
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, cast

from attrs import define, field, frozen
from twisted.application import strports
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import ILogObserver, Logger, LogPublisher, globalLogPublisher
from twisted.web.server import Site

from canner import fs
from canner.acceptance import Acceptance
from canner.blocking import BlockingRunner, ThreadPoolRunner
from canner.config import Config, ConfigError, check_data_dir
from canner.connections import ConnectionLimits, raise_open_file_limit, usable_connections
from canner.delivery import index as sql
from canner.delivery.index import DeliveryIndex, IndexFeed, open_pool, upgrade_schema
from canner.delivery.liveness import HeartbeatService, InFlight, index_answers
from canner.delivery.rescan import ReceiptRescan
from canner.delivery.scheduler import DeliveryService, planner
from canner.fs import DataDirLock, Locked
from canner.hq import HQRoutes, Lookups, Releases
from canner.inventory import take_survey
from canner.journal import Journal, JournalLog
from canner.ledger.files import ArchivedIds, LedgerDir
from canner.ledger.service import LedgerService, validate_ledger
from canner.manhole import OperatorHelpers, manhole_service
from canner.metrics import (
    DELIVER,
    RECEIVER,
    Metrics,
    MetricsPage,
    SurveyCache,
    SurveyCollector,
)
from canner.objects import ObjectReader
from canner.observe import OutboundObserver, UploadObserver
from canner.packaging import batches as packaging_sql
from canner.packaging.pipeline import PackagingService
from canner.packaging.store import PackageStore
from canner.readiness import FloorWatch, check_readiness
from canner.receipts import Origin, Receipt, ReceiptStore
from canner.receiver import receiver_site
from canner.releases import TokenFile, TokenFileError
from canner.sinks.base import Sink
from canner.sinks.credentials import CredentialsError, load_credentials
from canner.sinks.internet_archive import IASink
from canner.sinks.projects import project_sinks
from canner.sinks.transport import make_http_client
from canner.status_page import RecentProblems, StatusSource
from canner.systemd import SystemdNotifier
from canner.trends import SAMPLE_INTERVAL, record_sample
from canner.tus.channel import ReceiverSite
from canner.tus.intake import UploadIntake
from canner.tus.routes import TusRoutes
from canner.tus.store import UploadStore
from canner.tus.sweep import SweepReport, sweep_stale
from canner.version import version

log = Logger()

Observer = Callable[[Mapping[str, Any]], None]

IO_THREADS = 16
HASH_THREADS = 2
LEDGER_THREADS = 32


@define(eq=False)
class PeriodicService(Service):
    """Runs ``job`` every ``interval`` seconds on the given clock; a failing run is logged, never
    fatal, and runs never overlap (the next waits for a returned Deferred)."""

    _clock: Any
    _interval: float
    _job: Callable[[], Deferred[Any]]
    _label: str
    _loop: LoopingCall = field(init=False)
    _done: Deferred[Any] | None = None

    def __attrs_post_init__(self) -> None:
        self._loop = LoopingCall(self._guarded)
        self._loop.clock = self._clock

    def _guarded(self) -> Deferred[Any]:
        return self._job().addErrback(lambda f: log.failure("{label} failed", f, label=self._label))

    def startService(self) -> None:
        super().startService()
        self._done = self._loop.start(self._interval, now=True)

    def stopService(self) -> Deferred[Any] | None:
        super().stopService()
        if self._loop.running:
            self._loop.stop()
        return self._done


@define(eq=False)
class DaemonRoot(MultiService):
    """A daemon's top service.  Its children stop the way MultiService stops them (all at once,
    last added first); what joined through :meth:`outlive` started before them and stops only
    once every child has finished stopping, one at a time, last added first; then
    ``on_stopped`` runs (close the index, free the lock).

    Thread pools outlive the children: a child's in-flight work (a rescan between two batches, a
    build between two chunks) still runs blocking steps while the child stops, and a stopped
    pool would never answer them, so the process would wait for ever.
    """

    _on_stopped: Callable[[], None] = lambda: None
    _outliving: list[IService] = field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        MultiService.__init__(self)

    def outlive(self, service: IService) -> None:
        """Start ``service`` before the children, and stop it after all of them."""
        self._outliving.append(service)

    def startService(self) -> None:
        for service in self._outliving:
            service.startService()
        super().startService()

    def stopService(self) -> Deferred[None]:
        d: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return d

    async def _stop(self) -> None:
        await super().stopService()
        for service in reversed(self._outliving):
            try:
                await maybeDeferred(service.stopService)
            except Exception:
                log.failure("stopping {service}", service=service)
        self._on_stopped()


def quiet_repeated_stop_signals(reactor: Any) -> None:
    """Once the process has begun to stop, a further SIGTERM or SIGINT is only logged.

    The first one still goes to Twisted's handler, which stops the reactor.  Twisted would take
    a second one as another request to stop the stopping reactor and log a critical
    ``ReactorNotRunning`` traceback; the stop under way goes on either way, and SIGKILL still
    ends the process at once.  Call it once per process, with the global reactor."""
    stopping = False

    def stop_begins() -> None:
        nonlocal stopping
        stopping = True

    def once(first: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
        def handler(signum: int, frame: Any) -> None:
            if stopping:
                name = signal.Signals(signum).name
                log.info("{signal} while stopping: already stopping", signal=name)
                return
            stop_begins()
            first(signum, frame)

        return handler

    def wrap_handlers() -> None:  # once the reactor has installed its own
        for signum in (signal.SIGTERM, signal.SIGINT):
            first = signal.getsignal(signum)
            if callable(first):
                signal.signal(signum, once(first))

    reactor.callWhenRunning(wrap_handlers)
    reactor.addSystemEventTrigger("before", "shutdown", stop_begins)


@define(eq=False)
class ShutdownHook(Service):
    """Calls ``on_stop`` when the process begins to stop (add it last: it stops first)."""

    _on_stop: Callable[[], None]

    def stopService(self) -> None:
        super().stopService()
        self._on_stop()


class Listening(MultiService):
    """A listener whose failure to listen (port in use, no permission) ends start-up with one
    clear line instead of a traceback."""

    def __init__(self, description: str, factory: Any, reactor: Any, what: str) -> None:
        super().__init__()
        self._description = description
        self._what = what
        strports.service(description, factory, reactor=reactor).setServiceParent(self)

    def _refuse(self, error: CannotListenError) -> NoReturn:
        reason = error.socketError
        text = getattr(reason, "strerror", None) or str(reason)
        raise SystemExit(f"canner: cannot listen on {self._description} ({self._what}): {text}")

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except CannotListenError as e:
            self._refuse(e)

    def startService(self) -> None:
        try:
            super().startService()
        except CannotListenError as e:
            self._refuse(e)


@define(eq=False)
class LogObservers(Service):
    """Adds ``observers`` to ``publisher`` while running (add it early: it stops late)."""

    _publisher: LogPublisher
    _observers: Iterable[Observer]

    def startService(self) -> None:
        super().startService()
        for observer in self._observers:
            self._publisher.addObserver(cast(ILogObserver, observer))

    def stopService(self) -> None:
        super().stopService()
        for observer in self._observers:
            self._publisher.removeObserver(cast(ILogObserver, observer))


def _operator_surfaces(
    config: Config,
    role: str,
    top: MultiService,
    run: BlockingRunner,
    reactor: Any,
    publisher: LogPublisher,
    observers: Iterable[Observer] = (),
    in_flight: InFlight | None = None,
) -> tuple[Metrics, SurveyCache]:
    """The process's metrics, the survey cache behind their gauges, and ``observers`` of the
    log (added to ``top``)."""
    metrics = Metrics(role, config.projects)
    LogObservers(publisher, list(observers)).setServiceParent(top)
    cache = SurveyCache(run, partial(take_survey, config.data_dir, config.object_ids), reactor)
    metrics.register(SurveyCollector(cache, config.min_free_bytes, in_flight))
    return metrics, cache


def _survey_and_floor(cache: SurveyCache, floor: FloorWatch) -> Deferred[None]:
    """Refresh the metrics survey; its free bytes also tell the floor watch, so crossing the
    floor is logged even while no upload arrives."""

    def observe(_: object) -> None:
        if cache.latest is not None:
            floor.observe(cache.latest.free_bytes)

    return cache.refresh().addCallback(observe)


def _trend_sampler(config: Config, index: DeliveryIndex, reactor: Any) -> IService:
    """Records a trend sample in ``delivery.sqlite`` every minute (both daemons do)."""

    def sample() -> Deferred[Any]:
        return index.run(record_sample, config.data_dir, reactor.seconds())

    return PeriodicService(reactor, SAMPLE_INTERVAL, sample, "trend sample")


def _item_urls(config: Config) -> dict[str, str]:
    return {
        pid: p.delivery.metadata_url for pid, p in config.projects.items() if p.delivery is not None
    }


def _add_manhole(
    config: Config, role: str, namespace: dict[str, Any], run: BlockingRunner, reactor: Any
) -> IService | None:
    """The role's manhole (None when not configured); its helpers join ``namespace``."""
    if config.manhole is None:
        return None
    helpers = OperatorHelpers(config.data_dir, config.object_ids, run, reactor)
    return manhole_service(config.manhole, role, helpers.bind(namespace), reactor)


class CannotStart(Exception):
    """Start-up is refused for a reason the operator must fix; ``str()`` is the one line that
    says what and how."""


# What each daemon writes directly in its data directory (which is always checked, first);
# files inside these directories are theirs too.
RECEIVER_WRITES = (
    "uploads",
    "receipts",
    "journal",
    "delivery.sqlite",
    "delivery.sqlite-wal",
    "delivery.sqlite-shm",
)
DELIVER_WRITES = (*RECEIVER_WRITES, "ledger", "deliver.lock")


def _process_user() -> tuple[str, str]:
    """The user and group names this process runs as (numbers when they have no name)."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return user, group


def _unwritable(path: Path, tree: Path, error: OSError) -> CannotStart:
    """The one-line refusal for ``path`` (in ``tree``, which the fix names) that this process
    cannot write: the path, the user, the error and the fix."""
    user, group = _process_user()
    if error.errno in (errno.EACCES, errno.EPERM):
        fix = f"fix the ownership: chown -R {user}:{group} {tree}"
    elif error.errno == errno.EROFS:
        fix = "mount it read-write (under systemd: list data_dir in ReadWritePaths=)"
    else:
        fix = "check the disk under it (dmesg)"
    reason = error.strerror or str(error)
    return CannotStart(f"cannot write {path} as user {user}: {reason}; {fix}")


def _prepare_data_dir(config: Config, writes: Iterable[str]) -> tuple[UploadStore, ReceiptStore]:
    """``uploads/`` and ``receipts/`` in the existing data directory (:class:`ConfigError` when
    it is missing), and every path in ``writes`` writable by this process (:class:`CannotStart`
    naming the first that is not)."""
    data_dir = check_data_dir(config)
    path = data_dir
    try:
        fs.check_writable(data_dir)
        for sub in ("uploads", "receipts"):
            path = data_dir / sub
            path.mkdir(exist_ok=True)
            # A crash between linking a receipt and fsyncing its directory leaves a name that a
            # power cut could still erase: make every name durable before anything serves it.
            fs.fsync_dir(path)
        for name in writes:
            path = data_dir / name
            fs.check_writable(path)
    except OSError as e:
        raise _unwritable(path, data_dir, e) from None
    return UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")


def _index_feed(
    config: Config, reactor: Any
) -> tuple[Callable[[Receipt, Origin], None], Any, DeliveryIndex | None]:
    """The best-effort enqueue for acceptance; a broken index is logged, never fatal."""
    path = config.data_dir / "delivery.sqlite"
    try:
        upgrade_schema(path)
    except Exception as e:
        log.error(
            "delivery index {path} unusable, receipts will be picked up by the deliver rescan:"
            " {error}",
            path=str(path),
            error=str(e),
        )
        return (lambda receipt, origin: None), None, None
    pool = open_pool(path)
    index = DeliveryIndex(pool, reactor)
    return IndexFeed(index).enqueue, pool, index


def _connection_limits(config: Config) -> ConnectionLimits:
    open_files = raise_open_file_limit()
    total = usable_connections(config.connections.max, open_files)
    if total < config.connections.max:
        log.warn(
            "open-file limit {open_files} allows {total} client connections, not"
            " connections.max = {configured}; raise LimitNOFILE",
            open_files=open_files,
            total=total,
            configured=config.connections.max,
        )
    return ConnectionLimits(total, config.connections.max_per_client)


def _report_sweep(report: SweepReport, observer: UploadObserver) -> None:
    if report.removed:
        observer.stale_removed(len(report.removed))
        log.info("removed {count} stale uploads", count=len(report.removed), ids=report.removed)


def freeze_startup_objects() -> None:
    """Move every object start-up made (modules, config, the service tree: some 80,000 in the
    receiver) to the garbage collector's permanent generation.  Answered requests leave cyclic
    garbage (on the routes Klein serves, its and werkzeug's closures hold the request), so full
    collections come often; frozen objects are no longer walked by each of them."""
    gc.freeze()


@frozen
class ReceiverParts:
    """The receiver's request-serving objects (what :func:`receiver_parts` builds)."""

    acceptance: Acceptance
    intake: UploadIntake
    hq: HQRoutes
    site: ReceiverSite
    floor: FloorWatch
    journal: Journal


def receiver_parts(
    config: Config,
    uploads: UploadStore,
    receipts: ReceiptStore,
    *,
    run: BlockingRunner,
    hashing: BlockingRunner,
    clock: IReactorTime,
    enqueue: Callable[[Receipt, Origin], None],
    index: DeliveryIndex | None,
    metrics: Metrics,
    problems: RecentProblems,
    connection_limits: ConnectionLimits | None,
) -> ReceiverParts:
    """The receiver's HTTP site and everything behind it, from its collaborators: no threads,
    listeners or timers of its own, so the in-memory tests build the same graph with a
    ``Clock`` and inline runners."""
    acceptance = Acceptance(
        uploads=uploads,
        receipts=receipts,
        run=run,
        hash=hashing,
        clock=clock,
        issuer=config.issuer,
        enqueue=enqueue,
        observer=metrics,
    )
    floor = FloorWatch(config.min_free_bytes)
    status = StatusSource(
        run,
        partial(take_survey, config.data_dir, config.object_ids, history=True),
        clock,
        problems,
        config.issuer,
        config.min_free_bytes,
        version=version(),
        item_urls=_item_urls(config),
        started_at=clock.seconds(),
    )
    ready = partial(check_readiness, config.data_dir, config.min_free_bytes, floor)
    archived = ArchivedIds(LedgerDir(config.data_dir / "ledger"))
    reader = ObjectReader(config.data_dir, config.object_ids, config.issuer, archived)
    journal = Journal(config.data_dir / "journal")
    intake = UploadIntake(
        config=config,
        uploads=uploads,
        receipts=receipts,
        acceptance=acceptance,
        run=run,
        clock=clock,
        free_space_seen=floor.observe,
        purged_origin=reader.origin,
        observer=metrics,
    )
    hq = HQRoutes(
        Lookups(reader, run),
        reader,
        Releases(index, journal, archived, config.object_ids, run, clock),
        _hq_tokens(config),
        run,
    )
    site = receiver_site(
        intake,
        TusRoutes(intake, config.max_upload_bytes),
        config.object_ids,
        config.data_dir,
        run,
        metrics,
        status,
        ready,
        access_log=config.access_log,
        connection_limits=connection_limits,
        header_timeout=config.connections.header_timeout,
        hq=hq.app.resource(),
        reactor=clock,
    )
    return ReceiverParts(acceptance, intake, hq, site, floor, journal)


def receiver_service(
    config: Config, reactor: Any, log_publisher: LogPublisher = globalLogPublisher
) -> IService:
    """The receiver process: tus, receipts, health, the stale-upload sweep, status page,
    metrics and (when configured) the manhole."""
    uploads, receipts = _prepare_data_dir(config, RECEIVER_WRITES)
    io = ThreadPoolRunner(reactor, "canner-io", IO_THREADS)
    hashing = ThreadPoolRunner(reactor, "canner-hash", HASH_THREADS)
    run: BlockingRunner = io
    enqueue, pool, index = _index_feed(config, reactor)
    # The index closes once every service and thread pool has stopped.
    top = DaemonRoot(pool.close if pool is not None else lambda: None)
    top.outlive(io)
    top.outlive(hashing)
    problems = RecentProblems()
    metrics, survey_cache = _operator_surfaces(
        config, RECEIVER, top, run, reactor, log_publisher, [problems.observe]
    )
    parts = receiver_parts(
        config,
        uploads,
        receipts,
        run=run,
        hashing=hashing,
        clock=reactor,
        enqueue=enqueue,
        index=index,
        metrics=metrics,
        problems=problems,
        connection_limits=_connection_limits(config),
    )
    acceptance, intake, site, floor = parts.acceptance, parts.intake, parts.site, parts.floor
    journal = parts.journal
    PeriodicService(
        reactor,
        config.metrics.refresh,
        partial(_survey_and_floor, survey_cache, floor),
        "metrics survey",
    ).setServiceParent(top)
    if index is not None:
        _trend_sampler(config, index, reactor).setServiceParent(top)
    manhole = _add_manhole(
        config,
        RECEIVER,
        {
            "config": config,
            "services": top,
            "index": index,
            "intake": intake,
            "acceptance": acceptance,
            "uploads": uploads,
            "receipts": receipts,
            "site": site,
            "hq": parts.hq,
            "metrics": metrics,
            "sql": sql,
        },
        run,
        reactor,
    )
    if manhole is not None:
        manhole.setServiceParent(top)
    Listening(config.listen, site, reactor, "listen").setServiceParent(top)

    def sweep() -> Deferred[Any]:
        d = run(
            sweep_stale,
            uploads,
            receipts,
            journal,
            config.object_ids,
            reactor.seconds(),
            config.partial_upload_retention,
        )
        return d.addCallback(_report_sweep, metrics)

    interval = max(1.0, min(60.0, config.partial_upload_retention / 4))
    PeriodicService(reactor, interval, sweep, "stale upload sweep").setServiceParent(top)

    ShutdownHook(acceptance.stop).setServiceParent(top)
    # Last: by the time it starts the port listens (listeners listen in privilegedStartService).
    SystemdNotifier(reactor).setServiceParent(top)
    reactor.callWhenRunning(freeze_startup_objects)
    return top


RESCAN_INTERVAL = 3600.0


class DeliverLocked(CannotStart):
    """Another canner-deliver owns this data directory."""


def _sinks(
    config: Config, reactor: Any, run: BlockingRunner, hashing: BlockingRunner
) -> tuple[dict[str, Sink], dict[str, float]]:
    sinks = project_sinks(config, reactor, run, hashing)
    retention = {
        pid: project.delivery.local_artifact_retention
        for pid, project in config.projects.items()
        if project.delivery is not None
    }
    for pid, project in config.projects.items():
        if project.delivery is None:
            log.warn(
                "project {project} has no [projects.{project}.delivery]: its artifacts stay"
                " local and are never delivered or purged",
                project=pid,
            )
    return sinks, retention


def deliver_service(
    config: Config,
    reactor: Any,
    sinks: Mapping[str, Sink] | None = None,
    log_publisher: LogPublisher = globalLogPublisher,
) -> IService:
    """The deliver process: the queue, rescans, verification and purge; metrics on
    ``[metrics] deliver_listen`` and the manhole when configured.

    Raises :class:`DeliverLocked` when another deliver process owns the data directory.
    ``sinks`` replaces the configured sinks (tests).
    """
    # Made here, started with the process: sinks read payloads through them.
    io = ThreadPoolRunner(reactor, "canner-io", IO_THREADS)
    hashing = ThreadPoolRunner(reactor, "canner-hash", HASH_THREADS)
    if sinks is None:
        sinks, retention = _sinks(config, reactor, io, hashing)
    else:
        retention = {
            pid: (p.delivery.local_artifact_retention if p.delivery else 0.0)
            for pid, p in config.projects.items()
        }
    uploads, receipts = _prepare_data_dir(config, DELIVER_WRITES)
    # Megawarc projects are delivered a package at a time; the object queue serves the rest.
    packed = {
        pid: p
        for pid, p in config.projects.items()
        if p.packaging.megawarc and p.delivery is not None and pid in sinks
    }
    object_sinks = {pid: s for pid, s in sinks.items() if pid not in packed}
    packages = PackageStore(config.packages_path)
    if packed:
        try:
            packages.prepare()
            fs.check_writable(packages.root)
        except OSError as e:
            raise _unwritable(packages.root, packages.root, e) from None
    lock = DataDirLock(config.data_dir / "deliver.lock")
    try:
        lock.acquire()
    except Locked:
        raise DeliverLocked(
            f"another canner-deliver already owns {config.data_dir} (see deliver.lock)"
        ) from None
    except OSError as e:
        raise _unwritable(lock.path, config.data_dir, e) from None
    path = config.data_dir / "delivery.sqlite"
    upgrade_schema(path)
    pool = open_pool(path)
    index = DeliveryIndex(pool, reactor)

    def stopped() -> None:
        pool.close()
        delivery_log.close()
        lock.release()

    top = DaemonRoot(stopped)
    top.outlive(io)
    top.outlive(hashing)
    archived = ArchivedIds(LedgerDir(config.data_dir / "ledger"))
    # canner-deliver's delivery records; its ledger prunes the journal around the open segment.
    delivery_log = JournalLog(Journal(config.data_dir / "journal"))
    in_flight = InFlight(reactor)
    metrics, survey_cache = _operator_surfaces(
        config, DELIVER, top, io, reactor, log_publisher, in_flight=in_flight
    )
    ledger = _ledger_service(config, index, receipts, delivery_log, io, reactor, top, metrics)

    rescan: Callable[[], Deferred[Any]] = ReceiptRescan(
        index=index,
        receipts=receipts,
        uploads=uploads,
        journal=Journal(config.data_dir / "journal"),
        archived=archived.contains,
        object_ids=config.object_ids,
        run=io,
        now=reactor.seconds,
        keep_going=lambda: bool(top.running),
    ).run

    if ledger is not None:  # never while the ledger deletes records: it could re-insert them
        rescan = partial(ledger.guard.run, rescan)
    PeriodicService(reactor, RESCAN_INTERVAL, rescan, "receipt rescan").setServiceParent(top)
    scheduler = DeliveryService(
        index=index,
        uploads=uploads,
        receipts=receipts,
        journal=delivery_log,
        sinks=object_sinks,
        retention=retention,
        run=io,
        hash=hashing,
        clock=reactor,
        concurrency=config.delivery_concurrency,
        planner=planner(
            {pid: p.delivery for pid, p in config.projects.items() if p.delivery is not None}
        ),
        verify_timeouts={
            pid: p.delivery.verify_timeout
            for pid, p in config.projects.items()
            if p.delivery is not None
        },
        in_flight=in_flight,
        observer=metrics,
    )
    scheduler.setServiceParent(top)
    packing = ThreadPoolRunner(reactor, "canner-pack", config.packaging_concurrency)
    packaging = PackagingService(
        index=index,
        uploads=uploads,
        receipts=receipts,
        store=packages,
        projects=packed,
        sinks={pid: sinks[pid] for pid in packed},
        run=io,
        pack=packing,
        clock=reactor,
        build_concurrency=config.packaging_concurrency,
        min_free_bytes=config.min_free_bytes,
        delivery_concurrency=config.delivery_concurrency,
        in_flight=in_flight,
        archived=archived.contains,
        observer=metrics,
    )
    if packed:
        # A build in a thread ends at its next chunk once the service has asked it to stop.
        top.outlive(packing)
        packaging.setServiceParent(top)
    if ledger is not None:
        ledger.setServiceParent(top)
    # Stops after every child, before the thread pools: "stopped cleanly" is written only once
    # deliver's work has ended, while the index is still open.
    top.outlive(HeartbeatService(index, in_flight, reactor))
    _trend_sampler(config, index, reactor).setServiceParent(top)
    if config.metrics.deliver_listen is not None:
        PeriodicService(
            reactor, config.metrics.refresh, survey_cache.refresh, "metrics survey"
        ).setServiceParent(top)
        site = Site(MetricsPage(metrics).app.resource())
        site.displayTracebacks = False
        Listening(
            config.metrics.deliver_listen, site, reactor, "metrics.deliver_listen"
        ).setServiceParent(top)
    manhole = _add_manhole(
        config,
        DELIVER,
        {
            "config": config,
            "services": top,
            "index": index,
            "scheduler": scheduler,
            "packaging": packaging,
            "packages": packages,
            "packaging_sql": packaging_sql,
            "ledger": ledger,
            "sinks": sinks,
            "uploads": uploads,
            "receipts": receipts,
            "metrics": metrics,
            "sql": sql,
        },
        io,
        reactor,
    )
    if manhole is not None:
        manhole.setServiceParent(top)
    # Ready once the index answers a query through the daemon's own connection.
    SystemdNotifier(reactor, lambda: index.run(index_answers)).setServiceParent(top)
    reactor.callWhenRunning(freeze_startup_objects)
    return top


def _hq_tokens(config: Config) -> TokenFile | None:
    """The ``[hq] tokens`` file, read once now: an unreadable or malformed one refuses to start."""
    if config.hq is None:
        return None
    tokens = TokenFile(config.hq.tokens)
    try:
        tokens.current()
    except OSError as e:
        raise ConfigError("hq.tokens", f"cannot read {config.hq.tokens}: {e.strerror}") from None
    except TokenFileError as e:
        raise ConfigError("hq.tokens", f"{config.hq.tokens}: {e}") from None
    return tokens


def _ledger_service(
    config: Config,
    index: DeliveryIndex,
    receipts: ReceiptStore,
    journal: JournalLog,
    io: BlockingRunner,
    reactor: Any,
    top: DaemonRoot,
    observer: OutboundObserver,
) -> LedgerService | None:
    """The ledger of ``[ledger]`` (None without one); reads its credentials (blocking)."""
    ledger = config.ledger
    if ledger is None:
        return None
    validate_ledger(ledger)
    try:
        credentials = load_credentials(ledger.credentials)
    except CredentialsError as e:
        raise ConfigError("ledger.credentials", str(e)) from None
    sink = IASink(
        make_http_client(reactor),
        reactor,
        credentials,
        ledger.s3_url,
        ledger.metadata_url,
        io,
    )
    unlink = ThreadPoolRunner(reactor, "canner-ledger", LEDGER_THREADS)
    service = LedgerService(
        ledger,
        config.object_ids,
        index,
        config.data_dir / "delivery.sqlite",
        LedgerDir(config.data_dir / "ledger"),
        receipts,
        journal,
        config.data_dir / "uploads",
        sink,
        io,
        reactor,
        unlink=unlink,
        observer=observer,
    )
    top.outlive(unlink)
    return service
