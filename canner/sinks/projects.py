"""One sink per project, as its ``[projects.<id>.delivery]`` table says (``sink = ...``)."""

from __future__ import annotations

import time
from typing import Any

from treq.client import HTTPClient

from canner.blocking import BlockingRunner
from canner.config import Config, ConfigError
from canner.sinks.base import Sink
from canner.sinks.directory import DirectorySink
from canner.sinks.internet_archive import internet_archive_sink
from canner.sinks.multipart import PartJournal
from canner.sinks.pacing import PutGate
from canner.sinks.transport import make_http_client


def project_sinks(
    config: Config, reactor: Any, run: BlockingRunner, hash: BlockingRunner
) -> dict[str, Sink]:
    """A sink per project with a delivery table (blocking: reads credentials, stats paths).

    ``run`` does the sinks' file I/O, ``hash`` their BLAKE3 re-reads.  Raises
    :class:`~canner.config.ConfigError` naming the key when a project's table is unusable.
    """
    sinks: dict[str, Sink] = {}
    http: HTTPClient | None = None
    # One gate per IA account: its task ration is the account's, whichever project uploads.
    gates: dict[str, PutGate] = {}
    # One multipart journal for all projects: a destination (item and name) is one file at IA,
    # whichever project sends it.
    journal: PartJournal | None = None
    for project_id, project in config.projects.items():
        delivery = project.delivery
        if delivery is None:
            continue
        if delivery.sink == "directory":
            if project.packaging.megawarc:
                raise ConfigError(
                    f"projects.{project_id}.packaging.mode",
                    'megawarc packages are delivered to sink = "internet_archive" only',
                )
            sinks[project_id] = DirectorySink.for_delivery(project_id, delivery, run, hash, reactor)
            continue
        if http is None:
            http = make_http_client(reactor)
            journal = PartJournal.opened(config.data_dir / "multipart", time.time())
        sinks[project_id] = internet_archive_sink(
            project_id,
            delivery,
            http,
            reactor,
            run,
            project.packaging.mode,
            journal=journal,
            gates=gates,
        )
    return sinks
