"""Config parsing: Go durations, key validation, and errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from canner.config import (
    ConfigError,
    ConfigErrors,
    listen_url,
    load_config,
    parse_config,
    parse_duration,
)
from canner.sinks.ia.config import READBACK_ALL

BASE: dict[str, Any] = {
    "issuer": "https://canner.test",
    "min_free_bytes": 10,
    "projects": {"example": {}},
}


def config(**overrides: Any) -> dict[str, Any]:
    return {**BASE, **overrides}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0", 0.0), ("500ms", 0.5), ("30s", 30.0), ("1h30m", 5400.0), ("1.5h", 5400.0), ("2us", 2e-6)],
)
def test_go_durations_parse_to_seconds(text: str, seconds: float) -> None:
    """Go duration strings parse to the number of seconds Go would give."""
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "1d", "-1s", "+1s", "1h 30m", "h", "1.2.3s", "1S"])
def test_malformed_durations_are_refused(text: str) -> None:
    """Anything Go would refuse (and negative durations) raises ValueError."""
    with pytest.raises(ValueError):
        parse_duration(text)


@given(st.integers(0, 10**6), st.integers(0, 59), st.integers(0, 59))
def test_composed_durations_add_up(hours: int, minutes: int, seconds: int) -> None:
    """h, m and s parts add up to their total in seconds."""
    text = f"{hours}h{minutes}m{seconds}s"
    assert parse_duration(text) == hours * 3600 + minutes * 60 + seconds


def test_defaults_fill_in_and_relative_data_dir_resolves_against_base(tmp_path: Path) -> None:
    """Optional keys take their documented defaults; a relative data_dir is resolved once."""
    parsed = parse_config(config(data_dir="data"), tmp_path)
    assert parsed.data_dir == tmp_path / "data"
    assert parsed.listen == "tcp:8080:interface=127.0.0.1"
    assert parsed.partial_upload_retention == 1800.0
    assert parsed.max_upload_bytes == 107374182400
    assert parsed.delivery_concurrency == 2
    assert set(parsed.projects) == {"example"}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"issuer": None}, "issuer"),
        ({"issuer": ""}, "issuer"),
        ({"issuer": "x" * 513}, "issuer"),
        ({"min_free_bytes": 0}, "min_free_bytes"),
        ({"min_free_bytes": -5}, "min_free_bytes"),
        ({"min_free_bytes": "100"}, "min_free_bytes"),
        ({"min_free_bytes": True}, "min_free_bytes"),
        ({"max_upload_bytes": 0}, "max_upload_bytes"),
        ({"partial_upload_retention": "30"}, "partial_upload_retention"),
        ({"partial_upload_retention": "0"}, "partial_upload_retention"),
        ({"public_url": "ftp://x"}, "public_url"),
        ({"node_prefix": "Bad!"}, "node_prefix"),
        ({"trust_forwarded_headers": "yes"}, "trust_forwarded_headers"),
        ({"projects": {}}, "projects"),
        ({"projects": {"bad id!": {}}}, "projects.bad id!"),
        ({"projects": {"p": {"colour": 1}}}, "projects.p.colour"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_config_names_the_key(overrides: dict[str, Any], key: str, tmp_path: Path) -> None:
    """Every invalid or unknown key is refused with an error naming it."""
    raw = config(**overrides)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, tmp_path)
    assert caught.value.key == key
    assert repr(key) in str(caught.value)


def test_issuer_limit_counts_bytes_not_characters(tmp_path: Path) -> None:
    """The 512-byte issuer limit is in UTF-8 bytes."""
    with pytest.raises(ConfigError):
        parse_config(config(issuer="é" * 257), tmp_path)
    assert parse_config(config(issuer="é" * 256), tmp_path).issuer == "é" * 256


def _delivery(**overrides: Any) -> dict[str, Any]:
    table = {
        "sink": "internet_archive",
        "credentials": "ia.ini",
        "identifier": "example-{object_id}",
        "local_artifact_retention": "24h",
        **overrides,
    }
    return {k: v for k, v in table.items() if v is not None}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"local_artifact_retention": None}, "projects.p.delivery.local_artifact_retention"),
        ({"local_artifact_retention": "500ms"}, "projects.p.delivery.local_artifact_retention"),
        ({"sink": "s3"}, "projects.p.delivery.sink"),
        ({"identifier": None}, "projects.p.delivery.identifier"),
        ({"s3_url": "nope"}, "projects.p.delivery.s3_url"),
        ({"metadata": {"title": 3}}, "projects.p.delivery.metadata.title"),
        ({"extra": 1}, "projects.p.delivery.extra"),
        ({"verify_timeout": "500ms"}, "projects.p.delivery.verify_timeout"),
        ({"verify_timeout": "6 hours"}, "projects.p.delivery.verify_timeout"),
        ({"verify_timeout": 3600}, "projects.p.delivery.verify_timeout"),
        ({"readback_bytes": -1}, "projects.p.delivery.readback_bytes"),
        ({"readback_bytes": "64KiB"}, "projects.p.delivery.readback_bytes"),
        ({"readback_bytes": "ALL"}, "projects.p.delivery.readback_bytes"),
        ({"readback_bytes": "whole"}, "projects.p.delivery.readback_bytes"),
        ({"readback_bytes": True}, "projects.p.delivery.readback_bytes"),
        ({"readback_bytes": (64 << 20) + 1}, "projects.p.delivery.readback_bytes"),
        ({"download_url": "archive.org"}, "projects.p.delivery.download_url"),
        (
            {"sink": "directory", "credentials": None, "path": "/srv", "readback_bytes": 0},
            "projects.p.delivery.readback_bytes",
        ),
    ],
)
def test_bad_delivery_tables_name_the_key(
    overrides: dict[str, Any], key: str, tmp_path: Path
) -> None:
    """The delivery table is validated key by key, retention at least 1s."""
    with pytest.raises(ConfigError) as caught:
        parse_config(config(projects={"p": {"delivery": _delivery(**overrides)}}), tmp_path)
    assert caught.value.key == key


def test_delivery_table_parses_with_defaults(tmp_path: Path) -> None:
    """Delivery defaults point at the real IA; metadata values become tuples."""
    raw = config(projects={"p": {"delivery": _delivery(metadata={"mediatype": "web"})}})
    delivery = parse_config(raw, tmp_path).projects["p"].delivery
    assert delivery is not None
    assert delivery.s3_url == "https://s3.us.archive.org"
    assert delivery.metadata_url == "https://archive.org"
    assert delivery.remote_name == "{filename}"
    assert delivery.local_artifact_retention == 86400.0
    assert delivery.credentials == tmp_path / "ia.ini"
    assert delivery.metadata == {"mediatype": ("web",)}
    assert delivery.verify_timeout == 6 * 3600.0
    assert delivery.readback_bytes == 3 * 64 * 1024
    assert delivery.download_url == "https://archive.org"


def test_download_url_follows_metadata_url_unless_set(tmp_path: Path) -> None:
    """A test or mirror setup that moves metadata_url moves downloads with it by default."""
    raw = config(projects={"p": {"delivery": _delivery(metadata_url="http://127.0.0.1:9")}})
    delivery = parse_config(raw, tmp_path).projects["p"].delivery
    assert delivery is not None and delivery.download_url == "http://127.0.0.1:9"
    raw = config(
        projects={
            "p": {
                "delivery": _delivery(
                    download_url="https://dl.example", verify_timeout="90m", readback_bytes=0
                )
            }
        }
    )
    delivery = parse_config(raw, tmp_path).projects["p"].delivery
    assert delivery is not None
    assert (delivery.download_url, delivery.verify_timeout, delivery.readback_bytes) == (
        "https://dl.example",
        5400.0,
        0,
    )


@pytest.mark.parametrize("value", ["all", 0, 196608, 64 << 20])
def test_readback_bytes_is_a_byte_count_or_all(tmp_path: Path, value: int | str) -> None:
    """readback_bytes is a byte count (0 to 64 MiB) or "all" (the whole file), kept as written
    so the resolved config shows it as the file says."""
    raw = config(projects={"p": {"delivery": _delivery(readback_bytes=value)}})
    delivery = parse_config(raw, tmp_path).projects["p"].delivery
    assert delivery is not None and delivery.readback_bytes == value
    assert (delivery.readback_bytes == READBACK_ALL) is (value == "all")


def test_load_config_reports_unreadable_and_invalid_files(tmp_path: Path) -> None:
    """A missing file or broken TOML is a ConfigError, not a traceback."""
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("issuer = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_example_configs_load_once_the_placeholder_issuer_is_set(tmp_path: Path) -> None:
    """The shipped example is refused for its placeholder issuer alone; the dev config is valid."""
    root = Path(__file__).resolve().parents[2]
    example = (root / "conf" / "canner.example.toml").read_text(encoding="utf-8")
    shipped = tmp_path / "canner.toml"
    shipped.write_text(example, encoding="utf-8")
    with pytest.raises(ConfigError, match="is still the placeholder") as refused:
        load_config(shipped)
    assert refused.value.key == "issuer"
    edited = example.replace('issuer = "https://canner.example"', 'issuer = "https://node.test"')
    shipped.write_text(edited, encoding="utf-8")
    assert load_config(shipped).issuer == "https://node.test"
    dev = load_config(root / "conf" / "canner.dev.toml")
    assert dev.data_dir == root / "run" / "data"


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("tcp:8080:interface=127.0.0.1", "http://127.0.0.1:8080/"),
        ("tcp:80", "http://localhost:80/"),
        ("tcp6:8080:interface=\\:\\:1", "http://[::1]:8080/"),
        ("unix:/run/canner.sock", None),
    ],
)
def test_listen_url_is_what_dev_run_prints(listen: str, url: str | None) -> None:
    assert listen_url(listen) == url


def test_a_misspelt_required_key_is_reported_once(tmp_path: Path) -> None:
    """A typo of a required key is one line, the unknown key naming the key it meant: no second
    "required" line for the key that is then missing (two typos, two lines)."""
    raw = {
        "issuer": "https://canner.test",
        "min_free_byte": 10,
        "projects": {"example": {"delivery": {"sinc": "directory", "path": "/srv"}}},
        "delivery_concurrency": 0,
    }
    with pytest.raises(ConfigErrors) as caught:
        parse_config(raw, tmp_path)
    assert [str(e) for e in caught.value.errors] == [
        "config key 'min_free_byte': unknown key (did you mean 'min_free_bytes'?)",
        "config key 'projects.example.delivery.sinc': unknown key (did you mean 'sink'?)",
        "config key 'delivery_concurrency': must be positive, not 0",
    ]


def test_a_required_key_missing_without_a_typo_is_still_required(tmp_path: Path) -> None:
    """Only the key an unknown key names is spared its "required" line: an unknown key that
    names another key leaves a missing one reported."""
    raw = {"issuer": "https://canner.test", "acces_log": True, "projects": {"example": {}}}
    raw["connections"] = {"min_free_bytes": 1}
    with pytest.raises(ConfigErrors) as caught:
        parse_config(raw, tmp_path)
    assert [str(e) for e in caught.value.errors] == [
        "config key 'acces_log': unknown key (did you mean 'access_log'?)",
        "config key 'connections.min_free_bytes': unknown key",
        "config key 'min_free_bytes': required",
    ]


DURATION_EXAMPLES = [
    "0",
    "20s",
    "500ms",
    "1h30m",
    "1.5h",
    ".5s",
    "1.s",
    "2us",
    "3\u00b5s",
    "4\u03bcs",
    "7ns",
    "1h2m3s4ms5us6ns",
    "100000h",
    "0s",
    "0.0s",
    # refused by both
    "",
    "1d",
    "-1s",
    "+1s",
    "1h 30m",
    " 1s",
    "1s ",
    "h",
    "1.2.3s",
    "1S",
    "s1",
    "1hh",
    "0x10s",
    "..s",
]


@pytest.mark.parametrize("text", DURATION_EXAMPLES)
def test_canner_upload_reads_durations_as_the_config_does(text: str) -> None:
    """canner-upload's own duration parser (the client depends on nothing of canner's) gives
    what the config's gives, or refuses what it refuses."""
    from canner_client.cli import parse_duration as client_duration

    try:
        expected: float | None = parse_duration(text)
    except ValueError:
        expected = None
    try:
        got: float | None = client_duration(text)
    except ValueError:
        got = None
    assert got == expected
