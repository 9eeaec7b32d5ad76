"""The read-back before a purge: range choice (pure), and IAClient/IASink against the
fake IA on a loopback socket (redirect to the datanode, Range, altered bytes, refusals)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import pytest_twisted  # type: ignore[import-untyped]
from hypothesis import given
from hypothesis import strategies as st
from treq.client import HTTPClient
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.iweb import IResponse

from canner.blocking import run_inline
from canner.checksum import delivery_digests
from canner.sinks.base import RemoteCheck
from canner.sinks.ia.client import IAClient
from canner.sinks.ia.config import READBACK_ALL, IADelivery
from canner.sinks.ia.credentials import Credentials
from canner.sinks.ia.readback import ReadBack, choose_ranges, parse_content_range
from canner.sinks.ia.sink import IASink
from canner.sinks.plan import ItemPlan, plan_upload
from canner.sinks.transport import StreamedBody, read_digest
from tests.fake_ia import FakeIA, url_of
from tests.fakes import succeeded

reactor: Any = _reactor

OID = "0123456789abcdef0123456789abcdef"
ACCEPTED = 1784764800
KiB = 1024


@given(st.integers(1, 1 << 40), st.integers(0, 1 << 26), st.floats(0, 0.999999))
def test_ranges_stay_inside_the_file_and_the_budget(size: int, budget: int, r: float) -> None:
    """At most 3 ranges, inside the file, within the budget; the whole file when it fits."""
    ranges = choose_ranges(size, budget, lambda: r)
    if budget == 0:
        assert ranges == []
    elif size <= budget:
        assert ranges == [(0, size - 1)]
    else:
        assert 1 <= len(ranges) <= 3
        assert sum(last - first + 1 for first, last in ranges) <= budget
        assert all(0 <= first <= last < size for first, last in ranges)


def test_ranges_spread_over_the_file() -> None:
    """Three draws give three ranges of budget/3 bytes at the drawn positions."""
    draws = iter([0.0, 0.5, 0.999999])
    ranges = choose_ranges(10 * 1 << 20, 3 * 64 * KiB, lambda: next(draws))
    assert [last - first + 1 for first, last in ranges] == [64 * KiB] * 3
    assert ranges[0][0] == 0 and ranges[1][0] == int(0.5 * ((10 << 20) - 64 * KiB + 1))
    assert (10 << 20) - 20 <= ranges[-1][1] < 10 << 20


def test_content_range_parsing() -> None:
    assert parse_content_range("bytes 0-9/100") == (0, 9, 100)
    assert parse_content_range("bytes 5-9/*") == (5, 9, None)
    assert parse_content_range("bytes */100") is None
    assert parse_content_range(None) is None


@attrs.define
class World:
    fake: FakeIA
    url: str
    tmp: Path
    clock: Clock

    def sink(self, **kwargs: Any) -> IAClient:
        pool = HTTPConnectionPool(reactor, persistent=False)
        http = HTTPClient(Agent(reactor, connectTimeout=5, pool=pool))
        creds = Credentials("fake-access", "fake-secret")
        return IAClient(
            http=http,
            clock=reactor,
            credentials=creds,
            s3_url=self.url,
            metadata_url=self.url,
            run=run_inline,
            **kwargs,
        )

    def delivery(self, **changes: Any) -> IADelivery:
        base = IADelivery(
            sink="internet_archive",
            credentials=Path("/nonexistent"),
            identifier="example-{object_id}",
            remote_name="{filename}",
            local_artifact_retention=60.0,
            s3_url=self.url,
            metadata_url=self.url,
            download_url=self.url,
        )
        return attrs.evolve(base, **changes)

    async def delivered(self, size: int) -> tuple[ItemPlan, Path]:
        path = self.tmp / "payload"
        path.write_bytes(os.urandom(size))
        _, md5, _ = delivery_digests(path)
        plan = plan_upload(self.delivery(), "example", OID, "a.warc", ACCEPTED, size, md5)
        assert (await self.sink().deliver(plan, path)).delivered
        return plan, path

    def downloads(self) -> list[dict[str, Any]]:
        return [
            r for r in self.fake.requests if "/download/" in r["uri"] or "/datanode/" in r["uri"]
        ]


@pytest_twisted.async_yield_fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    clock = Clock()
    fake = FakeIA(tmp_path / "fake-ia", clock)
    port = fake.listen(reactor)
    yield World(fake, url_of(port), tmp_path, clock)
    fake.drop_connections()
    stopped = port.stopListening()
    if stopped is not None:
        await stopped
    await deferLater(reactor, 0.01, lambda: None)
    assert fake.errors == []


@pytest_twisted.ensureDeferred
async def test_read_back_follows_the_redirect_and_asks_for_ranges(world: World) -> None:
    """Three 64 KiB ranges of a 1 MiB file, each through /download/ and its 302 to the datanode,
    with a Range header and no credentials; the bytes match."""
    plan, path = await world.delivered(1 << 20)
    result = await world.sink().read_back(
        plan.identifier, plan.remote_name, path, 1 << 20, 3 * 64 * KiB
    )
    assert result == ReadBack(True)
    served = [r for r in world.downloads() if "/datanode/" in r["uri"]]
    assert len(served) == 3 and all(r["status"] == 206 for r in served)
    assert len([r for r in world.downloads() if "/download/" in r["uri"]]) == 3
    for r in served:
        first, last = (int(x) for x in r["headers"]["range"].removeprefix("bytes=").split("-"))
        assert last - first + 1 == 64 * KiB
        assert r["auth"] is None


@pytest_twisted.ensureDeferred
async def test_altered_bytes_are_a_mismatch_naming_the_offsets(world: World) -> None:
    """IA serving other bytes under intact metadata: a mismatch with the ranges' offsets."""
    plan, path = await world.delivered(300 * KiB)
    world.fake.add_fault("altered", count=3)
    draws = iter([0.0, 0.5, 0.9])
    sink = world.sink(random=lambda: next(draws))
    result = await sink.read_back(plan.identifier, plan.remote_name, path, 300 * KiB, 3 * KiB)
    assert not result.ok and result.mismatch
    assert "offsets 0-1023, 153088-154111, 275559-276582 " in result.detail


@pytest_twisted.ensureDeferred
async def test_small_files_are_read_back_whole(world: World) -> None:
    """A file within the budget is fetched in one range covering all of it."""
    plan, path = await world.delivered(1000)
    assert (await world.sink().read_back(plan.identifier, plan.remote_name, path, 1000, 3000)).ok
    (served,) = [r for r in world.downloads() if "/datanode/" in r["uri"]]
    assert served["headers"]["range"] == "bytes=0-999"


@pytest.mark.parametrize(
    ("kind", "operator"), [("forbidden", True), ("error500", False)], ids=["403", "500"]
)
@pytest_twisted.ensureDeferred
async def test_refused_or_failed_downloads_are_no_mismatch(
    world: World, kind: str, operator: bool
) -> None:
    """403 needs an operator (an access-restricted item; a project's verify names
    readback_bytes = 0 as the way out); a 500 is retried later; neither says the bytes differ."""
    plan, path = await world.delivered(1000)
    world.fake.add_fault(kind, target="download")
    result = await world.sink().read_back(plan.identifier, plan.remote_name, path, 1000, 3000)
    assert not result.ok and not result.mismatch and result.needs_operator is operator
    if operator:
        assert "access-restricted" in result.detail
        project = IASink(world.delivery().readback_bytes, world.sink())
        world.fake.add_fault(kind, target="download")
        check = await project.verify(plan, path)
        assert not check.verified and check.needs_operator and not check.bad_copy
        assert "set readback_bytes = 0" in check.detail


@pytest_twisted.ensureDeferred
async def test_a_network_failure_is_transient(world: World) -> None:
    """Nothing listening at the download URL: a transient failure, not a mismatch."""
    plan, path = await world.delivered(1000)
    sink = world.sink(download_url="http://127.0.0.1:9")
    result = await sink.read_back(plan.identifier, plan.remote_name, path, 1000, 3000)
    assert not result.ok and not result.mismatch and not result.needs_operator
    assert "read-back of bytes 0-999" in result.detail


@pytest_twisted.ensureDeferred
async def test_verify_reads_back_before_calling_a_copy_verified(world: World) -> None:
    """verify(): metadata and read-back agree -> verified; altered bytes -> flagged bad copy
    with offsets; readback_bytes = 0 -> the metadata alone, no download."""
    plan, path = await world.delivered(2000)
    project = IASink(world.delivery().readback_bytes, world.sink())
    assert await project.verify(plan, path) == RemoteCheck(True)
    world.fake.add_fault("altered", count=10)
    check = await project.verify(plan, path)
    assert not check.verified and check.needs_operator and check.bad_copy
    assert "offsets 0-1999" in check.detail and "payload is kept" in check.detail
    before = len(world.downloads())
    metadata_only = IASink(world.delivery(readback_bytes=0).readback_bytes, world.sink())
    assert await metadata_only.verify(plan, path) == RemoteCheck(True)
    assert len(world.downloads()) == before


@pytest_twisted.ensureDeferred
async def test_a_forced_delivery_uploads_although_listed(world: World) -> None:
    """After a read-back mismatch (force_upload) the delivery PUTs again instead of trusting
    the matching metadata; without it, nothing is sent."""
    plan, path = await world.delivered(2000)
    project = IASink(world.delivery().readback_bytes, world.sink())
    await project.deliver(plan, path, lambda n: None)
    assert world.fake.object(plan.identifier, plan.remote_name)["puts"] == 1  # type: ignore[index]
    await project.deliver(plan, path, lambda n: None, overwrite=True)
    stored = world.fake.object(plan.identifier, plan.remote_name)
    assert stored is not None and (stored["puts"], stored["stores"]) == (2, 2)


# -- readback_bytes = "all": the whole file, streamed, its MD5 compared -----------------------


def middle_missed() -> Callable[[], float]:
    """Draws that put three 64 KiB ranges of a 4 MB file well away from its middle byte."""
    return iter([0.1, 0.3, 0.8]).__next__


@pytest_twisted.ensureDeferred
async def test_whole_file_read_back_streams_through_the_redirect(world: World) -> None:
    """ "all" downloads the whole file in one GET (redirected to the datanode, no Range, no
    credentials) and compares its MD5 and size with the local copy's."""
    plan, _path = await world.delivered(4_000_000)
    result = await world.sink().read_back_all(
        plan.identifier, plan.remote_name, plan.size, plan.content_md5
    )
    assert result == ReadBack(True)
    (served,) = [r for r in world.downloads() if "/datanode/" in r["uri"]]
    assert served["status"] == 200 and "range" not in served["headers"]
    assert served["auth"] is None
    assert len([r for r in world.downloads() if "/download/" in r["uri"]]) == 1


@pytest_twisted.ensureDeferred
async def test_whole_file_read_back_keeps_pace_with_a_slower_hash(world: World) -> None:
    """Over a real connection, with 64 KiB batches whose hash answers only on a later reactor
    turn (as a thread would), the download pauses and resumes and the digest still matches."""
    plan, _path = await world.delivered(4_000_000)
    batches: list[int] = []

    def later(f: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Deferred[Any]:
        batches.append(sum(len(chunk) for chunk in args[1]))
        return deferLater(reactor, 0.001, f, *args, **kwargs)

    sink = IAClient(
        http=world.sink()._http,
        clock=reactor,
        credentials=Credentials("a", "s"),
        s3_url=world.url,
        metadata_url=world.url,
        run=later,
        digest_batch=64 * KiB,
    )
    result = await sink.read_back_all(
        plan.identifier, plan.remote_name, plan.size, plan.content_md5
    )
    assert result == ReadBack(True)
    assert sum(batches) == 4_000_000 and len(batches) > 10


@pytest_twisted.ensureDeferred
async def test_one_flipped_byte_is_caught_by_all_and_missed_by_sampling(world: World) -> None:
    """IA serving a 4 MB file with its middle byte flipped (listing intact): the default three
    64 KiB samples away from it verify the copy, while readback_bytes = "all" flags it as a bad
    copy (payload kept, not purged) naming both MD5s."""
    plan, path = await world.delivered(4_000_000)
    world.fake.add_fault("flip_byte", count=10)
    sampled = IASink(world.delivery().readback_bytes, world.sink(random=middle_missed()))
    assert await sampled.verify(plan, path) == RemoteCheck(True)
    whole = IASink(world.delivery(readback_bytes=READBACK_ALL).readback_bytes, world.sink())
    check = await whole.verify(plan, path)
    assert not check.verified and check.needs_operator and check.bad_copy
    assert f"the local copy's is {plan.content_md5}" in check.detail
    assert "payload is kept" in check.detail
    world.fake.clear_faults()
    assert await whole.verify(plan, path) == RemoteCheck(True)


@pytest_twisted.ensureDeferred
async def test_whole_file_of_another_size_or_md5_is_a_mismatch(world: World) -> None:
    """A file whose length is not the receipt's (Content-Length) or whose MD5 differs is a
    mismatch, not a failure to retry."""
    plan, _path = await world.delivered(3000)
    sink = world.sink()
    longer = await sink.read_back_all(plan.identifier, plan.remote_name, 2999, plan.content_md5)
    assert not longer.ok and longer.mismatch
    assert "IA serves a 3000-byte file, its receipt says 2999" in longer.detail
    other = await sink.read_back_all(plan.identifier, plan.remote_name, 3000, "0" * 32)
    assert not other.ok and other.mismatch and "MD5" in other.detail


@pytest.mark.parametrize(
    ("kind", "operator"), [("forbidden", True), ("error500", False)], ids=["403", "500"]
)
@pytest_twisted.ensureDeferred
async def test_refused_or_failed_whole_downloads_are_no_mismatch(
    world: World, kind: str, operator: bool
) -> None:
    """As for ranges: 403 needs an operator, a 500 is retried later, neither is a mismatch."""
    plan, _path = await world.delivered(1000)
    world.fake.add_fault(kind, target="download")
    result = await world.sink().read_back_all(
        plan.identifier, plan.remote_name, 1000, plan.content_md5
    )
    assert not result.ok and not result.mismatch and result.needs_operator is operator
    assert "read-back of the whole file" in result.detail


def failed(d: Deferred[Any]) -> Failure:
    """The failure of a Deferred that must already have failed."""
    results: list[Any] = []
    d.addBoth(results.append)
    assert results and isinstance(results[0], Failure), results
    return results[0]


@attrs.define
class Body:
    """Just enough of an IResponse to hand a body to a protocol over a StringTransport."""

    transport: StringTransport = attrs.field(factory=StringTransport)
    protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)


@attrs.define
class HeldRunner:
    """A BlockingRunner whose jobs wait until the test runs them, to see the backpressure."""

    jobs: list[tuple[Deferred[Any], Callable[[], Any]]] = attrs.field(factory=list)

    def __call__(self, f: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.jobs.append((d, lambda: f(*args, **kwargs)))
        return d

    def run_one(self) -> None:
        d, job = self.jobs.pop(0)
        d.callback(job())


def test_digest_hashes_in_batches_and_pauses_while_behind() -> None:
    """Bytes are hashed a batch per job, one job at a time; when the next batch is full before
    the hash is done the download pauses, and resumes once it is; the digest is the body's MD5."""
    clock, runner, body = Clock(), HeldRunner(), Body()
    chunks = [os.urandom(1000) for _ in range(10)]
    d = read_digest(
        cast(IResponse, body), limit=10_000, run=runner, clock=clock, idle=30, batch=3000
    )
    for chunk in chunks[:3]:
        body.protocol.dataReceived(chunk)
    assert len(runner.jobs) == 1 and body.transport.producerState == "producing"
    for chunk in chunks[3:6]:
        body.protocol.dataReceived(chunk)
    assert len(runner.jobs) == 1 and body.transport.producerState == "paused"
    runner.run_one()  # the first batch hashed: the second one goes, reading resumes
    assert len(runner.jobs) == 1 and body.transport.producerState == "producing"
    for chunk in chunks[6:]:
        body.protocol.dataReceived(chunk)
    body.protocol.connectionLost(Failure(ResponseDone()))
    assert not d.called
    while runner.jobs:
        runner.run_one()
    digest = succeeded(d)
    assert digest == StreamedBody(hashlib.md5(b"".join(chunks)).hexdigest(), 10_000)
    assert clock.getDelayedCalls() == []


def test_digest_gives_up_without_progress_and_stops_past_the_limit() -> None:
    """No byte for ``idle`` seconds fails with TimeoutError and closes the connection; a body
    longer than ``limit`` is cut off there."""
    clock, body = Clock(), Body()
    d = read_digest(cast(IResponse, body), limit=100, run=run_inline, clock=clock, idle=30)
    body.protocol.dataReceived(b"x" * 50)
    clock.advance(29)
    body.protocol.dataReceived(b"x" * 10)
    clock.advance(29)
    assert not d.called
    clock.advance(1)
    failure = failed(d)
    assert failure.check(TimeoutError) and body.transport.producerState == "stopped"
    body = Body()
    d = read_digest(cast(IResponse, body), limit=100, run=run_inline, clock=clock, idle=30)
    body.protocol.dataReceived(b"x" * 101)
    assert succeeded(d) == StreamedBody("", 101, cut=True)
    assert body.transport.producerState == "stopped" and clock.getDelayedCalls() == []


def test_a_broken_off_body_fails() -> None:
    """The connection lost mid-body (not ResponseDone) fails the read: a transient error."""
    clock, body = Clock(), Body()
    d = read_digest(cast(IResponse, body), limit=100, run=run_inline, clock=clock, idle=30)
    body.protocol.dataReceived(b"x" * 10)
    body.protocol.connectionLost(Failure(ConnectionLost()))
    assert failed(d).check(ConnectionLost) and clock.getDelayedCalls() == []
