"""Space promised to uploads in flight: the admission rule (pure), the live account, and the
in-memory receiver that refuses a creation free space cannot cover (tus and PUT alike),
releases promises on acceptance, discard and sweep, and rebuilds them from ``uploads/``."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from treq.testing import StubTreq
from twisted.internet.task import Clock

from canner.blocking import run_inline
from canner.cli.inspect import _status_text
from canner.daemon.site import ReceiverRoutes
from canner.ids import ObjectIds
from canner.ops.inventory import survey_json, take_survey
from canner.ops.metrics import RECEIVER, Metrics, SurveyCache, SurveyCollector
from canner.ops.problems import RecentProblems
from canner.ops.readiness import FloorWatch, check_readiness
from canner.ops.status_page import StatusSource, StatusView, render_status
from canner.store.journal import Journal
from canner.store.promises import Promises, overpromised
from canner.store.receipts import ReceiptStore
from canner.store.sweep import StaleSweep
from canner.store.uploads import UploadStore
from tests.fakes import SyncIndex, succeeded
from tests.unit.receiver_harness import InMemoryReceiver, blake3_hex

FLOOR = 1_000_000
SIZE = 10_000
DATA = [bytes([i]) * SIZE for i in range(3)]


# -- the rule ----------------------------------------------------------------------------------


def test_a_creation_is_admitted_while_free_space_covers_every_promise() -> None:
    """Free minus promised minus the new size at the floor is admitted; one byte less is not."""
    assert overpromised(FLOOR + 300, 200, 2, 100, FLOOR) is None
    refusal = overpromised(FLOOR + 299, 200, 2, 100, FLOOR)
    assert refusal is not None
    assert "200 bytes are promised to 2 uploads" in refusal.describe()


@given(
    free=st.integers(0, 10**13),
    promised=st.integers(0, 10**13),
    size=st.integers(1, 10**12),
    floor=st.integers(1, 10**12),
)
def test_the_rule_is_free_minus_promises_against_the_floor(
    free: int, promised: int, size: int, floor: int
) -> None:
    """Refused exactly when free - promised - size < floor."""
    refused = overpromised(free, promised, 1, size, floor) is not None
    assert refused == (free - promised - size < floor)


def test_the_account_counts_what_each_upload_still_lacks() -> None:
    """Promised = declared sizes minus bytes stored; a release ends one promise."""
    promises = Promises()
    assert promises.admit("a", 100, FLOOR + 1000, FLOOR) is None
    assert promises.admit("b", 300, FLOOR + 1000, FLOOR) is None
    promises.stored("a", 40)
    assert promises.total == 360 and promises.uploads == 2
    refusal = promises.admit("c", 641, FLOOR + 1000, FLOOR)
    assert refusal is not None and refusal.promised_bytes == 360
    assert promises.uploads == 2, "a refused creation promised something"
    promises.release("b")
    promises.stored("gone", 10)  # an upload holding no promise changes nothing
    assert promises.total == 60 and promises.uploads == 1
    promises.hold("b", 300, 100)  # appended to again after a restart
    assert promises.total == 260


# One change to the account: (kind, upload, size, stored or offset).
CHANGES = st.lists(
    st.tuples(
        st.sampled_from(["admit", "hold", "stored", "release", "release_all"]),
        st.sampled_from("abcd"),
        st.integers(0, 500),
        st.integers(0, 700),  # an offset past the size too: that owes nothing, never less
    ),
    max_size=40,
)


@given(
    start=st.dictionaries(
        st.sampled_from("abcd"), st.tuples(st.integers(0, 500), st.integers(0, 700))
    ),
    changes=CHANGES,
)
def test_the_running_total_is_the_sum_of_what_each_upload_owes_after_every_change(
    start: dict[str, tuple[int, int]], changes: list[tuple[str, str, int, int]]
) -> None:
    """The total an admission compares with free space is kept as uploads change, not summed
    at each creation: after every kind of change, from any account rebuilt at start, it equals
    the sum of each open upload's size minus its stored bytes (never below 0), and a creation
    is refused exactly by the rule applied to that sum."""
    promises = Promises(dict(start))
    for kind, upload_id, size, offset in changes:
        expected = sum(max(s - stored, 0) for s, stored in promises._open.values())
        if kind == "admit":
            refusal = promises.admit(upload_id, size, FLOOR + 1000, FLOOR)
            assert (refusal is None) == (FLOOR + 1000 - expected - size >= FLOOR)
            assert refusal is None or refusal.promised_bytes == expected
        elif kind == "hold":
            promises.hold(upload_id, size, offset)
        elif kind == "stored":
            promises.stored(upload_id, offset)
        elif kind == "release":
            promises.release(upload_id)
        else:
            promises.release_all([upload_id, "never open"])
        assert promises.total == sum(max(s - stored, 0) for s, stored in promises._open.values())


# -- the receiver ------------------------------------------------------------------------------


def receiver(data_dir: Path, free: int) -> InMemoryReceiver:
    """An in-memory receiver whose data filesystem always has ``free`` bytes available."""
    rcv = InMemoryReceiver.build(data_dir, min_free_bytes=FLOOR)
    rcv.intake.free_space = lambda path: free
    rcv.release(rcv.io)
    rcv.release(rcv.hashing)
    return rcv


def test_the_third_upload_that_would_overrun_free_space_is_refused_at_creation(
    tmp_path: Path,
) -> None:
    """Room for two promises: the third creation gets 503, Retry-After and the reason; the
    first two finish, and their acceptance frees room again."""
    rcv = receiver(tmp_path, FLOOR + 2 * SIZE + SIZE // 2)
    first, second = rcv.new_upload(DATA[0]), rcv.new_upload(DATA[1])
    assert rcv.intake.promises.total == 2 * SIZE
    refused = rcv.create(SIZE, blake3_hex(DATA[2]))
    assert refused.status == 503
    assert refused.header("Retry-After") == "60"
    assert b"promised to 2 uploads in flight" in refused.body
    assert len(rcv.upload_entries()) == 4, "a refused creation left files"
    # Half of the first arrives: it still owes the other half.
    assert rcv.patch(first, 0, DATA[0][: SIZE // 2]).status == 204
    assert rcv.intake.promises.total == 2 * SIZE - SIZE // 2
    for oid, data, offset in ((first, DATA[0], SIZE // 2), (second, DATA[1], 0)):
        done = rcv.patch(oid, offset, data[offset:])
        assert done.status == 204, done.body
        rcv.verify_receipt(done.header("Artifact-Receipt"), oid, data)
    assert rcv.intake.promises.total == 0 and rcv.intake.promises.uploads == 0
    assert rcv.create(SIZE, blake3_hex(DATA[2])).status == 201


def test_a_put_is_promised_its_content_length(tmp_path: Path) -> None:
    """A PUT counts like a tus creation: refused 503 before its body when free space is
    promised, and its promise ends when it is accepted or cut short."""
    rcv = receiver(tmp_path, FLOOR + SIZE + SIZE // 2)
    first = rcv.new_upload(DATA[0])
    refused = rcv.exchange("PUT", "/seesaw/example/alice/one.warc.gz", (), DATA[1])
    assert refused.status == 503 and refused.header("Retry-After") == "60"
    assert b"insufficient storage for a new upload" in refused.body
    assert rcv.patch(first, 0, DATA[0]).status == 204
    connection = rcv.connect()
    connection.send_head(
        "PUT", "/seesaw/example/alice/two.warc.gz", [("Content-Length", str(SIZE))]
    )
    connection.send(DATA[1][:100])
    assert rcv.intake.promises.total == SIZE - 100
    connection.close()
    assert rcv.intake.promises.total == 0, "a PUT cut short kept its promise"
    put = rcv.exchange("PUT", "/seesaw/example/alice/three.warc.gz", (), DATA[2])
    assert put.status == 201 and rcv.intake.promises.total == 0


def test_promises_are_rebuilt_from_uploads_at_start(tmp_path: Path) -> None:
    """A new receiver over the same data directory owes what the uploads there still lack,
    so the creation that the first one would have refused is refused again."""
    rcv = receiver(tmp_path, FLOOR + 2 * SIZE)
    accepted = rcv.new_upload(DATA[2])
    assert rcv.patch(accepted, 0, DATA[2]).status == 204
    first = rcv.new_upload(DATA[0])
    rcv.new_upload(DATA[1])
    assert rcv.patch(first, 0, DATA[0][:1000]).status == 204
    restarted = receiver(tmp_path, FLOOR + 2 * SIZE)
    assert restarted.intake.promises.total == 2 * SIZE - 1000
    assert restarted.create(1001, blake3_hex(b"x" * 1001)).status == 503
    assert restarted.create(1000, blake3_hex(b"x" * 1000)).status == 201
    # The half-sent upload resumes (appends are never refused for promises) and completes.
    done = restarted.patch(first, 1000, DATA[0][1000:])
    assert done.status == 204
    assert restarted.intake.promises.total == SIZE + 1000


def test_the_sweep_releases_the_promises_of_the_uploads_it_removes(tmp_path: Path) -> None:
    """An abandoned upload swept after the retention is owed nothing more."""
    rcv = receiver(tmp_path, FLOOR + 2 * SIZE)
    rcv.new_upload(DATA[0])
    clock = Clock()
    clock.advance(rcv.clock.seconds() + 3600)
    sweep = StaleSweep(
        uploads=UploadStore(tmp_path / "uploads"),
        receipts=ReceiptStore(tmp_path / "receipts"),
        journal=Journal(tmp_path / "journal"),
        ids=rcv.config.object_ids,
        retention=60.0,
        run=run_inline,
        clock=clock,
        observer=rcv.metrics,
        promises=rcv.intake.promises,
    )
    # The upload's files carry the real time: sweep as if long after it.
    clock.advance(10**10)
    succeeded(sweep.sweep())
    assert rcv.upload_entries() == set()
    assert rcv.intake.promises.total == 0


# -- readiness and the survey -----------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    for sub in ("uploads", "receipts"):
        (tmp_path / sub).mkdir()
    SyncIndex(tmp_path / "delivery.sqlite").close()
    return tmp_path


def test_readyz_names_free_space_promised_to_uploads_in_flight(data_dir: Path) -> None:
    """With more promised than is free, /readyz answers 503 with the promises as its reason."""
    promises = Promises()
    promises.hold("a", 10**18, 0)
    routes = ReceiverRoutes(
        ReceiptStore(data_dir / "receipts"),
        ObjectIds(),
        data_dir,
        run_inline,
        Metrics(RECEIVER),
        StatusSource(
            run=run_inline,
            take=lambda now: take_survey(data_dir, ObjectIds(), now),
            clock=Clock(),
            problems=RecentProblems(),
            issuer="i",
            min_free_bytes=1,
        ),
        partial(check_readiness, data_dir, 1, FloorWatch(1), promises),
    )
    response = succeeded(StubTreq(routes.app.resource()).get("http://localhost/readyz"))
    doc = json.loads(succeeded(response.content()))
    assert response.code == 503
    assert doc["promised_bytes"] == 10**18
    assert any("promised to uploads in flight" in r for r in doc["reasons"])
    promises.release("a")
    response = succeeded(StubTreq(routes.app.resource()).get("http://localhost/readyz"))
    assert response.code == 200


def test_the_survey_counts_promises_as_the_receiver_does(tmp_path: Path) -> None:
    """canner status, the status page and the metrics gauge show the rebuilt total."""
    rcv = receiver(tmp_path, FLOOR + 3 * SIZE)
    first = rcv.new_upload(DATA[0])
    rcv.new_upload(DATA[1])
    assert rcv.patch(first, 0, DATA[0][:1234]).status == 204
    survey = take_survey(tmp_path, rcv.config.object_ids, rcv.clock.seconds())
    assert survey.promised_bytes == rcv.intake.promises.total == 2 * SIZE - 1234
    rebuilt = Promises.from_disk(
        UploadStore(tmp_path / "uploads"), ReceiptStore(tmp_path / "receipts"), ObjectIds()
    )
    assert rebuilt.total == survey.promised_bytes
    promised = 2 * SIZE - 1234
    page = render_status(StatusView("i", survey, FLOOR, ())).decode()
    assert f'data-field="promised_bytes"><b>{promised:,}</b>' in page
    doc = survey_json(survey, FLOOR)
    assert doc["promised_bytes"] == promised
    assert f"promised         18.3 KiB ({promised} bytes)" in _status_text(doc, rcv.config)
    metrics = Metrics(RECEIVER)
    cache = SurveyCache(run_inline, lambda now: survey, rcv.clock)
    succeeded(cache.refresh())
    metrics.register(SurveyCollector(cache, FLOOR))
    assert metrics.registry.get_sample_value("canner_promised_bytes") == promised
