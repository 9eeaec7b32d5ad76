"""HQ release and ledger: token files, release classification, ledger records, periods, the
archived-id index and the ledger's SQL (on a real ``delivery.sqlite``)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from canner.config import ConfigError, parse_config
from canner.delivery.index import (
    AcceptedObject,
    configure_connection,
    get_row,
    insert_objects,
    upgrade_schema,
)
from canner.hq import releases as rel
from canner.hq.objects import ObjectReader
from canner.ids import ObjectIds
from canner.ledger import store
from canner.ledger.files import (
    ArchivedIds,
    LedgerDir,
    Manifest,
    id_record,
    period_end,
    period_of,
    record_line,
)
from canner.ledger.steps import id_batches, write_ledger
from canner.store.journal import (
    RELEASE,
    Journal,
    JournalLog,
    JournalLookup,
    release_record,
    released_at_of,
)
from canner.store.receipts import ReceiptStore

DAY = 86400.0
T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z


# -- tokens --------------------------------------------------------------------------------------


def test_token_file_holds_digests_and_authenticates_by_them(tmp_path: Path) -> None:
    """A token is accepted when its SHA-256 is listed; the name of its client is returned."""
    path = tmp_path / "tokens"
    path.write_text(f"# clients\nhq {rel.token_digest('s3cret')}\n\nhq2 {rel.token_digest('x')}\n")
    tokens = rel.TokenFile(path)
    assert tokens.authenticate("s3cret") == "hq"
    assert tokens.authenticate("x") == "hq2"
    assert tokens.authenticate("s3cret ") is None
    assert tokens.authenticate(None) is None
    path.write_text(f"hq {rel.token_digest('s3cret')}\n")  # hq2 removed, and the size changed
    assert tokens.authenticate("x") is None


@pytest.mark.parametrize(
    "text",
    [
        "hq sha256:abc",
        "hq md5:" + "0" * 64,
        "hq",
        "a b sha256:" + "0" * 64,
        "hq SHA256:" + "0" * 64,
    ],
)
def test_malformed_token_lines_are_refused_naming_the_line(text: str) -> None:
    """Anything but ``NAME sha256:<64 hex>`` is an error that names its line."""
    with pytest.raises(rel.TokenFileError, match="line 2"):
        rel.parse_tokens("# ok\n" + text)


def test_bearer_header_parsing() -> None:
    """Only ``Bearer <token>`` yields a token."""
    assert rel.bearer_token(b"Bearer abc") == "abc"
    assert rel.bearer_token("bearer  abc ") == "abc"
    assert rel.bearer_token(b"Basic abc") is None
    assert rel.bearer_token(b"Bearer ") is None
    assert rel.bearer_token(None) is None


# -- release classification ----------------------------------------------------------------------


def test_release_answers_cover_every_case() -> None:
    """Unknown, refused, already released, archived, fresh and a duplicate in one batch."""
    valid = ObjectIds().is_valid
    a, b, c, d, e = ("a" * 32, "b" * 32, "c" * 32, "d" * 32, "e" * 32)
    candidates = {
        a: rel.Candidate(a, True, None),
        b: rel.Candidate(b, False, None),
        c: rel.Candidate(c, True, 5.0),
    }
    ids = [f"receipt:{x}" for x in (a, b, c, d, e, a)] + ["nonsense"]
    answers, publish = rel.classify(ids, candidates, {d: 3.0}, valid)
    assert publish == [a]
    done = rel.finish_answers(ids, answers, {a: 9.0}, 9.0)
    assert [(r.status, r.released_at) for r in done] == [
        ("released", 9.0),
        ("not_delivered", None),
        ("already_released", 5.0),
        ("already_released", 3.0),
        ("unknown", None),
        ("already_released", 9.0),
        ("unknown", None),
    ]
    # An earlier release (another process's, committed first) wins: the first time stands.
    assert rel.finish_answers(ids[:1], answers[:1], {a: 7.0}, 9.0)[0].status == "already_released"


def test_release_request_bodies() -> None:
    """A JSON list (or {"ids": [...]}) of 1..1000 strings."""
    assert rel.parse_release_request(b'["receipt:x"]') == ["receipt:x"]
    assert rel.parse_release_request(b'{"ids": ["receipt:x"]}') == ["receipt:x"]
    for bad in (b"", b"{", b"[]", b"[1]", b'{"x": []}', json.dumps(["a"] * 1001).encode()):
        with pytest.raises(ValueError):
            rel.parse_release_request(bad)


# -- periods and records ---------------------------------------------------------------------------


@given(st.floats(min_value=0, max_value=4e9), st.sampled_from(["day", "month"]))
def test_a_time_lies_inside_its_period(when: float, period: str) -> None:
    """Every time is before the end of its period and at or after the end of the one before."""
    name = period_of(when, period)
    assert when < period_end(name)
    assert period_of(period_end(name), period) != name


def test_period_names() -> None:
    assert period_of(T0, "day") == "2026-05-28"
    assert period_of(T0, "month") == "2026-05"
    assert period_end("2026-12") == period_end("2026-12-31")


def test_record_line_keeps_the_receipt_bytes() -> None:
    """A ledger line starts with the receipt's own bytes and adds the facts after them."""
    receipt = b'{"id":"receipt:x","issuer":"https://i","object_id":"x","size_bytes":1}'
    facts: dict[str, Any] = {k: None for k in ("project", "filename", "identifier", "remote_name")}
    facts.update(delivered_at=1.0, verified_at=2.0, purged_at=3.0, released_at=4.5)
    line = record_line(receipt, facts)
    assert line.startswith(receipt[:-1] + b',"project":null')
    assert line.endswith(b"}\n") and line.count(b"\n") == 1
    assert json.loads(line)["released_at"] == 4.5


# -- the index and the files -----------------------------------------------------------------------


def _db(tmp_path: Path) -> sqlite3.Connection:
    path = tmp_path / "delivery.sqlite"
    upgrade_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    configure_connection(conn)
    return conn


def _accepted(oid: str) -> AcceptedObject:
    return AcceptedObject(oid, "example", "f.warc", 10, "blake3:" + "ab" * 32, int(T0))


def _released(
    conn: sqlite3.Connection, oid: str, released: float | None, purged: float | None
) -> None:
    insert_objects(conn.cursor(), [_accepted(oid)], T0)
    conn.execute(
        "UPDATE outbound SET state = 'delivered', remote_identifier = 'item', delivered_at = ?,"
        " verified_at = ? WHERE kind = 'object' AND ref = ?",
        (T0, T0, oid),
    )
    conn.execute(
        "UPDATE objects SET remote_name = 'f', purged_at = ?, released_at = ? WHERE object_id = ?",
        (purged, released, oid),
    )


# -- the release journal -----------------------------------------------------------------------


def _verified(conn: sqlite3.Connection, oid: str) -> None:
    _released(conn, oid, None, None)


def _release(conn: sqlite3.Connection, journal: Journal, ids: list[str], now: float) -> Any:
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    candidates, released = rel.release_known(cur, journal, ids, now, "hq")
    cur.execute("COMMIT")
    # Every id released, by this call (at now) or an earlier one (its first time).
    earlier = {oid: c.released_at for oid, c in candidates.items() if c.released_at is not None}
    return earlier | released


def test_a_release_batch_is_one_journal_segment_and_the_first_time_stands(tmp_path: Path) -> None:
    """A batch writes one segment holding only the rows it changed; a repeat answers the first
    released_at and writes nothing; an unverified id is left out."""
    conn = _db(tmp_path)
    journal = Journal(tmp_path / "journal")
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    _verified(conn, a)
    _verified(conn, b)
    insert_objects(conn.cursor(), [_accepted(c)], T0)  # pending: not releasable
    assert _release(conn, journal, [a], 10.0) == {a: 10.0}
    assert _release(conn, journal, [a, b, c], 20.0) == {a: 10.0, b: 20.0}
    assert journal.segments() == ["000000000001.jsonl", "000000000002.jsonl"]
    assert [r["object_id"] for r in journal.read("000000000002.jsonl")] == [b]
    assert list(journal.read("000000000001.jsonl")) == [
        {"kind": "release", "object_id": a, "released_at": 10.0, "client": "hq"}
    ]
    assert _release(conn, journal, [a, b], 30.0) == {a: 10.0, b: 20.0}
    assert len(journal.segments()) == 2
    assert get_row(conn.cursor(), c).released_at is None  # type: ignore[union-attr]


def test_a_request_released_first_answers_as_one_looked_up_first(tmp_path: Path) -> None:
    """release_known releases in one guarded update and looks up only the rest: a batch of
    every case (fresh, a duplicate, released before, not delivered, unknown) gets the answers
    a look before the release gives, and one journal segment of the fresh id alone."""
    conn = _db(tmp_path)
    journal = Journal(tmp_path / "journal")
    a, b, c, d = "a" * 32, "b" * 32, "c" * 32, "d" * 32
    _verified(conn, a)
    _released(conn, b, 5.0, None)
    insert_objects(conn.cursor(), [_accepted(c)], T0)  # pending: not releasable
    ids = [f"receipt:{x}" for x in (a, b, c, d, a)]
    oids = [rel.object_id_of(r) for r in ids]
    valid = ObjectIds().is_valid
    looked_first = rel.classify(ids, rel.release_candidates(conn.cursor(), oids), {}, valid)[0]
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    candidates, released = rel.release_known(cur, journal, oids, 9.0, "hq")
    cur.execute("COMMIT")
    assert released == {a: 9.0}
    assert rel.classify(ids, candidates, {}, valid)[0] == looked_first
    answers = rel.finish_answers(ids, looked_first, released, 9.0)
    assert [(r.status, r.released_at) for r in answers] == [
        ("released", 9.0),
        ("already_released", 5.0),
        ("not_delivered", None),
        ("unknown", None),
        ("already_released", 9.0),
    ]
    assert [r["object_id"] for name in journal.segments() for r in journal.read(name)] == [a]
    # Asked again, nothing is released and nothing written: the first time stands.
    cur.execute("BEGIN IMMEDIATE")
    candidates, released = rel.release_known(cur, journal, oids, 20.0, "hq")
    cur.execute("COMMIT")
    assert released == {} and candidates[a] == rel.Candidate(a, True, 9.0)
    assert len(journal.segments()) == 1


def test_a_record_left_by_a_crash_is_superseded_by_the_release_that_committed(
    tmp_path: Path,
) -> None:
    """A segment written before a crash (its transaction never committed) precedes the one of
    the release that did: a rebuild reads the committed time."""
    conn = _db(tmp_path)
    journal = Journal(tmp_path / "journal")
    a = "a" * 32
    _verified(conn, a)
    journal.append([release_record(a, 5.0, "hq")])  # the crashed attempt's record
    assert _release(conn, journal, [a], 9.0) == {a: 9.0}
    lookup = JournalLookup(journal)
    try:
        assert released_at_of(lookup.get(a, RELEASE)) == 9.0
        assert lookup.get("b" * 32, RELEASE) is None
    finally:
        lookup.close()


def test_spent_segments_go_and_a_damaged_one_is_named(tmp_path: Path) -> None:
    """remove_spent deletes only segments whose every object is spent; a line that does not
    parse is an error naming the segment and line (a lookup skips it and names it)."""
    journal = Journal(tmp_path / "journal")
    assert journal.segments() == [] and journal.remove_spent(lambda oid: True) == 0
    first = journal.append([release_record("a", 1.0, "hq"), release_record("b", 1.0, "hq")])
    second = journal.append([release_record("c", 2.0, "hq")])
    assert journal.remove_spent(lambda oid: oid in {"a", "c"}) == 1
    assert journal.segments() == [first]
    # A new segment always sorts after every one still on disk.
    assert second == "000000000002.jsonl"
    assert journal.append([release_record("d", 3.0, "hq")]) > first
    (journal.directory / first).write_bytes(b'{"kind":"release","object_id":"a"}\n{"kind"\n')
    with pytest.raises(ValueError, match=f"{first}: line 2"):
        list(journal.read(first))
    lookup = JournalLookup(journal)
    assert lookup.get("a", RELEASE) == {"kind": "release", "object_id": "a"}
    assert [(d.path.name, d.line, d.object_id) for d in lookup.damage] == [(first, 2, None)]
    lookup.close()


def test_records_are_assigned_once_per_closed_period(tmp_path: Path) -> None:
    """A period's ledger is made once it closed and delay passed; each record joins one ledger;
    a flush archives the rest at once under the next free name."""
    conn = _db(tmp_path)
    day1, day2 = T0, T0 + DAY
    _released(conn, "1" * 32, day1, day1 + 1)
    _released(conn, "2" * 32, day1, day2)  # purged the next day: the next day's ledger
    _released(conn, "3" * 32, day2, day2 + 1)
    insert_objects(conn.cursor(), [_accepted("4" * 32)], T0)  # never released
    cur = conn.cursor()
    end1 = period_end(period_of(day1, "day"))
    assert store.assign_records(cur, end1 - 1, 0.0, "day", "n", False) == []
    [first] = store.assign_records(cur, end1 + 1, 0.0, "day", "n", False)
    assert store.assign_records(cur, end1 + 1, 0.0, "day", "n", False) == []
    ledger = store.get_ledger(cur, first)
    assert ledger is not None and ledger.records == 1 and ledger.name == "n-2026-05-28"
    [second] = store.assign_records(cur, day2 + 9, 0.0, "day", "n", True, taken=["n-2026-05-29"])
    again = store.get_ledger(cur, second)
    assert again is not None and again.name == "n-2026-05-29-2" and again.records == 2
    ledger_of = dict(conn.execute("SELECT object_id, ledger_id FROM objects").fetchall())
    assert ledger_of == {"1" * 32: first, "2" * 32: second, "3" * 32: second, "4" * 32: None}


def test_written_ledger_and_archived_ids_find_every_record(tmp_path: Path) -> None:
    """The ledger file is sorted by object id with the receipts' bytes; the .ids index finds
    each id's line and released_at once a manifest exists, and nothing before."""
    conn = _db(tmp_path)
    receipts = ReceiptStore(tmp_path / "receipts")
    receipts.directory.mkdir()
    ids = sorted(hashlib.md5(str(i).encode()).hexdigest() for i in range(50))
    for n, oid in enumerate(reversed(ids)):
        _released(conn, oid, T0 + n, T0)
        (receipts.directory / f"{oid}.json").write_bytes(b'{"object_id":"%s"}' % oid.encode())
    [ledger_id] = store.assign_records(conn.cursor(), T0 + 10 * DAY, 0.0, "day", "n", True)
    ledgers = LedgerDir(tmp_path / "ledger")
    written = write_ledger(tmp_path / "delivery.sqlite", ledgers, receipts, ledger_id, "n-x")
    assert written.records == 50
    data = ledgers.ledger_path("n-x").read_bytes()
    assert len(data) == written.size and hashlib.md5(data).hexdigest() == written.md5
    lines = zstandard.ZstdDecompressor().decompressobj().decompress(data).splitlines()
    assert [json.loads(x)["object_id"] for x in lines] == ids
    assert ledgers.ids_path("n-x").stat().st_size == 24 * 50
    archived = ArchivedIds(ledgers)
    assert archived.find(ids[0]) is None  # not verified: not archived
    ledgers.write_manifest(
        Manifest("n-x", "x", 50, written.size, written.md5, written.blake3, "i", "r", "u", 1.0)
    )
    for line, oid in enumerate(ids, start=1):
        where = archived.find(oid)
        assert where is not None and where.line == line
        assert where.released_at == get_row(conn.cursor(), oid).released_at  # type: ignore[union-attr]
    assert archived.find("0" * 32) is None and archived.find("zz") is None
    batches = list(id_batches(ledgers, "n-x", lambda tail: tail, size=20))
    assert [len(b) for b in batches] == [20, 20, 10] and [i for b in batches for i in b] == ids


def test_status_of_an_archived_object(tmp_path: Path) -> None:
    """An object only a verified ledger knows answers where its record is."""
    _db(tmp_path)
    ledgers = LedgerDir(tmp_path / "ledger")
    ledgers.directory.mkdir()
    ledgers.ids_path("n-x").write_bytes(id_record("a" * 32, 5.0) + id_record("b" * 32, 6.0))
    ledgers.write_manifest(Manifest("n-x", "x", 2, 1, "m", "b", "item", "n-x.jsonl.zst", "u", 7.0))
    reader = ObjectReader(tmp_path, ObjectIds(), "https://i", ArchivedIds(ledgers))
    doc = reader.lookup("b" * 32)
    assert doc is not None
    assert doc["hq"] == {"released_at": 6.0}
    assert doc["archived"]["line"] == 2 and doc["archived"]["file"] == "n-x.jsonl.zst"
    assert reader.lookup("c" * 32) is None


# -- config ----------------------------------------------------------------------------------------

BASE: dict[str, Any] = {
    "issuer": "https://canner.test",
    "min_free_bytes": 10,
    "projects": {"example": {}},
}


def test_hq_and_ledger_config(tmp_path: Path) -> None:
    """[hq] tokens and [ledger] parse with defaults; bad values name their key."""
    config = parse_config(
        {**BASE, "hq": {"tokens": "t"}, "ledger": {"credentials": "k", "node": "n1"}}, tmp_path
    )
    assert config.hq is not None and config.hq.tokens == tmp_path / "t"
    ledger = config.ledger
    assert ledger is not None and ledger.period == "day" and ledger.delay == 7 * DAY
    assert ledger.identifier == "canner-ledger-{node}-{period}"
    bad = [
        ({"hq": {"tokens": "t", "x": 1}}, "hq.x"),
        ({"ledger": {"credentials": "k"}}, "ledger.node"),
        ({"ledger": {"credentials": "k", "node": "n", "period": "week"}}, "ledger.period"),
        ({"ledger": {"credentials": "k", "node": "n", "sink": "directory"}}, "ledger.sink"),
        ({"ledger": {"node": "n"}}, "ledger.credentials"),
        ({"ledger": {"credentials": "k", "node": "n", "delay": "1d"}}, "ledger.delay"),
    ]
    for extra, key in bad:
        with pytest.raises(ConfigError) as e:
            parse_config({**BASE, **extra}, tmp_path)
        assert e.value.key == key
    for identifier in ("canner-ledger-{node}", "-{period}", "ledger-{node}-{period}-{object_id}"):
        with pytest.raises(ConfigError) as e:
            parse_config(
                {**BASE, "ledger": {"credentials": "k", "node": "n", "identifier": identifier}},
                tmp_path,
            )
        assert e.value.key == "ledger.identifier"


def test_receiver_refuses_an_unusable_tokens_file(tmp_path: Path) -> None:
    """A missing or malformed [hq] tokens file is a config error naming hq.tokens."""
    from canner.hq.routes import hq_tokens

    config = parse_config({**BASE, "hq": {"tokens": "tokens"}}, tmp_path)
    for content in (None, "hq md5:abc\n"):
        if content is not None:
            (tmp_path / "tokens").write_text(content)
        with pytest.raises(ConfigError) as e:
            hq_tokens(config)
        assert e.value.key == "hq.tokens"
    (tmp_path / "tokens").write_text(f"hq {rel.token_digest('t')}\n")
    tokens = hq_tokens(config)
    assert tokens is not None and tokens.authenticate("t") == "hq"


def test_schema_v4_applies_on_top_of_a_v3_that_adds_its_own_tables(tmp_path: Path) -> None:
    """v4 only adds (columns, tables, indexes): it applies to a database that another v3
    (megawarc packaging, on another branch) already changed."""
    from canner.delivery.index import _migrations, _statements

    steps = dict(_migrations())
    conn = sqlite3.connect(tmp_path / "d.sqlite", isolation_level=None)
    for number in (1, 2):
        for statement in _statements(steps[number]):
            conn.execute(statement)
    conn.execute("ALTER TABLE objects ADD COLUMN package_id TEXT")
    conn.execute("CREATE TABLE packages (package_id TEXT PRIMARY KEY, state TEXT)")
    for statement in _statements(steps[4]):
        conn.execute(statement)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(objects)")}
    assert {"package_id", "released_at", "ledger_id"} <= columns
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"packages", "ledgers", "ledger_flush"} <= tables


def test_the_delivery_log_appends_to_one_open_segment_and_survives_a_torn_tail(
    tmp_path: Path,
) -> None:
    """Appends share the open segment (no file per record); a crash's torn last line is skipped
    by readers; a restarted writer opens a new segment; pruning never takes the open one."""
    journal = Journal(tmp_path / "journal")
    log = JournalLog(journal)
    log.append([{"kind": "delivery", "object_id": "a", "purged_at": 1.0}])
    log.append([{"kind": "delivery", "object_id": "b", "purged_at": 2.0}])
    [first] = journal.segments()
    assert log.open_segment == first
    with open(journal.directory / first, "ab") as f:  # a crash in the middle of an append
        f.write(b'{"kind":"delivery","object_id":"c"')
    assert [r["object_id"] for r in journal.read(first)] == ["a", "b"]
    log.close()
    again = JournalLog(journal)  # the next start
    again.append([{"kind": "delivery", "object_id": "a", "purged_at": 3.0}])
    assert journal.segments() == [first, again.open_segment]
    lookup = JournalLookup(journal)
    assert lookup.get("a", "delivery") == {"kind": "delivery", "object_id": "a", "purged_at": 3.0}
    assert lookup.get("c", "delivery") is None
    lookup.close()
    assert again.remove_spent(lambda oid: True) == 1
    assert journal.segments() == [again.open_segment]
    again.close()


def test_the_delivery_log_rotates_and_never_appends_after_a_failed_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ROTATE_AFTER records a new segment opens; a failed fdatasync abandons the segment
    (its state is unknown) and the next append goes to a new one."""
    journal = Journal(tmp_path / "journal")
    log = JournalLog(journal)
    monkeypatch.setattr(JournalLog, "ROTATE_AFTER", 2)
    for name in "abc":
        log.append([{"kind": "delivery", "object_id": name}])
    assert len(journal.segments()) == 2
    real = os.fdatasync

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError):
        log.append([{"kind": "delivery", "object_id": "d"}])
    assert log.open_segment is None
    monkeypatch.setattr(os, "fdatasync", real)
    log.append([{"kind": "delivery", "object_id": "e"}])
    assert len(journal.segments()) == 3
    assert [r["object_id"] for r in journal.read(journal.segments()[-1])] == ["e"]
    log.close()
