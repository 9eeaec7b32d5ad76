"""The ``canner`` command: inspection and a few repairs for operators.

Every subcommand takes ``--config FILE`` (default ``/etc/canner/canner.toml``)::

    canner check-config       validate, print the resolved config and example IA destinations
    canner status [--json]    objects by delivery state, bytes pending, free space, oldest pending
    canner show ID            receipt, tus sidecar, local payload and delivery row of one object
    canner deliveries         one JSON line per object in the delivery index
    canner retry ID           make a retry_wait delivery due now (a guarded update)
    canner rebuild-index      add every receipt missing from delivery.sqlite (canner-deliver
                              must be stopped: it refuses while deliver.lock is held)

Reads use read-only SQLite connections, safe while both daemons run.  Run as root, the command
first becomes the owner of the data directory, so any file SQLite creates there (``-wal``,
``-shm``, a new index) stays usable by the daemons.  Errors go to stderr as ``canner: ...`` with
exit status 1 (2 for usage errors); a config error names its key.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
from attrs import define, field, frozen

from canner import inventory
from canner.config import Config, ConfigError, load_config
from canner.delivery import index as sql
from canner.delivery.index import configure_connection, upgrade_schema
from canner.delivery.rescan import missing_objects
from canner.fs import DataDirLock, Locked
from canner.receipts import ReceiptStore
from canner.sinks.credentials import CredentialsError, load_credentials
from canner.sinks.directory import validate_directory
from canner.sinks.plan import PlanError, plan_upload, validate_delivery
from canner.status_page import human_bytes, human_duration
from canner.tus.store import UploadStore

DEFAULT_CONFIG = Path("/etc/canner/canner.toml")
EXAMPLE_FILENAME = "example.warc.gz"
EXAMPLE_HEX = "0123456789abcdef0123456789abcdef"
EMPTY_MD5 = "d41d8cd98f00b204e9800998ecf8427e"
INSERT_BATCH = 500


class CommandError(Exception):
    """An expected failure: printed as ``canner: <message>``, exit status 1."""


@define
class Io:
    """Where a command writes, and its clock (injected by tests)."""

    out: TextIO
    err: TextIO
    now: Callable[[], float] = time.time


def _dump(io: Io, doc: Any) -> None:
    io.out.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def _object_id(config: Config, text: str) -> str:
    if not config.object_ids.is_valid(text):
        raise CommandError(f"{text!r} is not an object id of this node")
    return text


def _data_dir(config: Config) -> Path:
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


# -- check-config ------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def config_json(config: Config) -> dict[str, Any]:
    """The resolved config as JSON (paths absolute, durations in seconds; no secrets in it)."""
    doc = attrs.asdict(config, value_serializer=lambda _inst, _field, v: _jsonable(v))
    doc["projects"] = {pid: {"delivery": p["delivery"]} for pid, p in doc["projects"].items()}
    return doc


def delivery_example(config: Config, project_id: str, now: float) -> dict[str, Any] | None:
    """Where an object uploaded now would go; raises ConfigError naming the key at fault."""
    delivery = config.projects[project_id].delivery
    if delivery is None:
        return None
    validate_delivery(project_id, delivery)
    object_id = f"{config.node_prefix}-{EXAMPLE_HEX}" if config.node_prefix else EXAMPLE_HEX
    try:
        plan = plan_upload(
            delivery, project_id, object_id, EXAMPLE_FILENAME, int(now), 0, EMPTY_MD5
        )
    except PlanError as e:
        raise ConfigError(f"projects.{project_id}.delivery", str(e)) from None
    example = {
        "object_id": object_id,
        "filename": EXAMPLE_FILENAME,
        "accepted_at": int(now),
        "identifier": plan.identifier,
        "remote_name": plan.remote_name,
    }
    if delivery.sink == "directory":
        root = validate_directory(project_id, delivery)
        example["path"] = str(root / plan.identifier / plan.remote_name)
    else:
        example["url"] = f"{delivery.metadata_url.rstrip('/')}/details/{plan.identifier}"
    return example


def _credential_warnings(config: Config) -> list[str]:
    warnings = []
    for pid, project in config.projects.items():
        if project.delivery is None:
            warnings.append(f"projects.{pid}: no delivery table, artifacts stay local")
            continue
        path = project.delivery.credentials
        if path is None:
            continue  # a directory sink: delivery_example checked its path
        key = f"projects.{pid}.delivery.credentials"
        if path.exists() and not os.access(path, os.R_OK):
            warnings.append(f"{key}: {path} is not readable by this user (not checked)")
            continue
        try:
            load_credentials(path)
        except CredentialsError as e:
            raise ConfigError(key, str(e)) from None
    if config.manhole is not None and not os.access(config.manhole.authorized_keys, os.R_OK):
        warnings.append(
            f"manhole.authorized_keys: {config.manhole.authorized_keys} is not readable"
            " (the daemons refuse to start with a manhole and no keys)"
        )
    return warnings


def check_config(config_path: Path, io: Io) -> int:
    config = load_config(config_path)
    now = io.now()
    examples = {pid: delivery_example(config, pid, now) for pid in config.projects}
    warnings = _credential_warnings(config)
    _dump(
        io,
        {
            "config_file": str(config_path.resolve()),
            "config": config_json(config),
            "delivery_examples": examples,
            "warnings": warnings,
        },
    )
    for warning in warnings:
        io.err.write(f"canner: warning: {warning}\n")
    return 0


# -- status ------------------------------------------------------------------------------------


def _status_text(doc: dict[str, Any], config: Config) -> str:
    lines = [f"data directory   {config.data_dir}"]
    free = doc["free_bytes"]
    lines.append(
        "free space       "
        + (
            f"{human_bytes(free)} ({free} bytes)"
            if free is not None
            else f"unknown: {doc['free_error']}"
        )
        + f", floor {human_bytes(config.min_free_bytes)}"
    )
    lines.append(
        f"active uploads   {doc['active_uploads']} ({human_bytes(doc['active_upload_bytes'])}"
        f" stored, {doc['awaiting_acceptance']} awaiting acceptance)"
    )
    if doc["states"] is None:
        lines.append(f"delivery index   unreadable: {doc['index_error']}")
        return "\n".join(lines) + "\n"
    states = ", ".join(f"{state} {count}" for state, count in doc["states"].items())
    lines.append(f"deliveries       {states}")
    lines.append(
        f"pending          {doc['pending_objects']} objects, {human_bytes(doc['pending_bytes'])}"
        f" ({doc['pending_bytes']} bytes)"
    )
    lines.append(f"oldest pending   {human_duration(doc['oldest_pending_age_s'])}")
    lines.append(f"needs operator   {doc['needs_operator']}")
    lines.append(
        f"purges overdue   {doc['purge_overdue']} (lag {human_duration(doc['purge_lag_s'])})"
    )
    for project, totals in doc["projects"].items():
        lines.append(
            f"project {project}: {totals['accepted_objects']} accepted"
            f" ({human_bytes(totals['accepted_bytes'])}), {totals['pending_objects']} pending"
            f" ({human_bytes(totals['pending_bytes'])}), {totals['delivered_objects']} delivered"
        )
    return "\n".join(lines) + "\n"


def status(config_path: Path, as_json: bool, io: Io) -> int:
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    survey = inventory.take_survey(data_dir, config.object_ids, io.now())
    doc = inventory.survey_json(survey, config.min_free_bytes)
    io.out.write(json.dumps(doc, indent=2) + "\n" if as_json else _status_text(doc, config))
    problems = [e for e in (survey.free_error, survey.index_error) if e]
    for problem in problems:
        io.err.write(f"canner: {problem}\n")
    return 1 if problems else 0


# -- show, deliveries, retry -------------------------------------------------------------------


def show(config_path: Path, object_id: str, io: Io) -> int:
    config = load_config(config_path)
    oid = _object_id(config, object_id)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    try:
        description = inventory.lookup_object(data_dir, oid)
    except sqlite3.Error as e:
        raise CommandError(f"cannot read the delivery index: {e}") from None
    if not inventory.known(description):
        raise CommandError(f"no object {oid} in {data_dir} (no receipt, upload or delivery row)")
    _dump(io, description)
    return 0


def deliveries(config_path: Path, io: Io) -> int:
    config = load_config(config_path)
    become_data_dir_owner(_data_dir(config))
    conn = inventory.open_read_only(config.data_dir / inventory.INDEX_NAME)
    try:
        for row in sql.all_rows(conn.cursor()):
            io.out.write(json.dumps(row.as_dict(), separators=(",", ":")) + "\n")
    finally:
        conn.close()
    return 0


def retry(config_path: Path, object_id: str, io: Io) -> int:
    config = load_config(config_path)
    oid = _object_id(config, object_id)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    path = data_dir / inventory.INDEX_NAME
    if not path.exists():
        raise CommandError(f"{path} does not exist (has canner run on this data directory?)")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        cur = conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            made_due = sql.make_due_now(cur, oid, io.now())
            row = sql.get_row(cur, oid)
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")
    finally:
        conn.close()
    if row is None:
        raise CommandError(f"{oid} is not in the delivery index")
    if not made_due:
        raise CommandError(
            f"{oid} is {row.state}, not retry_wait: only a waiting retry can be made due"
        )
    io.out.write(
        f"{oid} is due now: canner-deliver starts attempt {row.attempts + 1} within a second"
        f" (last error: {row.last_error or 'none'})\n"
    )
    return 0


# -- rebuild-index -----------------------------------------------------------------------------


@define
class Progress:
    """``label: done/total`` rewritten in place on a terminal; silent elsewhere."""

    stream: TextIO
    label: str
    total: int
    done: int = 0
    _shown: int = -1

    def step(self, count: int = 1) -> None:
        self.done += count
        # Redraw about 200 times over the whole run, and at the end.
        if self.done == self.total or self.done - self._shown >= max(1, self.total // 200):
            self._shown = self.done
            self.stream.write(f"\r{self.label}: {self.done}/{self.total}")
            self.stream.flush()

    def finish(self) -> None:
        self.stream.write(f"\r{self.label}: {self.done}/{self.total}\n")
        self.stream.flush()


@frozen
class _CountedReceipts(ReceiptStore):
    """A ReceiptStore whose listing reports each id to a progress display."""

    progress: Progress | None = field(default=None, kw_only=True)

    def object_ids(self) -> Iterator[str]:
        for object_id in super().object_ids():
            if self.progress is not None:
                self.progress.step()
            yield object_id


def rebuild_index(config_path: Path, io: Io) -> int:
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    lock = DataDirLock(data_dir / "deliver.lock")
    try:
        lock.acquire()
    except Locked:
        raise CommandError(
            f"canner-deliver is running on {data_dir} (it holds deliver.lock):"
            " stop it first (systemctl stop canner-deliver)"
        ) from None
    try:
        return _rebuild(config, data_dir, io)
    finally:
        lock.release()


def _rebuild(config: Config, data_dir: Path, io: Io) -> int:
    path = data_dir / inventory.INDEX_NAME
    upgrade_schema(path)
    receipts_dir = data_dir / "receipts"
    tty = io.err.isatty()
    scan = None
    if tty:
        total = sum(1 for _ in ReceiptStore(receipts_dir).object_ids())
        scan = Progress(io.err, "reading receipts", total)
    receipts = _CountedReceipts(receipts_dir, progress=scan)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        known = sql.known_ids(conn.cursor())
        missing = missing_objects(
            receipts, UploadStore(data_dir / "uploads"), config.object_ids, known
        )
        if scan is not None:
            scan.finish()
        writing = Progress(io.err, "adding to the index", len(missing)) if tty else None
        added = 0
        for start in range(0, len(missing), INSERT_BATCH):
            batch = missing[start : start + INSERT_BATCH]
            cur = conn.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                added += sql.insert_objects(cur, batch, io.now())
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
            if writing is not None:
                writing.step(len(batch))
        if writing is not None and missing:
            writing.finish()
    finally:
        conn.close()
    io.out.write(
        f"rebuild-index: {len(known)} objects were indexed, {added} added from receipts"
        f" ({len(missing) - added} appeared meanwhile)\n"
    )
    return 0


# -- main --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canner", description="Operate a canner data directory.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the canner TOML file")
        return sub

    command("check-config", "validate the config, print it resolved with example IA destinations")
    command("status", "objects by state, bytes pending, free space, oldest pending").add_argument(
        "--json", action="store_true", help="print JSON"
    )
    command("show", "everything known about one object").add_argument("object_id")
    command("deliveries", "one JSON line per object in the delivery index")
    command("retry", "make a retry_wait delivery due now").add_argument("object_id")
    command("rebuild-index", "add receipts missing from delivery.sqlite (deliver stopped)")
    return parser


def main(argv: Sequence[str] | None = None, io: Io | None = None) -> int:
    io = io or Io(sys.stdout, sys.stderr)
    args = _parser().parse_args(argv)
    runs: dict[str, Callable[[], int]] = {
        "check-config": lambda: check_config(args.config, io),
        "status": lambda: status(args.config, args.json, io),
        "show": lambda: show(args.config, args.object_id, io),
        "deliveries": lambda: deliveries(args.config, io),
        "retry": lambda: retry(args.config, args.object_id, io),
        "rebuild-index": lambda: rebuild_index(args.config, io),
    }
    try:
        return runs[args.command]()
    except BrokenPipeError:
        return 0
    except (ConfigError, CommandError, FileNotFoundError) as e:
        io.err.write(f"canner: {e}\n")
    except (sqlite3.Error, OSError) as e:
        io.err.write(f"canner: {type(e).__name__}: {e}\n")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
