"""``twistd canner-deliver --config FILE``: options and makeService, nothing else."""

from __future__ import annotations

from twisted.application.service import IService

from canner.tap.receiver import Options

__all__ = ["Options", "makeService"]


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from canner.config import ConfigError
    from canner.daemon.roots import deliver_service
    from canner.daemon.services import quiet_repeated_stop_signals
    from canner.store.datadir import CannotStart

    try:
        service = deliver_service(options.loaded, reactor)
    except (CannotStart, ConfigError) as e:  # e.g. locked, or an unwritable data directory
        raise SystemExit(f"canner-deliver: {e}") from None
    quiet_repeated_stop_signals(reactor)
    return service
