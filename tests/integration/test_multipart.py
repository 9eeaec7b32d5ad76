"""canner.sinks.ia.multipart: the pure part layout, XML and journal, and IAClient's multipart
delivery against the fake IA (in-process, on loopback)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted  # type: ignore[import-untyped]
from hypothesis import given
from hypothesis import strategies as st
from treq.client import HTTPClient
from twisted.internet import reactor as _reactor
from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock, deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import LogEvent, globalLogPublisher
from twisted.web.client import Agent, HTTPConnectionPool

from canner.checksum import delivery_digests
from canner.config import ConfigError
from canner.sinks.ia.client import IAClient
from canner.sinks.ia.config import MAX_PARTS, MIN_PART_SIZE
from canner.sinks.ia.credentials import Credentials
from canner.sinks.ia.multipart import (
    FileIdentity,
    FinishedPart,
    PartJournal,
    UploadRecord,
    complete_body,
    error_code,
    parse_list_parts,
    parse_upload_id,
    part_ranges,
    part_size_for,
)
from canner.sinks.plan import ItemPlan, plan_upload
from tests.fake_ia import S3_NS, FakeIA, url_of
from tests.integration.test_ia import ACCEPTED, OID, delivery

reactor: Any = _reactor
PART = MIN_PART_SIZE


# --- pure ---------------------------------------------------------------------------------------


@given(st.integers(0, 1 << 40), st.integers(MIN_PART_SIZE, 1 << 32))
def test_parts_cover_the_file_in_order_within_the_part_limit(size: int, configured: int) -> None:
    """Parts tile the file from byte 0, never more than MAX_PARTS, only the last one short."""
    part_size = part_size_for(size, configured)
    ranges = part_ranges(size, part_size)
    assert len(ranges) <= MAX_PARTS
    assert [n for n, _, _ in ranges] == list(range(1, len(ranges) + 1))
    assert sum(length for _, _, length in ranges) == size
    assert all(length == part_size for _, _, length in ranges[:-1])
    offsets = [offset for _, offset, _ in ranges]
    assert offsets == [i * part_size for i in range(len(ranges))]


def test_ia_answers_are_read_with_or_without_a_namespace() -> None:
    """UploadId, Error codes and ListParts are found whether IA namespaces its XML or not."""
    for ns in (f' xmlns="{S3_NS}"', ""):
        tag = "InitiateMultipartUploadResult"
        body = f"<{tag}{ns}><UploadId> abc </UploadId></{tag}>"
        assert parse_upload_id(body.encode()) == "abc"
        error = f"<Error{ns}><Code>NoSuchUpload</Code><Message>gone</Message></Error>"
        assert error_code(error.encode()) == "NoSuchUpload"
        listing = (
            f"<ListPartsResult{ns}><IsTruncated>true</IsTruncated>"
            "<NextPartNumberMarker>2</NextPartNumberMarker>"
            '<Part><PartNumber>1</PartNumber><ETag>"AB"</ETag><Size>5</Size></Part>'
            "<Part><PartNumber>2</PartNumber><ETag>&quot;cd&quot;</ETag><Size>6</Size></Part>"
            "</ListPartsResult>"
        )
        page = parse_list_parts(listing.encode())
        assert page is not None
        assert [(p.number, p.size, p.etag) for p in page[0]] == [(1, 5, "ab"), (2, 6, "cd")]
        assert page[1] == 2
    assert parse_upload_id(b"not xml <UploadId>x1</UploadId>") == "x1"
    assert parse_upload_id(b"<Result/>") is None
    assert error_code(b"<html>oops</html>") is None
    assert parse_list_parts(b"<Error><Code>X</Code></Error>") is None


def test_complete_request_has_no_namespace() -> None:
    """The complete request lists the parts in order, quoted ETags, no xmlns."""
    body = complete_body((FinishedPart(1, 5, "a" * 32, "e1"), FinishedPart(2, 3, "b" * 32, "")))
    assert b"xmlns" not in body
    assert body == (
        b'<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>"e1"</ETag></Part>'
        b'<Part><PartNumber>2</PartNumber><ETag>"' + b"b" * 32 + b'"</ETag></Part>'
        b"</CompleteMultipartUpload>"
    )


def test_journal_round_trips_and_replaces_durably(tmp_path: Path) -> None:
    """A saved record loads back equal; saving again replaces it; delete removes it."""
    journal = PartJournal(tmp_path / "j")
    record = UploadRecord("item-1", "a/b.warc", "UP1", PART, FileIdentity(10, "m" * 32, 1, 2))
    assert journal.load("item-1", "a/b.warc") is None
    journal.save(record)
    assert journal.load("item-1", "a/b.warc") == record
    record = record.with_part(FinishedPart(1, PART, "c" * 32, "c" * 32))
    journal.save(record)
    assert journal.load("item-1", "a/b.warc") == record
    assert journal.load("item-1", "other") is None
    assert [p.name for p in (tmp_path / "j").iterdir()] == [
        journal.path_for("item-1", "a/b.warc").name
    ]
    assert journal.delete("item-1", "a/b.warc")
    assert journal.load("item-1", "a/b.warc") is None
    journal.path_for("item-1", "x").write_bytes(b"garbage")
    assert journal.load("item-1", "x") is None


def test_a_save_cut_short_leaves_no_temp_file_behind_once_reopened(tmp_path: Path) -> None:
    """A crash in the middle of a save leaves a temp file; the journal opened at the next start
    removes it once it is old enough to be nobody's, and keeps every record."""
    journal = PartJournal(tmp_path / "j")
    record = UploadRecord("item-1", "a.warc", "UP1", PART, FileIdentity(10, "m" * 32, 1, 2))
    journal.save(record)
    left = tmp_path / "j" / ".tmp-abandoned.json-0123456789ab"
    left.write_bytes(b'{"partial')
    now = left.stat().st_mtime
    assert PartJournal.opened(tmp_path / "j", now + 60).load("item-1", "a.warc") == record
    assert left.exists(), "a temp file a minute old may be a save still running"
    reopened = PartJournal.opened(tmp_path / "j", now + 2 * 3600)
    assert not left.exists()
    assert reopened.load("item-1", "a.warc") == record


def test_part_size_below_the_s3_minimum_is_refused() -> None:
    """multipart_part_size under 5 MiB, or a non-positive threshold, is a config error."""
    from canner.config import PackagingConfig, _parse_delivery

    def parse(table: dict[str, Any]) -> Any:
        return _parse_delivery(table, "d", Path("/"), "p", PackagingConfig())

    base = {"sink": "internet_archive", "credentials": "ia.ini", "identifier": "x-{object_id}"}
    base["local_artifact_retention"] = "1h"
    ok = parse({**base, "multipart_threshold": 1 << 30})
    assert (ok.multipart_threshold, ok.multipart_part_size) == (1 << 30, 512 << 20)
    assert parse(base).multipart_threshold is None
    with pytest.raises(ConfigError, match="multipart_part_size"):
        parse({**base, "multipart_part_size": PART - 1})
    with pytest.raises(ConfigError, match="multipart_threshold"):
        parse({**base, "multipart_threshold": 0})


# --- IAClient against the fake IA -----------------------------------------------------------------


def in_thread(f: Any, *args: Any, **kwargs: Any) -> Any:
    return deferToThread(f, *args, **kwargs)


@attrs.define
class World:
    fake: FakeIA
    url: str
    tmp: Path

    def sink(self, **kwargs: Any) -> IAClient:
        pool = HTTPConnectionPool(reactor, persistent=False)
        return IAClient(
            http=HTTPClient(Agent(reactor, connectTimeout=5, pool=pool)),
            clock=reactor,
            credentials=Credentials("fake-access", "fake-secret"),
            s3_url=self.url,
            metadata_url=self.url,
            run=in_thread,
            **{
                "multipart_threshold": 1,
                "multipart_part_size": PART,
                "journal": self.journal,
                "part_retry_delay": 0.01,
                **kwargs,
            },
        )

    @property
    def journal(self) -> PartJournal:
        return PartJournal(self.tmp / "multipart")

    def artifact(self, size: int) -> tuple[ItemPlan, Path]:
        path = self.tmp / "artifact"
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        config = delivery(s3_url=self.url, metadata_url=self.url)
        plan = plan_upload(
            config, "example", OID, "big.warc.gz", ACCEPTED, size, delivery_digests(path)[1]
        )
        return plan, path

    def part_puts(self) -> list[int]:
        """Part numbers of every part PUT that reached the fake, answered or not."""
        return [
            r["part"] if "part" in r else int(r["uri"].split("partNumber=")[1].split("&")[0])
            for r in self.fake.requests
            if "part" in r or (r["method"] == "PUT" and "partNumber=" in r["uri"])
        ]

    def calls(self, method: str, marker: str) -> int:
        return sum(1 for r in self.fake.requests if r["method"] == method and marker in r["uri"])


@pytest_twisted.async_yield_fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    fake = FakeIA(tmp_path / "fake-ia", Clock())
    port = fake.listen(reactor)
    yield World(fake, url_of(port), tmp_path)
    fake.drop_connections()
    stopped = port.stopListening()
    if stopped is not None:
        await stopped
    await deferLater(reactor, 0.01, lambda: None)
    assert fake.errors == []


@pytest.fixture
def warnings() -> Any:
    events: list[LogEvent] = []

    def observe(event: LogEvent) -> None:
        if event.get("log_level") is not None and event["log_level"].name == "warn":
            events.append(event)

    globalLogPublisher.addObserver(observe)
    yield events
    globalLogPublisher.removeObserver(observe)


@pytest_twisted.ensureDeferred
async def test_a_big_file_goes_up_in_parts_with_their_md5(world: World) -> None:
    """Three parts, each with Content-MD5, then complete: IA stores the file; journal gone."""
    plan, path = world.artifact(2 * PART + 1000)
    result = await world.sink().deliver(plan, path)
    assert result.delivered, result.outcome
    stored = world.fake.object(plan.identifier, plan.remote_name)
    assert stored is not None and (stored["size"], stored["md5"]) == (plan.size, plan.content_md5)
    assert world.part_puts() == [1, 2, 3]
    assert world.fake.part_bytes[f"{plan.identifier}/{plan.remote_name}"] == plan.size
    assert result.bytes_sent == plan.size
    parts = [r for r in world.fake.requests if "partNumber=" in r["uri"]]
    assert all(len(r["headers"]["content-md5"]) == 32 for r in parts)
    assert world.calls("POST", "?uploads") == 1 and world.calls("POST", "?uploadId=") == 1
    assert stored["filemeta"] == {"canner-object-id": OID}  # the initiate carried the headers
    assert world.journal.load(plan.identifier, plan.remote_name) is None
    assert not world.fake.multipart


@pytest_twisted.ensureDeferred
async def test_a_file_under_the_threshold_is_one_put(world: World) -> None:
    """Below multipart_threshold nothing changes: one PUT."""
    plan, path = world.artifact(1000)
    result = await world.sink(multipart_threshold=None).deliver(plan, path)
    assert result.delivered
    assert world.part_puts() == [] and world.calls("POST", "?uploads") == 0


@pytest_twisted.ensureDeferred
async def test_a_part_that_fails_once_is_the_only_one_sent_again(world: World) -> None:
    """A reset in part 2 sends part 2 again, within the same attempt, and nothing else."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("reset", target="part", after_bytes=PART // 2).part = 2
    result = await world.sink().deliver(plan, path)
    assert result.delivered, result.outcome
    assert world.part_puts() == [1, 2, 2, 3]
    received = world.fake.part_bytes[f"{plan.identifier}/{plan.remote_name}"]
    assert plan.size < received <= plan.size + PART


@pytest_twisted.ensureDeferred
async def test_a_failed_attempt_resumes_at_the_first_missing_part(world: World) -> None:
    """Part 3 keeps failing: the attempt ends; the next one lists the parts and sends only 3."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("error500", count=4, target="part").part = 3
    first = await world.sink().deliver(plan, path)
    assert not first.delivered and "part 3" in first.outcome.reason
    record = world.journal.load(plan.identifier, plan.remote_name)
    assert record is not None and [p.number for p in record.parts] == [1, 2]
    second = await world.sink().deliver(plan, path)
    assert second.delivered, second.outcome
    assert world.part_puts() == [1, 2, 3, 3, 3, 3, 3]
    assert world.calls("GET", "?uploadId=") == 1  # ListParts confirmed the journal
    assert world.calls("POST", "?uploads") == 1
    stored = world.fake.object(plan.identifier, plan.remote_name)
    assert stored is not None and stored["md5"] == plan.content_md5


@pytest_twisted.ensureDeferred
async def test_an_upload_ia_forgot_starts_over_loudly(world: World, warnings: Any) -> None:
    """NoSuchUpload on a part: a new upload begins at part 1, and a warning says so."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("forget", target="part").part = 2
    result = await world.sink().deliver(plan, path)
    assert result.delivered, result.outcome
    assert world.part_puts() == [1, 2, 1, 2, 3]
    assert world.calls("POST", "?uploads") == 2
    assert any("NoSuchUpload" in e["log_format"] for e in warnings)


@pytest_twisted.ensureDeferred
async def test_a_changed_local_file_aborts_the_old_upload(world: World, warnings: Any) -> None:
    """A journal for another version of the file: the old upload is aborted, a new one sent."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("error500", count=4, target="part").part = 2
    assert not (await world.sink().deliver(plan, path)).delivered
    os.utime(path, ns=(1, 1))
    result = await world.sink().deliver(plan, path)
    assert result.delivered, result.outcome
    assert world.calls("DELETE", "?uploadId=") == 1
    assert world.calls("POST", "?uploads") == 2
    assert world.part_puts() == [1, 2, 2, 2, 2, 1, 2, 3]
    assert any("changed" in e["log_format"] for e in warnings)


@pytest_twisted.ensureDeferred
async def test_a_lost_complete_answer_finds_the_file_listed(world: World) -> None:
    """A crash after complete leaves a journal: the next attempt finds the file and drops it."""
    plan, path = world.artifact(PART + 10)
    assert (await world.sink().deliver(plan, path)).delivered
    record = UploadRecord(
        plan.identifier,
        plan.remote_name,
        "gone",
        PART,
        FileIdentity.of(path, plan.content_md5),
        completing=True,
    )
    world.journal.save(record)
    again = await world.sink().deliver(plan, path)
    assert again.delivered and again.already_present
    assert world.journal.load(plan.identifier, plan.remote_name) is None


@attrs.define
class Heard:
    """A progress callback that also listens for parts."""

    sent: int = 0
    parts_heard: list[tuple[int, int, int]] = attrs.field(factory=list)

    def __call__(self, n: int) -> None:
        self.sent += n

    def parts(self, done: int, total: int, done_bytes: int) -> None:
        self.parts_heard.append((done, total, done_bytes))


@pytest_twisted.ensureDeferred
async def test_progress_hears_parts_done_including_resumed_ones(world: World) -> None:
    """The progress callback hears parts at the start and after each part; a resumed upload
    starts from the parts already at IA, and only new bytes count as sent."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("error500", count=4, target="part").part = 3
    first = Heard()
    assert not (await world.sink().deliver(plan, path, first)).delivered
    assert first.parts_heard == [(0, 3, 0), (1, 3, PART), (2, 3, 2 * PART)]
    second = Heard()
    assert (await world.sink().deliver(plan, path, second)).delivered
    assert second.parts_heard == [(2, 3, 2 * PART), (3, 3, plan.size)]
    assert second.sent == 1000


def test_in_flight_shows_parts_and_bytes_at_ia() -> None:
    """An attempt that resumed with two parts at IA shows them, and its ETA counts only what is
    left."""
    from canner.delivery.liveness import Attempt, InFlight

    clock = Clock()
    in_flight = InFlight(clock)
    in_flight.begin(Attempt("k", "p", "f", 10 * PART, 2))
    sent: Any = in_flight.uploading("k")
    sent.parts(2, 10, 2 * PART)
    clock.advance(1)
    sent(PART // 2)
    in_flight.snapshot()
    clock.advance(1)
    sent(PART // 2)
    (shown,) = in_flight.snapshot()
    assert (shown.parts_done, shown.parts, shown.done, shown.sent) == (2, 10, 3 * PART, PART)
    assert shown.eta_s is not None and shown.rate is not None
    assert shown.eta_s == pytest.approx(7 * PART / shown.rate)


@pytest_twisted.ensureDeferred
async def test_a_slowdown_on_a_part_waits_and_sends_that_part_again(world: World) -> None:
    """503 SlowDown with Retry-After on part 1: the part is sent again after the pause."""
    plan, path = world.artifact(PART + 10)
    world.fake.add_fault("slowdown", target="part", retry_after=1).part = 1
    started = reactor.seconds()
    result = await world.sink().deliver(plan, path)
    assert result.delivered, result.outcome
    assert world.part_puts() == [1, 1, 2]
    assert reactor.seconds() - started >= 1.0


@pytest_twisted.ensureDeferred
async def test_a_cancelled_attempt_keeps_the_finished_parts(world: World) -> None:
    """Cancelling the attempt while part 2 hangs (deliver stopping) keeps part 1 journalled;
    the next attempt sends parts 2 and 3 only."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("stall", target="part", after_bytes=1).part = 2
    attempt = world.sink().deliver(plan, path)
    while not any(r.get("fault") == "stall" for r in world.fake.requests):
        await deferLater(reactor, 0.02, lambda: None)
    attempt.cancel()
    with pytest.raises(CancelledError):
        await attempt
    record = world.journal.load(plan.identifier, plan.remote_name)
    assert record is not None and [p.number for p in record.parts] == [1]
    world.fake.drop_connections()
    assert (await world.sink().deliver(plan, path)).delivered
    assert world.part_puts() == [1, 2, 2, 3]


@pytest_twisted.ensureDeferred
async def test_an_upload_gone_after_its_complete_counts_as_delivered(world: World) -> None:
    """A journal whose complete request was sent (answer lost) and an upload IA no longer knows:
    the attempt succeeds without uploading, leaving the file to verification."""
    plan, path = world.artifact(PART + 10)
    identity = FileIdentity.of(path, plan.content_md5)
    record = UploadRecord(plan.identifier, plan.remote_name, "gone", PART, identity)
    world.journal.save(attrs.evolve(record, completing=True))
    result = await world.sink().deliver(plan, path)
    assert result.delivered and not result.already_present
    assert world.part_puts() == [] and world.calls("POST", "?uploads") == 0
    assert world.journal.load(plan.identifier, plan.remote_name) is None


@pytest_twisted.ensureDeferred
async def test_a_journalled_part_ia_does_not_list_is_sent_again(world: World) -> None:
    """The journal says parts 1 and 2, ListParts shows only 1: part 2 goes again, then 3."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("error500", count=4, target="part").part = 3
    assert not (await world.sink().deliver(plan, path)).delivered
    (upload,) = world.fake.multipart.values()
    del upload["parts"][2]
    result = await world.sink().deliver(plan, path)
    assert result.delivered, result.outcome
    assert world.part_puts() == [1, 2, 3, 3, 3, 3, 2, 3]


def test_metrics_count_each_part_ia_acknowledged_not_the_resumed_ones() -> None:
    """canner_ia_parts_total grows by the parts finished in this attempt only."""
    from canner.observe import Destination, Outbound, counting_sent
    from canner.ops.metrics import DELIVER, Metrics

    metrics = Metrics(DELIVER, ["example"])
    heard = Heard()
    sent: Any = counting_sent(heard, metrics, Outbound.OBJECT, Destination.IA)
    sent.parts(2, 5, 2 * PART)
    sent(PART)
    sent.parts(3, 5, 3 * PART)
    sent.parts(4, 5, 4 * PART)
    body = metrics.render().decode()
    assert 'canner_ia_parts_total{kind="object"} 2.0' in body
    assert heard.parts_heard == [(2, 5, 2 * PART), (3, 5, 3 * PART), (4, 5, 4 * PART)]
    assert heard.sent == PART


@pytest_twisted.ensureDeferred
async def test_a_single_put_drops_the_journal_of_an_earlier_multipart_upload(world: World) -> None:
    """Multipart turned off mid-upload: the file goes as one PUT and the journal is dropped."""
    plan, path = world.artifact(2 * PART + 1000)
    world.fake.add_fault("error500", count=4, target="part").part = 2
    assert not (await world.sink().deliver(plan, path)).delivered
    assert world.journal.load(plan.identifier, plan.remote_name) is not None
    result = await world.sink(multipart_threshold=None).deliver(plan, path)
    assert result.delivered
    assert world.journal.load(plan.identifier, plan.remote_name) is None
