"""The parts canner-deliver is built from, each out of the config and :class:`DeliverBase`.

``canner.daemon.roots.deliver_service`` takes the lock, opens the index and connects these: the
outbound service with its owners (objects, packages, ledgers), the megawarc package pipeline,
the ledger's own steps, the hourly receipt rescan and the
metrics listener.  Each builder maps config onto keyword-only constructors and adds nothing to
the service tree but the thread pool it makes (which must outlive the children); the root
decides where each part goes in the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from attrs import frozen
from twisted.application.service import IService
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from canner.blocking import BlockingRunner, ThreadPoolRunner
from canner.config import Config, ConfigError, ProjectConfig
from canner.daemon.services import DaemonRoot, Listening
from canner.delivery.index import DeliveryIndex
from canner.delivery.liveness import InFlight
from canner.delivery.objects import ObjectOwner, planner
from canner.delivery.outbound_service import OutboundService, Owner, lanes_of
from canner.delivery.rescan import ReceiptRescan
from canner.ledger.files import ArchivedIds, LedgerDir
from canner.ledger.ledger_owner import LedgerOwner
from canner.ledger.service import LedgerService
from canner.ops.metrics import Metrics, SurveyCache, metrics_site
from canner.packaging.dictionaries import DictionaryStore
from canner.packaging.dictionary_api import Dictionaries, DictionaryApi
from canner.packaging.package_owner import PackageOwner
from canner.packaging.pipeline import PackagingService
from canner.packaging.store import PackageStore
from canner.periodic import PeriodicService
from canner.sinks.base import Sink
from canner.sinks.ia.client import IAClient
from canner.sinks.ia.config import READBACK_ALL
from canner.sinks.ia.credentials import CredentialsError, load_credentials
from canner.sinks.ia.sink import IASink
from canner.sinks.registry import project_sinks
from canner.sinks.transport import make_http_client
from canner.store.journal import Journal, JournalLog
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore

log = Logger()

LEDGER_THREADS = 32
RESCAN_INTERVAL = 3600.0
# A rescan batch that finds every receipt indexed is followed by a pause of this many times
# its own duration (at most RESCAN_PAUSE_MAX): the hourly pass over every receipt then takes
# at most a quarter of the time it runs for, and uploads and deliveries keep their latency.
RESCAN_PACE = 3.0
RESCAN_PAUSE_MAX = 1.0


def rescan_pace(clock: IReactorTime) -> Callable[[float], Deferred[None]]:
    """The rescan's pause after a batch of ``seconds`` that found nothing to add."""

    def pause(seconds: float) -> Deferred[None]:
        return deferLater(clock, min(seconds * RESCAN_PACE, RESCAN_PAUSE_MAX), lambda: None)

    return pause


@frozen(kw_only=True)
class DeliverBase:
    """What every part of canner-deliver is built from: the config, the reactor, the daemon's
    root (whose running state ends a rescan), the index, the stores, the thread pools, the
    attempts in flight and the metrics."""

    config: Config
    reactor: Any
    top: DaemonRoot
    index: DeliveryIndex
    uploads: UploadStore
    receipts: ReceiptStore
    io: BlockingRunner
    hashing: BlockingRunner
    in_flight: InFlight
    metrics: Metrics


def configured_sinks(
    config: Config,
    reactor: Any,
    run: BlockingRunner,
    hashing: BlockingRunner,
    sinks: Mapping[str, Sink] | None = None,
) -> tuple[Mapping[str, Sink], dict[str, float]]:
    """The sink of each delivered project (``sinks`` when given: tests) and how long its
    artifacts stay once verified (blocking: reads credentials); a project without a delivery
    table is logged."""
    if sinks is None:
        sinks = project_sinks(config, reactor, run, hashing)
    retention = {
        pid: project.delivery.local_artifact_retention if project.delivery else 0.0
        for pid, project in config.projects.items()
    }
    for pid, project in config.projects.items():
        if project.delivery is None:
            log.warn(
                "project {project} has no [projects.{project}.delivery]: its artifacts stay"
                " local and are never delivered or purged",
                project=pid,
            )
    return sinks, retention


@frozen
class LedgerParts:
    """The ledger's two halves: its own steps (assign, write, delete) and its files' owner."""

    service: LedgerService
    owner: LedgerOwner


def ledger_parts(base: DeliverBase, journal: JournalLog) -> LedgerParts | None:
    """The ledger of ``[ledger]`` (None without one); reads its credentials (blocking).  Its
    unlink pool joins the pools that outlive the children."""
    config, reactor, ledger = base.config, base.reactor, base.config.ledger
    if ledger is None:
        return None
    try:
        credentials = load_credentials(ledger.credentials)
    except CredentialsError as e:
        raise ConfigError("ledger.credentials", str(e)) from None
    client = IAClient(
        http=make_http_client(reactor),
        clock=reactor,
        credentials=credentials,
        s3_url=ledger.s3_url,
        metadata_url=ledger.metadata_url,
        run=base.io,
    )
    unlink = ThreadPoolRunner(reactor, "canner-ledger", LEDGER_THREADS)
    ledgers = LedgerDir(config.data_dir / "ledger")
    service = LedgerService(
        config=ledger,
        ids=config.object_ids,
        index=base.index,
        db=config.data_dir / "delivery.sqlite",
        ledgers=ledgers,
        receipts=base.receipts,
        journal=journal,
        uploads=config.data_dir / "uploads",
        run=base.io,
        clock=reactor,
        unlink=unlink,
        observer=base.metrics,
    )
    # Ledgers are small: every one is read back whole before its records' state may go.
    owner = LedgerOwner(
        config=ledger,
        index=base.index,
        ledgers=ledgers,
        sink=IASink(READBACK_ALL, client),
        run=base.io,
        guard=service.guard,
    )
    base.top.outlive(unlink)
    return LedgerParts(service, owner)


def receipt_rescan(
    base: DeliverBase, archived: ArchivedIds, ledger: LedgerParts | None
) -> PeriodicService:
    """The receipt rescan, at start and hourly until the daemon stops, paced while it only
    finds receipts the index holds (:func:`rescan_pace`); never while the ledger deletes
    records (it could re-insert them)."""
    rescan: Callable[[], Deferred[Any]] = ReceiptRescan(
        index=base.index,
        receipts=base.receipts,
        uploads=base.uploads,
        journal=Journal(base.config.data_dir / "journal"),
        archived=archived.contains,
        object_ids=base.config.object_ids,
        run=base.io,
        now=base.reactor.seconds,
        keep_going=lambda: bool(base.top.running),
        pace=rescan_pace(base.reactor),
    ).run
    if ledger is not None:
        rescan = partial(ledger.service.guard.run, rescan)
    return PeriodicService(
        clock=base.reactor, interval=RESCAN_INTERVAL, job=rescan, label="receipt rescan"
    )


def object_owner(
    base: DeliverBase,
    sinks: Mapping[str, Sink],
    retention: Mapping[str, float],
    journal: JournalLog,
) -> ObjectOwner:
    """The objects delivered one at a time, to ``sinks`` (every delivered project's but the
    megawarc ones')."""
    deliveries = {pid: p.delivery for pid, p in base.config.projects.items() if p.delivery}
    return ObjectOwner(
        index=base.index,
        uploads=base.uploads,
        receipts=base.receipts,
        journal=journal,
        sinks=sinks,
        planner=planner(deliveries),
        retention=retention,
        run=base.io,
        hash=base.hashing,
        clock=base.reactor,
        verify_timeouts={pid: d.verify_timeout for pid, d in deliveries.items()},
    )


def outbound_service(
    base: DeliverBase,
    sinks: Mapping[str, Sink],
    retention: Mapping[str, float],
    packed: Mapping[str, ProjectConfig],
    packages: PackageStore,
    ledger: LedgerParts | None,
    journal: JournalLog,
) -> OutboundService:
    """The one service that sends, verifies and hands back every owner's files (objects, the
    ``packed`` projects' megawarc packages, ledgers), in ``delivery_concurrency`` slots shared
    by every kind."""
    object_sinks = {pid: s for pid, s in sinks.items() if pid not in packed}
    owners: list[Owner] = [
        object_owner(base, object_sinks, retention, journal),
        package_owner(base, packed, sinks, packages),
    ]
    if ledger is not None:
        owners.append(ledger.owner)
    return OutboundService(
        index=base.index,
        owners=lanes_of(owners),
        clock=base.reactor,
        concurrency=base.config.delivery_concurrency,
        in_flight=base.in_flight,
        observer=base.metrics,
    )


def package_pipeline(
    base: DeliverBase,
    packed: Mapping[str, ProjectConfig],
    packages: PackageStore,
    archived: ArchivedIds,
) -> PackagingService:
    """The megawarc pipeline of the ``packed`` projects.  When there are any, its build pool
    outlives the children: a build in a thread ends at its next chunk once the service has asked
    it to stop."""
    config = base.config
    packing = ThreadPoolRunner(base.reactor, "canner-pack", config.packaging_concurrency)
    packaging = PackagingService(
        index=base.index,
        uploads=base.uploads,
        receipts=base.receipts,
        store=packages,
        projects=packed,
        run=base.io,
        pack=packing,
        clock=base.reactor,
        build_concurrency=config.packaging_concurrency,
        min_free_bytes=config.min_free_bytes,
        archived=archived.contains,
        dictionaries=dictionaries(base, packed),
    )
    if packed:
        base.top.outlive(packing)
    return packaging


def package_owner(
    base: DeliverBase,
    packed: Mapping[str, ProjectConfig],
    sinks: Mapping[str, Sink],
    packages: PackageStore,
) -> PackageOwner:
    """The packages of the ``packed`` projects, each sent to its project's sink."""
    return PackageOwner(
        index=base.index,
        store=packages,
        projects=packed,
        sinks={pid: sinks[pid] for pid in packed},
        run=base.io,
    )


def dictionaries(base: DeliverBase, packed: Mapping[str, ProjectConfig]) -> Dictionaries:
    """The zstd dictionaries members name, kept in ``<data dir>/dictionaries``; fetched over
    HTTP when a packed project has a ``zstd_dictionary_url``."""
    api = None
    if any(p.packaging.zstd_dictionary_url for p in packed.values()):
        api = DictionaryApi(http=make_http_client(base.reactor), clock=base.reactor)
    return Dictionaries(
        store=DictionaryStore(base.config.data_dir / "dictionaries"),
        api=api,
        run=base.io,
        now=base.reactor.seconds,
        observer=base.metrics,
    )


def packed_projects(config: Config, sinks: Mapping[str, Sink]) -> dict[str, ProjectConfig]:
    """The megawarc projects with a sink: delivered a package at a time, where objects go one
    serves the rest."""
    return {
        pid: p
        for pid, p in config.projects.items()
        if p.packaging.megawarc and p.delivery is not None and pid in sinks
    }


def deliver_metrics(base: DeliverBase, survey_cache: SurveyCache) -> list[IService]:
    """With ``[metrics] deliver_listen`` (none without): the survey behind the gauges, then the
    listener of the metrics page."""
    listen = base.config.metrics.deliver_listen
    if listen is None:
        return []
    survey = PeriodicService(
        clock=base.reactor,
        interval=base.config.metrics.refresh,
        job=survey_cache.refresh,
        label="metrics survey",
    )
    listener = Listening(
        description=listen,
        factory=metrics_site(base.metrics),
        reactor=base.reactor,
        what="metrics.deliver_listen",
    )
    return [survey, listener]
