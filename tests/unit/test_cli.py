"""The ``canner`` command, on a temporary data directory (in process, and as a subprocess where
the process boundary matters: exit codes, privilege dropping)."""

from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from canner.checksum import parse_checksum
from canner.cli import base as cli_base
from canner.cli.base import Io, with_utc
from canner.cli.main import main
from canner.delivery import index as sql
from canner.delivery.index import AcceptedObject
from canner.delivery.liveness import Heartbeat, write_heartbeat
from canner.delivery.purge import purge_is_due
from canner.fs import DataDirLock
from canner.ledger.files import LedgerDir, Manifest, id_record
from canner.store.journal import Journal
from canner.store.receipts import (
    DeliveryRecord,
    Origin,
    Receipt,
    ReceiptStore,
    delivery_journal_record,
    origin_journal_record,
)
from tests.fakes import SyncIndex

NOW = 1_784_764_800.0
CHECKSUM = "blake3:" + "ab" * 32
REPO = Path(__file__).resolve().parents[2]


def oid(n: int) -> str:
    return f"{n:032x}"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Run:
    """A config file and data directory, and the command run against them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        for sub in ("uploads", "receipts"):
            (self.data_dir / sub).mkdir(parents=True)
        self.config = root / "canner.toml"
        self.write_config()

    def write_config(self, extra: str = "") -> None:
        self.config.write_text(
            'issuer = "https://canner.test"\n'
            f'data_dir = "{self.data_dir}"\n'
            "min_free_bytes = 1\n\n[projects.example]\n[projects.other]\n" + extra,
            encoding="utf-8",
        )

    def __call__(self, *argv: str, err: io.StringIO | None = None) -> tuple[int, str, str]:
        out, err = io.StringIO(), err or io.StringIO()
        code = main([*argv, "--config", str(self.config)], Io(out, err, lambda: NOW))
        return code, out.getvalue(), err.getvalue()

    def receipt(self, n: int, size: int = 10, project: str = "example") -> None:
        store = ReceiptStore(self.data_dir / "receipts")
        store.record_origin(oid(n), Origin(project, f"f{n}.warc"))
        store.commit(Receipt(oid(n), "https://canner.test", parse_checksum(CHECKSUM), size, 1000))

    def index(self) -> SyncIndex:
        return SyncIndex(self.data_dir / "delivery.sqlite")


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


@pytest.fixture
def indexed(run: Run) -> Iterator[SyncIndex]:
    """Objects 1 (pending, 10 B), 2 (retry_wait, 20 B), 3 (delivered, 30 B, project other)."""
    index = run.index()
    objects = [
        AcceptedObject(oid(1), "example", None, 10, CHECKSUM, 500),
        AcceptedObject(oid(2), "example", None, 20, CHECKSUM, 700),
        AcceptedObject(oid(3), "other", None, 30, CHECKSUM, 900),
    ]
    index.run(sql.insert_objects, objects, NOW - 100)
    index.query(
        "UPDATE outbound SET state = 'retry_wait', attempts = 3, next_attempt_at = ?,"
        " last_error = 'slow down' WHERE kind = 'object' AND ref = ?",
        NOW + 3600,
        oid(2),
    )
    index.query("UPDATE outbound SET state = 'delivered' WHERE kind = 'object' AND ref = ?", oid(3))
    yield index
    index.close()


# -- check-config ------------------------------------------------------------------------------

DELIVERY = """
[projects.example.delivery]
sink = "internet_archive"
credentials = "keys"
identifier = "{identifier}"
local_artifact_retention = "1h"
[projects.example.delivery.metadata]
collection = ["test"]
"""


def test_check_config_prints_resolved_config_and_example_destinations(run: Run) -> None:
    """The resolved config (absolute paths, seconds) and where an object would go at IA."""
    (run.root / "keys").write_text("access\nsecret\n")
    run.write_config(DELIVERY.replace("{identifier}", "example-{date}-{object_id}"))
    code, out, err = run("check-config")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["config"]["data_dir"] == str(run.data_dir)
    assert doc["config"]["partial_upload_retention"] == 1800.0
    delivery = doc["config"]["projects"]["example"]["delivery"]
    assert delivery["credentials"] == str(run.root / "keys")
    example = doc["delivery_examples"]["example"]
    assert example["identifier"] == f"example-20260723000000-{example['object_id']}"
    assert example["remote_name"] == "example.warc.gz"
    assert doc["delivery_examples"]["other"] is None
    assert "secret" not in out
    assert "projects.other: no delivery table" in err


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("colour = 1\n", "projects.other.colour"),
        (DELIVERY.replace("{identifier}", "static-name"), "projects.example.delivery.identifier"),
        (
            DELIVERY.replace("{identifier}", "x-{object_id}").replace('"keys"', '"missing"'),
            "projects.example.delivery.credentials",
        ),
        ("[manhole]\nreceiver_ssh = 'tcp:22'\n", "manhole.authorized_keys"),
    ],
)
def test_check_config_errors_name_the_key(run: Run, extra: str, key: str) -> None:
    """Unknown keys, unusable templates and unreadable credentials: exit 1, key named."""
    run.write_config(extra)
    code, out, err = run("check-config")
    assert code == 1 and out == ""
    assert err.startswith(f"canner: config key {key!r}"), err


# -- status ------------------------------------------------------------------------------------


def test_status_json_counts_states_bytes_and_oldest(run: Run, indexed: SyncIndex) -> None:
    """Counts by state, pending bytes, oldest pending and free space, as JSON."""
    code, out, err = run("status", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["states"] == {"pending": 1, "delivering": 0, "retry_wait": 1, "delivered": 1}
    assert doc["pending_bytes"] == 30 and doc["pending_objects"] == 2
    assert doc["oldest_pending_accepted_at"] == 500 and doc["oldest_pending_age_s"] == NOW - 500
    assert doc["free_bytes"] > 0 and doc["min_free_bytes"] == 1
    assert doc["projects"]["other"]["delivered_objects"] == 1


def test_status_text(run: Run, indexed: SyncIndex) -> None:
    """The human form says the same in lines."""
    code, out, _ = run("status")
    assert code == 0
    assert "deliveries       pending 1, delivering 0, retry_wait 1, delivered 1" in out
    assert "pending          2 objects, 30 B (30 bytes)" in out


def test_status_without_index_or_data_dir_fails_clearly(run: Run) -> None:
    """No index yet: the rest is shown, exit 2 (critical); no data directory: exit 1, named."""
    code, out, err = run("status")
    assert code == 2 and "delivery index   unreadable" in out
    assert "canner: critical: delivery index unreadable" in err
    assert "delivery.sqlite does not exist" in err
    shutil.rmtree(run.data_dir)
    code, out, err = run("status")
    assert code == 1 and out == ""
    assert err == f"canner: data directory {run.data_dir} does not exist\n"


# -- show --------------------------------------------------------------------------------------


def test_show_joins_receipt_payload_and_row(run: Run, indexed: SyncIndex) -> None:
    """Receipt, origin, local payload presence and the delivery row of one object."""
    run.receipt(2, size=20)
    (run.data_dir / "uploads" / oid(2)).write_bytes(b"x" * 20)
    code, out, err = run("show", oid(2))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["receipt"]["size_bytes"] == 20
    assert doc["origin"]["filename"] == "f2.warc"
    assert doc["payload_present"] is True
    assert doc["delivery"]["state"] == "retry_wait" and doc["delivery"]["attempts"] == 3


def test_show_an_archived_object_names_its_ledger_line(run: Run, indexed: SyncIndex) -> None:
    """Archiving deleted its receipt and row: the verified ledger still says where it is."""
    ledgers = LedgerDir(run.data_dir / "ledger")
    ledgers.directory.mkdir()
    ledgers.ids_path("n-x").write_bytes(id_record(oid(7), 5.0) + id_record(oid(8), 6.0))
    ledgers.write_manifest(Manifest("n-x", "x", 2, 1, "m", "b", "item", "n-x.jsonl.zst", "u", 7.0))
    code, out, err = run("show", oid(8))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["receipt"] is None and doc["delivery"] is None
    assert doc["archived"]["ledger"] == "n-x" and doc["archived"]["line"] == 2
    assert doc["archived"]["released_at"] == 6.0 and doc["archived"]["identifier"] == "item"


@pytest.mark.parametrize(
    ("object_id", "message"),
    [(oid(9), "no object"), ("../receipts/x", "is not an object id of this node")],
)
def test_show_unknown_or_invalid_ids(
    run: Run, indexed: SyncIndex, object_id: str, message: str
) -> None:
    """An id nothing is known about, or not an id at all: exit 1 with a message."""
    code, out, err = run("show", object_id)
    assert code == 1 and out == "" and message in err


# -- deliveries and retry ----------------------------------------------------------------------


def test_deliveries_prints_one_json_line_per_object(run: Run, indexed: SyncIndex) -> None:
    """JSONL of every row, oldest accepted first."""
    code, out, _ = run("deliveries")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["object_id"] for r in rows] == [oid(1), oid(2), oid(3)]


def test_retry_makes_a_waiting_row_due_now(run: Run, indexed: SyncIndex) -> None:
    """A retry_wait row becomes due now; its state and attempts are left to the scheduler."""
    code, out, err = run("retry", oid(2))
    assert code == 0, err
    assert f"{oid(2)} is due now" in out and "attempt 4" in out and "slow down" in out
    [(state, due, attempts)] = indexed.query(
        "SELECT state, next_attempt_at, attempts FROM object_delivery WHERE object_id = ?", oid(2)
    )
    assert (state, due, attempts) == ("retry_wait", NOW, 3)


@pytest.mark.parametrize(
    ("n", "message"),
    [
        (1, "is pending: only a waiting retry or a delivered, unverified object"),
        (3, "is delivered and verified at its destination: nothing to retry"),
        (9, "not in the delivery index"),
    ],
)
def test_retry_refuses_rows_not_waiting(run: Run, indexed: SyncIndex, n: int, message: str) -> None:
    """Pending, verified and unknown rows cannot be retried; nothing changes then."""
    indexed.query(
        "UPDATE outbound SET verified_at = ? WHERE kind = 'object' AND ref = ?",
        NOW - 5,
        oid(3),
    )
    before = indexed.query("SELECT * FROM object_delivery ORDER BY object_id")
    code, out, err = run("retry", oid(n))
    assert code == 1 and out == "" and message in err
    assert indexed.query("SELECT * FROM object_delivery ORDER BY object_id") == before


def test_retry_delivers_an_unverified_flagged_row_again(run: Run, indexed: SyncIndex) -> None:
    """A delivered row IA never listed (flagged after its re-deliveries), or whose remote copy
    differs, goes back to retry_wait due now with its re-delivery count reset; a read-back
    mismatch keeps force_upload so the next attempt uploads."""
    indexed.query(
        "UPDATE outbound SET delivered_at = ?, needs_operator = 1, redeliveries = 3,"
        " force_upload = 1, last_error = 'still not listed' WHERE kind = 'object' AND ref = ?",
        NOW - 50,
        oid(3),
    )
    indexed.query("UPDATE objects SET purge_after = ? WHERE object_id = ?", NOW - 40, oid(3))
    code, out, err = run("retry", oid(3))
    assert code == 0, err
    assert f"{oid(3)} is due now (delivered again)" in out and "still not listed" in out
    [row] = indexed.query(
        "SELECT state, next_attempt_at, needs_operator, redeliveries, force_upload,"
        " delivered_at, purge_after FROM object_delivery WHERE object_id = ?",
        oid(3),
    )
    assert row == ("retry_wait", NOW, 0, 0, 1, None, None)


def test_bulk_retry_includes_flagged_unverified_deliveries(run: Run, indexed: SyncIndex) -> None:
    """``retry --needs-operator`` also re-delivers flagged delivered rows that are not verified,
    and leaves verified ones alone."""
    indexed.query(
        "UPDATE outbound SET needs_operator = 1 WHERE kind = 'object' AND ref = ?",
        oid(3),
    )
    code, out, err = run("retry", "--needs-operator")
    assert code == 0, err
    assert "1 deliveries needing an operator are due now" in out and oid(3) in out
    assert indexed.query("SELECT state FROM object_delivery WHERE object_id = ?", oid(3)) == [
        ("retry_wait",)
    ]
    indexed.query(
        "UPDATE outbound SET state = 'delivered', verified_at = 1, needs_operator = 1"
        " WHERE kind = 'object' AND ref = ?",
        oid(3),
    )
    code, out, _ = run("retry", "--needs-operator")
    assert code == 0 and "0 deliveries" in out


# -- rebuild-index -----------------------------------------------------------------------------


def test_rebuild_index_adds_missing_receipts(run: Run, indexed: SyncIndex) -> None:
    """Receipts the index lacks become pending rows; known rows are left alone."""
    run.receipt(2, size=20)
    run.receipt(4, size=40)
    run.receipt(5, size=50, project="other")
    code, out, err = run("rebuild-index")
    assert code == 0, err
    assert "3 objects were indexed, 2 added" in out
    assert err == "", "no progress display without a terminal"
    rows = dict(indexed.query("SELECT object_id, state FROM object_delivery"))
    assert rows[oid(4)] == "pending" and rows[oid(5)] == "pending"
    assert rows[oid(2)] == "retry_wait"


@pytest.mark.parametrize("damage", ["empty", "corrupt"])
@pytest.mark.parametrize("side", ["json", "meta.json", "delivery.json"])
def test_rebuild_index_names_a_damaged_side_file_and_indexes_the_rest(
    run: Run, side: str, damage: str
) -> None:
    """One empty or corrupt receipt, origin or delivery file is named on stderr and skipped
    (exit 1); every other receipt is indexed."""
    for n in range(1, 6):
        run.receipt(n)
    bad = run.data_dir / "receipts" / f"{oid(3)}.{side}"
    bad.write_bytes(b"" if damage == "empty" else b'{"object_id": 7, "not": "a record"')
    code, out, err = run("rebuild-index")
    assert code == 1
    assert "4 added" in out
    assert str(bad) in err
    index = run.index()
    ids = {row.object_id for row in index.run(lambda cur: list(sql.all_rows(cur))).result}
    index.close()
    assert ids == {oid(n) for n in (1, 2, 4, 5)}


def _purged(run: Run, ns: range) -> str:
    """Receipts of objects ``ns`` whose payloads were purged: their origin and delivery records
    are in one journal segment (two lines each, in order), their origin files are gone."""
    records: list[dict[str, Any]] = []
    for n in ns:
        run.receipt(n)
        (run.data_dir / "receipts" / f"{oid(n)}.meta.json").unlink()
        delivery = DeliveryRecord(f"item-{n}", f"f{n}.warc", "00" * 16, 10.0, 20.0, 30.0, 40.0)
        records += [
            origin_journal_record(oid(n), Origin("example", f"f{n}.warc")),
            delivery_journal_record(oid(n), delivery),
        ]
    return Journal(run.data_dir / "journal").append(records)


def _rows(run: Run) -> dict[str, sql.ObjectRow]:
    index = run.index()
    try:
        rows: list[sql.ObjectRow] = index.run(lambda cur: list(sql.all_rows(cur))).result
    finally:
        index.close()
    return {row.object_id: row for row in rows}


def test_rebuild_index_flags_the_object_of_a_damaged_journal_line_and_indexes_the_rest(
    run: Run,
) -> None:
    """A damaged middle line of the journal (object 3's delivery record) is named by segment
    and line (exit 1); every other purged object comes back delivered and purged, and object 3
    comes back flagged for an operator with that line as its error."""
    segment = run.data_dir / "journal" / _purged(run, range(1, 6))
    lines = segment.read_bytes().splitlines(keepends=True)
    assert oid(3).encode() in lines[5]
    lines[5] = b"\0" * 20 + lines[5][20:]  # the delivery record of object 3
    segment.write_bytes(b"".join(lines))

    code, out, err = run("rebuild-index")

    assert code == 1
    assert "5 added" in out
    assert f"damaged journal line {segment}: line 6: " in err and f"object {oid(3)}" in err
    rows = _rows(run)
    assert set(rows) == {oid(n) for n in range(1, 6)}
    for n in (1, 2, 4, 5):
        row = rows[oid(n)]
        assert (row.state, row.purged_at, row.needs_operator) == ("delivered", 40.0, 0), row
    flagged = rows[oid(3)]
    assert flagged.needs_operator == 1 and flagged.purged_at is None
    assert flagged.last_error is not None and f"{segment}: line 6" in flagged.last_error


def test_rebuild_index_purges_again_a_payload_the_journal_says_is_purged(run: Run) -> None:
    """A crash between the purge's journal record and the unlink left the payload: the rebuilt
    row is delivered and verified but not purged, and its purge is due again; a payload that is
    really gone stays purged."""
    _purged(run, range(1, 3))
    (run.data_dir / "uploads" / oid(2)).write_bytes(b"0123456789")

    code, _, err = run("rebuild-index")

    assert code == 0, err
    rows = _rows(run)
    assert rows[oid(1)].purged_at == 40.0
    left = rows[oid(2)]
    assert (left.state, left.verified_at, left.purged_at) == ("delivered", 20.0, None)
    index = run.index()
    try:
        due = index.run(sql.follow_ups_due, NOW, 10, ["example"]).result
    finally:
        index.close()
    assert [row.object_id for row in due] == [oid(2)]
    assert purge_is_due(due[0], NOW)


def test_rebuild_index_creates_a_missing_index_and_shows_progress(run: Run) -> None:
    """From receipts alone, with progress on a terminal."""
    for n in range(1, 6):
        run.receipt(n)
    terminal = Terminal()
    code, out, _ = run("rebuild-index", err=terminal)
    assert code == 0 and "0 objects were indexed, 5 added" in out
    shown = terminal.getvalue()
    assert "\rreading receipts: 5/5\n" in shown
    index = run.index()
    try:
        assert index.query("SELECT count(*) FROM objects") == [(5,)]
    finally:
        index.close()


def test_rebuild_index_refuses_while_deliver_holds_the_lock(run: Run) -> None:
    """A running canner-deliver (its deliver.lock held) makes rebuild-index refuse."""
    run.receipt(1)
    lock = DataDirLock(run.data_dir / "deliver.lock")
    lock.acquire()
    try:
        code, out, err = run("rebuild-index")
    finally:
        lock.release()
    assert code == 1 and out == ""
    assert "canner-deliver is running" in err and "deliver.lock" in err
    assert not (run.data_dir / "delivery.sqlite").exists()


def test_replacing_a_damaged_index_is_refused_while_a_receiver_runs(run: Run) -> None:
    """``--replace-damaged`` moves nothing while a canner-receiver holds receiver.lock: it would
    go on writing into the file moved aside.  Stopped, the index is moved aside and rebuilt."""
    run.receipt(1)
    damaged = os.urandom(8192)
    (run.data_dir / "delivery.sqlite").write_bytes(damaged)
    lock = DataDirLock(run.data_dir / "receiver.lock")
    lock.acquire()
    try:
        code, out, err = run("rebuild-index", "--replace-damaged")
    finally:
        lock.release()
    assert code == 1 and out == ""
    assert "canner-receiver is running" in err and "receiver.lock" in err
    assert (run.data_dir / "delivery.sqlite").read_bytes() == damaged
    code, out, err = run("rebuild-index", "--replace-damaged")
    assert code == 0, err
    assert "moved" in out and "aside" in out
    assert [p.read_bytes() for p in run.data_dir.glob("delivery-damaged-*.sqlite")] == [damaged]


# -- as a process ------------------------------------------------------------------------------


def canner(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "canner.cli.main", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        **kwargs,
    )


def test_usage_errors_exit_2_and_config_errors_exit_1(run: Run) -> None:
    """argparse's usage errors exit 2; a missing config file exits 1 naming it."""
    assert canner().returncode == 2
    assert canner("retry", "--config", str(run.config)).returncode == 2
    missing = canner("status", "--config", str(run.root / "nope.toml"))
    assert missing.returncode == 1
    assert missing.stderr.startswith("canner: config key '<file>': cannot read")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch users")
def test_root_becomes_the_data_directory_owner() -> None:
    """Run as root, files SQLite creates in the data directory belong to its owner."""
    # pytest's tmp_path is private to root; the other user must be able to reach this one.
    root = Path(tempfile.mkdtemp(prefix="canner-cli-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        run = Run(root)
        run.index().close()
        for name in ("delivery.sqlite-wal", "delivery.sqlite-shm"):
            (run.data_dir / name).unlink(missing_ok=True)
        for path in (run.data_dir, *run.data_dir.rglob("*")):
            os.chown(path, 65534, 65534)
        done = canner("status", "--json", "--config", str(run.config))
        assert done.returncode == 0, done.stderr
        created = [p for p in run.data_dir.iterdir() if p.name.startswith("delivery.sqlite-")]
        assert created, "a read-only open creates -wal/-shm"
        assert {p.stat().st_uid for p in created} == {65534}
    finally:
        shutil.rmtree(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch users")
def test_status_as_root_on_an_unreadable_data_directory_says_so() -> None:
    """Run as root, canner reads as the data directory's owner; when even the owner cannot read
    it, status says the state is unknown (critical), never that the node is draining."""
    root = Path(tempfile.mkdtemp(prefix="canner-cli-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        run = Run(root)
        run.index().close()
        for path in (run.data_dir, *run.data_dir.rglob("*")):
            os.chown(path, 65534, 65534)
        os.chmod(run.data_dir, 0)
        done = canner("status", "--config", str(run.config))
        assert (done.returncode, done.stdout) == (
            2,
            f"data directory   {run.data_dir}: unreadable, state unknown\n",
        )
        assert done.stderr == (
            f"canner: critical: data directory {run.data_dir} is not readable by nobody"
            " (uid 65534, its owner, whom canner runs as): this node's state is unknown; give"
            " it back to its owner with mode 0750\n"
        )
    finally:
        os.chmod(root / "data", 0o755)
        shutil.rmtree(root)


# -- exit codes for monitoring, prefixes, filters, bulk retry ----------------------------------


def beat(index: SyncIndex, age: float, stopped: bool = False) -> None:
    index.run(
        write_heartbeat,
        Heartbeat(7, "1.0", NOW - 600, NOW - age, NOW - age if stopped else None),
    )


def test_status_exit_codes_say_ok_warning_critical(run: Run, indexed: SyncIndex) -> None:
    """0 when all is well; 1 with a flagged delivery; 2 when deliver (configured) is not running
    or its heartbeat is stale, each reason on stderr."""
    (run.root / "keys").write_text("access\nsecret\n")
    run.write_config(DELIVERY.replace("{identifier}", "example-{date}-{object_id}"))
    beat(indexed, 2)
    code, out, err = run("status", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["status"] == "ok" and doc["deliver"]["state"] == "running"
    indexed.query(
        "UPDATE outbound SET needs_operator = 1 WHERE kind = 'object' AND ref = ?",
        oid(2),
    )
    code, out, err = run("status")
    assert code == 1 and err == "canner: warning: 1 deliveries need an operator\n"
    assert "canner-deliver   running" in out
    beat(indexed, 45)
    code, _, err = run("status")
    assert code == 2 and "critical: canner-deliver is not running or wedged" in err
    beat(indexed, 5, stopped=True)
    code, _, err = run("status")
    assert code == 2 and "critical: canner-deliver is not running (stopped cleanly)" in err


def test_status_never_says_stopped_cleanly_while_deliver_lock_is_held(
    run: Run, indexed: SyncIndex
) -> None:
    """A heartbeat marked stopped while a process still holds deliver.lock: deliver is starting
    or stopping (critical), not stopped cleanly; once the lock is free it is."""
    (run.root / "keys").write_text("access\nsecret\n")
    run.write_config(DELIVERY.replace("{identifier}", "example-{date}-{object_id}"))
    beat(indexed, 5, stopped=True)
    lock = DataDirLock(run.data_dir / "deliver.lock")
    lock.acquire()
    try:
        code, out, err = run("status")
    finally:
        lock.release()
    assert code == 2 and "stopped cleanly" not in out + err
    assert "canner-deliver   starting or stopping" in out
    code, out, err = run("status")
    assert code == 2 and "critical: canner-deliver is not running (stopped cleanly)" in err


def test_status_ignores_deliver_when_nothing_is_delivered(run: Run, indexed: SyncIndex) -> None:
    """Without a delivery table anywhere, a missing canner-deliver is no problem."""
    code, out, err = run("status", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["deliver"]["state"] == "never started"


def test_config_before_or_after_the_subcommand_and_version(run: Run) -> None:
    """``--config`` works on either side of the subcommand; ``--version`` names the version."""
    out = io.StringIO()
    code = main(["--config", str(run.config), "status", "--json"], Io(out, io.StringIO()))
    assert code == 2 and json.loads(out.getvalue())["min_free_bytes"] == 1
    shown = canner("--version")
    assert shown.returncode == 0 and shown.stdout.startswith("canner ")


def test_ids_by_unique_prefix(run: Run, indexed: SyncIndex) -> None:
    """show and retry take a unique prefix (as the page shows it, with or without its …);
    an ambiguous or unknown prefix is refused, naming the candidates."""
    indexed.run(
        sql.insert_objects, [AcceptedObject("abcd" + "0" * 28, "example", None, 5, CHECKSUM, 1)], 0
    )
    indexed.run(
        sql.insert_objects, [AcceptedObject("abce" + "0" * 28, "example", None, 5, CHECKSUM, 1)], 0
    )
    code, out, err = run("show", "abcd0000…")
    assert code == 0, err
    assert json.loads(out)["object_id"] == "abcd" + "0" * 28
    code, _, err = run("show", "abc")
    assert code == 1 and "too short" in err
    code, _, err = run("show", "abcd")
    assert code == 0
    code, _, err = run("show", "00000000")
    assert code == 1 and "ambiguous: it starts 3 object ids" in err
    code, _, err = run("show", "ffff")
    assert code == 1 and "no object id starts with 'ffff'" in err
    indexed.query(
        "UPDATE outbound SET state = 'retry_wait' WHERE kind = 'object' AND ref LIKE 'abce%'",
    )
    code, out, err = run("retry", "abce")
    assert code == 0 and "abce" + "0" * 28 + " is due now" in out


def test_deliveries_filters(run: Run, indexed: SyncIndex) -> None:
    """--state, --project, --since (duration or ISO time) and --needs-operator narrow the list."""
    indexed.query(
        "UPDATE outbound SET updated_at = ?, needs_operator = 1 WHERE kind = 'object' AND ref = ?",
        NOW - 30,
        oid(2),
    )

    def listed(*argv: str) -> list[str]:
        code, out, err = run("deliveries", *argv)
        assert code == 0, err
        return [json.loads(line)["object_id"] for line in out.splitlines()]

    assert listed("--state", "retry_wait") == [oid(2)]
    assert listed("--project", "other") == [oid(3)]
    assert listed("--since", "1m") == [oid(2)]
    assert listed("--since", "2026-07-23T00:00:00") == []
    assert listed("--since", "2026-07-22T23:59:00+00:00") == [oid(2)]
    assert listed("--needs-operator") == [oid(2)]
    assert listed("--state", "pending", "--project", "example") == [oid(1)]
    code, _, err = run("deliveries", "--since", "yesterday")
    assert code == 1 and "neither a duration" in err


def test_retry_clears_the_flag_of_a_verified_row(run: Run, indexed: SyncIndex) -> None:
    """A delivered, verified row flagged for an operator (a rebuild could not read one of its
    journal records) has nothing left to send: retry clears the flag and keeps the error as
    the record of why, one by one or with --needs-operator; an unflagged verified row is still
    refused."""
    note = "a journal record of it could not be read (journal/x.jsonl: line 6: bad)"
    indexed.query(
        "UPDATE outbound SET verified_at = ?, needs_operator = 1, last_error = ?"
        " WHERE kind = 'object' AND ref = ?",
        NOW - 5,
        note,
        oid(3),
    )
    code, out, err = run("retry", oid(3))
    assert code == 0, err
    assert "its flag for an operator is cleared" in out and "line 6" in out
    [(flag, error)] = indexed.query(
        "SELECT needs_operator, last_error FROM object_delivery WHERE object_id = ?", oid(3)
    )
    assert (flag, error) == (0, note)
    code, _, err = run("retry", oid(3))
    assert code == 1 and "nothing to retry" in err

    indexed.query(
        "UPDATE outbound SET needs_operator = 1 WHERE kind = 'object' AND ref = ?",
        oid(3),
    )
    code, out, err = run("retry", "--needs-operator")
    assert code == 0, err
    assert f"{oid(3)} (other) is delivered and verified: its flag is cleared" in out
    assert indexed.query("SELECT count(*) FROM object_delivery WHERE needs_operator != 0") == [(0,)]


def test_bulk_retry_of_rows_needing_an_operator(run: Run, indexed: SyncIndex) -> None:
    """After credentials are fixed: every flagged retry_wait row (of a project) is due now;
    rows not flagged, or of another project, keep waiting."""
    indexed.run(
        sql.insert_objects, [AcceptedObject(oid(4), "other", None, 5, CHECKSUM, 1)], NOW - 10
    )
    indexed.query(
        "UPDATE outbound SET state = 'retry_wait', needs_operator = 1, next_attempt_at = ?"
        " WHERE kind = 'object' AND ref IN (?, ?)",
        NOW + 3600,
        oid(2),
        oid(4),
    )
    code, out, err = run("retry", "--needs-operator", "--project", "example")
    assert code == 0, err
    assert "1 deliveries needing an operator are due now" in out and oid(2) in out
    due = dict(indexed.query("SELECT object_id, next_attempt_at FROM object_delivery"))
    assert due[oid(2)] == NOW and due[oid(4)] == NOW + 3600
    # A retried row is no longer flagged (the operator acted): only the other project's is left.
    code, out, _ = run("retry", "--needs-operator")
    assert code == 0 and "1 deliveries" in out and oid(4) in out and oid(2) not in out
    assert canner("retry", "--needs-operator", oid(2), "--config", str(run.config)).returncode == 2


@pytest.mark.parametrize(
    ("listen", "ok"),
    [
        ("tcp:8080:interface=127.0.0.1", True),
        ("unix:/run/canner/receiver.sock", True),
        ("systemd:domain=INET:index=0", True),
        ("tcp:eighty", False),
        ("carrier-pigeon:1", False),
    ],
)
def test_check_config_validates_listen(run: Run, listen: str, ok: bool) -> None:
    """``listen`` must be a Twisted endpoint description that parses."""
    text = run.config.read_text().replace("min_free_bytes", f'listen = "{listen}"\nmin_free_bytes')
    run.config.write_text(text)
    code, _, err = run("check-config")
    if ok:
        assert code == 0, err
    else:
        assert code == 1 and err.startswith("canner: config key 'listen'"), err


def test_check_config_refuses_the_placeholder_issuer_like_the_daemons(run: Run) -> None:
    """The example config's placeholder issuer, which the daemons refuse: exit 1, key named."""
    run.config.write_text(
        run.config.read_text().replace("https://canner.test", "https://canner.example")
    )
    code, out, err = run("check-config")
    assert code == 1 and out == ""
    assert err.startswith("canner: config key 'issuer': is still the placeholder"), err


def test_check_config_refuses_a_missing_data_dir(run: Run) -> None:
    """A data directory that does not exist (an unmounted volume) is refused, not created."""
    shutil.rmtree(run.data_dir)
    code, _, err = run("check-config")
    assert code == 1 and err.startswith("canner: config key 'data_dir'") and "mount" in err
    assert not run.data_dir.exists()


def test_check_config_as_root_checks_as_the_canner_account(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as root on the packaged config where a ``canner`` account exists (the packaged
    units' ``User=``; here it stands for nobody), check-config runs the daemons' start-up check
    as that account, even on a data directory root owns (a new volume, a restore as root): it
    fails with the daemons' line, then, the directory given to the account, passes; root stays
    root.  On another config (daemons started by hand) it checks as the data directory's
    owner, root here."""
    nobody = pwd.getpwnam("nobody")
    real = pwd.getpwnam
    monkeypatch.setattr(pwd, "getpwnam", lambda name: nobody if name == "canner" else real(name))
    root = Path(tempfile.mkdtemp(prefix="canner-cli-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        run = Run(root)
        code, out, err = run("check-config")
        assert code == 0 and "cannot write" not in err, err
        monkeypatch.setattr(cli_base, "DEFAULT_CONFIG", run.config)
        data = run.data_dir
        code, out, err = run("check-config")
        assert (code, out) == (1, ""), err
        assert err == (
            f"canner: cannot write {data} as user nobody: Permission denied; fix the ownership:"
            f" chown -R nobody:nogroup {data}\n"
        )
        assert (os.geteuid(), os.getegid()) == (0, 0)
        for path in (data, *data.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        code, out, err = run("check-config")
        assert code == 0 and "cannot write" not in err, err
        assert (os.geteuid(), os.getegid()) == (0, 0)
    finally:
        shutil.rmtree(root)


def test_retry_sends_a_flagged_package_or_ledger_again(run: Run, indexed: SyncIndex) -> None:
    """``canner retry`` takes a megawarc package id or a ledger name too; ``--needs-operator``
    covers flagged packages and ledgers, and ``canner status`` counts them as needing an
    operator until then."""
    package = "a" * 32
    indexed.query(
        "INSERT INTO packages (batch_id, project, state, opened_at, package_id, updated_at)"
        " VALUES (7, 'example', 'verified', ?, ?, ?)",
        NOW - 100,
        package,
        NOW - 100,
    )
    indexed.query(
        "INSERT INTO ledgers (ledger_id, name, period, state, created_at)"
        " VALUES (3, 'node-2026-11-30', '2026-11-30', 'written', ?)",
        NOW - 100,
    )
    for kind, ref, error in (("package", "7", "403 Forbidden"), ("ledger", "3", "upload: 403")):
        indexed.query(
            "INSERT INTO outbound (kind, ref, project, state, needs_operator, last_error,"
            " next_attempt_at, updated_at) VALUES (?, ?, '', 'retry_wait', 1, ?, ?, ?)",
            kind,
            ref,
            error,
            NOW + 3600,
            NOW - 100,
        )
    indexed.query("UPDATE outbound SET project = 'example' WHERE kind = 'package'")
    indexed.query(
        "INSERT INTO ledgers (name, period, state, created_at, next_attempt_at)"
        " VALUES ('node-2026-11-29', '2026-11-29', 'done', ?, ?)",
        NOW - 100,
        NOW - 100,
    )
    code, out, _ = run("status", "--json")
    assert json.loads(out)["needs_operator"] == 2
    code, out, err = run("retry", package)
    assert code == 0, err
    assert f"package {package} is due now" in out and "403 Forbidden" in out
    assert indexed.query(
        "SELECT next_attempt_at, needs_operator FROM package_delivery WHERE package_id = ?", package
    ) == [(NOW, 0)]
    code, out, err = run("retry", "--needs-operator")
    assert code == 0, err
    assert "ledger node-2026-11-30 is due now" in out and package not in out
    assert "1 deliveries needing an operator are due now" in out
    assert indexed.query(
        "SELECT next_attempt_at, needs_operator FROM outbound WHERE kind = 'ledger' AND ref = '3'"
    ) == [(NOW, 0)]
    code, out, _ = run("status", "--json")
    assert json.loads(out)["needs_operator"] == 0
    code, _, err = run("retry", "node-2026-11-29")
    assert code == 1 and "ledger node-2026-11-29 has nothing to retry" in err


def test_check_config_reports_every_error_with_the_nearest_key(run: Run) -> None:
    """One run names every bad key of the file; an unknown key gets the nearest known one."""
    run.config.write_text(
        'issuer = "https://canner.test"\n'
        f'data_dir = "{run.data_dir}"\n'
        "min_free_byte = 1\n"
        'partial_upload_retention = "soon"\n\n'
        "[connections]\nmax_per_clent = 0\n\n"
        '[projects.example.delivery]\nsink = "directory"\npath = "/srv"\n'
        'identifier = "x-{object_id}"\nlocal_artifact_retention = "1d"\n',
        encoding="utf-8",
    )
    code, out, err = run("check-config")
    assert (code, out) == (1, "")
    assert err == (
        "canner: 4 config errors:\n"
        "  config key 'min_free_byte': unknown key (did you mean 'min_free_bytes'?)\n"
        "  config key 'connections.max_per_clent': unknown key (did you mean 'max_per_client'?)\n"
        "  config key 'partial_upload_retention': 'soon' is not a Go duration"
        ' (such as "30s" or "1h30m")\n'
        "  config key 'projects.example.delivery.local_artifact_retention': '1d' is not a Go"
        ' duration (such as "30s" or "1h30m")\n'
    )


def test_times_are_shown_as_utc_beside_the_unix_time(run: Run, indexed: SyncIndex) -> None:
    """show, deliveries and status --json: each Unix time keeps its number and gets its ISO
    8601 UTC text right after it."""
    code, out, err = run("show", oid(2))
    assert code == 0, err
    assert (
        '    "next_attempt_at": 1784768400.0,\n    "next_attempt_at_utc": "2026-07-23T01:00:00Z",\n'
        in out
    )
    code, out, _ = run("deliveries", "--state", "retry_wait")
    assert '"next_attempt_at":1784768400.0,"next_attempt_at_utc":"2026-07-23T01:00:00Z",' in out
    code, out, _ = run("status", "--json")
    doc = json.loads(out)
    assert (doc["taken_at"], doc["taken_at_utc"]) == (NOW, "2026-07-23T00:00:00Z")
    assert '  "taken_at": 1784764800.0,\n  "taken_at_utc": "2026-07-23T00:00:00Z",\n' in out


def test_a_receipt_is_shown_as_issued_without_utc_fields() -> None:
    """The receipt's bytes are immutable: the people's times go beside the row's fields, never
    into the receipt shown."""
    receipt = {"id": "receipt:x", "accepted_at": 1784764800}
    shown = with_utc({"receipt": receipt, "delivered_at": 1784764800.0})
    assert shown["receipt"] == receipt
    assert shown["delivered_at_utc"] == "2026-07-23T00:00:00Z"


def test_show_says_a_prefix_needs_four_characters(run: Run, indexed: SyncIndex) -> None:
    code, out, err = run("show", "2f")
    assert (code, out) == (1, "")
    assert err == (
        "canner: '2f' is too short: give the whole object id or at least its first 4 characters\n"
    )


@pytest.mark.parametrize("argv", [["ledger"], ["ledger", "flush"]])
def test_ledger_without_a_ledger_table_says_so(run: Run, argv: list[str]) -> None:
    """Exit 2, like a usage error: the command does not apply to this node (1 is a failure)."""
    assert run(*argv) == (
        2,
        "",
        "canner: no [ledger] table in the config: this node writes no ledgers (released records"
        " stay local); see docs/operator-guide.md for [ledger]\n",
    )


def test_check_config_warns_about_credentials_others_can_read(run: Run) -> None:
    """The guide says 0600: a 0644 key file is a warning (the keys still work), 0600 none."""
    keys = run.root / "keys"
    keys.write_text("access\nsecret\n")
    run.write_config(DELIVERY.replace("{identifier}", "example-{date}-{object_id}"))
    keys.chmod(0o644)
    code, _, err = run("check-config")
    assert code == 0
    assert (
        f"canner: warning: projects.example.delivery.credentials: {keys} is mode 0644: other"
        f" users of this host can read the IA keys; chmod 0600 {keys}"
    ) in err.splitlines()
    keys.chmod(0o600)
    code, _, err = run("check-config")
    assert code == 0 and "chmod" not in err


def test_manhole_proxy_without_a_manhole_says_so(run: Run) -> None:
    assert run("manhole-proxy", "receiver") == (
        1,
        "",
        "canner: no manhole socket for canner-receiver: the config has no [manhole] table\n",
    )
