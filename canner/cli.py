"""The ``canner`` command: inspection for operators.

``canner deliveries --config FILE`` prints one JSON object per line for every object in the
delivery index (state, attempts, next attempt, last error, identifier, remote name, delivered,
verified and purged times).  It opens ``delivery.sqlite`` read-only, so it is safe while both
daemons run.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path

from canner.config import ConfigError, load_config
from canner.delivery import index as sql


def _open_read_only(path: Path) -> sqlite3.Connection:
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (has canner run on this data directory?)")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.execute(f"PRAGMA busy_timeout={sql.BUSY_TIMEOUT_MS}")
    return conn


def deliveries(config_path: Path) -> int:
    config = load_config(config_path)
    conn = _open_read_only(config.data_dir / "delivery.sqlite")
    try:
        for row in sql.all_rows(conn.cursor()):
            sys.stdout.write(json.dumps(row.as_dict(), separators=(",", ":")) + "\n")
    finally:
        conn.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="canner", description="Inspect a canner data directory.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("deliveries", help="one JSON line per object in the index")
    listing.add_argument("--config", type=Path, default=Path("/etc/canner/canner.toml"))
    args = parser.parse_args(argv)
    try:
        if args.command == "deliveries":
            return deliveries(args.config)
    except (ConfigError, FileNotFoundError, sqlite3.Error) as e:
        sys.stderr.write(f"canner: {e}\n")
        return 1
    except BrokenPipeError:
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
