"""The ``canner`` command: inspection and a few repairs for operators.

``--config FILE`` (default ``/etc/canner/canner.toml``) goes before or after the subcommand;
``canner --version`` prints the version::

    canner check-config       validate, print the resolved config and example IA destinations
    canner status [--json]    deliver's state, objects by delivery state, bytes pending, free
                              space; exit 0 ok (or draining), 1 warning, 2 critical (reasons
                              on stderr)
    canner show ID            receipt, tus sidecar, local payload, delivery row and attempts
    canner deliveries [--state S] [--project P] [--since D] [--needs-operator]
                              one JSON line per object in the delivery index
    canner retry ID           make a retry_wait delivery due now, send a delivered but
                              unverified one (unlisted, mismatched, flagged) to be delivered
                              again (guarded updates), or let a packed object that failed its
                              receipt check join a batch again
    canner retry --needs-operator [--project P]
                              the same for every flagged row (after a fix)
    canner packages           one JSON line per megawarc batch and package (state, members,
                              bytes, item, files, times)
    canner rebuild-index      add every receipt missing from delivery.sqlite, and every package
                              in the packages directory (canner-deliver must be stopped: it
                              refuses while deliver.lock is held); refuses a damaged index,
                              which --replace-damaged first moves aside
    canner adopt-go DATA_DIR [--apply]
                              take a Go canner's data directory over (both systems' daemons
                              stopped): a dry run prints the plan per object
    canner drain [--reason R] stop taking new uploads (a durable marker in the data directory);
                              uploads in progress and deliveries go on
    canner undrain            take new uploads again
    canner import-go-config CONFIG.json [--output PATH]
                              a Go canner config as canner TOML; every change on stderr
    canner manhole-proxy ROLE relay stdin/stdout to ROLE's manhole unix socket: ssh's
                              ProxyCommand (conf/manhole.md), needing nothing but canner

IDs may be given by a unique prefix of at least 4 characters (the status page shows 8).
Every Unix time in the JSON output is followed by ``<key>_utc``, the same instant in ISO 8601
UTC, for people; the number stays for scripts.

Reads use read-only SQLite connections, safe while both daemons run.  Run as root, the command
first becomes the owner of the data directory, so any file SQLite creates there (``-wal``,
``-shm``, a new index) stays usable by the daemons.  Errors go to stderr as ``canner: ...`` with
exit status 1 (2 for usage errors); a config error names its key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import attrs
from attrs import define, field, frozen

from canner.blocking import result_now, run_inline
from canner.config import Config, ConfigError, check_data_dir, load_config, parse_duration
from canner.delivery import index as sql
from canner.delivery.index import (
    UNKNOWN_PROJECT,
    ConnectionIndex,
    QueueRow,
    configure_connection,
    upgrade_schema,
)
from canner.delivery.queue import State
from canner.delivery.rescan import ReceiptRescan
from canner.doors.rsync.conf import GLOBAL_TEMPLATE, MODULE_TEMPLATE, rsyncd_conf
from canner.doors.rsync.incoming import count_waiting
from canner.fs import DataDirLock, Locked, fsync_dir, lock_held, replace_file
from canner.go_canner.adopt import AdoptError, adopt
from canner.go_canner.config_import import convert_config
from canner.hq import releases as rel
from canner.ledger import store as ledger_store
from canner.ledger.files import ArchivedIds, LedgerDir, Manifest
from canner.ledger.service import validate_ledger
from canner.ops import inventory
from canner.ops.humane import human_bytes, human_duration
from canner.ops.verdict import CRITICAL, Verdict, assess
from canner.packaging import batches as psql
from canner.packaging.restore import PackageRestore
from canner.packaging.store import PackageStore
from canner.sinks.credentials import CredentialsError, load_credentials, loose_permissions
from canner.sinks.directory import validate_directory
from canner.sinks.plan import (
    PlanError,
    format_date,
    plan_package_file,
    plan_upload,
    validate_delivery,
)
from canner.store import drain as draining
from canner.store.datadir import DELIVER_WRITES, CannotStart, check_writes
from canner.store.journal import Journal
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore
from canner.version import version

DEFAULT_CONFIG = Path("/etc/canner/canner.toml")
EXAMPLE_FILENAME = "example.warc.gz"
EXAMPLE_HEX = "0123456789abcdef0123456789abcdef"
EMPTY_MD5 = "d41d8cd98f00b204e9800998ecf8427e"


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


def _dump(io: Io, doc: Any) -> None:
    io.out.write(json.dumps(with_utc(doc), indent=2, sort_keys=False) + "\n")


def _line(io: Io, doc: Any) -> None:
    """One JSON line (``deliveries``, ``packages``, ``ledger``...), times as in :func:`with_utc`."""
    io.out.write(json.dumps(with_utc(doc), separators=(",", ":")) + "\n")


def _object_id(config: Config, text: str) -> str:
    """``text`` when it is a whole object id; otherwise the one known object it starts."""
    try:
        return inventory.resolve_id(config.data_dir, config.object_ids, text)
    except inventory.UnknownId as e:
        raise CommandError(str(e)) from None


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


# Who the packaged units run the daemons as (debian/canner.canner-*.service: ``User=canner``).
DAEMON_ACCOUNT = "canner"


@frozen
class Account:
    """A user to act as: uid, primary gid and supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]


def daemon_account(config_path: Path, data_dir: Path) -> Account | None:
    """Run as root, the user the daemons run as: for the packaged config (``DEFAULT_CONFIG``,
    which the packaged units start the daemons on) the ``canner`` account when it exists (their
    ``User=``), else the owner of ``data_dir`` (whom every other command runs as); None when not
    root, or when that user is root."""
    if os.geteuid() != 0:
        return None
    try:
        if config_path.resolve() != DEFAULT_CONFIG.resolve():
            raise KeyError(DAEMON_ACCOUNT)  # daemons started by hand run as whoever owns the data
        user = pwd.getpwnam(DAEMON_ACCOUNT)
    except KeyError:
        owner = data_dir.stat()
        try:
            user = pwd.getpwuid(owner.st_uid)
        except KeyError:  # an owner without a name: its ids alone
            return Account(owner.st_uid, owner.st_gid, ()) if owner.st_uid != 0 else None
    if user.pw_uid == 0:
        return None
    groups = tuple(os.getgrouplist(user.pw_name, user.pw_gid))
    return Account(user.pw_uid, user.pw_gid, groups)


@contextlib.contextmanager
def acting_as(account: Account | None) -> Iterator[None]:
    """Within the block, this process's effective user, group and groups are ``account``'s (so
    the kernel lets it write exactly what that user may write); root's again after it.  None:
    unchanged."""
    if account is None:
        yield
        return
    egid, groups = os.getegid(), os.getgroups()
    os.setgroups(list(account.groups))
    os.setegid(account.gid)
    os.seteuid(account.uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(egid)
        os.setgroups(groups)


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
    doc["projects"] = {
        pid: {"delivery": p["delivery"], "packaging": p["packaging"]}
        for pid, p in doc["projects"].items()
    }
    return doc


def delivery_example(config: Config, project_id: str, now: float) -> dict[str, Any] | None:
    """Where an object uploaded now would go; raises ConfigError naming the key at fault."""
    delivery = config.projects[project_id].delivery
    if delivery is None:
        return None
    packaging = config.projects[project_id].packaging
    validate_delivery(project_id, delivery, packaging.mode)
    if packaging.megawarc:
        try:
            plan = plan_package_file(
                delivery, project_id, EXAMPLE_HEX, format_date(int(now)), ".megawarc.warc.gz",
                0, EMPTY_MD5,
            )  # fmt: skip
        except PlanError as e:
            raise ConfigError(f"projects.{project_id}.delivery", str(e)) from None
        return {
            "package": EXAMPLE_HEX,
            "batch_date": format_date(int(now)),
            "identifier": plan.identifier,
            "remote_name": plan.remote_name,
            "url": f"{delivery.metadata_url.rstrip('/')}/details/{plan.identifier}",
        }
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
        if (loose := loose_permissions(path)) is not None:
            warnings.append(f"{key}: {loose}")
    if config.hq is not None:
        try:
            rel.TokenFile(config.hq.tokens).current()
        except OSError as e:
            raise ConfigError(
                "hq.tokens", f"cannot read {config.hq.tokens}: {e.strerror}"
            ) from None
        except rel.TokenFileError as e:
            raise ConfigError("hq.tokens", f"{config.hq.tokens}: {e}") from None
    if config.ledger is not None:
        validate_ledger(config.ledger)
        try:
            load_credentials(config.ledger.credentials)
        except CredentialsError as e:
            raise ConfigError("ledger.credentials", str(e)) from None
        if (loose := loose_permissions(config.ledger.credentials)) is not None:
            warnings.append(f"ledger.credentials: {loose}")
    if config.manhole is not None and not os.access(config.manhole.authorized_keys, os.R_OK):
        warnings.append(
            f"manhole.authorized_keys: {config.manhole.authorized_keys} is not readable"
            " (the daemons refuse to start with a manhole and no keys)"
        )
    return warnings


def _listen_problem(description: str) -> str | None:
    """Why ``description`` is no Twisted server endpoint this process could listen on."""
    from twisted.internet import endpoints, reactor

    if description.startswith("systemd:"):
        return None  # sockets passed by systemd exist only under systemd
    try:
        endpoints.serverFromString(reactor, description)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return f"{description!r} is not a Twisted endpoint description: {e or type(e).__name__}"
    return None


def check_config(config_path: Path, io: Io) -> int:
    """Validate as the daemons do at start (config, listen endpoint, the data directory as
    their user: :func:`daemon_account`), then print the resolved config, example destinations
    and warnings."""
    config = load_config(config_path)
    problem = _listen_problem(config.listen)
    if problem is not None:
        raise ConfigError("listen", problem)
    check_data_dir(config)
    # The daemons' own start-up check, as their user: a data directory they would refuse to
    # start on fails here with their line (the path, the user and the fix).
    with acting_as(daemon_account(config_path, config.data_dir)):
        check_writes(config, DELIVER_WRITES)
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


def _status_text(doc: dict[str, Any], config: Config, flagged: Sequence[QueueRow] = ()) -> str:
    """``canner status`` for people; ``flagged``: objects waiting for an operator, named."""
    lines = [f"data directory   {config.data_dir}"]
    mark, retire = doc.get("draining"), doc.get("retirement")
    if mark is not None and retire is not None:
        state = draining.DrainMark(mark["since"], mark["reason"]).describe()
        if retire["retirable"]:
            lines.append(f"draining         {state}; retirable: nothing here is undelivered")
        else:
            lines.append(f"draining         {state}; not retirable yet:")
            lines += [f"  remaining      {what}" for what in retire["remaining"]]
    deliver = doc.get("deliver")
    if deliver is not None:
        lines.append(f"canner-deliver   {deliver['state']}: {deliver['text']}")
        for p in deliver["in_flight"]:
            rate = f"{human_bytes(int(p['rate']))}/s" if p["rate"] else "-"
            lines.append(
                f"  in flight      {p['object_id']} {p['phase']}: {human_bytes(p['sent'])}"
                f" of {human_bytes(p['size'])}, {rate}, ETA {human_duration(p['eta_s'])}"
                + (
                    f", {p['parts_done']} of {p['parts']} parts at IA"
                    if p.get("parts") is not None
                    else ""
                )
            )
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
    lines.append(
        f"promised         {human_bytes(doc['promised_bytes'])} ({doc['promised_bytes']} bytes)"
        " to uploads in flight"
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
    lines += [f"  flagged        {r.object_id} ({r.project}): {r.last_error}" for r in flagged]
    lines.append(
        f"purges overdue   {doc['purge_overdue']} (lag {human_duration(doc['purge_lag_s'])})"
    )
    if "rsync_waiting" in doc:
        lines.append(f"rsync waiting    {doc['rsync_waiting']} files finished, not yet adopted")
    if any((doc.get("packages") or {}).values()):
        phases = ", ".join(f"{phase} {n}" for phase, n in doc["packages"].items() if n)
        lines.append(f"packages         {phases}")
    now = doc["taken_at"]
    for w in doc.get("dictionary_waits") or []:
        lines.append(
            f"dictionary wait  zstd dictionary {w['dict_id']} of {w['project']}: its members"
            f" wait since {human_duration(now - w['since'])} ({w['attempts']} attempts, next in"
            f" {human_duration(max(0.0, w['next_attempt_at'] - now))}): {w['error']}"
        )
    for project, totals in doc["projects"].items():
        lines.append(
            f"project {project}: {totals['accepted_objects']} accepted"
            f" ({human_bytes(totals['accepted_bytes'])}), {totals['pending_objects']} pending"
            f" ({human_bytes(totals['pending_bytes'])}), {totals['delivered_objects']} delivered"
        )
    return "\n".join(lines) + "\n"


def judge_survey(survey: inventory.Survey, config: Config) -> Verdict:
    """The verdict of ``canner status`` (its code the exit status: 0 ok or draining, 1 warning,
    2 critical): the one the status page shows and whose storage reasons ``/readyz`` gives."""
    delivers = any(p.delivery is not None for p in config.projects.values())
    return assess(survey, min_free_bytes=config.min_free_bytes, delivers=delivers)


def unreadable_data_dir(data_dir: Path) -> str | None:
    """Why this process cannot look inside ``data_dir``, or None when it can."""
    if os.access(data_dir, os.R_OK | os.X_OK):
        return None
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return (
        f"data directory {data_dir} is not readable by {user} (uid {uid}, its owner, whom"
        " canner runs as): this node's state is unknown; give it back to its owner with"
        " mode 0750"
    )


def status(config_path: Path, as_json: bool, io: Io) -> int:
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    problem = unreadable_data_dir(data_dir)
    if problem is not None:
        # Nothing inside can be read: say only that, never a state (draining...) guessed from
        # files that could not be opened.
        doc = {"taken_at": io.now(), "status": "critical", "reasons": [f"critical: {problem}"]}
        io.out.write(
            json.dumps(with_utc(doc), indent=2) + "\n"
            if as_json
            else f"data directory   {data_dir}: unreadable, state unknown\n"
        )
        io.err.write(f"canner: critical: {problem}\n")
        return CRITICAL
    survey = inventory.take_survey(data_dir, config.object_ids, io.now())
    # A heartbeat marked stopped is not a stop while a deliver process still holds the lock.
    survey = attrs.evolve(survey, deliver_lock_held=lock_held(data_dir / "deliver.lock"))
    doc = inventory.survey_json(survey, config.min_free_bytes)
    verdict = judge_survey(survey, config)
    doc["status"] = verdict.status
    doc["reasons"] = reasons = list(verdict.reasons)
    if config.rsync is not None:
        doc["rsync_waiting"] = count_waiting(config.rsync.incoming, config.projects, data_dir)
    # The latest failures that wait for an operator, by name (the page lists the same).
    flagged = [r for r in survey.index.recent_failures if r.needs_operator] if survey.index else []
    io.out.write(
        json.dumps(with_utc(doc), indent=2) + "\n"
        if as_json
        else _status_text(doc, config, flagged)
    )
    for reason in reasons:
        io.err.write(f"canner: {reason}\n")
    return verdict.code


# -- drain, undrain ----------------------------------------------------------------------------


def drain(config_path: Path, reason: str, io: Io) -> int:
    config = load_config(config_path)
    data_dir = _data_dir(config)
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
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    if draining.stop_draining(data_dir):
        io.out.write("no longer draining: new uploads are accepted again\n")
    else:
        io.out.write("not draining: nothing to do\n")
    return 0


# -- show, deliveries, retry -------------------------------------------------------------------


def show(config_path: Path, object_id: str, io: Io) -> int:
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    oid = _object_id(config, object_id)
    try:
        description = inventory.lookup_object(data_dir, oid)
    except sqlite3.Error as e:
        raise CommandError(f"cannot read the delivery index: {e}") from None
    if not inventory.known(description):
        raise CommandError(
            f"no object {oid} in {data_dir} (no receipt, upload, delivery row or ledger record)"
        )
    try:
        package = inventory.read_index(data_dir / inventory.INDEX_NAME, psql.object_package, oid)
    except FileNotFoundError:
        package = None
    if package is None:
        # The receipt's side file names the package once the upload is purged.
        package = ReceiptStore(data_dir / "receipts").read_package(oid)
    if package is not None:
        description["package"] = package
    _dump(io, description)
    return 0


def packages(config_path: Path, io: Io) -> int:
    """One JSON line per package (batches still filling included), oldest first."""
    config = load_config(config_path)
    become_data_dir_owner(_data_dir(config))
    conn = inventory.open_read_only(config.data_dir / inventory.INDEX_NAME)
    try:
        cur = conn.cursor()
        for row in psql.all_packages(cur):
            doc = psql.package_listing(cur, row)
            _line(io, doc)
    finally:
        conn.close()
    return 0


@frozen
class RowFilter:
    """``canner deliveries`` filters; None matches everything."""

    state: str | None = None
    project: str | None = None
    since: float | None = None  # updated at or after (Unix time)
    needs_operator: bool = False

    def matches(self, row: QueueRow) -> bool:
        return (
            (self.state is None or row.state == self.state)
            and (self.project is None or row.project == self.project)
            and (self.since is None or row.updated_at >= self.since)
            and (not self.needs_operator or bool(row.needs_operator))
        )


def parse_since(text: str, now: float) -> float:
    """``--since``: a duration back from now (``90m``, ``2h``) or an ISO 8601 time (UTC unless
    it says otherwise)."""
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(
            f"--since {text!r} is neither a duration (90m, 2h) nor an ISO 8601 time"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def deliveries(config_path: Path, io: Io, where: RowFilter = RowFilter()) -> int:
    config = load_config(config_path)
    become_data_dir_owner(_data_dir(config))
    conn = inventory.open_read_only(config.data_dir / inventory.INDEX_NAME)
    try:
        for row in sql.all_rows(conn.cursor()):
            if where.matches(row):
                _line(io, row.as_dict())
    finally:
        conn.close()
    return 0


def _write(data_dir: Path, f: Callable[..., Any], *args: Any) -> Any:
    """Run the cursor function ``f`` in one write transaction on the index."""
    path = data_dir / inventory.INDEX_NAME
    if not path.exists():
        raise CommandError(f"{path} does not exist (has canner run on this data directory?)")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        return ConnectionIndex(conn).transact(f, *args)
    finally:
        conn.close()


def _retry_one(
    cur: sqlite3.Cursor, oid: str, now: float
) -> tuple[str | None, QueueRow | None, QueueRow | None]:
    """("due" | "readmitted" | "cleared" | None, the row before, the row after)."""
    before = sql.get_row(cur, oid)
    if sql.operator_retry(cur, oid, now):
        return "due", before, sql.get_row(cur, oid)
    if psql.readmit(cur, oid, now):
        return "readmitted", before, sql.get_row(cur, oid)
    if sql.clear_flag(cur, oid, now):
        return "cleared", before, sql.get_row(cur, oid)
    return None, before, sql.get_row(cur, oid)


def _retry_flagged(
    cur: sqlite3.Cursor, project: str | None, config: Config, now: float
) -> tuple[list[QueueRow], list[tuple[QueueRow, str]]]:
    """Flagged rows waiting for a retry, and flagged delivered rows not yet verified (a remote
    copy that differs, or one the destination kept losing): both are delivered again (the
    rows before), but for those canner-deliver would never send (each with why, still
    flagged)."""
    done, left = [], []
    for oid in sql.flagged_objects(cur, project):
        before = sql.get_row(cur, oid)
        assert before is not None
        if (why := _undeliverable(before, config)) is not None:
            left.append((before, why))
        elif sql.operator_retry(cur, oid, now):
            done.append(before)
    return done, left


def _clear_verified_flags(cur: sqlite3.Cursor, project: str | None, now: float) -> list[QueueRow]:
    """Flagged rows that are delivered and verified: nothing to send, the flags are cleared."""
    cur.execute(
        "SELECT object_id FROM object_delivery WHERE needs_operator != 0 AND state = 'delivered'"
        " AND verified_at IS NOT NULL AND (? IS NULL OR project = ?)"
        " ORDER BY accepted_at, object_id",
        (project, project),
    )
    cleared = []
    for (oid,) in cur.fetchall():
        before = sql.get_row(cur, oid)
        if sql.clear_flag(cur, oid, now):
            assert before is not None
            cleared.append(before)
    return cleared


def retry_needing_operator(config_path: Path, project: str | None, io: Io) -> int:
    """Every row flagged for an operator (of ``project``) is retried (see :func:`retry`)."""
    config = load_config(config_path)
    if project is not None and project not in config.projects:
        raise CommandError(f"--project {project!r} is not a configured project")
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    rows, left = _write(data_dir, _retry_flagged, project, config, io.now())
    for row in rows:
        io.out.write(f"{row.object_id} ({row.project}) is due now; last error: {row.last_error}\n")
    for row, why in left:
        name = "project unknown" if row.project == UNKNOWN_PROJECT else row.project
        io.out.write(f"{row.object_id} ({name}) is not retried: {why}\n")
    for row in _write(data_dir, _clear_verified_flags, project, io.now()):
        io.out.write(
            f"{row.object_id} ({row.project}) is delivered and verified: its flag is cleared;"
            f" it said: {row.last_error}\n"
        )
    files = _write(data_dir, _retry_flagged_files, project, io.now())
    for kind, name, last_error in files:
        _say_file_retried(kind, name, last_error, io)
    io.out.write(
        f"{len(rows) + len(files)} deliveries needing an operator are due now: canner-deliver"
        " retries them within a second\n"
    )
    return 0


def _retry_file(cur: sqlite3.Cursor, name: str, now: float) -> tuple[str, Any] | None:
    """A megawarc package or a ledger named ``name`` retried: ("package" | "ledger", its row
    before); ("package" | "ledger", None) when it exists but there is nothing to retry; None
    when no package or ledger has that name."""
    before = psql.operator_retry(cur, name, now)
    if before is not None:
        return "package", before
    cur.execute("SELECT 1 FROM packages WHERE package_id = ?", (name,))
    if cur.fetchone() is not None:
        return "package", None
    ledger = ledger_store.operator_retry(cur, name, now)
    if ledger is not None:
        return "ledger", ledger
    cur.execute("SELECT 1 FROM ledgers WHERE name = ?", (name,))
    return ("ledger", None) if cur.fetchone() is not None else None


def _retry_flagged_files(
    cur: sqlite3.Cursor, project: str | None, now: float
) -> list[tuple[str, str, str | None]]:
    """Every flagged package (of ``project``) and, without a project, every flagged ledger,
    retried: (kind, name, last error)."""
    done = []
    for package_id in psql.flagged_packages(cur, project):
        row = psql.operator_retry(cur, package_id, now)
        if row is not None:
            done.append(("package", package_id, row.last_error))
    for name in ledger_store.flagged_ledgers(cur) if project is None else []:
        ledger = ledger_store.operator_retry(cur, name, now)
        if ledger is not None:
            done.append(("ledger", name, ledger.last_error))
    return done


def _say_file_retried(kind: str, name: str, last_error: str | None, io: Io) -> None:
    io.out.write(
        f"{kind} {name} is due now: canner-deliver sends it again within a second"
        f" (last error: {last_error or 'none'})\n"
    )


def retry(config_path: Path, object_id: str, io: Io) -> int:
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    named = _write(data_dir, _retry_file, object_id, io.now())
    if named is not None:
        kind, before = named
        if before is None:
            raise CommandError(
                f"{kind} {object_id} has nothing to retry: it is delivered and verified, or"
                " on its way (a retry takes one waiting for an attempt, or delivered and not"
                " verified)"
            )
        _say_file_retried(kind, object_id, before.last_error, io)
        return 0
    oid = _object_id(config, object_id)
    known = _write(data_dir, sql.get_row, oid)
    if known is not None and (why := _undeliverable(known, config)) is not None:
        raise CommandError(f"{oid} is not retried: {why}")
    made_due, before, row = _write(data_dir, _retry_one, oid, io.now())
    if row is None or before is None:
        raise CommandError(f"{oid} is not in the delivery index")
    if made_due == "cleared":
        io.out.write(
            f"{oid} is delivered and verified at its destination: nothing to send; its flag for"
            f" an operator is cleared (it said: {row.last_error or 'nothing'})\n"
        )
        return 0
    if made_due == "readmitted":
        io.out.write(
            f"{oid} joins a megawarc batch again (its bytes are checked against its receipt"
            f" when packed; last error: {row.last_error or 'none'})\n"
        )
        return 0
    if made_due is None:
        if row.state == State.DELIVERED and row.verified_at is not None:
            raise CommandError(
                f"{oid} is delivered and verified at its destination: nothing to retry"
            )
        raise CommandError(
            f"{oid} is {row.state}: only a waiting retry or a delivered, unverified object can"
            " be retried"
        )
    again = " (delivered again)" if before.state == State.DELIVERED else ""
    io.out.write(
        f"{oid} is due now{again}: canner-deliver starts attempt {row.attempts + 1} within a"
        f" second (last error: {before.last_error or 'none'})\n"
    )
    # An identity object is sent from its payload (a megawarc member was checked when packed).
    identity = not config.projects[row.project].packaging.megawarc
    if identity and row.purged_at is None and not (data_dir / "uploads" / oid).exists():
        io.out.write(
            f"note: its payload uploads/{oid} is missing: the attempt fails and flags it again"
            " unless its bytes (as its receipt describes them) are put there first\n"
        )
    return 0


def _undeliverable(row: QueueRow, config: Config) -> str | None:
    """Why canner-deliver would never send ``row`` whatever a retry does (None: it would): it
    claims only rows of configured projects."""
    if row.project == UNKNOWN_PROJECT:
        return (
            "no project is known for it (adopted from the Go canner without one), so canner"
            " cannot deliver it; its receipt is kept and served"
        )
    if row.project not in config.projects:
        return (
            f"its project {row.project} is not in the config: add [projects.{row.project}]"
            " and restart canner-deliver first"
        )
    return None


# -- release -----------------------------------------------------------------------------------


def release(config_path: Path, given: Sequence[str], io: Io) -> int:
    """Release receipts as HQ would (``canner release ID...``): one JSON line per id; exit 1
    when any was refused (not delivered and verified yet, or unknown)."""
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    receipt_ids = []
    for text in given:
        oid = rel.object_id_of(text) or text
        if not config.object_ids.is_valid(oid):
            oid = _object_id(config, oid)
        receipt_ids.append(f"receipt:{oid}")
    oids = [rel.object_id_of(r) for r in receipt_ids]
    now = io.now()
    candidates = _write(data_dir, rel.release_candidates, oids)
    archived_ids = ArchivedIds(LedgerDir(data_dir / "ledger"))
    archived = {}
    for oid in oids:
        where = archived_ids.find(oid) if oid not in candidates else None
        if where is not None:
            archived[oid] = where.released_at
    answers, to_publish = rel.classify(
        receipt_ids, candidates, archived, config.object_ids.is_valid
    )
    published: dict[str, float] = {}
    if to_publish:
        journal = Journal(data_dir / "journal")
        published = _write(data_dir, rel.record_releases, journal, to_publish, now, "operator")
    results = rel.finish_answers(receipt_ids, answers, published, now)
    for result in results:
        _line(io, result.as_dict())
    refused = [r for r in results if r.status in (rel.NOT_DELIVERED, rel.UNKNOWN)]
    for r in refused:
        io.err.write(f"canner: {r.id}: {r.status.replace('_', ' ')}\n")
    return 1 if refused else 0


# -- ledger ------------------------------------------------------------------------------------


def _ledger_doc(row: ledger_store.LedgerRow, manifest: Manifest | None) -> dict[str, Any]:
    return {
        "name": row.name,
        "period": row.period,
        "state": row.state,
        "records": row.records,
        "bytes": row.bytes,
        "md5": row.md5,
        "blake3": row.blake3,
        "identifier": row.identifier,
        "remote_name": row.remote_name,
        "url": manifest.url if manifest else None,
        "created_at": row.created_at,
        "written_at": row.written_at,
        "uploaded_at": row.uploaded_at,
        "verified_at": row.verified_at,
        "done_at": row.done_at,
        "needs_operator": bool(row.needs_operator),
        "last_error": row.last_error,
    }


NO_LEDGER = (
    "no [ledger] table in the config: this node writes no ledgers (released records stay"
    " local); see docs/operator-guide.md for [ledger]"
)


def list_ledgers(config_path: Path, io: Io) -> int:
    """``canner ledger``: one JSON line per ledger (the index, and verified ones on disk).

    Without ``[ledger]`` it says so and exits 2, like a usage error: the command does not apply
    to this node as configured, which a script must be able to tell from 1, a failure."""
    config = load_config(config_path)
    if config.ledger is None:
        io.err.write(f"canner: {NO_LEDGER}\n")
        return 2
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    for doc in _ledger_docs(data_dir):
        _line(io, doc)
    return 0


def _ledger_docs(data_dir: Path) -> list[dict[str, Any]]:
    manifests = {m.name: m for m in LedgerDir(data_dir / "ledger").manifests()}
    conn = inventory.open_read_only(data_dir / inventory.INDEX_NAME)
    try:
        rows = ledger_store.ledgers(conn.cursor())
    finally:
        conn.close()
    docs = [_ledger_doc(row, manifests.pop(row.name, None)) for row in rows]
    for m in manifests.values():  # verified, and not (yet) known to a rebuilt index
        docs.append(
            {
                "name": m.name,
                "period": m.period,
                "state": "done" if m.done_at else "deleting",
                "records": m.records,
                "bytes": m.size,
                "md5": m.md5,
                "blake3": m.blake3,
                "identifier": m.identifier,
                "remote_name": m.remote_name,
                "url": m.url,
                "created_at": None,
                "written_at": None,
                "uploaded_at": None,
                "verified_at": m.verified_at,
                "done_at": m.done_at,
                "needs_operator": False,
                "last_error": None,
            }
        )
    return docs


def _read_flush(data_dir: Path) -> tuple[tuple[float, float | None] | None, int]:
    conn = inventory.open_read_only(data_dir / inventory.INDEX_NAME)
    try:
        return ledger_store.flush_state(conn.cursor()), ledger_store.unfinished(conn.cursor())
    finally:
        conn.close()


def flush_ledger(config_path: Path, timeout: float, io: Io) -> int:
    """``canner ledger flush``: ask canner-deliver to close the current period now and archive
    every record past ``delay``; wait until every ledger is done (or ``timeout``)."""
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    if config.ledger is None:
        io.err.write(f"canner: {NO_LEDGER}\n")
        return 2
    if not lock_held(data_dir / "deliver.lock"):
        raise CommandError("canner-deliver is not running: it writes and uploads the ledgers")
    requested = io.now()
    deadline = time.monotonic() + timeout
    while True:
        try:
            _write(data_dir, ledger_store.request_flush, requested)
            break
        except sqlite3.OperationalError:
            # canner-deliver holds the write lock (a large deletion commits): try again.
            if time.monotonic() > deadline:
                raise
    while True:
        # Read-only: never waits behind canner-deliver's writes (WAL readers do not block).
        state, unfinished = _read_flush(data_dir)
        if state is not None and state[1] is not None and unfinished == 0:
            break
        if time.monotonic() > deadline:
            for doc in _ledger_docs(data_dir):
                if doc["state"] != "done":
                    io.err.write(f"canner: ledger {doc['name']} is {doc['state']}: "
                                 f"{doc['last_error'] or 'in progress'}\n")  # fmt: skip
            raise CommandError(f"the flush did not finish within {timeout:.0f}s")
        time.sleep(0.2)
    for doc in _ledger_docs(data_dir):
        _line(io, doc)
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


def rebuild_index(config_path: Path, io: Io, replace_damaged: bool = False) -> int:
    """``canner rebuild-index [--replace-damaged]``, with deliver.lock held: a damaged index is
    refused, or with ``replace_damaged`` moved aside (never deleted), then the index is
    rebuilt from receipts."""
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
        _replace_if_damaged(data_dir / inventory.INDEX_NAME, replace_damaged, io)
        return _rebuild(config, data_dir, io)
    finally:
        lock.release()


def _replace_if_damaged(path: Path, replace: bool, io: Io) -> None:
    """Refuse a damaged index at ``path`` naming ``--replace-damaged``; with ``replace``, move
    it aside and say where (and say so when there was nothing to move)."""
    damage = sql.index_damage(path)
    if damage is None:
        if replace and path.exists():
            io.out.write(f"rebuild-index: {path} is not damaged: nothing moved aside\n")
        return
    if not replace:
        raise CommandError(
            f"delivery index {path} is damaged ({damage}): with deliver and the receiver"
            " stopped, canner rebuild-index --replace-damaged moves delivery.sqlite* aside and"
            " rebuilds it from receipts (docs/operator-guide.md, Recover)"
        )
    if lock_held(path.parent / "receiver.lock"):
        # A running receiver keeps writing into the file it opened, wherever it is moved.
        raise CommandError(
            f"canner-receiver is running on {path.parent} (it holds receiver.lock): stop it"
            " first (systemctl stop canner-receiver), then run rebuild-index --replace-damaged"
        )
    for old, new in sql.move_aside(path, io.now()):
        io.out.write(f"rebuild-index: damaged ({damage}): moved {old} aside to {new}\n")


def _rebuild(config: Config, data_dir: Path, io: Io) -> int:
    path = data_dir / inventory.INDEX_NAME
    upgrade_schema(path)
    receipts_dir = data_dir / "receipts"
    scan = None
    if io.err.isatty():
        total = sum(1 for _ in ReceiptStore(receipts_dir).object_ids())
        scan = Progress(io.err, "reading receipts", total)
    archived = ArchivedIds(LedgerDir(data_dir / "ledger"))
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        index = ConnectionIndex(conn)
        known = sql.count_objects(conn.cursor())
        # The daemon's rescan and package restore, run inline: no reactor, no threads.
        rescan = ReceiptRescan(
            index=index,
            receipts=_CountedReceipts(receipts_dir, progress=scan),
            uploads=UploadStore(data_dir / "uploads"),
            journal=Journal(data_dir / "journal"),
            archived=archived.contains,
            object_ids=config.object_ids,
            run=run_inline,
            now=io.now,
        )
        scanned = result_now(rescan.run())
        if scan is not None:
            scan.finish()
        restore = PackageRestore(
            index=index,
            store=PackageStore(config.packages_path),
            run=run_inline,
            now=io.now,
            archived=archived.contains,
        )
        restored = result_now(restore.run())
    finally:
        conn.close()
    if restored:
        io.out.write(f"rebuild-index: {restored} packages restored from {config.packages_path}\n")
    damage, problems = scanned.damage, scanned.problems
    for line in damage:
        whose = "no legible object id" if line.object_id is None else f"object {line.object_id}"
        io.err.write(f"canner: rebuild-index: damaged journal line {line.describe()} ({whose})\n")
    for problem in problems:
        io.err.write(f"canner: rebuild-index skipped {problem}\n")
    io.out.write(
        f"rebuild-index: {known} objects were indexed, {scanned.added} added from receipts"
        f" ({scanned.read - scanned.added} appeared meanwhile)\n"
    )
    if damage:
        io.err.write(
            f"canner: {len(damage)} journal lines could not be read: the records they held are"
            " lost; the objects named that were added are flagged for an operator"
            " (canner deliveries --needs-operator)\n"
        )
    if problems:
        io.err.write(
            f"canner: {len(problems)} receipts were skipped: repair or move the files named"
            " above, then run rebuild-index again\n"
        )
    return 1 if problems or damage else 0


# -- adopt-go ----------------------------------------------------------------------------------


def adopt_go(config_path: Path, go_dir: Path, apply: bool, io: Io) -> int:
    """``canner adopt-go``: see :mod:`canner.go_canner.adopt`."""
    config = load_config(config_path)
    data_dir = _data_dir(config)
    become_data_dir_owner(data_dir)
    try:
        return adopt(go_dir, data_dir, config.listen, config.projects, apply, io.out, io.now)
    except AdoptError as e:
        raise CommandError(str(e)) from None


# -- manhole-proxy ------------------------------------------------------------------------------


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


# -- import-go-config --------------------------------------------------------------------------


def import_go_config(source: Path, output: Path | None, io: Io) -> int:
    """Print (or write atomically to ``output``) the canner TOML of a Go canner config; each
    finding is one stderr line.  Exit 1, writing nothing, when a finding is an error."""
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"cannot read {source}: {e}") from None
    conversion = convert_config(text, source, source.resolve().parent)
    for finding in conversion.findings:
        io.err.write(f"canner: {finding.line()}\n")
    if conversion.toml is None:
        io.err.write(f"canner: {source}: not converted (errors above)\n")
        return 1
    if output is None:
        io.out.write(conversion.toml)
    else:
        directory = output.resolve().parent
        replace_file(directory, output.name, conversion.toml.encode("utf-8"), sync=True)
        fsync_dir(directory)
    return 0


# -- main --------------------------------------------------------------------------------------


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
        "--templates", type=Path, default=Path("/etc/canner/rsyncd"),
        help="the directory of rsyncd.conf and module.conf (default /etc/canner/rsyncd)",
    )  # fmt: skip
    conf.add_argument(
        "--runtime-dir", type=Path, default=Path("/run/canner/rsyncd"),
        help="the daemon's runtime directory (its lock file)",
    )  # fmt: skip
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
