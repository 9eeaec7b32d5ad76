"""The ``canner`` command's entry point: its arguments, and the table that dispatches each
sub-command to the module of its group (``canner --help`` lists them; docs/operator-guide.md
says how to read what they print).

``--config FILE`` (default ``/etc/canner/canner.toml``) goes before or after the sub-command.
An expected failure is one ``canner: ...`` line on stderr and exit status 1 (2 for a usage
error); a config error names its key.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import canner.sinks.registry  # noqa: F401 (registers the sinks a config may name)
from canner.cli.base import DEFAULT_CONFIG, CommandError, Io
from canner.cli.check import check_config
from canner.cli.go import adopt_go, import_go_config
from canner.cli.inspect import RowFilter, deliveries, packages, parse_since, show, status
from canner.cli.ledger import flush_ledger, list_ledgers
from canner.cli.rebuild import rebuild_index
from canner.cli.release import release
from canner.cli.retry import retry, retry_needing_operator
from canner.cli.service import drain, manhole_proxy, undrain, write_rsyncd_conf
from canner.config import ConfigError
from canner.delivery.queue import State
from canner.store.datadir import CannotStart
from canner.version import version


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canner", description="Operate a canner data directory.")
    parser.add_argument("--version", action="version", version=f"canner {version()}")
    config_help = f"the canner TOML file (default {DEFAULT_CONFIG})"
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=config_help)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        # SUPPRESS: given after the subcommand it wins, absent it leaves the one given before.
        sub.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=config_help)
        return sub

    command("check-config", "validate the config, print it resolved with example IA destinations")
    command(
        "status", "deliver's state, objects by state, bytes pending, free space (exit 0/1/2)"
    ).add_argument("--json", action="store_true", help="print JSON")
    command("show", "everything known about one object").add_argument(
        "object_id", help="an object id or a unique prefix of one"
    )
    listing = command("deliveries", "one JSON line per object in the delivery index")
    listing.add_argument("--state", choices=[s.value for s in State])
    listing.add_argument("--project")
    listing.add_argument(
        "--since", help="changed since: a duration back from now (90m, 2h) or an ISO 8601 time"
    )
    listing.add_argument("--needs-operator", action="store_true", help="only flagged rows")
    again = command(
        "retry",
        "make a retry_wait delivery due now, or deliver a delivered but unverified one again"
        " (an object, a megawarc package or a ledger; or every flagged one)",
    )
    again.add_argument(
        "object_id",
        nargs="?",
        help="an object id (or a unique prefix of one), a megawarc package id, or a ledger name",
    )
    again.add_argument(
        "--needs-operator",
        action="store_true",
        help="every object, package and ledger flagged for an operator (after fixing the cause)",
    )
    again.add_argument("--project", help="with --needs-operator: only this project's")
    command("packages", "one JSON line per megawarc batch and package")
    command(
        "rebuild-index", "add receipts missing from delivery.sqlite (deliver stopped)"
    ).add_argument(
        "--replace-damaged",
        action="store_true",
        help="first move a delivery.sqlite that is no readable database aside (with its -wal"
        " and -shm, to delivery-damaged-TIME.sqlite*; nothing is deleted)",
    )
    command(
        "drain", "take no new uploads (uploads in progress and deliveries go on); durable"
    ).add_argument("--reason", default="", help="a note shown by /readyz and canner status")
    command("undrain", "take new uploads again")
    adopting = command("adopt-go", "take a Go canner's data directory over (dry run by default)")
    adopting.add_argument("go_dir", type=Path, metavar="DATA_DIR", help="the Go canner's data_dir")
    adopting.add_argument("--apply", action="store_true", help="act (default: print the plan)")
    command(
        "release", "release receipts as HQ does (only delivered and verified objects)"
    ).add_argument("ids", nargs="+", help="object ids, receipt:<id>, or unique prefixes")
    ledger = command("ledger", "list ledgers as JSON lines; 'ledger flush' archives now")
    ledger.add_argument("action", nargs="?", choices=["flush"], help="flush: archive now")
    ledger.add_argument(
        "--timeout", type=float, default=600.0, help="flush: seconds to wait (default 600)"
    )
    command(
        "manhole-proxy",
        "relay stdin/stdout to a daemon's manhole socket (ssh -o ProxyCommand=...)",
    ).add_argument("role", choices=["receiver", "deliver"], help="whose manhole")
    conf = command("rsyncd-conf", "write the rsync daemon's config: one module per project")
    conf.add_argument(
        "--templates",
        type=Path,
        default=Path("/etc/canner/rsyncd"),
        help="the directory of rsyncd.conf and module.conf (default /etc/canner/rsyncd)",
    )
    conf.add_argument(
        "--runtime-dir",
        type=Path,
        default=Path("/run/canner/rsyncd"),
        help="the daemon's runtime directory (its lock file)",
    )
    conf.add_argument("--output", type=Path, help="write here instead of standard output")
    go = command("import-go-config", "print a Go canner config.json as canner TOML")
    go.add_argument("json_config", metavar="CONFIG.json", type=Path)
    go.add_argument("--output", type=Path, help="write here (atomically) instead of stdout")
    return parser


def main(argv: Sequence[str] | None = None, io: Io | None = None) -> int:
    io = io or Io(sys.stdout, sys.stderr)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "retry" and (args.object_id is None) == (not args.needs_operator):
        parser.error("retry takes an object id or --needs-operator (not both)")
    if args.command == "retry" and args.project is not None and not args.needs_operator:
        parser.error("retry --project goes with --needs-operator")

    def listing() -> int:
        since = parse_since(args.since, io.now()) if args.since else None
        where = RowFilter(args.state, args.project, since, args.needs_operator)
        return deliveries(args.config, io, where)

    def again() -> int:
        if args.needs_operator:
            return retry_needing_operator(args.config, args.project, io)
        return retry(args.config, args.object_id, io)

    runs: dict[str, Callable[[], int]] = {
        "check-config": lambda: check_config(args.config, io),
        "status": lambda: status(args.config, args.json, io),
        "show": lambda: show(args.config, args.object_id, io),
        "deliveries": listing,
        "retry": again,
        "packages": lambda: packages(args.config, io),
        "rebuild-index": lambda: rebuild_index(args.config, io, args.replace_damaged),
        "drain": lambda: drain(args.config, args.reason, io),
        "undrain": lambda: undrain(args.config, io),
        "adopt-go": lambda: adopt_go(args.config, args.go_dir, args.apply, io),
        "release": lambda: release(args.config, args.ids, io),
        "manhole-proxy": lambda: manhole_proxy(args.config, args.role, io),
        "rsyncd-conf": lambda: write_rsyncd_conf(
            args.config, args.templates, args.runtime_dir, args.output, io
        ),
        "import-go-config": lambda: import_go_config(args.json_config, args.output, io),
        "ledger": lambda: (
            flush_ledger(args.config, args.timeout, io)
            if args.action == "flush"
            else list_ledgers(args.config, io)
        ),
    }
    try:
        return runs[args.command]()
    except BrokenPipeError:
        return 0
    except (ConfigError, CommandError, CannotStart, FileNotFoundError) as e:
        io.err.write(f"canner: {e}\n")
    except (sqlite3.Error, OSError) as e:
        io.err.write(f"canner: {type(e).__name__}: {e}\n")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
