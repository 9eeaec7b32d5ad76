"""``canner adopt-go DATA_DIR``: take a Go canner's data directory over into canner's.

The plan (:func:`make_plan`) decides, per object, one of four steps:

- ``delivered``: its Go package was delivered.  The receipt moves; the object is indexed
  delivered and verified (Go's upload succeeded; canner does not check history again) at the
  Go item, with its delivery and purge times; its origin and a delivery record join the facts
  journal first, so an index rebuilt later still knows it is delivered.  Nothing is sent again.
- ``deliver``: accepted, not delivered.  The payload moves into ``uploads/`` (from its upload;
  when Go already purged that, from the Go package file: an identity package is the artifact,
  a mergewarc member is its byte range, both checked against the receipt's BLAKE3), with a
  canner info sidecar and an origin record; the object is indexed pending, so canner delivers
  (or packages) it under its own config.  A Go package that was never built is "rebuilt".
- ``in_flight``: an upload with no receipt.  Data file and a canner sidecar (no ``Storage``:
  paths derive from the id) move into ``uploads/``, keeping the offset (the file's size), the
  metadata and the idle time, so the worker resumes at the same ``/files/<id>``.
- ``problem``: what canner cannot take (reported, its files left in place).  A receipt still
  moves, byte for byte, and its object is indexed ``retry_wait`` and flagged for an operator
  with the step's note (project ``(unknown)`` when none is known): ``canner status`` warns and
  names it, and canner-deliver does not try it until an operator's ``canner retry``.

Crash safety: ``--apply`` first writes the plan (``adopt-go/plan.json``, fsynced), then runs the
steps in order, appending each finished one to ``adopt-go/done.jsonl`` (fsynced).  Every step is
idempotent (a file is found moved or not, a row is inserted or ignored), and a receipt moves
last, so canner never sees a receipt whose object is not indexed as the plan says.  A second run
after a kill loads the saved plan and finishes the steps not yet recorded.  Blocking.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

import blake3
from attrs import frozen

from canner import fs
from canner.crashpoints import crash_point
from canner.delivery import outbound
from canner.delivery.index import (
    OBJECT,
    UNKNOWN_PROJECT,
    AcceptedObject,
    configure_connection,
    insert_objects,
    upgrade_schema,
)
from canner.delivery.queue import retry_delay
from canner.go_canner.godir import GoDataDir
from canner.go_canner.plan import (
    DELIVER,
    DELIVERED,
    FROM_MEMBER,
    FROM_PACKAGE,
    FROM_UPLOAD,
    IN_FLIGHT,
    PROBLEM,
    Plan,
    Step,
    make_plan,
    print_plan,
)
from canner.store.journal import Journal
from canner.store.receipts import (
    DeliveryRecord,
    Origin,
    ReceiptStore,
    delivery_journal_record,
    origin_journal_record,
)
from canner.store.uploads import UploadDoor, UploadInfo

STATE_DIR = "adopt-go"
MARKER = "ADOPTED-BY-CANNER"
BATCH = 500


class AdoptError(Exception):
    """adopt-go cannot go on (a daemon runs, the directories do not fit)."""


# -- refusing while a daemon runs --------------------------------------------------------------


def running_daemons(go: GoDataDir, data_dir: Path, listen: str) -> list[str]:
    """Signs that a daemon of either system runs on these directories (empty: none)."""
    found = []
    if fs.lock_held(go.root / "delivery.lock"):
        found.append(f"the Go canner's deliver holds {go.root / 'delivery.lock'}")
    for path, pid in go.upload_lock_holders():
        found.append(f"the Go canner (pid {pid}) holds {path}")
    for daemon in ("receiver", "deliver"):
        if fs.lock_held(data_dir / f"{daemon}.lock"):
            found.append(f"canner-{daemon} holds {data_dir / f'{daemon}.lock'}")
    if _listening(listen):
        found.append(f"something (canner-receiver?) answers on {listen}")
    return found


def _listening(listen: str) -> bool:
    parts = listen.split(":")
    try:
        if parts[0] == "unix":
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.5)
                s.connect(":".join(parts[1:]).split(":mode=")[0])
                return True
        if parts[0] in ("tcp", "tcp6"):
            port = int(parts[1])
            host = "127.0.0.1"
            for p in parts[2:]:
                if p.startswith("interface="):
                    host = p[len("interface=") :] or host
            host = "127.0.0.1" if host in ("0.0.0.0", "") else host
            host = "::1" if host == "::" else host
            with socket.create_connection((host, port), timeout=0.5):
                return True
    except (OSError, ValueError, IndexError):
        return False
    return False


# -- applying ----------------------------------------------------------------------------------


@frozen
class Target:
    """canner's data directory, as adoption writes it."""

    data_dir: Path

    @property
    def uploads(self) -> Path:
        return self.data_dir / "uploads"

    @property
    def receipts(self) -> ReceiptStore:
        return ReceiptStore(self.data_dir / "receipts")

    @property
    def state(self) -> Path:
        return self.data_dir / STATE_DIR

    def taken(self, object_id: str) -> bool:
        """Whether canner has a receipt or an upload of this id (only before a plan exists:
        afterwards what is there is the adoption's own work)."""
        return (
            self.receipts.receipt_path(object_id).exists()
            or (self.uploads / f"{object_id}.info").exists()
            or (self.uploads / object_id).exists()
        )

    def prepare(self) -> None:
        for sub in ("uploads", "receipts", "journal", STATE_DIR):
            (self.data_dir / sub).mkdir(exist_ok=True)
        fs.fsync_dir(self.data_dir)


def load_or_save_plan(target: Target, go: GoDataDir, fresh: Callable[[], Plan]) -> Plan:
    """The plan saved by an earlier run (it must be for the same Go directory), or a fresh
    one, saved durably before any step runs."""
    path = target.state / "plan.json"
    if path.exists():
        plan = Plan.from_json(path.read_bytes())
        if Path(plan.go_dir) != go.root:
            raise AdoptError(
                f"{path} is the plan of adopting {plan.go_dir}, not {go.root}: finish that one"
            )
        return plan
    plan = fresh()
    fs.replace_file(target.state, "plan.json", plan.to_json(), sync=True)
    fs.fsync_dir(target.state)
    return plan


def done_steps(target: Target) -> set[str]:
    try:
        lines = (target.state / "done.jsonl").read_bytes().splitlines()
    except FileNotFoundError:
        return set()
    done = set()
    for line in lines:
        try:
            done.add(json.loads(line)["object_id"])
        except (ValueError, KeyError):
            continue  # a line a kill cut short: its step runs again (idempotent)
    return done


def _record_done(target: Target, steps: Iterable[Step]) -> None:
    data = b"".join(
        json.dumps({"object_id": s.object_id, "action": s.action}).encode() + b"\n" for s in steps
    )
    fd = os.open(
        target.state / "done.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644
    )
    try:
        # A line a kill cut short ends with no newline: start on a fresh line.
        if os.fstat(fd).st_size and os.pread(fd, 1, os.fstat(fd).st_size - 1) != b"\n":
            data = b"\n" + data
        fs.write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


@frozen
class AdoptionReport:
    """What one adoption did: the counts and findings ``summary_line`` reports."""

    receipts: int
    in_flight: int
    delivered: int
    to_deliver: int
    problems: tuple[str, ...]
    cleaned: tuple[str, ...]
    from_packages: int = 0
    rebuilt: int = 0


def apply_plan(plan: Plan, go: GoDataDir, target: Target, now: float) -> AdoptionReport:
    """Run every step not yet recorded done, clean the Go leftovers, retire the Go index."""
    done = done_steps(target)
    todo = [s for s in plan.steps if s.object_id not in done]
    index_path = target.data_dir / "delivery.sqlite"
    upgrade_schema(index_path)
    conn = sqlite3.connect(index_path, isolation_level=None)
    try:
        configure_connection(conn)
        for start in range(0, len(todo), BATCH):
            batch = todo[start : start + BATCH]
            _apply_batch(batch, go, target, conn, now)
            _record_done(target, batch)
    finally:
        conn.close()
    cleaned = _clean(go)
    _retire_go_index(go)
    marker = f"adopted by canner into {target.data_dir} at {int(now)}\n"
    fs.replace_file(go.root, MARKER, marker.encode(), sync=True)
    return AdoptionReport(
        receipts=sum(1 for s in plan.steps if s.has_receipt),
        in_flight=plan.count(IN_FLIGHT),
        delivered=plan.count(DELIVERED),
        to_deliver=plan.count(DELIVER),
        problems=tuple(f"{s.object_id}: {s.note}" for s in plan.steps if s.action == PROBLEM),
        cleaned=tuple(cleaned),
        from_packages=sum(1 for s in plan.steps if s.source in (FROM_PACKAGE, FROM_MEMBER)),
        rebuilt=sum(1 for s in plan.steps if s.rebuilt),
    )


def _apply_batch(
    batch: list[Step], go: GoDataDir, target: Target, conn: sqlite3.Connection, now: float
) -> None:
    # 1. Facts first: a rebuilt index knows the delivered objects before their receipts move
    # (an object indexed already had its facts written by the run a kill cut short).
    indexed = _indexed(conn, [s.object_id for s in batch if s.action == DELIVERED])
    delivered = [s for s in batch if s.action == DELIVERED and s.object_id not in indexed]
    records: list[dict[str, Any]] = []
    for s in delivered:
        assert s.project is not None
        records.append(origin_journal_record(s.object_id, Origin(s.project, s.filename)))
        records.append(delivery_journal_record(s.object_id, _delivery(s, now)))
    if records:
        Journal(target.data_dir / "journal").append(records)
    # 2. Payloads and sidecars of objects to deliver and uploads in flight.
    for s in batch:
        if s.action == DELIVER:
            _place_payload(s, go, target)
        elif s.action == IN_FLIGHT:
            _move_upload(s, go, target)
        elif s.action == PROBLEM and s.has_receipt and s.project:
            # A rebuilt index still has its row (then pending: deliver flags its missing bytes).
            target.receipts.record_origin(s.object_id, Origin(s.project, s.filename))
    fs.fsync_dir(target.uploads)
    fs.fsync_dir(target.receipts.directory)
    crash_point("adopt-go.placed")
    # 3. Index rows (INSERT OR IGNORE: a second run adds nothing twice).  A receipt canner
    # cannot deliver (its bytes or its project are gone) is indexed waiting and flagged, so an
    # operator sees it (canner status, canner deliveries --needs-operator), with the reason:
    # pending, deliver would try it at once and a missing payload's error would replace it.
    objects = [
        AcceptedObject(
            s.object_id,
            s.project or UNKNOWN_PROJECT,
            s.filename,
            s.size_bytes,
            s.checksum,
            s.accepted_at,
            delivery=_delivery(s, now) if s.action == DELIVERED else None,
            problem=problem_reason(s) if s.action == PROBLEM else None,
        )
        for s in batch
        if ((s.action in (DELIVERED, DELIVER) and s.project) or _flagged(s)) and s.checksum
    ]
    held = [(o.object_id, o.problem) for o in objects if o.problem is not None]
    conn.execute("BEGIN IMMEDIATE")
    try:
        cur = conn.cursor()
        insert_objects(cur, objects, now)
        until = now + retry_delay(1, needs_operator=True)
        outbound.hold(cur, OBJECT, held, until, now)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    crash_point("adopt-go.indexed")
    # 4. Receipts last, byte for byte.
    for n, s in enumerate(s for s in batch if s.has_receipt):
        _move(go.receipt_path(s.object_id), target.receipts.receipt_path(s.object_id))
        if n == 2:
            crash_point("adopt-go.receipts")
    fs.fsync_dir(target.receipts.directory)


def _flagged(s: Step) -> bool:
    """A problem whose receipt canner takes over: indexed, flagged for an operator."""
    return s.action == PROBLEM and s.has_receipt


def problem_reason(s: Step) -> str:
    """The flagged row's ``last_error``: what ``canner show`` and ``deliveries`` say."""
    return f"adopted from the Go canner: {s.note}"


def _indexed(conn: sqlite3.Connection, object_ids: list[str]) -> set[str]:
    if not object_ids:
        return set()
    marks = ", ".join("?" for _ in object_ids)
    rows = conn.execute(f"SELECT object_id FROM objects WHERE object_id IN ({marks})", object_ids)
    return {row[0] for row in rows}


def _delivery(s: Step, now: float) -> DeliveryRecord:
    assert s.identifier is not None and s.delivered_at is not None
    return DeliveryRecord(
        identifier=s.identifier,
        remote_name=s.remote_name or s.object_id,
        content_md5="",  # the Go canner never recorded one
        delivered_at=float(s.delivered_at),
        verified_at=float(s.delivered_at),
        purge_after=float(s.purge_after if s.purge_after is not None else s.delivered_at),
        # canner never holds the payload: the Go package file, if any, stays with the Go dir.
        purged_at=float(s.purged_at) if s.purged_at is not None else now,
    )


def _sidecar(s: Step, created_at: int) -> bytes:
    meta = {"project": s.project or ""}
    if s.checksum:
        meta["checksum"] = s.checksum
    if s.filename:
        meta["filename"] = s.filename
    return UploadInfo(
        s.object_id, s.size_bytes, meta, created_at, door=UploadDoor.GO_ADOPTED
    ).to_json()


def _place_payload(s: Step, go: GoDataDir, target: Target) -> None:
    oid = s.object_id
    dst = target.uploads / oid
    assert s.source_file is not None
    src = go.root / s.source_file
    if not dst.exists():
        if s.source == FROM_UPLOAD:
            _move(src, dst)
        else:
            _copy_range(src, s.source_offset, s.size_bytes, s.checksum, target.uploads, oid)
    fs.replace_file(target.uploads, f"{oid}.info", _sidecar(s, s.accepted_at), sync=True)
    for leftover in (go.info_path(oid), go.uploads / f"{oid}.attempt", go.uploads / f"{oid}.stop"):
        leftover.unlink(missing_ok=True)
    if s.project:
        target.receipts.record_origin(oid, Origin(s.project, s.filename))


def _move_upload(s: Step, go: GoDataDir, target: Target) -> None:
    oid = s.object_id
    marker = go.uploads / f"{oid}.attempt"
    src = go.data_path(oid)
    # The idle time canner's sweep judges by: the end of the last PATCH (Go's marker).
    idle = next((p.stat().st_mtime for p in (marker, src, go.info_path(oid)) if p.exists()), None)
    if go.info_path(oid).exists():
        created = int(idle or time.time())
        fs.replace_file(target.uploads, f"{oid}.info", _sidecar(s, created), sync=True)
    _move(src, target.uploads / oid)
    if idle is not None:
        for p in (target.uploads / oid, target.uploads / f"{oid}.info"):
            os.utime(p, (idle, idle))
    for leftover in (go.info_path(oid), marker, go.uploads / f"{oid}.stop"):
        leftover.unlink(missing_ok=True)


def _move(src: Path, dst: Path) -> None:
    """Move a file, durably and idempotently (a move a kill cut short is finished)."""
    if not src.exists():
        return  # moved already (or gone: the plan said it was there; the next step reports)
    if dst.exists():
        src.unlink()
        return
    fs.fsync_path(src)
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        temp = dst.parent / f"{fs.TEMP_PREFIX}adopt-{dst.name}"
        shutil.copyfile(src, temp)
        fs.fsync_path(temp)
        os.rename(temp, dst)
        fs.fsync_dir(dst.parent)
        src.unlink()
    fs.fsync_dir(dst.parent)


def _copy_range(
    src: Path, offset: int, size: int, checksum: str | None, directory: Path, name: str
) -> None:
    """Copy ``size`` bytes at ``offset`` of ``src`` into ``directory/name``, checked against
    the receipt's BLAKE3 before the name appears."""
    hasher = blake3.blake3()
    temp = directory / f"{fs.TEMP_PREFIX}adopt-{name}"
    with src.open("rb") as f, temp.open("wb") as out:
        f.seek(offset)
        left = size
        while left:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            hasher.update(chunk)
            out.write(chunk)
            left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())
    if left or f"blake3:{hasher.hexdigest()}" != checksum:
        temp.unlink()
        raise AdoptError(f"{src} at {offset}+{size} does not hold {name} ({checksum})")
    os.rename(temp, directory / name)


def _clean(go: GoDataDir) -> list[str]:
    cleaned = []
    for path in go.leftovers():
        path.unlink(missing_ok=True)
        cleaned.append(str(path.relative_to(go.root)))
    return cleaned


def _retire_go_index(go: GoDataDir) -> None:
    """Rename the Go index away, so a Go daemon started again by mistake finds nothing to
    deliver (canner owns those objects now)."""
    path = go.root / "delivery.sqlite"
    if not path.exists():
        return
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()
    os.replace(path, go.root / "delivery.sqlite.adopted-by-canner")
    fs.fsync_dir(go.root)


# -- the command -------------------------------------------------------------------------------


def summary_line(o: AdoptionReport) -> str:
    return (
        f"adopt-go: receipts {o.receipts}, uploads in flight {o.in_flight}, delivered"
        f" {o.delivered}, to deliver {o.to_deliver} ({o.from_packages} from Go package files,"
        f" {o.rebuilt} rebuilt), problems {len(o.problems)}, leftovers cleaned {len(o.cleaned)}"
    )


def adopt(
    go_root: Path,
    data_dir: Path,
    listen: str,
    projects: Iterable[str],
    apply: bool,
    out: TextIO,
    now: Callable[[], float] = time.time,
) -> int:
    """The command: a dry run prints the plan; ``apply`` runs it and prints the summary."""
    go = GoDataDir(go_root.resolve())
    if not go.looks_like_one():
        raise AdoptError(f"{go.root} has no uploads/, receipts/ or delivery.sqlite")
    if go.root == data_dir.resolve():
        raise AdoptError("DATA_DIR is canner's own data directory: give the Go canner's")
    running = running_daemons(go, data_dir, listen)
    if running and apply:
        raise AdoptError("stop both systems' daemons first: " + "; ".join(running))
    target = Target(data_dir)
    if not apply:
        # A preview is fine while the Go canner still runs (what it shows may change).
        for sign in running:
            out.write(f"warning: {sign}: --apply refuses until it is stopped\n")
        saved = target.state / "plan.json"
        if saved.exists():
            out.write(f"an adoption is under way ({saved}): run with --apply to finish it\n")
        plan = make_plan(go, projects, target.taken)
        print_plan(plan, out)
        leftovers = go.leftovers()
        for path in leftovers:
            out.write(f"leftover {path.relative_to(go.root)}: would be deleted\n")
        out.write(
            f"dry run: receipts {sum(1 for s in plan.steps if s.has_receipt)}, uploads in flight"
            f" {plan.count(IN_FLIGHT)}, delivered {plan.count(DELIVERED)}, to deliver"
            f" {plan.count(DELIVER)}, problems {plan.count(PROBLEM)}, leftovers {len(leftovers)};"
            " nothing was changed (--apply to act)\n"
        )
        return 0
    _check_owner(go, data_dir)
    target.prepare()
    plan = load_or_save_plan(target, go, lambda: make_plan(go, projects, target.taken))
    outcome = apply_plan(plan, go, target, now())
    for problem in outcome.problems:
        out.write(f"problem {problem}\n")
    for note in plan.packages:
        out.write(f"{note}\n")
    for name in outcome.cleaned:
        out.write(f"cleaned {name}\n")
    out.write(summary_line(outcome) + "\n")
    return 1 if outcome.problems else 0


def _check_owner(go: GoDataDir, data_dir: Path) -> None:
    mine, theirs = data_dir.stat().st_uid, go.root.stat().st_uid
    if mine != theirs:
        raise AdoptError(
            f"{go.root} belongs to uid {theirs} and {data_dir} to uid {mine}: the moved files"
            f" must be canner's (chown -R --reference={data_dir} {go.root}, then run again)"
        )
