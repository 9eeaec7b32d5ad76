"""Commands for the running services: ``canner drain`` and ``undrain`` (the receiver's
intake), ``manhole-proxy`` (ssh's way to a daemon's manhole), ``rsyncd-conf`` (the
configuration of the rsync daemon beside the receiver)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

from canner.cli.base import CommandError, Io, become_data_dir_owner, existing_data_dir
from canner.config import load_config
from canner.doors.rsync.conf import GLOBAL_TEMPLATE, MODULE_TEMPLATE, rsyncd_conf
from canner.store import drain as draining


def drain(config_path: Path, reason: str, io: Io) -> int:
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    mark, new = draining.start_draining(data_dir, io.now(), reason)
    io.out.write(
        ("" if new else "already draining: ")
        + f"{mark.describe()}\nnew uploads get 503 and /readyz fails; uploads in progress and"
        " deliveries go on. `canner status` says when the node is retirable.\n"
    )
    return 0


def undrain(config_path: Path, io: Io) -> int:
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    if draining.stop_draining(data_dir):
        io.out.write("no longer draining: new uploads are accepted again\n")
    else:
        io.out.write("not draining: nothing to do\n")
    return 0


def manhole_proxy(config_path: Path, role: str, io: Io) -> int:
    """Relay bytes between stdin/stdout and ``role``'s manhole socket until both ends close:
    ssh's ``ProxyCommand``, so that no netcat or socat is needed (stock Debian has neither)."""
    config = load_config(config_path)
    path = config.manhole.socket_for(role) if config.manhole is not None else None
    if path is None:
        raise CommandError(
            f"no manhole socket for canner-{role}: the config has no [manhole] table"
            if config.manhole is None
            else f"no manhole socket for canner-{role}: manhole.{role}_socket is empty"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError as e:
        sock.close()
        raise CommandError(
            f"cannot connect to {path}: {e.strerror} (is canner-{role} running with a manhole,"
            " and are you root or canner?)"
        ) from None

    def upstream() -> None:
        # ssh's requests to the daemon; EOF from ssh half-closes the socket.
        with contextlib.suppress(OSError):
            while data := os.read(0, 65536):
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    with sock:
        while data := sock.recv(65536):
            os.write(1, data)
    return 0


# -- rsyncd-conf -------------------------------------------------------------------------------


def write_rsyncd_conf(
    config_path: Path, templates: Path, runtime_dir: Path, output: Path | None, io: Io
) -> int:
    """Write the rsync daemon's configuration for ``[rsync]`` (to ``output``, or stdout)."""
    config = load_config(config_path)
    if config.rsync is None:
        raise CommandError("the config has no [rsync] table: the rsync intake is off")
    text = rsyncd_conf(
        (templates / GLOBAL_TEMPLATE).read_text(encoding="utf-8"),
        (templates / MODULE_TEMPLATE).read_text(encoding="utf-8"),
        projects=config.projects,
        incoming=config.rsync.incoming,
        max_connections=config.rsync.max_connections,
        runtime_dir=runtime_dir,
    )
    if output is None:
        io.out.write(text)
    else:
        output.write_text(text, encoding="utf-8")
    return 0
