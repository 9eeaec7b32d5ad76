"""The receipt rescan (canner-deliver's hourly pass and ``canner rebuild-index``), over real
receipt files, a real verified ledger and a real SQLite index, with inline runners."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.logger import LogPublisher, globalLogPublisher

from canner.blocking import run_inline
from canner.checksum import parse_checksum
from canner.delivery import index as sql
from canner.delivery.index import AcceptedObject
from canner.delivery.rescan import ReceiptRescan, Rescanned
from canner.ids import ObjectIds
from canner.ledger.files import ArchivedIds, LedgerDir, Manifest, id_record
from canner.store.journal import Journal
from canner.store.receipts import (
    DeliveryRecord,
    Origin,
    Receipt,
    ReceiptStore,
    delivery_journal_record,
    origin_journal_record,
)
from canner.store.uploads import UploadStore
from tests.fakes import SyncIndex, succeeded

NOW = 1_784_764_800.0
CHECKSUM = "blake3:" + "ab" * 32


def oid(n: int) -> str:
    return f"{n:032x}"


class DataDir:
    """A data directory with receipts, a verified ledger and a delivery index."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("uploads", "receipts"):
            (root / sub).mkdir()
        self.receipts = ReceiptStore(root / "receipts")
        self.index = SyncIndex(root / "delivery.sqlite")
        self.archived = ArchivedIds(LedgerDir(root / "ledger"))

    def receipt(self, n: int) -> None:
        self.receipts.record_origin(oid(n), Origin("example", f"f{n}.warc"))
        self.receipts.commit(Receipt(oid(n), "https://canner.test", parse_checksum(CHECKSUM), n, 1))

    def archive(self, *ns: int) -> None:
        """A verified ledger owns the records of objects ``ns``."""
        ledgers = LedgerDir(self.root / "ledger")
        ledgers.directory.mkdir()
        ledgers.ids_path("n-x").write_bytes(b"".join(id_record(oid(n), 5.0) for n in sorted(ns)))
        ledgers.write_manifest(
            Manifest("n-x", "x", len(ns), 1, "m", "b", "item", "n-x.jsonl.zst", "u", 7.0)
        )

    def rescan(
        self,
        keep_going: Callable[[], bool] | None = None,
        pace: Callable[[float], Deferred[None]] | None = None,
    ) -> ReceiptRescan:
        more: dict[str, Any] = {} if keep_going is None else {"keep_going": keep_going}
        if pace is not None:
            more["pace"] = pace
        return ReceiptRescan(
            index=self.index,
            receipts=self.receipts,
            uploads=UploadStore(self.root / "uploads"),
            journal=Journal(self.root / "journal"),
            archived=self.archived.contains,
            object_ids=ObjectIds(),
            run=run_inline,
            now=lambda: NOW,
            batch=2,
            **more,
        )

    def states(self) -> dict[str, str]:
        return dict(self.index.query("SELECT object_id, state FROM object_delivery"))


@pytest.fixture
def data(tmp_path: Path) -> Iterator[DataDir]:
    data = DataDir(tmp_path)
    yield data
    data.index.close()


def _logged(f: Callable[[], Any]) -> tuple[Any, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    publisher = LogPublisher()
    publisher.addObserver(seen.append)
    globalLogPublisher.addObserver(publisher)
    try:
        result = f()
    finally:
        globalLogPublisher.removeObserver(publisher)
    return result, [e for e in seen if e.get("log_namespace") == "canner.delivery.rescan"]


def test_a_rescan_adds_missing_receipts_and_skips_known_and_archived_ones(data: DataDir) -> None:
    """Receipts the index lacks become pending rows, known rows are left alone, and a receipt
    whose record a verified ledger owns is never indexed again."""
    for n in range(1, 6):
        data.receipt(n)
    known = AcceptedObject(oid(2), "example", None, 2, CHECKSUM, 1)
    data.index.run(sql.insert_objects, [known], NOW - 100)
    data.index.query(
        "UPDATE outbound SET state = 'retry_wait' WHERE kind = 'object' AND ref = ?",
        oid(2),
    )
    data.archive(4)

    done, events = _logged(lambda: succeeded(data.rescan().run()))

    assert done == Rescanned(added=3, read=3, problems=[], damage=[])
    assert data.states() == {
        oid(1): "pending",
        oid(2): "retry_wait",
        oid(3): "pending",
        oid(5): "pending",
    }
    [event] = events
    assert event["log_format"] == "rescan added {count} receipts to the delivery index"
    assert event["count"] == 3
    again, events = _logged(lambda: succeeded(data.rescan().run()))
    assert again == Rescanned(added=0, read=0, problems=[], damage=[]) and events == []


def test_a_rescan_stops_between_batches_when_told_and_the_next_one_finishes(
    data: DataDir,
) -> None:
    """Asked before each batch, ``keep_going`` ends the pass between two batches (the daemon
    stopping); the next pass starts from the beginning and adds the rest."""
    for n in range(1, 7):
        data.receipt(n)
    asked = 0

    def two_batches() -> bool:
        nonlocal asked
        asked += 1
        return asked <= 2

    first = succeeded(data.rescan(two_batches).run())

    assert (first.added, asked) == (4, 3)
    assert len(data.states()) == 4
    rest = succeeded(data.rescan().run())
    assert rest.added == 2
    assert set(data.states()) == {oid(n) for n in range(1, 7)}


def test_a_paced_rescan_pauses_after_batches_it_found_indexed_and_rebuilds_at_once(
    data: DataDir,
) -> None:
    """With a pace, every batch whose receipts the index holds is followed by a pause (what is
    at rest is checked slowly); a batch that adds rows (a lost index rebuilt) is not, and the
    pass still adds every missing receipt."""
    for n in range(1, 7):
        data.receipt(n)
    data.index.run(
        sql.insert_objects,
        [AcceptedObject(oid(n), "example", None, n, CHECKSUM, 1) for n in range(1, 6)],
        NOW - 100,
    )
    pauses: list[float] = []

    def pace(seconds: float) -> Deferred[None]:
        pauses.append(seconds)
        return succeed(None)

    done = succeeded(data.rescan(pace=pace).run())

    # Three batches of two (in directory order): two fully indexed, one with the missing one.
    assert done.added == 1 and set(data.states()) == {oid(n) for n in range(1, 7)}
    assert len(pauses) == 2 and all(p == 0.0 for p in pauses)
    pauses.clear()
    again = succeeded(data.rescan(pace=pace).run())
    assert again.added == 0 and len(pauses) == 3


def test_a_damaged_receipt_is_named_and_skipped_and_the_rest_are_added(data: DataDir) -> None:
    """A corrupt receipt file is reported by path; every other receipt is indexed."""
    for n in range(1, 4):
        data.receipt(n)
    bad = data.receipts.receipt_path(oid(2))
    bad.write_bytes(b'{"object_id": 7')

    done = succeeded(data.rescan().run())

    assert (done.added, done.read) == (2, 2)
    [problem] = done.problems
    assert problem.startswith(str(bad))
    assert set(data.states()) == {oid(1), oid(3)}


@pytest.mark.parametrize(
    ("left", "purged", "after"),
    [
        # A crash between the purge's record and its first unlink: purged again later.
        ({"data", "info"}, False, {"data", "info"}),
        # Not a purge's cut (it unlinks the data first), but a payload: purged again later.
        ({"data"}, False, {"data"}),
        # A crash between the purge's two unlinks: purged now, the purge finished.
        ({"info"}, True, set()),
        ({""}, True, set()),
    ],
)
def test_a_journaled_purge_is_shown_as_the_disk_leaves_it(
    data: DataDir, left: set[str], purged: bool, after: set[str]
) -> None:
    """An object whose journal records it delivered and purged comes back purged (at the
    recorded time) exactly when its data file is gone, a sidecar left behind then removed; a data
    file still on disk comes back unpurged, so it is purged again."""
    data.receipt(1)
    uploads = data.root / "uploads"
    paths = {"data": uploads / oid(1), "info": uploads / f"{oid(1)}.info"}
    for name in left - {""}:
        paths[name].write_bytes(b"x")
    record = DeliveryRecord("item", "f1.warc", "00" * 16, NOW - 30, NOW - 20, NOW - 10, NOW - 5)
    Journal(data.root / "journal").append(
        [
            origin_journal_record(oid(1), Origin("example", "f1.warc")),
            delivery_journal_record(oid(1), record),
        ]
    )
    done = succeeded(data.rescan().run())
    assert (done.added, done.problems) == (1, [])
    [(state, purged_at)] = data.index.query("SELECT state, purged_at FROM object_delivery")
    assert (state, purged_at) == ("delivered", NOW - 5 if purged else None)
    assert {name for name, path in paths.items() if path.exists()} == after
