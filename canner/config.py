"""The configuration tree shared by both daemons.

``parse_config(mapping, base_dir)`` is pure: it turns the TOML mapping of DESIGN.md §8 into a
frozen :class:`Config` or raises :class:`ConfigError` naming the key and the problem.
``load_config(path)`` reads the file.  Everything after this module trusts the values it returns.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from attrs import field, frozen

from canner.ids import ObjectIds, validate_node_prefix

PROJECT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ISSUER_MAX_BYTES = 512

_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


class ConfigError(ValueError):
    """The configuration is unusable; ``str()`` names the key and the problem."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key {key!r}: {problem}")
        self.key = key
        self.problem = problem


def parse_duration(text: str) -> float:
    """Parse a Go duration string (``"1h30m"``, ``"500ms"``, ``"0"``) into seconds.

    Raises ``ValueError`` for anything Go's ``time.ParseDuration`` would refuse, and for negative
    durations, which no canner setting accepts.
    """
    if not isinstance(text, str):
        raise ValueError('a duration must be a string such as "30m" or "1h30m"')
    if text == "0":
        return 0.0
    if text.startswith(("-", "+")):
        raise ValueError(f"{text!r}: a duration must not be signed")
    pos, total = 0, 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None:
            raise ValueError(f'{text!r} is not a Go duration (such as "30s" or "1h30m")')
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos == 0:
        raise ValueError(f'{text!r} is not a Go duration (such as "30s" or "1h30m")')
    return total


@frozen
class DeliveryConfig:
    """``[projects.<id>.delivery]``: where and how a project's artifacts go."""

    sink: str
    credentials: Path
    identifier: str
    remote_name: str
    local_artifact_retention: float
    s3_url: str
    metadata_url: str
    metadata: Mapping[str, tuple[str, ...]] = field(factory=dict)


@frozen
class ProjectConfig:
    """``[projects.<id>]``: a project workers may upload for."""

    project_id: str
    delivery: DeliveryConfig | None = None


@frozen
class Config:
    """The whole validated configuration."""

    issuer: str
    data_dir: Path
    listen: str
    public_url: str | None
    max_upload_bytes: int
    min_free_bytes: int
    partial_upload_retention: float
    delivery_concurrency: int
    node_prefix: str
    trust_forwarded_headers: bool
    projects: Mapping[str, ProjectConfig]

    @property
    def object_ids(self) -> ObjectIds:
        return ObjectIds(self.node_prefix)


_TOP_KEYS = {
    "issuer",
    "data_dir",
    "listen",
    "public_url",
    "max_upload_bytes",
    "min_free_bytes",
    "partial_upload_retention",
    "delivery_concurrency",
    "node_prefix",
    "trust_forwarded_headers",
    "projects",
}
_DELIVERY_KEYS = {
    "sink",
    "credentials",
    "identifier",
    "remote_name",
    "local_artifact_retention",
    "s3_url",
    "metadata_url",
    "metadata",
}
_SINKS = {"internet_archive"}


def _unknown(keys: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    for key in keys:
        if key not in allowed:
            raise ConfigError(prefix + key, "unknown key")


def _positive_int(mapping: Mapping[str, Any], key: str, default: int | None, name: str) -> int:
    value = mapping.get(key, default)
    if value is None:
        raise ConfigError(name, "required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, not {value!r}")
    if value <= 0:
        raise ConfigError(name, f"must be positive, not {value}")
    return value


def _string(mapping: Mapping[str, Any], key: str, name: str, default: str | None = None) -> str:
    value = mapping.get(key, default)
    if value is None:
        raise ConfigError(name, "required")
    if not isinstance(value, str):
        raise ConfigError(name, f"must be a string, not {value!r}")
    return value


def _duration(mapping: Mapping[str, Any], key: str, name: str, default: str | None) -> float:
    value = mapping.get(key, default)
    if value is None:
        raise ConfigError(name, "required")
    try:
        return parse_duration(value)
    except ValueError as e:
        raise ConfigError(name, str(e)) from None


def _http_url(value: str, name: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(name, f"must be an absolute http(s) URL, not {value!r}")
    return value


def _parse_delivery(raw: Any, name: str, base_dir: Path) -> DeliveryConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(name, "must be a table")
    _unknown(raw, _DELIVERY_KEYS, name + ".")
    sink = _string(raw, "sink", name + ".sink")
    if sink not in _SINKS:
        raise ConfigError(name + ".sink", f"unknown sink {sink!r} (known: internet_archive)")
    retention = _duration(raw, "local_artifact_retention", name + ".local_artifact_retention", None)
    if retention < 1.0:
        raise ConfigError(name + ".local_artifact_retention", "must be at least 1s")
    metadata_raw = raw.get("metadata", {})
    if not isinstance(metadata_raw, Mapping):
        raise ConfigError(name + ".metadata", "must be a table")
    metadata: dict[str, tuple[str, ...]] = {}
    for key, value in metadata_raw.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) for v in values):
            raise ConfigError(f"{name}.metadata.{key}", "must be a string or a list of strings")
        metadata[key] = tuple(values)
    return DeliveryConfig(
        sink=sink,
        credentials=(base_dir / _string(raw, "credentials", name + ".credentials")).resolve(),
        identifier=_string(raw, "identifier", name + ".identifier"),
        remote_name=_string(raw, "remote_name", name + ".remote_name", "{filename}"),
        local_artifact_retention=retention,
        s3_url=_http_url(
            _string(raw, "s3_url", name + ".s3_url", "https://s3.us.archive.org"), name + ".s3_url"
        ),
        metadata_url=_http_url(
            _string(raw, "metadata_url", name + ".metadata_url", "https://archive.org"),
            name + ".metadata_url",
        ),
        metadata=metadata,
    )


def _parse_projects(raw: Any, base_dir: Path) -> dict[str, ProjectConfig]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("projects", "at least one [projects.<id>] table is required")
    projects: dict[str, ProjectConfig] = {}
    for project_id, table in raw.items():
        name = f"projects.{project_id}"
        if not PROJECT_ID.fullmatch(project_id):
            raise ConfigError(name, "project ids are 1-128 characters of [A-Za-z0-9._:-]")
        if not isinstance(table, Mapping):
            raise ConfigError(name, "must be a table")
        _unknown(table, {"delivery"}, name + ".")
        delivery = None
        if "delivery" in table:
            delivery = _parse_delivery(table["delivery"], name + ".delivery", base_dir)
        projects[project_id] = ProjectConfig(project_id=project_id, delivery=delivery)
    return projects


def parse_config(raw: Mapping[str, Any], base_dir: Path) -> Config:
    """Validate a parsed TOML mapping; relative paths are resolved against ``base_dir`` once."""
    _unknown(raw, _TOP_KEYS, "")
    issuer = _string(raw, "issuer", "issuer")
    if not issuer:
        raise ConfigError("issuer", "must not be empty")
    if len(issuer.encode("utf-8")) > ISSUER_MAX_BYTES:
        raise ConfigError("issuer", f"must be at most {ISSUER_MAX_BYTES} bytes")
    public_url = raw.get("public_url")
    if public_url is not None:
        public_url = _http_url(_string(raw, "public_url", "public_url"), "public_url")
        public_url = public_url.rstrip("/") + "/"
    listen = _string(raw, "listen", "listen", "tcp:8080:interface=127.0.0.1")
    if not listen:
        raise ConfigError("listen", "must be a Twisted endpoint string")
    data_dir = _string(raw, "data_dir", "data_dir", "/var/lib/canner")
    if not data_dir:
        raise ConfigError("data_dir", "must not be empty")
    node_prefix = _string(raw, "node_prefix", "node_prefix", "")
    try:
        validate_node_prefix(node_prefix)
    except ValueError as e:
        raise ConfigError("node_prefix", str(e)) from None
    trust = raw.get("trust_forwarded_headers", False)
    if not isinstance(trust, bool):
        raise ConfigError("trust_forwarded_headers", "must be true or false")
    retention = _duration(raw, "partial_upload_retention", "partial_upload_retention", "30m")
    if retention <= 0:
        raise ConfigError("partial_upload_retention", "must be positive")
    return Config(
        issuer=issuer,
        data_dir=(base_dir / data_dir).resolve(),
        listen=listen,
        public_url=public_url,
        max_upload_bytes=_positive_int(raw, "max_upload_bytes", 107374182400, "max_upload_bytes"),
        min_free_bytes=_positive_int(raw, "min_free_bytes", None, "min_free_bytes"),
        partial_upload_retention=retention,
        delivery_concurrency=_positive_int(raw, "delivery_concurrency", 2, "delivery_concurrency"),
        node_prefix=node_prefix,
        trust_forwarded_headers=trust,
        projects=_parse_projects(raw.get("projects"), base_dir),
    )


def load_config(path: Path) -> Config:
    """Read and validate a TOML config file; relative paths resolve against the file's directory.

    Raises :class:`ConfigError` (key ``"<file>"`` when the file itself is unreadable or not TOML).
    """
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError("<file>", f"cannot read {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("<file>", f"{path} is not valid TOML: {e}") from None
    return parse_config(raw, path.parent.resolve())
