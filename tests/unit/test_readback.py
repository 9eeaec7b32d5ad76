"""The read-back before a purge: range choice (pure), and IASink/IADeliverySink against the
fake IA on a loopback socket (redirect to the datanode, Range, altered bytes, refusals)."""

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
from twisted.internet.task import Clock, deferLater
from twisted.web.client import Agent, HTTPConnectionPool

from canner.blocking import run_inline
from canner.checksum import delivery_digests
from canner.config import DeliveryConfig
from canner.sinks.base import RemoteCheck
from canner.sinks.credentials import Credentials
from canner.sinks.internet_archive import IADeliverySink, IASink
from canner.sinks.plan import ItemPlan, plan_upload
from canner.sinks.readback import ReadBack, choose_ranges, parse_content_range
from tests.fake_ia import FakeIA, url_of

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

    def sink(self, **kwargs: Any) -> IASink:
        pool = HTTPConnectionPool(reactor, persistent=False)
        http = HTTPClient(Agent(reactor, connectTimeout=5, pool=pool))
        creds = Credentials("fake-access", "fake-secret")
        return IASink(http, reactor, creds, self.url, self.url, run_inline, **kwargs)

    def delivery(self, **changes: Any) -> DeliveryConfig:
        base = DeliveryConfig(
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
    """403 needs an operator (an access-restricted item); a 500 is retried later; neither says
    the bytes differ."""
    plan, path = await world.delivered(1000)
    world.fake.add_fault(kind, target="download")
    result = await world.sink().read_back(plan.identifier, plan.remote_name, path, 1000, 3000)
    assert not result.ok and not result.mismatch and result.needs_operator is operator
    if operator:
        assert "readback_bytes = 0" in result.detail


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
    project = IADeliverySink(world.delivery(), world.sink())
    assert await project.verify(plan, path) == RemoteCheck(True)
    world.fake.add_fault("altered", count=10)
    check = await project.verify(plan, path)
    assert not check.verified and check.needs_operator and check.bad_copy
    assert "offsets 0-1999" in check.detail and "payload is kept" in check.detail
    before = len(world.downloads())
    metadata_only = IADeliverySink(world.delivery(readback_bytes=0), world.sink())
    assert await metadata_only.verify(plan, path) == RemoteCheck(True)
    assert len(world.downloads()) == before


@pytest_twisted.ensureDeferred
async def test_a_forced_delivery_uploads_although_listed(world: World) -> None:
    """After a read-back mismatch (force_upload) the delivery PUTs again instead of trusting
    the matching metadata; without it, nothing is sent."""
    plan, path = await world.delivered(2000)
    project = IADeliverySink(world.delivery(), world.sink())
    await project.deliver(plan, path, lambda n: None)
    assert world.fake.object(plan.identifier, plan.remote_name)["puts"] == 1  # type: ignore[index]
    await project.deliver(plan, path, lambda n: None, overwrite=True)
    stored = world.fake.object(plan.identifier, plan.remote_name)
    assert stored is not None and (stored["puts"], stored["stores"]) == (2, 2)
