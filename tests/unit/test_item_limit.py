"""``max_item_bytes``: a plan that would push an IA item past it is refused at planning, for
identity items and megawarc packages alike, and the row is flagged for an operator without
anything being sent."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import attrs
import pytest

from canner.config import ConfigError, parse_config
from canner.delivery.objects import planner
from canner.sinks.directory import DirectoryDelivery
from canner.sinks.plan import ItemTooBig, plan_package_file, plan_upload
from tests.integration.test_ia import ACCEPTED, OID, delivery
from tests.packaging_support import warc_bytes
from tests.unit.test_config import _delivery, config
from tests.unit.test_object_delivery import Harness
from tests.unit.test_packaging import Harness as PackagingHarness

MD5 = hashlib.md5(b"").hexdigest()


def parsed(tmp_path: Path, **overrides: Any) -> Any:
    raw = config(projects={"p": {"delivery": _delivery(**overrides)}})
    delivery_config = parse_config(raw, tmp_path).projects["p"].delivery
    assert delivery_config is not None
    return delivery_config


def test_max_item_bytes_defaults_to_one_terabyte_and_takes_sizes(tmp_path: Path) -> None:
    """Default 10**12; an integer or a size string; anything else names the key; only for IA."""
    assert parsed(tmp_path).max_item_bytes == 10**12
    assert parsed(tmp_path, max_item_bytes="900GiB").max_item_bytes == 900 << 30
    assert parsed(tmp_path, max_item_bytes=5000).max_item_bytes == 5000
    for bad in (0, -1, "lots", True):
        with pytest.raises(ConfigError) as caught:
            parsed(tmp_path, max_item_bytes=bad)
        assert caught.value.key == "projects.p.delivery.max_item_bytes"
    with pytest.raises(ConfigError) as caught:
        parsed(tmp_path, sink="directory", credentials=None, path=".", max_item_bytes=5)
    assert caught.value.key == "projects.p.delivery.max_item_bytes"


def test_an_object_bigger_than_an_item_may_be_is_refused_at_planning() -> None:
    """An identity item holds its object: over max_item_bytes is ItemTooBig, at it is planned."""
    config = delivery(max_item_bytes=1000)
    assert plan_upload(config, "example", OID, "a", ACCEPTED, 1000, MD5).size_hint == 1000
    with pytest.raises(ItemTooBig, match=r"would hold 1001 bytes, more than max_item_bytes"):
        plan_upload(config, "example", OID, "a", ACCEPTED, 1001, MD5)


def test_a_package_whose_files_would_overfill_its_item_is_refused_at_planning() -> None:
    """A package's item holds all its files: their sum counts, not the one file planned."""
    config = delivery(identifier="example-{package}", remote_name="{package}", max_item_bytes=1000)
    package = "0" * 32

    def plan(item_bytes: int) -> Any:
        return plan_package_file(
            config, "example", package, "20260723000000", ".megawarc.json.gz", 10, MD5, item_bytes
        )

    assert plan(1000).size_hint == 1000
    with pytest.raises(ItemTooBig, match=r"example-0+ would hold 1001 bytes"):
        plan(1001)


def test_a_directory_sink_has_no_item_limit() -> None:
    """Only IA has items: a directory destination plans any size."""
    ia = delivery(max_item_bytes=10)
    config = DirectoryDelivery(
        sink="directory",
        identifier=ia.identifier,
        remote_name=ia.remote_name,
        local_artifact_retention=ia.local_artifact_retention,
        path="/srv",
    )
    assert plan_upload(config, "example", OID, "a", ACCEPTED, 11, MD5).size == 11


def test_a_row_over_the_limit_is_flagged_and_never_sent(tmp_path: Path) -> None:
    """The objects' planner refuses the row: needs_operator with the reason, no attempt
    reaches the sink."""
    h = Harness(tmp_path)
    h.owner._planner = planner({"example": delivery(max_item_bytes=5)})
    [oid] = h.accept(1, data=b"more than five bytes")
    h.tick()
    assert h.sink.pending == {}, "the sink was asked to send it"
    row = h.row(oid)
    assert row.state == "retry_wait" and row.needs_operator == 1
    assert "more than max_item_bytes (5)" in (row.last_error or "")
    h.index.close()


def test_a_package_over_the_limit_is_flagged_and_none_of_its_files_sent(tmp_path: Path) -> None:
    """The package's owner plans every file of a package before sending one: a package
    bigger than max_item_bytes is flagged with the reason and IA gets nothing."""
    h = PackagingHarness(tmp_path, target="1GB", max_wait="1s")
    project = h.projects["example"]
    assert project.delivery is not None
    limited = attrs.evolve(project.delivery, max_item_bytes=1000)
    h.projects = {"example": attrs.evolve(project, delivery=limited)}
    h.index.close()
    h.open_index()
    for i in range(3):
        h.accept(warc_bytes(i))
    h.tick()
    (row,) = h.packages()
    assert row.state == "verified", "the package was not built"
    assert row.delivery_state != "delivered" and row.needs_operator == 1
    assert "more than max_item_bytes (1000)" in (row.last_error or "")
    assert h.items.puts == []
    h.index.close()
