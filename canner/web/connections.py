"""Caps on open client connections, in total and per client address.

Without them about a thousand slow connections from one address use up the process's open
files, and then normal uploads and ``/healthz`` fail too.  The total cap is kept below the
open-file limit (:func:`usable_connections`), leaving room for the files uploads, receipts and
the index need.
"""

from __future__ import annotations

import resource
from collections import Counter
from typing import Protocol

from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from canner.config import ConnectionsConfig

log = Logger()

# Open files kept for everything but client sockets: upload data and lock files, receipts,
# SQLite, logs, the manhole, threads' own needs.
RESERVED_FILES = 256


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one (systemd units set the hard one);
    return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def usable_connections(configured: int, open_file_limit: int) -> int:
    """The total cap in force: ``configured``, but never more than the open files allow."""
    return max(1, min(configured, open_file_limit - RESERVED_FILES))


class ConnectionCaps(Protocol):
    """What a channel asks of the caps: :class:`ConnectionLimits` in one process; a worker of a
    node asks its parent (``canner.daemon.node_protocol``), whose answer comes later, so
    :meth:`admit` may return a Deferred."""

    per_address: int
    refused: int

    @property
    def open(self) -> int: ...

    def admit(self, address: str) -> bool | Deferred[bool]: ...

    def release(self, address: str) -> None: ...


@define
class ConnectionLimits:
    """Counts open connections; :meth:`admit` says whether one more may stay open.

    ``per_address`` 0 means no per-address cap (behind a proxy every client has its address).
    Reactor thread only.
    """

    total: int
    per_address: int
    _open: int = 0
    _by_address: Counter[str] = field(factory=Counter)
    refused: int = 0

    def admit(self, address: str) -> bool:
        if self._open >= self.total or (
            self.per_address and self._by_address[address] >= self.per_address
        ):
            self.refused += 1
            return False
        self._open += 1
        self._by_address[address] += 1
        return True

    def release(self, address: str) -> None:
        self._open -= 1
        self._by_address[address] -= 1
        if not self._by_address[address]:
            del self._by_address[address]

    @property
    def open(self) -> int:
        return self._open


def connection_limits(config: ConnectionsConfig) -> ConnectionLimits:
    """The caps in force for ``[connections]``, once the open-file limit is raised as far as it
    goes; a total cap the open files cannot carry is lowered, with a warning."""
    open_files = raise_open_file_limit()
    total = usable_connections(config.max, open_files)
    if total < config.max:
        log.warn(
            "open-file limit {open_files} allows {total} client connections, not"
            " connections.max = {configured}; raise LimitNOFILE",
            open_files=open_files,
            total=total,
            configured=config.max,
        )
    return ConnectionLimits(total, config.max_per_client)
