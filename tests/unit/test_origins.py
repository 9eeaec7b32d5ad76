"""Objects by origin: the downloader in receipts' side files and the index, the idempotency
lookup (``canner.accept.origins``) over real receipt files and a real SQLite index, and what the
receiver's start gives the index (``index_at_start``)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.logger import LogLevel, capturedLogs, formatEvent

from canner.accept.origins import AcceptedOrigins, OriginKey, index_at_start, unindexed_among
from canner.blocking import run_inline
from canner.checksum import parse_checksum
from canner.delivery import index as sql
from canner.delivery.index import AcceptedObject
from canner.delivery.rescan import read_accepted
from canner.ids import ObjectIds
from canner.store.journal import Journal, JournalLookup, release_record
from canner.store.promises import unreceipted
from canner.store.receipts import (
    Origin,
    Receipt,
    ReceiptStore,
    origin_journal_record,
    origin_of,
    parse_origin,
)
from canner.store.uploads import UploadStore
from tests.fakes import SyncIndex, succeeded

CHECKSUM = parse_checksum("blake3:" + "ab" * 32)
OTHER = parse_checksum("blake3:" + "cd" * 32)
ISSUER = "https://canner.test"


def oid(n: int) -> str:
    return f"{n:032x}"


def key(downloader: str = "alice", size: int = 10, checksum: object = CHECKSUM) -> OriginKey:
    return OriginKey("urls", downloader, "item.warc.zst", size, checksum)  # type: ignore[arg-type]


# -- the origin record ---------------------------------------------------------------------


def test_an_origin_without_downloader_keeps_its_json_byte_for_byte() -> None:
    """An origin with no downloader writes exactly the side file it always wrote."""
    assert Origin("urls", "a.warc").to_json(oid(1)) == (
        b'{"object_id":"' + oid(1).encode() + b'","project":"urls","filename":"a.warc"}'
    )
    record = origin_journal_record(oid(1), Origin("urls", None))
    assert record == {"kind": "origin", "object_id": oid(1), "project": "urls", "filename": None}


def test_an_origin_with_downloader_round_trips_and_old_records_read_as_none() -> None:
    """The downloader survives the side file and the journal; records without it read None."""
    origin = Origin("urls", "a.warc", "alice")
    assert parse_origin(origin.to_json(oid(1))) == origin
    assert origin_of(origin_journal_record(oid(1), origin)) == origin
    assert parse_origin(b'{"object_id":"x","project":"urls","filename":"a"}').downloader is None
    with pytest.raises(ValueError):
        parse_origin(b'{"project":"urls","filename":"a","downloader":7}')


# -- the index -----------------------------------------------------------------------------


@pytest.fixture
def index(tmp_path: Path) -> Iterator[SyncIndex]:
    found = SyncIndex(tmp_path / "delivery.sqlite")
    yield found
    found.close()


def accepted(n: int, origin: Origin, size: int = 10, checksum: object = CHECKSUM) -> AcceptedObject:
    receipt = Receipt(oid(n), ISSUER, checksum, size, n)  # type: ignore[arg-type]
    return AcceptedObject.of(receipt, origin)


def test_the_index_keeps_the_downloader_and_finds_objects_by_origin(index: SyncIndex) -> None:
    """Rows carry the downloader; the origin query filters by it, or not, oldest first."""
    succeeded(
        index.run(
            sql.insert_objects,
            [
                accepted(3, Origin("urls", "item.warc.zst", "bob")),
                accepted(2, Origin("urls", "item.warc.zst", "alice")),
                accepted(1, Origin("urls", "item.warc.zst")),
                accepted(4, Origin("other", "item.warc.zst", "alice")),
            ],
            5.0,
        )
    )
    assert succeeded(index.run(sql.get_row, oid(2))).downloader == "alice"
    by = sql.ids_by_origin
    assert succeeded(index.run(by, "urls", "item.warc.zst", "alice")) == [oid(2)]
    assert succeeded(index.run(by, "urls", "item.warc.zst", None)) == [oid(1)]
    every = succeeded(index.run(by, "urls", "item.warc.zst", None, True))
    assert every == [oid(1), oid(2), oid(3)]


def test_the_origin_query_uses_the_origin_index(index: SyncIndex) -> None:
    """Looking objects up by origin is an index search, not a scan of ``objects``."""
    plan = index.query(
        "EXPLAIN QUERY PLAN SELECT object_id FROM objects WHERE project = ? AND filename = ?"
        " AND downloader IS ? ORDER BY accepted_at, object_id LIMIT 5",
        "urls",
        "a",
        "alice",
    )
    assert any("objects_origin" in row[-1] for row in plan), plan


def test_rows_written_before_version_7_keep_working(tmp_path: Path) -> None:
    """An index at version 6 with rows upgrades: its rows have no downloader and still load."""
    path = tmp_path / "delivery.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for number, text in sql._migrations():
        if number <= 6:
            conn.executescript(text)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
    conn.execute(
        "INSERT INTO objects (object_id, project, filename, size_bytes, checksum, accepted_at)"
        " VALUES (?, 'urls', 'a.warc', 1, ?, 1)",
        (oid(1), str(CHECKSUM)),
    )
    conn.close()
    assert sql.upgrade_schema(path) >= 7
    index = SyncIndex(path)
    try:
        row = succeeded(index.run(sql.get_row, oid(1)))
        assert row.downloader is None and row.filename == "a.warc"
    finally:
        index.close()


def test_a_rebuild_from_receipts_carries_the_downloader(tmp_path: Path) -> None:
    """The rescan reads the downloader from the origin side file into the row it inserts."""
    receipts = ReceiptStore(tmp_path / "receipts")
    receipts.directory.mkdir()
    (tmp_path / "uploads").mkdir()
    receipts.record_origin(oid(1), Origin("urls", "item.warc.zst", "alice"))
    receipts.commit(Receipt(oid(1), ISSUER, CHECKSUM, 10, 1))
    journal = JournalLookup(Journal(tmp_path / "journal"))
    try:
        found = read_accepted(receipts, UploadStore(tmp_path / "uploads"), journal, [oid(1)])
    finally:
        journal.close()
    assert [o.downloader for o in found.objects] == ["alice"]


# -- the idempotency lookup ----------------------------------------------------------------


class Node:
    """A receipts directory and an index, as the receiver has them."""

    def __init__(self, root: Path, index: SyncIndex | None) -> None:
        self.receipts = ReceiptStore(root / "receipts")
        self.receipts.directory.mkdir()
        self.index = index
        self.origins = AcceptedOrigins(receipts=self.receipts, run=run_inline, index=index)

    def accept(self, n: int, origin: Origin, size: int = 10, checksum: object = CHECKSUM) -> None:
        """An object accepted (receipt on disk) with its index row."""
        receipt = Receipt(oid(n), ISSUER, checksum, size, n)  # type: ignore[arg-type]
        self.receipts.record_origin(oid(n), origin)
        self.receipts.commit(receipt)
        if self.index is not None:
            succeeded(self.index.run(sql.insert_objects, [AcceptedObject.of(receipt, origin)], 1))

    def commit(self, n: int, size: int = 10) -> Deferred[Receipt]:
        """A commit as acceptance runs it: the receipt is durable when this fires."""
        return succeed(self.receipts.commit(Receipt(oid(n), ISSUER, CHECKSUM, size, n)))


@pytest.fixture
def node(tmp_path: Path, index: SyncIndex) -> Node:
    return Node(tmp_path, index)


def test_an_indexed_object_with_exactly_the_key_is_found(node: Node) -> None:
    """Project, downloader, file name, size and checksum must all match."""
    node.accept(1, Origin("urls", "item.warc.zst", "alice"))
    assert succeeded(node.origins.find(key())) == node.receipts.read(oid(1))
    for other in (key("bob"), key(size=11), key(checksum=OTHER)):
        assert succeeded(node.origins.find(other)) is None


def test_a_commit_not_yet_in_the_index_is_found_by_the_next_copy(node: Node) -> None:
    """A retry right after the first copy's commit gets its receipt before the index has it."""
    first = succeeded(node.origins.once(key(), lambda: node.commit(1)))
    assert first == (node.receipts.read(oid(1)), True)
    assert node.index is not None
    assert node.index.query("SELECT count(*) FROM objects") == [(0,)]
    assert succeeded(node.origins.once(key(), lambda: node.commit(2))) == (first[0], False)
    assert node.receipts.read(oid(2)) is None


def test_a_second_copy_waits_for_the_first_ones_commit(node: Node) -> None:
    """Two copies at once: the second runs no commit and answers the first one's receipt."""
    pending: Deferred[Receipt] = Deferred()
    first = node.origins.once(key(), lambda: pending)
    second = node.origins.once(key(), lambda: node.commit(2))
    assert not first.called and not second.called
    pending.callback(node.receipts.commit(Receipt(oid(1), ISSUER, CHECKSUM, 10, 1)))
    receipt = node.receipts.read(oid(1))
    assert succeeded(first) == (receipt, True)
    assert succeeded(second) == (receipt, False)
    assert node.receipts.read(oid(2)) is None


def test_a_failed_commit_lets_the_next_copy_commit(node: Node) -> None:
    """A commit that fails leaves nothing claimed: the waiting copy becomes the object."""
    pending: Deferred[Receipt] = Deferred()
    first = node.origins.once(key(), lambda: pending)
    second = node.origins.once(key(), lambda: node.commit(2))
    pending.errback(OSError(5, "fsync failed"))
    with pytest.raises(OSError):
        succeeded(first)
    assert succeeded(second) == (node.receipts.read(oid(2)), True)


def test_an_object_whose_receipt_is_gone_no_longer_counts(node: Node) -> None:
    """Archived objects (receipt deleted) do not swallow a new copy."""
    node.accept(1, Origin("urls", "item.warc.zst", "alice"))
    node.receipts.receipt_path(oid(1)).unlink()
    assert succeeded(node.origins.find(key())) is None


def test_a_failing_index_is_no_match(tmp_path: Path) -> None:
    """An index that cannot answer makes the copy a new object rather than a refusal."""

    class Broken:
        def run(self, f: object, *args: object) -> Deferred[object]:
            raise sqlite3.OperationalError("disk I/O error")

    origins = AcceptedOrigins(receipts=ReceiptStore(tmp_path), run=run_inline, index=Broken())
    assert succeeded(origins.find(key())) is None


def test_without_an_index_only_this_process_commits_are_found(tmp_path: Path) -> None:
    """A receiver without a usable index still answers retries of its own commits."""
    node = Node(tmp_path, None)
    node.accept(1, Origin("urls", "item.warc.zst", "alice"))
    assert succeeded(node.origins.find(key())) is None
    created = succeeded(node.origins.once(key(size=5), lambda: node.commit(2, size=5)))
    assert succeeded(node.origins.find(key(size=5))) == created[0]


# -- what the receiver's start gives the index ---------------------------------------------


class Restarted:
    """A data directory as a killed receiver leaves it, and the start that follows: the index
    at start (:func:`index_at_start`), then a fresh origin memory over it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.receipts = ReceiptStore(root / "receipts")
        self.receipts.directory.mkdir()
        (root / "uploads").mkdir()
        self.path = root / "delivery.sqlite"
        self.index = SyncIndex(self.path)
        self.journal = Journal(root / "journal")
        self.archived: set[str] = set()

    def commit(self, n: int, origin: Origin, indexed: bool = False) -> Receipt:
        """A commit as acceptance makes it: origin record, then receipt (the commit point);
        its index row only when ``indexed`` (a kill came before it otherwise)."""
        receipt = Receipt(oid(n), ISSUER, CHECKSUM, 10, n)
        self.receipts.record_origin(oid(n), origin)
        self.receipts.commit(receipt)
        if indexed:
            succeeded(self.index.run(sql.insert_objects, [AcceptedObject.of(receipt, origin)], 1))
        return receipt

    def start(self) -> int | None:
        return index_at_start(
            self.path,
            receipts=self.receipts,
            uploads=UploadStore(self.root / "uploads"),
            journal=self.journal,
            archived=self.archived.__contains__,
            object_ids=ObjectIds(),
            now=lambda: 100.0,
        )

    def origins(self) -> AcceptedOrigins:
        return AcceptedOrigins(receipts=self.receipts, run=run_inline, index=self.index)

    def rows(self) -> list[str]:
        return [row[0] for row in self.index.query("SELECT object_id FROM objects ORDER BY 1")]


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[Restarted]:
    found = Restarted(tmp_path)
    yield found
    found.index.close()


def test_a_commit_a_kill_left_unindexed_is_found_after_the_start(restarted: Restarted) -> None:
    """The kill came between the commit point and the index row: the start inserts the row,
    and the copy sent again answers the first receipt instead of committing."""
    first = restarted.commit(1, Origin("urls", "item.warc.zst", "alice"))
    assert succeeded(restarted.origins().find(key())) is None  # what today's start knew
    assert restarted.start() == 1
    row = succeeded(restarted.index.run(sql.get_row, oid(1)))
    assert (row.project, row.filename, row.downloader, row.state) == (
        "urls",
        "item.warc.zst",
        "alice",
        "pending",
    )
    commits: list[int] = []

    def commit_again() -> Deferred[Receipt]:
        commits.append(2)
        return succeed(restarted.commit(2, Origin("urls", "item.warc.zst", "alice")))

    assert succeeded(restarted.origins().once(key(), commit_again)) == (first, False)
    assert commits == []


def test_the_start_adds_only_what_the_index_lacks(restarted: Restarted) -> None:
    """Indexed rows stay as they are; a second start adds nothing."""
    restarted.commit(1, Origin("urls", "a.warc.zst", "alice"), indexed=True)
    restarted.commit(2, Origin("urls", "b.warc.zst", "alice"))
    before = succeeded(restarted.index.run(sql.get_row, oid(1)))
    assert before.updated_at == 1
    assert restarted.start() == 1
    assert restarted.rows() == [oid(1), oid(2)]
    assert succeeded(restarted.index.run(sql.get_row, oid(1))) == before
    assert restarted.start() == 0


def test_the_start_leaves_purged_and_archived_receipts_to_the_deliver_rescan(
    restarted: Restarted,
) -> None:
    """A receipt without its origin record (its payload was purged) or owned by a verified
    ledger gets no row from the receiver: those are canner-deliver's, under the ledger's
    guard; neither can be a commit the receiver left unindexed."""
    restarted.commit(1, Origin("urls", "a.warc.zst", "alice"))
    restarted.receipts.origin_path(oid(1)).unlink()
    restarted.commit(2, Origin("urls", "b.warc.zst", "alice"))
    restarted.archived.add(oid(2))
    restarted.commit(3, Origin("urls", "c.warc.zst", "alice"))
    assert restarted.start() == 1
    assert restarted.rows() == [oid(3)]


def test_the_start_builds_rows_as_the_rescan_does(restarted: Restarted) -> None:
    """A receipt released before its row existed comes back with its release from the journal
    (the row is the rescan's, not a bare pending one)."""
    restarted.commit(1, Origin("urls", "a.warc.zst", "alice"))
    restarted.journal.append([release_record(oid(1), 42.0, "hq")])
    assert restarted.start() == 1
    assert succeeded(restarted.index.run(sql.get_row, oid(1))).released_at == 42.0


def test_a_start_whose_pass_fails_logs_and_goes_on(restarted: Restarted) -> None:
    """An index the pass cannot use is an error in the log, never a receiver that refuses to
    start: the receipts are all still there for canner-deliver's rescan."""
    restarted.commit(1, Origin("urls", "a.warc.zst", "alice"))
    restarted.path = restarted.root / "missing" / "delivery.sqlite"
    with capturedLogs() as events:
        assert restarted.start() is None
    [error] = [e for e in events if e["log_level"] == LogLevel.error]
    assert "canner-deliver's rescan" in formatEvent(error)


def _every_start_state(node: Restarted) -> None:
    """Receipts in every state a start meets: indexed; a commit a kill left unindexed, its
    payload waiting in uploads/; one whose payload was packaged away, unindexed (an index lost);
    purged (no origin record); archived; and an origin record whose receipt never came."""
    uploads = UploadStore(node.root / "uploads")
    node.commit(1, Origin("urls", "a.warc.zst", "alice"), indexed=True)
    for n in (1, 2):
        uploads.data_path(oid(n)).write_bytes(b"x" * 10)
        uploads.info_path(oid(n)).write_bytes(b"{}")
    node.commit(2, Origin("urls", "b.warc.zst", "alice"))
    node.commit(3, Origin("urls", "c.warc.zst", "alice"))
    node.commit(4, Origin("urls", "d.warc.zst", "alice"))
    node.receipts.origin_path(oid(4)).unlink()
    node.commit(5, Origin("urls", "e.warc.zst", "alice"))
    node.archived.add(oid(5))
    node.receipts.record_origin(oid(6), Origin("urls", "f.warc.zst", "alice"))


@contextmanager
def _full_and_fed(tmp_path: Path) -> Iterator[tuple[Restarted, Restarted]]:
    """Two nodes left in every start state: one to start on a listing of its own, one to feed."""
    (tmp_path / "full").mkdir()
    (tmp_path / "fed").mkdir()
    full, fed = Restarted(tmp_path / "full"), Restarted(tmp_path / "fed")
    try:
        for node in (full, fed):
            _every_start_state(node)
        yield full, fed
    finally:
        full.index.close()
        fed.index.close()


def test_the_start_fed_by_start_ups_listing_adds_what_a_listing_of_its_own_adds(
    tmp_path: Path,
) -> None:
    """The receiver's start checks only the origin records its start-up listed
    (``unreceipted(..., with_origins=True).recorded``), not every receipt again: the rows it
    adds are those a full listing of receipts/ adds, the unindexed commit with its payload
    waiting and the packaged one among them, and a second start adds nothing."""
    with _full_and_fed(tmp_path) as (full, fed):
        listed = unreceipted(
            UploadStore(fed.root / "uploads"), fed.receipts, ObjectIds(), with_origins=True
        )
        assert sorted(listed.recorded) == [oid(n) for n in (1, 2, 3, 5, 6)]

        def start_fed() -> int | None:
            return index_at_start(
                fed.path,
                receipts=fed.receipts,
                uploads=UploadStore(fed.root / "uploads"),
                journal=fed.journal,
                archived=fed.archived.__contains__,
                object_ids=ObjectIds(),
                now=lambda: 100.0,
                recorded=listed.recorded,
            )

        assert start_fed() == full.start() == 2
        assert fed.rows() == full.rows() == [oid(1), oid(2), oid(3)]
        assert start_fed() == 0


def test_a_start_up_listing_keeps_only_the_origin_records_the_index_lacks(
    tmp_path: Path,
) -> None:
    """Start-up keeps, of each batch of origin records it lists, only those whose object the
    index lacks (the ids of a million objects at rest are not held): the start fed with those
    adds the rows a full listing adds, and without a readable index every record is kept."""
    with _full_and_fed(tmp_path) as (full, fed):
        uploads = UploadStore(fed.root / "uploads")
        with unindexed_among(fed.path) as lacking:
            listed = unreceipted(
                uploads, fed.receipts, ObjectIds(), with_origins=True, keep_origins=lacking
            )
        everything = unreceipted(uploads, fed.receipts, ObjectIds(), with_origins=True)
        indexed = set(fed.rows())
        assert sorted(listed.recorded) == sorted(set(everything.recorded) - indexed)
        assert indexed & set(everything.recorded)  # some were dropped
        with unindexed_among(tmp_path / "no-such.sqlite") as lacking:
            assert lacking([oid(1), oid(2)]) == [oid(1), oid(2)]

        added = index_at_start(
            fed.path,
            receipts=fed.receipts,
            uploads=uploads,
            journal=fed.journal,
            archived=fed.archived.__contains__,
            object_ids=ObjectIds(),
            now=lambda: 100.0,
            recorded=listed.recorded,
        )
        assert added == full.start() == 2
        assert fed.rows() == full.rows()
