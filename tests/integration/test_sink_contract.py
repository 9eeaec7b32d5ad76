"""The Sink contract (canner.sinks.base): the fake sink, the directory sink and the IA sink against
the fake IA on loopback, through the same assertions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import pytest_twisted  # type: ignore[import-untyped]
from twisted.internet.task import Clock

from canner.blocking import run_inline
from canner.delivery.objects import plan_row
from canner.observe import Destination
from canner.sinks.base import Delivered, DeliveryFailed, Sink
from canner.sinks.directory import DirectorySink
from canner.sinks.ia.sink import IASink
from canner.sinks.plan import ItemPlan
from tests.fakes import FakeSink
from tests.integration import test_ia
from tests.integration.test_directory_sink import delivery as directory_delivery
from tests.integration.test_directory_sink import row_for
from tests.integration.test_ia import World
from tests.integration.test_ia import delivery as ia_delivery

# test_ia's fixture: a fake IA listening on loopback (the IA sink's destination; the other sinks
# ignore it).
world = test_ia.world

SINKS = ["fake", "directory", "internet_archive"]
# Enough for several chunks of the IA sink's body producer and of its read-back.
SIZE = (3 << 20) + 17


@attrs.define
class Subject:
    """One sink under the contract, a file planned for it, and a way to cut its destination off."""

    sink: Sink
    plan: ItemPlan
    path: Path
    # The same destination made unreachable (the sink to call afterwards).
    unreachable: Callable[[], Sink]


def make_subject(kind: str, world: World, tmp_path: Path) -> Subject:
    path = tmp_path / "payload"
    path.write_bytes(bytes(range(256)) * (SIZE // 256) + b"x" * (SIZE % 256))
    config = ia_delivery(s3_url=world.url, metadata_url=world.url)
    plan = plan_row(config, row_for(path))
    if kind == "fake":
        fake = FakeSink(answers=True)

        def cut_fake() -> Sink:
            fake.reachable = False
            return fake

        return Subject(fake, plan, path, cut_fake)
    if kind == "directory":
        root = tmp_path / "example"
        root.mkdir()
        table = directory_delivery(str(tmp_path / "{project}"))
        directory = DirectorySink.for_delivery("example", table, run_inline, run_inline, Clock())

        def cut_directory() -> Sink:
            root.rmdir()  # an unmounted NAS, whose mount point is gone
            return directory

        return Subject(directory, plan, path, cut_directory)
    assert kind == "internet_archive"
    readback = config.readback_bytes

    def cut_ia() -> Sink:
        return IASink(readback, world.sink(url="http://127.0.0.1:1"))

    return Subject(IASink(readback, world.sink()), plan, path, cut_ia)


async def deliver(sink: Sink, plan: ItemPlan, path: Path) -> tuple[Delivered, list[int]]:
    heard: list[int] = []
    delivered = await sink.deliver(plan, path, heard.append)
    return delivered, heard


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind", SINKS)
async def test_a_delivered_file_is_at_its_plans_place_and_verifies(
    kind: str, world: World, tmp_path: Path
) -> None:
    """deliver() fires with the plan's identifier and remote name, having reported every payload
    byte; verify() then finds the file there with its size and checksum."""
    s = make_subject(kind, world, tmp_path)
    delivered, heard = await deliver(s.sink, s.plan, s.path)
    assert delivered == Delivered(s.plan.identifier, s.plan.remote_name)
    assert sum(heard) == s.plan.size
    assert isinstance(s.sink.destination, Destination)
    check = await s.sink.verify(s.plan, s.path)
    assert check.verified and not check.absent and not check.bad_copy, check.detail


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind", SINKS)
async def test_delivering_the_same_plan_again_finds_it_sent(
    kind: str, world: World, tmp_path: Path
) -> None:
    """A second deliver() of a delivered plan fires with the same place, and the copy still
    verifies (a retry after a lost answer must not fail or damage it)."""
    s = make_subject(kind, world, tmp_path)
    first, _ = await deliver(s.sink, s.plan, s.path)
    second, _ = await deliver(s.sink, s.plan, s.path)
    assert second == first
    assert (await s.sink.verify(s.plan, s.path)).verified


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind", SINKS)
async def test_a_file_never_delivered_is_absent(kind: str, world: World, tmp_path: Path) -> None:
    """verify() of a plan nothing was sent to says the destination does not hold it."""
    s = make_subject(kind, world, tmp_path)
    check = await s.sink.verify(s.plan, s.path)
    assert not check.verified and check.absent


# How each failure is classified: True when retrying alone will not fix it.
FAILURES = {"missing_payload": True, "unreachable": False}


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("kind", SINKS)
async def test_a_failed_attempt_says_whether_an_operator_must_act(
    kind: str, failure: str, world: World, tmp_path: Path
) -> None:
    """A payload gone from disk fails with DeliveryFailed that needs an operator; a destination
    that cannot be reached fails with one that a retry may fix."""
    s = make_subject(kind, world, tmp_path)
    if failure == "missing_payload":
        s.path.unlink()
        sink = s.sink
    else:
        sink = s.unreachable()
    with pytest.raises(DeliveryFailed) as caught:
        await sink.deliver(s.plan, s.path, lambda n: None)
    assert caught.value.needs_operator is FAILURES[failure], caught.value.reason
