"""The sinks canner knows: each one's name, delivery table and factory.

A sink is one module and one :class:`SinkEntry` here.  :func:`register` makes the entry's table
known to ``parse_config`` (``[projects.<id>.delivery] sink = "<name>"``) and its factory known
to :func:`project_sinks`; this module registers the built-in sinks when it is imported, which
every entry point does before it loads a config.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import evolve, field, frozen

from canner.blocking import BlockingRunner
from canner.config import (
    Config,
    DeliveryContext,
    DeliveryTable,
    ProjectConfig,
    SinkTable,
    register_sink_table,
    unregister_sink_table,
)
from canner.sinks.base import Sink
from canner.sinks.directory import DIRECTORY_TABLE, DirectoryDelivery, DirectorySink
from canner.sinks.ia.config import IA_TABLE, IADelivery
from canner.sinks.plan import check_destination, check_ledger

if TYPE_CHECKING:
    from canner.sinks.ia.multipart import PartJournal
    from canner.sinks.ia.pacing import PutGate


@frozen
class SinkEnv:
    """What a factory may use: the reactor, the blocking runners (``run`` for file I/O,
    ``hash`` for BLAKE3 re-reads), the data directory, and ``shared``, where the sinks of one
    kind keep what all their projects share in this process (by the sink's name)."""

    reactor: Any
    run: BlockingRunner
    hash: BlockingRunner
    data_dir: Path
    shared: dict[str, Any] = field(factory=dict)


# A factory builds one project's sink from its validated table (blocking: it may read
# credentials and stat paths); it raises ConfigError naming the key for what only the world
# can refuse (an unreadable credentials file, a missing directory).
Factory = Callable[[str, ProjectConfig, SinkEnv], Sink]


@frozen
class SinkEntry:
    """One sink: ``table`` says how its delivery table is read (its name is the sink's),
    ``factory`` builds a project's sink from it."""

    table: SinkTable
    factory: Factory

    @property
    def name(self) -> str:
        return self.table.name


_ENTRIES: dict[str, SinkEntry] = {}


def register(entry: SinkEntry) -> None:
    """Make ``entry``'s sink one a config may name.  Its table is checked against the plan's
    rules first (:func:`~canner.sinks.plan.check_destination`): every sink's objects are planned
    by them, so no table that parses can plan a place the rules refuse."""
    _ENTRIES[entry.name] = entry
    own = entry.table.check

    def check(delivery: DeliveryTable, where: DeliveryContext) -> None:
        check_destination(where.project_id, delivery, where.packaging.mode)
        own(delivery, where)

    register_sink_table(evolve(entry.table, check=check))


def unregister(name: str) -> None:
    """Forget a sink (tests that register one of their own)."""
    _ENTRIES.pop(name, None)
    unregister_sink_table(name)


def project_sinks(
    config: Config, reactor: Any, run: BlockingRunner, hash: BlockingRunner
) -> dict[str, Sink]:
    """A sink per project with a delivery table (blocking: reads credentials, stats paths).

    Raises :class:`~canner.config.ConfigError` naming the key when the world refuses what a
    project's table names.
    """
    env = SinkEnv(reactor, run, hash, config.data_dir)
    return {
        project_id: _ENTRIES[project.delivery.sink].factory(project_id, project, env)
        for project_id, project in config.projects.items()
        if project.delivery is not None
    }


def _table(project: ProjectConfig, kind: type[DeliveryTable]) -> Any:
    assert isinstance(project.delivery, kind), "parse_config builds the sink's own table type"
    return project.delivery


def _directory(project_id: str, project: ProjectConfig, env: SinkEnv) -> Sink:
    delivery = _table(project, DirectoryDelivery)
    return DirectorySink.for_delivery(project_id, delivery, env.run, env.hash, env.reactor)


@frozen
class _IAShared:
    """What every IA project of a process shares: one HTTP client, one gate per IA account
    (its task ration is the account's, whichever project uploads) and one multipart journal (a
    destination, item and name, is one file at IA whichever project sends it)."""

    http: Any
    journal: PartJournal
    gates: dict[str, PutGate] = field(factory=dict)


def _internet_archive(project_id: str, project: ProjectConfig, env: SinkEnv) -> Sink:
    # Imported when a daemon builds the sink, not with the registry: every ``canner`` command
    # loads a config through it, and the HTTP client (treq, TLS) is half a second of start-up
    # none of them uses.
    from canner.sinks.ia.multipart import PartJournal
    from canner.sinks.ia.sink import internet_archive_sink
    from canner.sinks.transport import make_http_client

    delivery = _table(project, IADelivery)
    shared = env.shared.get(IA_TABLE.name)
    if shared is None:
        journal = PartJournal.opened(env.data_dir / "multipart", time.time())
        shared = env.shared[IA_TABLE.name] = _IAShared(make_http_client(env.reactor), journal)
    return internet_archive_sink(
        project_id,
        delivery,
        shared.http,
        env.reactor,
        env.run,
        journal=shared.journal,
        gates=shared.gates,
    )


register(SinkEntry(DIRECTORY_TABLE, _directory))
# The ledger goes to IA: its [ledger] table is checked by the plan's rules, as a delivery table is.
register(SinkEntry(evolve(IA_TABLE, check_ledger=check_ledger), _internet_archive))
