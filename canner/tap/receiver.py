"""``twistd canner-receiver --config FILE``: options and makeService, nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from twisted.application.service import IService
from twisted.python import usage

from canner.config import PLACEHOLDER_ISSUER, Config, ConfigError, load_config


class Options(usage.Options):
    """``--config``; a config that cannot serve ends start-up with one line on stderr (the
    journal under systemd), exit status 1."""

    optParameters: ClassVar[list[list[str]]] = [
        ["config", "c", "/etc/canner/canner.toml", "The canner TOML config file."]
    ]

    def postOptions(self) -> None:
        try:
            self.loaded: Config = load_config(Path(self["config"]))
            if self.loaded.issuer == PLACEHOLDER_ISSUER:
                # The shipped config: never serve (or sign receipts) as the example issuer.
                raise ConfigError(
                    "issuer",
                    f"is still the placeholder {PLACEHOLDER_ISSUER!r}: set this node's real"
                    f" issuer in {self['config']} before starting canner",
                )
        except ConfigError as e:
            raise SystemExit(f"canner: {e}") from None


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from canner.service import quiet_repeated_stop_signals, receiver_service

    try:
        service = receiver_service(options.loaded, reactor)
    except ConfigError as e:  # e.g. a manhole key file that cannot be read, no data_dir
        raise SystemExit(f"canner-receiver: {e}") from None
    quiet_repeated_stop_signals(reactor)
    return service
