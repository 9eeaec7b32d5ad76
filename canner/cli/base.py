"""What every ``canner`` sub-command shares: where it writes (:class:`Io`), its expected
failure (:class:`CommandError`), the JSON it prints, the data directory, the switch to the
data directory's owner, and one write transaction on the index."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ParamSpec, TextIO, TypeVar

from attrs import define

from canner.config import Config
from canner.delivery.index import ConnectionIndex, CursorFunction, configure_connection
from canner.ops import inventory

# The packaged config: the one the packaged units start the daemons on (``--config``'s default).
DEFAULT_CONFIG = Path("/etc/canner/canner.toml")

P = ParamSpec("P")
T = TypeVar("T")


class CommandError(Exception):
    """An expected failure: printed as ``canner: <message>``, exit status 1."""


@define
class Io:
    """Where a command writes, and its clock (injected by tests)."""

    out: TextIO
    err: TextIO
    now: Callable[[], float] = time.time


# A Unix time after 2001-09-09: below that, a number under a time-like key is not a timestamp.
_EPOCH_FLOOR = 1e9


def _is_time_key(key: str) -> bool:
    return key.endswith(("_at", "_after")) or key in ("since", "until")


def utc_text(when: float) -> str:
    """``when`` (Unix time) as ISO 8601 UTC to the second: ``2026-12-01T23:15:33Z``."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_utc(doc: Any) -> Any:
    """``doc`` with ``<key>_utc`` (ISO 8601 UTC, for people) right after every Unix-time field
    ``<key>`` (``*_at``, ``*_after``, ``since``, ``until``), which keeps its number for
    machines and for scripts written before the text was added.  A receipt is shown as issued:
    its bytes are immutable, and a field it never had must not seem to be part of it."""
    if isinstance(doc, list):
        return [with_utc(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out[key] = value if key == "receipt" else with_utc(value)
        if (
            _is_time_key(key)
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and value >= _EPOCH_FLOOR
        ):
            out[key + "_utc"] = utc_text(value)
    return out


def dump(io: Io, doc: Any) -> None:
    io.out.write(json.dumps(with_utc(doc), indent=2, sort_keys=False) + "\n")


def line(io: Io, doc: Any) -> None:
    """One JSON line (``deliveries``, ``packages``, ``ledger``...), times as in :func:`with_utc`."""
    io.out.write(json.dumps(with_utc(doc), separators=(",", ":")) + "\n")


def resolve_object_id(config: Config, text: str) -> str:
    """``text`` when it is a whole object id; otherwise the one known object it starts."""
    try:
        return inventory.resolve_id(config.data_dir, config.object_ids, text)
    except inventory.UnknownId as e:
        raise CommandError(str(e)) from None


def existing_data_dir(config: Config) -> Path:
    if not config.data_dir.is_dir():
        raise CommandError(f"data directory {config.data_dir} does not exist")
    return config.data_dir


def become_data_dir_owner(data_dir: Path) -> None:
    """As root, switch to the owner of ``data_dir`` (files SQLite creates must stay theirs)."""
    if os.geteuid() != 0:
        return
    owner = data_dir.stat()
    if owner.st_uid == 0:
        return
    os.setgroups([])
    os.setgid(owner.st_gid)
    os.setuid(owner.st_uid)


def transact(data_dir: Path, f: CursorFunction[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the cursor function ``f`` in one write transaction on the index."""
    path = data_dir / inventory.INDEX_NAME
    if not path.exists():
        raise CommandError(f"{path} does not exist (has canner run on this data directory?)")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        return ConnectionIndex(conn).transact(f, *args, **kwargs)
    finally:
        conn.close()
