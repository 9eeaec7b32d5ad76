"""One worker process of a canner-receiver node (``python -m canner.tap.worker`` runs it).

The node's parent (:mod:`canner.daemon.node`) starts it with the listening socket, its AMP
channel, a pipe for its log events and ``receiver.lock`` open on the descriptors named there.
It reads the same config, builds the single receiver's request-serving graph
(:func:`canner.daemon.roots.receiver_parts`) with the node's stand-ins
(:mod:`canner.daemon.node_protocol`) and serves the socket; it does none of the start-up work,
the sweep, the rsync intake, the trend sampler, the metrics survey or the manhole (the parent's).
It stops as a single receiver stops (listener closed, writers let go at their durable offsets,
running acceptances finished) on SIGTERM, and when its parent is gone (the channel closes;
``PR_SET_PDEATHSIG`` sends SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

from attrs import define
from twisted.application.service import IService, Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.logger import (
    Logger,
    LogPublisher,
    globalLogPublisher,
)
from twisted.protocols.tls import TLSMemoryBIOFactory

import canner.sinks.registry  # noqa: F401 (registers the sinks a config may name)
from canner.blocking import ThreadPoolRunner
from canner.config import Config
from canner.daemon.node import LISTEN_FD
from canner.daemon.node_protocol import (
    Listening,
    NodeConnections,
    NodeOrigins,
    NodePromises,
    TakeOver,
    WorkerLink,
)
from canner.daemon.roots import HASH_THREADS, IO_THREADS, receiver_parts
from canner.daemon.services import DaemonRoot, ShutdownHook
from canner.daemon.services import Listening as ListeningService
from canner.delivery.index import receiver_feed
from canner.ops.metrics import RECEIVER, metrics_site, process_metrics
from canner.ops.node import listen_description, parent_address, worker_metrics_address
from canner.ops.problems import watching_start_up
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore
from canner.web.proxy import NodeProxy

log = Logger()

_PR_SET_PDEATHSIG = 1


@define(eq=False)
class AdoptedListener(Service):
    """Serves ``site`` on the listening socket inherited as ``fd``; tells the parent once it
    does.  Stopping closes this process's copy (the parent's and the other workers' stay)."""

    _fd: int
    _site: Any
    _reactor: Any
    _link: WorkerLink
    _port: Any = None

    def __attrs_post_init__(self) -> None:
        Service.__init__(self)

    def startService(self) -> None:
        super().startService()
        probe = socket.socket(fileno=os.dup(self._fd))  # the family, as the parent opened it
        family = probe.family
        probe.close()
        self._port = self._reactor.adoptStreamPort(self._fd, family, self._site)
        os.close(self._fd)  # adopted as a duplicate
        self._link.ask(Listening, pid=os.getpid()).addErrback(
            lambda f: log.failure("telling the parent this worker listens", f)
        )

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        if self._port is None:
            return None
        d: Deferred[None] = self._port.stopListening()
        return d


def served(description: str, site: Any, reactor: Any) -> Any:
    """What serves the adopted socket of ``description``: ``site``, behind TLS for an ``ssl:``
    listener (the parent's socket is a plain one; the worker speaks TLS on it with the context
    the endpoint string describes, as the endpoint's own listener would)."""
    endpoint = serverFromString(reactor, description)
    # Twisted's SSL4ServerEndpoint keeps its context factory here (a canary test checks it).
    context = getattr(endpoint, "_sslContextFactory", None)
    if context is None:
        return site
    return TLSMemoryBIOFactory(context, False, site)


def worker_service(
    config: Config,
    reactor: Any,
    link: WorkerLink,
    index: int,
    private_dir: Path,
    log_publisher: LogPublisher = globalLogPublisher,
) -> IService:
    """Worker ``index``'s service tree over the node's ``link``; the parent's own site and this
    worker's metrics listen in the node's ``private_dir``."""
    with watching_start_up(log_publisher) as problems:
        uploads = UploadStore(config.data_dir / "uploads")
        receipts = ReceiptStore(config.data_dir / "receipts")
    io = ThreadPoolRunner(reactor, "canner-io", IO_THREADS)
    hashing = ThreadPoolRunner(reactor, "canner-hash", HASH_THREADS)
    # Its own connection to the shared index (WAL, with a busy timeout for the other writers).
    enqueue, pool, index_ = receiver_feed(config.data_dir / "delivery.sqlite", reactor)

    def stopped() -> None:
        if pool is not None:
            pool.close()

    top = DaemonRoot(stopped)
    top.outlive(io)
    top.outlive(hashing)
    reactor.callWhenRunning(problems.started)
    metrics, _survey = process_metrics(config, RECEIVER, io, reactor)

    proxy = NodeProxy(parent_address(private_dir), reactor)

    def take_over_elsewhere(upload_id: str) -> Deferred[bool]:
        return link.ask(TakeOver, upload_id=upload_id).addCallback(lambda a: bool(a["live"]))

    parts = receiver_parts(
        config,
        uploads=uploads,
        receipts=receipts,
        run=io,
        hashing=hashing,
        clock=reactor,
        enqueue=enqueue,
        index=index_,
        metrics=metrics,
        problems=problems,
        connection_limits=NodeConnections(link, config.connections.max_per_client),
        promises=NodePromises(link=link),
        origins=NodeOrigins(receipts=receipts, run=io, index=index_, link=link),
        take_over_elsewhere=take_over_elsewhere,
        # The node's view (status page, /readyz, /metrics, HQ's API) is the parent's.
        node=proxy,
    )
    link.take_over_here = parts.intake.take_over_here
    # The parent scrapes this worker's own counters for the node's /metrics.  The socket file of
    # this index's previous worker (killed: nothing removed it) is in the way of a new one; the
    # parent starts a worker again only once the previous one has ended.
    metrics_address = worker_metrics_address(private_dir, index)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(metrics_address)
    ListeningService(
        description=listen_description(metrics_address),
        factory=metrics_site(metrics),
        reactor=reactor,
        what="the worker's metrics for its parent",
    ).setServiceParent(top)
    ShutdownHook(proxy.close).setServiceParent(top)
    AdoptedListener(
        LISTEN_FD, served(config.listen, parts.site, reactor), reactor, link
    ).setServiceParent(top)
    ShutdownHook(parts.intake.stop).setServiceParent(top)
    ShutdownHook(parts.acceptance.stop).setServiceParent(top)
    return top
