"""``python -m canner.tap.worker``: options, the config and the reactor of one worker process
of a canner-receiver node, whose parent (:mod:`canner.daemon.node`) starts it; the worker itself
is :func:`canner.daemon.worker.worker_service`."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
from collections.abc import Sequence
from pathlib import Path

from twisted.logger import Logger, globalLogBeginner, jsonFileLogObserver

import canner.sinks.registry  # noqa: F401 (registers the sinks a config may name)
from canner.config import load_config
from canner.daemon.node import CHANNEL_FD, LOG_FD
from canner.daemon.node_protocol import ChannelFactory, WorkerLink
from canner.daemon.services import freeze_startup_objects, quiet_repeated_stop_signals
from canner.daemon.worker import worker_service

log = Logger()

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux's ``PR_SET_PDEATHSIG``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="canner.daemon.worker")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--index", required=True, type=int)
    # The path of the unix socket of the parent's own site.
    parser.add_argument("--node-site", required=True, type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Run worker ``--index`` until it is told to stop or its parent is gone."""
    _die_with_parent()
    args = _arguments(argv)
    if os.getppid() == 1:  # the parent died before the line above
        raise SystemExit(0)
    out = os.fdopen(LOG_FD, "w", encoding="utf-8", buffering=1)
    globalLogBeginner.beginLoggingTo([jsonFileLogObserver(out)], redirectStandardIO=False)
    config = load_config(args.config)

    from twisted.internet import reactor

    link = WorkerLink(reactor)
    reactor.adoptStreamConnection(CHANNEL_FD, socket.AF_UNIX, ChannelFactory(link))  # type: ignore[attr-defined]
    os.close(CHANNEL_FD)
    service = worker_service(config, reactor, link, args.index, args.node_site.parent)

    def parent_gone(_: object) -> None:
        if reactor.running:
            log.info("the node's parent is gone: stopping")
            reactor.stop()

    link.lost.addCallback(parent_gone)
    quiet_repeated_stop_signals(reactor)
    # Ctrl-C in a terminal reaches the whole process group: the parent stops its workers.
    reactor.callWhenRunning(signal.signal, signal.SIGINT, signal.SIG_IGN)
    reactor.callWhenRunning(service.startService)
    reactor.callWhenRunning(freeze_startup_objects)
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    reactor.run()


if __name__ == "__main__":
    main()
