"""``twistd canner-receiver --config FILE``: options and makeService, nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from twisted.application.service import IService
from twisted.python import usage

import canner.sinks.registry  # noqa: F401 (registers the sinks a config may name)
from canner.config import Config, ConfigError, load_config


class Options(usage.Options):
    """``--config``; a config that cannot serve ends start-up with one line on stderr (the
    journal under systemd), exit status 1."""

    optParameters: ClassVar[list[list[str]]] = [
        ["config", "c", "/etc/canner/canner.toml", "The canner TOML config file."]
    ]

    def postOptions(self) -> None:
        try:
            self.loaded: Config = load_config(Path(self["config"]))
        except ConfigError as e:
            raise SystemExit(f"canner: {e}") from None


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from canner.daemon.roots import receiver_service
    from canner.daemon.services import quiet_repeated_stop_signals
    from canner.store.datadir import CannotStart

    try:
        service = receiver_service(
            options.loaded, reactor, config_path=Path(options["config"]).resolve()
        )
    except (CannotStart, ConfigError) as e:  # e.g. no data_dir, or one this user cannot write
        raise SystemExit(f"canner-receiver: {e}") from None
    quiet_repeated_stop_signals(reactor)
    return service
