"""A sink is one module and one registry entry: a test-only sink, registered here and nowhere
else, is a sink a config may name, and an object of a project that uses it is delivered (over a
real SQLite file and the outbound service) and verified."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import blake3
import pytest
from attrs import define, frozen
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from canner.blocking import run_inline
from canner.config import (
    ConfigError,
    DeliveryContext,
    DeliveryTable,
    ProjectConfig,
    SinkTable,
    known_keys,
    parse_config,
    string_key,
)
from canner.delivery import index as sql
from canner.delivery.index import AcceptedObject
from canner.delivery.objects import ObjectOwner, planner
from canner.delivery.outbound_service import OutboundService, lanes_of
from canner.observe import Destination
from canner.sinks import registry
from canner.sinks.base import Delivered, RemoteCheck, Sink
from canner.sinks.plan import ItemPlan
from canner.store.journal import Journal, JournalLog
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore
from tests.fakes import SyncIndex

# --- the test-only sink: its table, its sink, its entry ---------------------------------------


@frozen(kw_only=True)
class ShelfDelivery(DeliveryTable):
    """``sink = "shelf"``: objects kept in memory on a named shelf."""

    shelf: str


def parse_shelf(raw: Mapping[str, Any], where: DeliveryContext) -> ShelfDelivery:
    return ShelfDelivery(**where.common, shelf=string_key(raw, "shelf", where.name + ".shelf"))


def check_shelf(delivery: DeliveryTable, where: DeliveryContext) -> None:
    assert isinstance(delivery, ShelfDelivery)
    if not delivery.shelf:
        raise ConfigError(where.name + ".shelf", "must not be empty")


@define(eq=False)
class ShelfSink:
    """Delivers at once: each file's bytes land on ``shelves[shelf]`` under its plan's place."""

    destination: ClassVar[Destination] = Destination.DIRECTORY

    shelf: str
    shelves: dict[str, dict[tuple[str, str], bytes]]

    def deliver(
        self, plan: ItemPlan, path: Path, progress: Any, *, overwrite: bool = False
    ) -> Deferred[Delivered]:
        data = path.read_bytes()
        self.shelves.setdefault(self.shelf, {})[plan.identifier, plan.remote_name] = data
        progress(len(data))
        return succeed(Delivered(plan.identifier, plan.remote_name))

    def verify(self, plan: ItemPlan, path: Path) -> Deferred[RemoteCheck]:
        there = self.shelves.get(self.shelf, {}).get((plan.identifier, plan.remote_name))
        return succeed(RemoteCheck(there == path.read_bytes(), absent=there is None))


SHELVES: dict[str, dict[tuple[str, str], bytes]] = {}


def shelf_sink(project_id: str, project: ProjectConfig, env: registry.SinkEnv) -> Sink:
    assert isinstance(project.delivery, ShelfDelivery)
    return ShelfSink(project.delivery.shelf, SHELVES)


SHELF = registry.SinkEntry(
    SinkTable(name="shelf", keys=frozenset({"shelf"}), parse=parse_shelf, check=check_shelf),
    shelf_sink,
)


@pytest.fixture
def shelf() -> Iterator[dict[str, dict[tuple[str, str], bytes]]]:
    registry.register(SHELF)
    SHELVES.clear()
    yield SHELVES
    registry.unregister("shelf")


# --- the tests ------------------------------------------------------------------------------


def raw_config(delivery: dict[str, Any]) -> dict[str, Any]:
    table = {"identifier": "item-{object_id}", "local_artifact_retention": "1h", **delivery}
    return {
        "issuer": "https://canner.test",
        "min_free_bytes": 10,
        "projects": {"example": {"delivery": table}},
    }


def test_a_registered_sink_is_one_a_config_may_name(shelf: Any, tmp_path: Path) -> None:
    """Its table parses to its own type with the common keys; its keys are known; its check,
    its required keys and the template rules of every sink name the key; other sinks' keys are
    refused in its table, and its keys in theirs."""
    config = parse_config(raw_config({"sink": "shelf", "shelf": "top"}), tmp_path)
    delivery = config.projects["example"].delivery
    assert isinstance(delivery, ShelfDelivery)
    assert (delivery.shelf, delivery.remote_name, delivery.verify_timeout) == (
        "top",
        "{filename}",
        6 * 3600.0,
    )
    assert "shelf" in known_keys("projects.<id>.delivery")
    for table, key in (
        ({"sink": "shelf"}, "projects.example.delivery.shelf"),
        ({"sink": "shelf", "shelf": ""}, "projects.example.delivery.shelf"),
        ({"sink": "shelf", "shelf": "a", "path": "/srv"}, "projects.example.delivery.path"),
        (
            {"sink": "shelf", "shelf": "a", "identifier": "x"},
            "projects.example.delivery.identifier",
        ),
    ):
        with pytest.raises(ConfigError) as caught:
            parse_config(raw_config(table), tmp_path)
        assert caught.value.key == key
    with pytest.raises(ConfigError) as caught:
        parse_config(raw_config({"sink": "internet_archive", "shelf": "a"}), tmp_path)
    assert caught.value.key == "projects.example.delivery.shelf"


def test_an_unregistered_sink_is_unknown(tmp_path: Path) -> None:
    """Without its entry, the sink's name is refused like any unknown one."""
    with pytest.raises(ConfigError) as caught:
        parse_config(raw_config({"sink": "shelf"}), tmp_path)
    assert caught.value.key == "projects.example.delivery.sink"
    assert "known: directory, internet_archive" in caught.value.problem


def test_an_object_of_a_project_on_the_sink_is_delivered_and_verified(
    shelf: dict[str, dict[tuple[str, str], bytes]], tmp_path: Path
) -> None:
    """The daemon's path: project_sinks builds the sink from the registry, the objects' planner
    plans by the project's table, the outbound service delivers, then verifies."""
    config = parse_config(raw_config({"sink": "shelf", "shelf": "top"}), tmp_path)
    clock = Clock()
    clock.advance(1_000_000)
    sinks = registry.project_sinks(config, clock, run_inline, run_inline)
    assert isinstance(sinks["example"], ShelfSink)
    deliveries = {pid: p.delivery for pid, p in config.projects.items() if p.delivery}
    for name in ("uploads", "receipts"):
        (tmp_path / name).mkdir()
    uploads = UploadStore(tmp_path / "uploads")
    index = SyncIndex(tmp_path / "delivery.sqlite")
    owner = ObjectOwner(
        index=index,
        uploads=uploads,
        receipts=ReceiptStore(tmp_path / "receipts"),
        journal=JournalLog(Journal(tmp_path / "journal")),
        sinks=sinks,
        planner=planner(deliveries),
        retention={"example": 3600.0},
        run=run_inline,
        hash=run_inline,
        clock=clock,
        verify_timeouts={"example": 7200.0},
    )
    service = OutboundService(
        index=index, owners=lanes_of([owner]), clock=clock, concurrency=1, random=lambda: 0.0
    )
    oid, data = "0" * 32, b"a payload"
    uploads.data_path(oid).write_bytes(data)
    uploads.info_path(oid).write_bytes(b"{}")
    checksum = "blake3:" + blake3.blake3(data).hexdigest()
    obj = AcceptedObject(oid, "example", "a.warc", len(data), checksum, 1_000_000)
    index.run(sql.insert_objects, [obj], clock.seconds())
    try:
        service.tick()
        row = index.run(sql.get_row, oid).result
        assert row is not None and row.state == "delivered"
        assert shelf["top"] == {(f"item-{oid}", "a.warc"): data}
        clock.advance(60)
        service.tick()
        row = index.run(sql.get_row, oid).result
        assert row is not None and row.verified_at is not None
    finally:
        index.close()
