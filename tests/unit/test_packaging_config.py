"""Packaging settings: sizes, modes, and the templates a megawarc project may use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from canner.cli.check import delivery_example
from canner.config import ConfigError, parse_config, parse_size
from canner.sinks.ia.config import validate_delivery
from canner.sinks.plan import PlanError, plan_package_file

DELIVERY: dict[str, Any] = {
    "sink": "internet_archive",
    "credentials": "ia.ini",
    "identifier": "example-{batch_date}-{package}",
    "local_artifact_retention": "1h",
}


def config(packaging: dict[str, Any] | None, **delivery: Any) -> dict[str, Any]:
    project: dict[str, Any] = {"delivery": {**DELIVERY, **delivery}}
    if packaging is not None:
        project["packaging"] = packaging
    return {"issuer": "https://c.test", "min_free_bytes": 1, "projects": {"example": project}}


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (1, 1),
        ("50GB", 50 * 10**9),
        ("2GiB", 2 << 30),
        ("10 MiB", 10 << 20),
        ("7", 7),
        ("3KB", 3000),
    ],
)
def test_sizes_accept_decimal_and_binary_suffixes(text: Any, size: int) -> None:
    """Sizes are integers or strings with a GB (10^9) or GiB (2^30) style suffix."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "1.5GB", "-1", 0, True, "1gb", "5 XB", 1.0])
def test_malformed_sizes_are_refused(text: Any) -> None:
    """Anything but a positive whole number of bytes with a known suffix raises ValueError."""
    with pytest.raises(ValueError):
        parse_size(text)


def test_identity_is_the_default_and_megawarc_parses(tmp_path: Path) -> None:
    """Without a packaging table a project is identity; megawarc keeps its sizes and wait."""
    plain = parse_config(config(None, identifier="x-{object_id}"), tmp_path)
    assert plain.projects["example"].packaging.mode == "identity"
    assert plain.packaging_concurrency == 1
    assert plain.packages_path == plain.data_dir / "packages"
    packed = parse_config(
        config({"mode": "megawarc", "target_bytes": "2GiB", "max_wait": "2h"}), tmp_path
    )
    packaging = packed.projects["example"].packaging
    assert (packaging.megawarc, packaging.target_bytes, packaging.max_wait) == (True, 2 << 30, 7200)
    assert packaging.zstd_dictionary_url is None
    url = "https://dicts.example/api/dictionary"
    with_api = parse_config(config({"mode": "megawarc", "zstd_dictionary_url": url}), tmp_path)
    assert with_api.projects["example"].packaging.zstd_dictionary_url == url
    # A megawarc item's basename defaults to the package id.
    assert packed.projects["example"].delivery is not None
    assert packed.projects["example"].delivery.remote_name == "{package}"


@pytest.mark.parametrize(
    ("packaging", "delivery", "key"),
    [
        ({"mode": "tar"}, {}, "projects.example.packaging.mode"),
        (
            {"mode": "megawarc", "target_bytes": "lots"},
            {},
            "projects.example.packaging.target_bytes",
        ),
        ({"mode": "megawarc", "max_wait": "1d"}, {}, "projects.example.packaging.max_wait"),
        ({"mode": "megawarc", "colour": 1}, {}, "projects.example.packaging.colour"),
        (
            {"mode": "megawarc"},
            {"identifier": "example-fixed-item"},
            "projects.example.delivery.identifier",
        ),
        (
            {"mode": "megawarc"},
            {"identifier": "example-{package}-{object_id}"},
            "projects.example.delivery.identifier",
        ),
        (
            {"mode": "megawarc"},
            {"remote_name": "{filename}"},
            "projects.example.delivery.remote_name",
        ),
        ({"mode": "identity"}, {}, "projects.example.delivery.identifier"),
        (
            {"mode": "megawarc", "zstd_dictionary_url": "ftp://dicts.example/"},
            {},
            "projects.example.packaging.zstd_dictionary_url",
        ),
        (
            {"mode": "megawarc", "zstd_dictionary_url": 7},
            {},
            "projects.example.packaging.zstd_dictionary_url",
        ),
        (
            {"zstd_dictionary_url": "https://dicts.example/api"},
            {"identifier": "x-{object_id}"},
            "projects.example.packaging.zstd_dictionary_url",
        ),
    ],
)
def test_bad_packaging_refuses_to_load_naming_the_key(
    tmp_path: Path, packaging: dict[str, Any], delivery: dict[str, Any], key: str
) -> None:
    """Bad packaging settings, or templates that could put two batches (or one object) into
    the wrong item, refuse the config naming the key."""
    with pytest.raises(ConfigError) as caught:
        parse_config(config(packaging, **delivery), tmp_path)
    assert caught.value.key == key


def test_top_level_packaging_keys(tmp_path: Path) -> None:
    """packages_dir resolves against the config's directory; the pool size must be positive."""
    raw = config({"mode": "megawarc"})
    parsed = parse_config({**raw, "packages_dir": "pk", "packaging_concurrency": 3}, tmp_path)
    assert (parsed.packages_path, parsed.packaging_concurrency) == (tmp_path / "pk", 3)
    with pytest.raises(ConfigError) as caught:
        parse_config({**raw, "packaging_concurrency": 0}, tmp_path)
    assert caught.value.key == "packaging_concurrency"


def test_package_files_plan_into_one_item(tmp_path: Path) -> None:
    """Every file of a package goes to the item named from {package}/{batch_date}, under the
    basename the remote_name template gives, with the item's metadata expanded."""
    raw = config(
        {"mode": "megawarc"},
        remote_name="{project}-{batch_date}",
        metadata={"title": ["Batch {batch_date} ({package})"]},
    )
    delivery = parse_config(raw, tmp_path).projects["example"].delivery
    assert delivery is not None
    validate_delivery("example", delivery, "megawarc")
    plan = plan_package_file(
        delivery, "example", "ab" * 16, "20260101000000", ".megawarc.warc.gz", 10, "0" * 32
    )
    assert plan.identifier == "example-20260101000000-" + "ab" * 16
    assert plan.remote_name == "example-20260101000000.megawarc.warc.gz"
    title = "uri(Batch%2020260101000000%20%28" + "ab" * 16 + "%29)"
    assert ("x-archive-meta-title", title) in plan.headers
    with pytest.raises(PlanError):
        plan_package_file(delivery, "example", "p", "d", ".x", 1, "not-md5")


def test_megawarc_metadata_may_not_name_one_object(tmp_path: Path) -> None:
    """An item of many objects has no single {object_id} for its metadata."""
    raw = config({"mode": "megawarc"}, metadata={"title": ["Object {object_id}"]})
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, tmp_path)
    assert caught.value.key == "projects.example.delivery.metadata.title"


def test_check_config_shows_where_a_package_would_go(tmp_path: Path) -> None:
    """canner check-config's example for a megawarc project names a package's item and file."""
    raw = config({"mode": "megawarc"})
    parsed = parse_config(raw, tmp_path)
    example = delivery_example(parsed, "example", 1_800_000_000)
    assert example is not None
    assert example["identifier"] == f"example-20270115080000-{example['package']}"
    assert example["remote_name"] == f"{example['package']}.megawarc.warc.gz"
