"""A receiver that runs workers, as the node's one view sees it: where each process listens
privately, how many workers run, and what readiness and the status page say about them.

With ``[receiver] workers = N`` the twistd process is a parent that owns the data directory
and N worker processes serve the public socket.  The node's view (status page, ``/readyz``,
``/metrics``, HQ's API) is answered by the parent, on its private socket
(:func:`parent_address`), which every worker forwards those routes to
(:class:`~canner.web.proxy.NodeProxy`); each worker serves its raw metrics on its own private
socket (:func:`worker_metrics_address`), which the parent scrapes for the node's ``/metrics``
(:mod:`canner.ops.node_metrics`).  Both sides compute the addresses from the node's private
directory (a 0700 temporary directory the parent makes and removes, short whatever the data
directory's path: a unix socket's path holds 107 bytes) and the worker's index.

:class:`WorkerRoster` is what the parent tells the view about its workers; the process model
fills it in.  Pure, but for reading the roster.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from attrs import frozen
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


def parent_address(private_dir: Path) -> str:
    """The unix socket in the node's private directory (made by the parent, 0700) where the
    parent serves its own receiver site (the node's view) to its workers."""
    return str(private_dir / "site.sock")


def worker_metrics_address(private_dir: Path, index: int) -> str:
    """The unix socket where worker ``index`` (1 ... N) serves its raw metrics (``GET
    /metrics``) to the parent.  A restarted worker takes its index's address again."""
    return str(private_dir / f"metrics-{index}.sock")


def listen_description(address: str) -> str:
    """The strports description that listens on unix socket ``address`` (no lock file: an
    abstract socket has none, and these addresses belong to one process anyway)."""
    escaped = address.replace("\\", "\\\\").replace(":", "\\:").replace("=", "\\=")
    return f"unix:{escaped}:lockfile=0"


class WorkerRoster(Protocol):
    """The parent's account of its workers.  Called from any thread (``/readyz`` runs in one):
    answer from what the parent last saw, without I/O or locks."""

    def configured(self) -> int:
        """How many workers the node runs (``[receiver] workers``)."""
        ...

    def running(self) -> int:
        """How many workers are listening on the public socket now."""
        ...

    def restarts(self) -> int:
        """How many times a worker was restarted since the parent started."""
        ...


@frozen
class WorkerCount:
    """The workers at one moment."""

    configured: int
    running: int
    restarts: int = 0

    @classmethod
    def of(cls, roster: WorkerRoster) -> WorkerCount:
        return cls(roster.configured(), roster.running(), roster.restarts())

    @property
    def missing(self) -> str | None:
        """Why the node serves less than configured (``/readyz``'s and the status page's words);
        None while every worker listens."""
        if self.running >= self.configured:
            return None
        return f"{self.running} of {self.configured} receiver workers are listening"

    def as_dict(self) -> dict[str, int]:
        return {"configured": self.configured, "running": self.running, "restarts": self.restarts}


class RosterCollector(Collector):
    """The workers as metrics, in the parent's registry."""

    def __init__(self, roster: WorkerRoster) -> None:
        self._roster = roster

    def collect(self) -> Iterable[Metric]:
        count = WorkerCount.of(self._roster)
        yield GaugeMetricFamily(
            "canner_receiver_workers", "Worker processes configured", value=count.configured
        )
        yield GaugeMetricFamily(
            "canner_receiver_workers_running",
            "Worker processes listening on the public socket",
            value=count.running,
        )
        yield CounterMetricFamily(
            "canner_receiver_worker_restarts",
            "Worker processes restarted since the receiver started",
            value=count.restarts,
        )
