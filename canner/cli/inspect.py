"""What an operator reads: ``canner status``, ``show``, ``deliveries`` and ``packages``
(read-only SQLite connections, safe while both daemons run)."""

from __future__ import annotations

import json
import os
import pwd
import sqlite3
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from canner.cli.base import (
    CommandError,
    Io,
    become_data_dir_owner,
    dump,
    existing_data_dir,
    line,
    resolve_object_id,
    with_utc,
)
from canner.config import Config, load_config, parse_duration
from canner.delivery import index as sql
from canner.delivery.index import ObjectRow
from canner.doors.rsync.incoming import count_waiting
from canner.fs import lock_held
from canner.ops import inventory
from canner.ops.humane import human_bytes, human_duration
from canner.ops.verdict import CRITICAL, Verdict, assess
from canner.packaging import batches as psql
from canner.store import drain as draining
from canner.store.receipts import ReceiptStore


def _status_text(doc: dict[str, Any], config: Config, flagged: Sequence[ObjectRow] = ()) -> str:
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
    data_dir = existing_data_dir(config)
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


def show(config_path: Path, object_id: str, io: Io) -> int:
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    oid = resolve_object_id(config, object_id)
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
    dump(io, description)
    return 0


def packages(config_path: Path, io: Io) -> int:
    """One JSON line per package (batches still filling included), oldest first."""
    config = load_config(config_path)
    become_data_dir_owner(existing_data_dir(config))
    conn = inventory.open_read_only(config.data_dir / inventory.INDEX_NAME)
    try:
        cur = conn.cursor()
        for row in psql.all_packages(cur):
            doc = psql.package_listing(cur, row)
            line(io, doc)
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

    def matches(self, row: ObjectRow) -> bool:
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
    become_data_dir_owner(existing_data_dir(config))
    conn = inventory.open_read_only(config.data_dir / inventory.INDEX_NAME)
    try:
        for row in sql.all_rows(conn.cursor()):
            if where.matches(row):
                line(io, row.as_dict())
    finally:
        conn.close()
    return 0
