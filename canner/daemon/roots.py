"""Composition roots: the only place that knows the whole object graph of each daemon.

``receiver_service(config, reactor)`` and ``deliver_service(config, reactor)`` build each
daemon's :class:`~canner.daemon.services.DaemonRoot` and do nothing else: the parts come from the
modules named after them.  Work that can fail at start-up (directories, the delivery index
schema, the manhole's keys) happens here, so a failure aborts the launch with a clear message.
Services stop in reverse order of addition, the listener first; the thread pools (and deliver's
heartbeat) only once every other service has stopped, and the index and the lock after them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from attrs import evolve, frozen
from twisted.application.service import IService
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger, LogPublisher, globalLogPublisher
from twisted.python.failure import Failure
from twisted.web.resource import IResource

from canner.accept.acceptance import Acceptance
from canner.accept.intake import UploadIntake
from canner.accept.origins import AcceptedOrigins, index_at_start, unindexed_among
from canner.blocking import BlockingRunner, ThreadPoolRunner
from canner.config import Config
from canner.daemon.deliver_parts import (
    DeliverBase,
    configured_sinks,
    deliver_metrics,
    ledger_parts,
    outbound_service,
    package_pipeline,
    packed_projects,
    receipt_rescan,
)
from canner.daemon.node import WorkerNode, settle_uploads
from canner.daemon.node_protocol import NodeState
from canner.daemon.services import (
    DaemonRoot,
    Listening,
    LogObservers,
    ShutdownHook,
    freeze_startup_objects,
)
from canner.daemon.site import NodeParent, receiver_site
from canner.daemon.startup import prepare_packages, upgrade_index
from canner.daemon.systemd import SystemdNotifier
from canner.delivery.index import (
    DeliveryIndex,
    damaged_index,
    is_damaged,
    open_pool,
    receiver_feed,
)
from canner.delivery.liveness import HeartbeatService, InFlight, index_answers
from canner.doors.base import DoorFactory, DoorParts
from canner.doors.router import DOORS, DoorRouter
from canner.doors.rsync.incoming import adoption_dir
from canner.doors.rsync.intake import RsyncIntake
from canner.fs import DataDirLock
from canner.hq.objects import ObjectReader
from canner.hq.routes import HQRoutes, Lookups, Releases, hq_tokens
from canner.ledger.files import ArchivedIds, LedgerDir
from canner.ops.inventory import InFlightScan
from canner.ops.manhole import daemon_manhole
from canner.ops.metrics import DELIVER, RECEIVER, Metrics, process_metrics
from canner.ops.node import RosterCollector
from canner.ops.node_metrics import NodeMetrics
from canner.ops.problems import RecentProblems, watching_start_up
from canner.ops.readiness import FloorWatch, check_readiness, with_workers
from canner.ops.status_page import StatusSource
from canner.ops.trends import SAMPLE_INTERVAL, record_sample
from canner.packaging import batches as packaging_sql
from canner.packaging.store import PackageStore
from canner.periodic import PeriodicService
from canner.sinks.base import Sink
from canner.store.datadir import (
    DELIVER_WRITES,
    RECEIVER_WRITES,
    lock_data_dir,
    lock_receiver_dir,
    prepare_data_dir,
)
from canner.store.journal import Journal, JournalLog
from canner.store.promises import Promises, sidecars_of, unreceipted
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.recovery import current_boot_id, cut_after_restart
from canner.store.sweep import StaleSweep, remove_whole_files
from canner.store.uploads import UploadStore
from canner.web.channel import ReceiverSite
from canner.web.connections import ConnectionCaps, connection_limits

log = Logger()

IO_THREADS = 16
HASH_THREADS = 2


def _trend_sampler(config: Config, index: DeliveryIndex, reactor: Any) -> IService:
    """Records a trend sample in ``delivery.sqlite`` every minute (both daemons do).  An index
    damaged while the daemon runs is one line naming the recovery a minute, not a traceback."""
    path = config.data_dir / "delivery.sqlite"

    def damaged(failure: Failure) -> Failure | None:
        if not is_damaged(failure.value):
            return failure
        log.error("trend sample not recorded: {damage}", damage=damaged_index(path, failure.value))
        return None

    def sample() -> Deferred[Any]:
        d = index.run(record_sample, config.data_dir, reactor.seconds())
        return d.addErrback(damaged)

    return PeriodicService(
        clock=reactor, interval=SAMPLE_INTERVAL, job=sample, label="trend sample"
    )


# -- canner-receiver ---------------------------------------------------------------------------


@frozen
class ReceiverParts:
    """The receiver's request-serving objects (what :func:`receiver_parts` builds)."""

    acceptance: Acceptance
    intake: UploadIntake
    origins: AcceptedOrigins
    hq: HQRoutes
    site: ReceiverSite
    floor: FloorWatch
    journal: Journal
    # The uploads in flight as the surveys (status page, metrics) look at them: the promises'.
    in_flight: InFlightScan


def receiver_parts(
    config: Config,
    *,
    uploads: UploadStore,
    receipts: ReceiptStore,
    run: BlockingRunner,
    hashing: BlockingRunner,
    clock: IReactorTime,
    enqueue: Callable[[Receipt, Origin], None],
    index: DeliveryIndex | None,
    metrics: Metrics,
    problems: RecentProblems,
    connection_limits: ConnectionCaps | None,
    doors: Sequence[DoorFactory] = DOORS,
    node: IResource | None = None,
    parent: NodeParent | None = None,
    promises: Promises | None = None,
    origins: AcceptedOrigins | None = None,
    take_over_elsewhere: Callable[[str], Deferred[bool]] | None = None,
) -> ReceiverParts:
    """The receiver's HTTP site and everything behind it, from its collaborators: no threads,
    listeners or timers of its own, so the in-memory tests build the same graph with a
    ``Clock`` and inline runners.  What a stop left of whole-file uploads is removed, every upload
    in flight is cut back to its durable offset after a restart of the machine, and the promises
    to uploads in flight are rebuilt from ``uploads/``, here (blocking, before anything listens;
    the caller holds ``receiver.lock``).  ``doors`` make the doors over HTTP (tests add one).
    On a node whose workers serve the socket: a worker's site forwards the node's view to
    ``node`` (a :class:`~canner.web.proxy.NodeProxy` to the parent's private socket); the
    parent's own site (on that socket, with ``connection_limits`` None: every request comes
    from a worker) takes ``parent``.

    A worker of a node (``[receiver] workers``, :mod:`canner.daemon.worker`) passes the node's
    stand-ins as ``promises``, ``origins`` and ``connection_limits``, and ``take_over_elsewhere``;
    then nothing is done at start (the parent did it)."""
    if promises is None:
        promises = receiver_start_up(config, uploads, receipts).promises
    if origins is None:
        origins = AcceptedOrigins(receipts=receipts, run=run, index=index)
    acceptance = Acceptance(
        uploads=uploads,
        receipts=receipts,
        run=run,
        hash=hashing,
        clock=clock,
        issuer=config.issuer,
        enqueue=enqueue,
        observer=metrics,
        origins=origins,
    )
    floor = FloorWatch(config.min_free_bytes)
    roster = parent.roster if parent is not None else None
    if roster is not None:
        metrics.register(RosterCollector(roster))
    in_flight = InFlightScan(promises.versions)
    status = StatusSource.for_config(
        config,
        run=run,
        clock=clock,
        problems=problems,
        roster=roster,
        in_flight=in_flight,
    )
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
        promises=promises,
        take_over_elsewhere=take_over_elsewhere,
    )
    releases = Releases(
        index=index,
        journal=journal,
        archived=archived,
        ids=config.object_ids,
        run=run,
        clock=clock,
    )
    lookups = Lookups(reader=reader, run=run)
    hq = HQRoutes(
        lookups=lookups, reader=reader, releases=releases, tokens=hq_tokens(config), run=run
    )
    ready = partial(check_readiness, config.data_dir, config.min_free_bytes, floor, promises)
    site = receiver_site(
        intake=intake,
        doors=DoorRouter.build(DoorParts(config=config, intake=intake, clock=clock), doors),
        ids=config.object_ids,
        data_dir=config.data_dir,
        run=run,
        metrics=metrics,
        status=status,
        ready=ready if roster is None else with_workers(ready, roster),
        access_log=config.access_log,
        connection_limits=connection_limits,
        header_timeout=config.connections.header_timeout,
        hq=hq.app.resource(),
        reactor=clock,
        node=node,
        metrics_page=parent.metrics.render if parent is not None else None,
        forwarded=parent is not None,
    )
    return ReceiverParts(acceptance, intake, origins, hq, site, floor, journal, in_flight)


@frozen
class StartedUp:
    """What :func:`receiver_start_up` leaves: the promises to the uploads in flight, every
    upload without a receipt it found (the stale-upload sweep's first watch list), and the ids
    of every origin record in ``receipts/`` (:func:`index_at_start`'s, dropped once it ran)."""

    promises: Promises
    unreceipted: frozenset[str]
    recorded: tuple[str, ...] = ()
    # Of ``unreceipted``, those whose sidecar could not be read (the sweep's first tick's).
    unreadable: frozenset[str] = frozenset()


def receiver_start_up(
    config: Config, uploads: UploadStore, receipts: ReceiptStore, index_path: Path | None = None
) -> StartedUp:
    """What a receiver does before it serves (blocking, under ``receiver.lock``): what a stop
    left of whole-file uploads is removed, every upload in flight is cut back to its durable
    offset after a restart of the machine; the promises to uploads in flight, from ``uploads/``.

    One pass: the uploads without a receipt (a listing of ``uploads/`` and a look for each
    one's receipt, :func:`~canner.store.promises.unreceipted`), then one read of each of their
    sidecars, which the three steps share; nothing of an accepted payload is read.  The one
    listing of ``receipts/`` names the origin records, which :func:`index_at_start` checks
    against the index; with ``index_path``, only those that index lacks as they are listed are
    kept (:func:`unindexed_among`), so no step holds the ids of the objects at rest."""
    ids = config.object_ids
    with unindexed_among(index_path) if index_path is not None else nullcontext(None) as keep:
        found = unreceipted(uploads, receipts, ids, with_origins=True, keep_origins=keep)
    in_flight = list(sidecars_of(uploads, receipts, sorted(found.sidecars)))
    removed = set(remove_whole_files(uploads, receipts, ids, in_flight))
    in_flight = [(upload_id, info) for upload_id, info in in_flight if upload_id not in removed]
    cut_after_restart(uploads, receipts, ids, config.data_dir, current_boot_id(), in_flight)
    promises = Promises.from_disk(uploads, receipts, ids, in_flight)
    unreadable = frozenset(upload_id for upload_id, info in in_flight if info is None)
    return StartedUp(promises, found.ids - removed, found.recorded, unreadable)


def receiver_service(
    config: Config,
    reactor: Any,
    log_publisher: LogPublisher = globalLogPublisher,
    config_path: Path | None = None,
) -> IService:
    """The receiver process: tus, receipts, health, the stale-upload sweep, status page,
    metrics and (when configured) the rsync intake and the manhole.  Raises
    :class:`~canner.store.datadir.ReceiverLocked` when another receiver serves the data
    directory.

    With ``[receiver] workers`` above 1 this process is the node's parent
    (:mod:`canner.daemon.node`): it does all of that but serve the public socket, which it
    opens and hands to that many worker processes (:mod:`canner.daemon.worker`, reading the
    config at ``config_path``); its own site listens on a private unix socket."""
    with watching_start_up(log_publisher) as problems:
        uploads, receipts = prepare_data_dir(config, RECEIVER_WRITES)
    # Before anything reads uploads/: a second receiver must not touch the first's uploads.
    lock = lock_receiver_dir(config)
    io = ThreadPoolRunner(reactor, "canner-io", IO_THREADS)
    hashing = ThreadPoolRunner(reactor, "canner-hash", HASH_THREADS)
    enqueue, pool, index = receiver_feed(config.data_dir / "delivery.sqlite", reactor)

    node: WorkerNode | None = None

    def stopped() -> None:
        if pool is not None:
            pool.close()
        if node is not None:
            node.remove_private_dir()
        lock.release()

    # The index closes, and the lock goes, once every service and thread pool has stopped.
    top = DaemonRoot(stopped)
    top.outlive(io)
    top.outlive(hashing)
    # Adding the observer again is a no-op; stopping removes it.
    LogObservers(log_publisher, [problems.observe]).setServiceParent(top)
    reactor.callWhenRunning(problems.started)
    metrics, survey_cache = process_metrics(config, RECEIVER, io, reactor)
    caps = connection_limits(config.connections)
    workers = config.receiver.workers
    # On a node, the one account, which the workers reach over their channels.
    index_path = config.data_dir / "delivery.sqlite"
    started = receiver_start_up(
        config, uploads, receipts, index_path if index is not None else None
    )
    if index is not None:
        # Before anything listens: a kill after a commit point may have left its row unwritten.
        # Only objects with an origin record can lack it (index_at_start): start-up listed them.
        index_at_start(
            index_path,
            receipts=receipts,
            uploads=uploads,
            journal=Journal(config.data_dir / "journal"),
            archived=ArchivedIds(LedgerDir(config.data_dir / "ledger")).contains,
            object_ids=config.object_ids,
            now=reactor.seconds,
            recorded=started.recorded,
        )
    started = evolve(started, recorded=())  # a million ids at rest are not kept past here
    promises = started.promises
    origins: AcceptedOrigins | None = None
    parent: NodeParent | None = None
    if workers > 1:
        assert config_path is not None, "a node's workers read the config file"
        origins = AcceptedOrigins(receipts=receipts, run=io, index=index)
        held_promises = promises
        node = WorkerNode.build(
            config,
            config_path,
            reactor,
            NodeState(promises=promises, limits=caps, origins=origins),
            lock,
            lambda held: io(settle_uploads, uploads, receipts, held_promises, held),
            log_publisher,
        )
        node_metrics, scraper = NodeMetrics.for_parent(
            metrics.render, node.private_dir, workers, reactor
        )
        parent = NodeParent(node.supervisor.roster, node_metrics)
        ShutdownHook(lambda: scraper.close().addCallback(lambda _: None)).setServiceParent(top)
    parts = receiver_parts(
        config,
        uploads=uploads,
        receipts=receipts,
        run=io,
        hashing=hashing,
        clock=reactor,
        enqueue=enqueue,
        index=index,
        metrics=metrics,
        problems=problems,
        # A node's parent serves only its private site: the caps count the workers' clients.
        connection_limits=caps if workers == 1 else None,
        promises=promises,
        origins=origins,
        parent=parent,
    )
    # The receiver's own account of its uploads in flight, instead of a walk of uploads/.
    survey_cache.in_flight = parts.in_flight
    PeriodicService(
        clock=reactor,
        interval=config.metrics.refresh,
        job=partial(survey_cache.refresh_and_tell, parts.floor.observe),
        label="metrics survey",
    ).setServiceParent(top)
    if index is not None:
        _trend_sampler(config, index, reactor).setServiceParent(top)
    manhole = daemon_manhole(
        config,
        RECEIVER,
        top,
        io,
        reactor,
        index=index,
        intake=parts.intake,
        acceptance=parts.acceptance,
        uploads=uploads,
        receipts=receipts,
        site=parts.site,
        hq=parts.hq,
        metrics=metrics,
        **({} if node is None else {"workers": node.supervisor.workers}),
    )
    if manhole is not None:
        manhole.setServiceParent(top)
    if node is None:
        Listening(
            description=config.listen, factory=parts.site, reactor=reactor, what="listen"
        ).setServiceParent(top)
    else:
        node.listener.setServiceParent(top)
        Listening(
            description=node.site_description,
            factory=parts.site,
            reactor=reactor,
            what="the node's own site",
        ).setServiceParent(top)
    sweep = StaleSweep(
        uploads=uploads,
        receipts=receipts,
        journal=parts.journal,
        ids=config.object_ids,
        retention=config.partial_upload_retention,
        run=io,
        clock=reactor,
        observer=metrics,
        promises=parts.intake.promises,
        adopting=adoption_dir(config.data_dir),
        watched=started.unreceipted,
        unreadable=started.unreadable,
    )
    PeriodicService(
        clock=reactor, interval=sweep.interval, job=sweep.sweep, label="stale upload sweep"
    ).setServiceParent(top)
    if config.rsync is not None:
        RsyncIntake.for_config(
            config,
            config.rsync,
            acceptance=parts.acceptance,
            uploads=uploads,
            receipts=receipts,
            io=io,
            hashing=hashing,
            reactor=reactor,
            observer=metrics,
        ).setServiceParent(top)
    ShutdownHook(parts.intake.stop).setServiceParent(top)
    ShutdownHook(parts.acceptance.stop).setServiceParent(top)
    if node is None:
        # Last: by the time it starts the port listens (listeners listen in
        # privilegedStartService).
        SystemdNotifier(reactor).setServiceParent(top)
    else:
        # Stops first: every worker has ended before the parent's own services stop.
        node.supervisor.setServiceParent(top)
        SystemdNotifier(reactor, node.supervisor.all_listening).setServiceParent(top)
    reactor.callWhenRunning(freeze_startup_objects)
    return top


# -- canner-deliver ----------------------------------------------------------------------------


def _deliver_root(
    config: Config, reactor: Any, lock: DataDirLock, *pools: ThreadPoolRunner
) -> tuple[DaemonRoot, DeliveryIndex, JournalLog]:
    """canner-deliver's root, which ``pools`` outlive, over its index (schema upgraded now) and
    its delivery records; once all has stopped it closes both and releases ``lock``."""
    upgrade_index(config.data_dir / "delivery.sqlite")
    pool = open_pool(config.data_dir / "delivery.sqlite")
    # canner-deliver's delivery records; its ledger prunes the journal around the open segment.
    delivery_log = JournalLog(Journal(config.data_dir / "journal"))

    def stopped() -> None:
        pool.close()
        delivery_log.close()
        lock.release()

    top = DaemonRoot(stopped)
    for runner in pools:
        top.outlive(runner)
    return top, DeliveryIndex(pool, reactor), delivery_log


def deliver_service(
    config: Config,
    reactor: Any,
    sinks: Mapping[str, Sink] | None = None,
) -> IService:
    """The deliver process: the outbound service, packaging, the ledger, rescans; metrics on
    ``[metrics] deliver_listen`` and the manhole when configured.  Raises
    :class:`~canner.store.datadir.DeliverLocked` when another deliver process owns the data
    directory. ``sinks`` replaces the configured sinks (tests)."""
    # Made here, started with the process: sinks read payloads through them.
    io = ThreadPoolRunner(reactor, "canner-io", IO_THREADS)
    hashing = ThreadPoolRunner(reactor, "canner-hash", HASH_THREADS)
    sinks, retention = configured_sinks(config, reactor, io, hashing, sinks)
    uploads, receipts = prepare_data_dir(config, DELIVER_WRITES)
    # Megawarc projects are delivered a package at a time, the others an object at a time.
    packed = packed_projects(config, sinks)
    packages = PackageStore(config.packages_path)
    if packed:
        prepare_packages(packages)
    top, index, delivery_log = _deliver_root(config, reactor, lock_data_dir(config), io, hashing)
    in_flight = InFlight(reactor)
    metrics, survey_cache = process_metrics(config, DELIVER, io, reactor, in_flight)
    base = DeliverBase(
        config=config,
        reactor=reactor,
        top=top,
        index=index,
        uploads=uploads,
        receipts=receipts,
        io=io,
        hashing=hashing,
        in_flight=in_flight,
        metrics=metrics,
    )
    ledger = ledger_parts(base, delivery_log)
    archived = ArchivedIds(LedgerDir(config.data_dir / "ledger"))
    receipt_rescan(base, archived, ledger).setServiceParent(top)
    outbound = outbound_service(base, sinks, retention, packed, packages, ledger, delivery_log)
    outbound.setServiceParent(top)
    packaging = package_pipeline(base, packed, packages, archived)
    if packed:
        packaging.setServiceParent(top)
    if ledger is not None:
        ledger.service.setServiceParent(top)
    # Stops after every child, before the thread pools: "stopped cleanly" is written only once
    # deliver's work has ended, while the index is still open.
    top.outlive(HeartbeatService(index, in_flight, reactor))
    _trend_sampler(config, index, reactor).setServiceParent(top)
    for service in deliver_metrics(base, survey_cache):
        service.setServiceParent(top)
    manhole = daemon_manhole(
        config,
        DELIVER,
        top,
        io,
        reactor,
        index=index,
        outbound=outbound,
        packaging=packaging,
        packages=packages,
        packaging_sql=packaging_sql,
        ledger=ledger and ledger.service,
        sinks=sinks,
        uploads=uploads,
        receipts=receipts,
        metrics=metrics,
    )
    if manhole is not None:
        manhole.setServiceParent(top)
    # Ready once the index answers a query through the daemon's own connection.
    SystemdNotifier(reactor, lambda: index.run(index_answers)).setServiceParent(top)
    reactor.callWhenRunning(freeze_startup_objects)
    return top
