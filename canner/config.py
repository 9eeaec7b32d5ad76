"""The configuration tree shared by both daemons.

``parse_config(mapping, base_dir)`` is pure: it turns the TOML mapping (docs/architecture.md,
"Configuration") into a frozen :class:`Config` or raises :class:`ConfigError` naming the key
and the problem.
``load_config(path)`` reads the file.  Everything after this module trusts the values it returns.
"""

from __future__ import annotations

import ipaddress
import os
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


# The issuer of the shipped example config (/etc/canner/canner.toml): the daemons refuse it.
PLACEHOLDER_ISSUER = "https://canner.example"


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
    # internet_archive only: the IA-S3 keys.
    credentials: Path | None
    identifier: str
    remote_name: str
    local_artifact_retention: float
    s3_url: str
    metadata_url: str
    metadata: Mapping[str, tuple[str, ...]] = field(factory=dict)
    # directory only: the absolute destination root, a template that may hold {project}.
    path: str | None = None


@frozen
class ProjectConfig:
    """``[projects.<id>]``: a project workers may upload for."""

    project_id: str
    delivery: DeliveryConfig | None = None


@frozen
class MetricsConfig:
    """``[metrics]``: Prometheus metrics (the receiver always serves ``/metrics`` on ``listen``)."""

    # Where canner-deliver serves /metrics: a loopback TCP or a unix endpoint; None: not served.
    deliver_listen: str | None = None
    # How often the gauges that need I/O (free space, index counts) are recomputed, in seconds.
    refresh: float = 15.0


@frozen
class ManholeConfig:
    """``[manhole]``: the operator's SSH shell (absent: no manhole, the default).

    Each daemon listens on its own unix socket (empty string: none) and, optionally, on a
    loopback TCP port.  Both speak SSH and accept the keys in ``authorized_keys``.
    """

    authorized_keys: Path
    host_key: Path
    receiver_socket: Path | None
    deliver_socket: Path | None
    receiver_ssh: str | None = None
    deliver_ssh: str | None = None

    def socket_for(self, role: str) -> Path | None:
        return self.receiver_socket if role == "receiver" else self.deliver_socket

    def ssh_for(self, role: str) -> str | None:
        return self.receiver_ssh if role == "receiver" else self.deliver_ssh


@frozen
class HQConfig:
    """``[hq]``: who may release receipts (absent: ``POST /api/v1/releases`` answers 401)."""

    # One "name sha256:<hex>" line per HQ client: the file never holds a usable secret.
    tokens: Path


LEDGER_PERIODS = ("day", "month")


@frozen
class LedgerConfig:
    """``[ledger]``: where released records go once their period closed (canner-deliver)."""

    period: str
    delay: float
    node: str
    sink: str
    credentials: Path
    identifier: str
    s3_url: str
    metadata_url: str
    metadata: Mapping[str, tuple[str, ...]] = field(factory=dict)


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
    metrics: MetricsConfig = MetricsConfig()
    manhole: ManholeConfig | None = None
    access_log: bool = True
    hq: HQConfig | None = None
    ledger: LedgerConfig | None = None

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
    "metrics",
    "manhole",
    "access_log",
    "hq",
    "ledger",
}
_HQ_KEYS = {"tokens"}
_LEDGER_KEYS = {
    "period",
    "delay",
    "node",
    "sink",
    "credentials",
    "identifier",
    "s3_url",
    "metadata_url",
    "metadata",
}
_METRICS_KEYS = {"deliver_listen", "refresh"}
_MANHOLE_KEYS = {
    "authorized_keys",
    "host_key",
    "receiver_socket",
    "deliver_socket",
    "receiver_ssh",
    "deliver_ssh",
}
# A unix socket address (sun_path) holds 108 bytes including the terminating NUL.
SOCKET_PATH_MAX = 107
DEFAULT_SOCKETS = {
    "receiver": "/run/canner/receiver/manhole.sock",
    "deliver": "/run/canner/deliver/manhole.sock",
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
    "path",
}
_SINKS = {"internet_archive", "directory"}
# Keys that only one sink reads; anything else in the table is common to both.
_SINK_ONLY_KEYS = {
    "credentials": "internet_archive",
    "s3_url": "internet_archive",
    "metadata_url": "internet_archive",
    "metadata": "internet_archive",
    "path": "directory",
}


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
        raise ConfigError(
            name + ".sink", f"unknown sink {sink!r} (known: directory, internet_archive)"
        )
    for key, owner in _SINK_ONLY_KEYS.items():
        if key in raw and owner != sink:
            raise ConfigError(f"{name}.{key}", f"only for sink = {owner!r}, not {sink!r}")
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
    credentials = path = None
    if sink == "internet_archive":
        credentials = (base_dir / _string(raw, "credentials", name + ".credentials")).resolve()
    else:
        # Relative to the config file's directory, like every other path; the sink checks at
        # start-up that the expanded directory exists.
        path = os.path.abspath(base_dir / _string(raw, "path", name + ".path"))
    return DeliveryConfig(
        sink=sink,
        credentials=credentials,
        path=path,
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


def _metadata_table(raw: Any, name: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, Mapping):
        raise ConfigError(name, "must be a table")
    metadata: dict[str, tuple[str, ...]] = {}
    for key, value in raw.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) for v in values):
            raise ConfigError(f"{name}.{key}", "must be a string or a list of strings")
        metadata[key] = tuple(values)
    return metadata


def _parse_hq(raw: Any, base_dir: Path) -> HQConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("hq", "must be a table")
    _unknown(raw, _HQ_KEYS, "hq.")
    return HQConfig(tokens=(base_dir / _string(raw, "tokens", "hq.tokens")).resolve())


def _parse_ledger(raw: Any, base_dir: Path, node_prefix: str) -> LedgerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("ledger", "must be a table")
    _unknown(raw, _LEDGER_KEYS, "ledger.")
    period = _string(raw, "period", "ledger.period", "day")
    if period not in LEDGER_PERIODS:
        raise ConfigError("ledger.period", f'must be "day" or "month", not {period!r}')
    sink = _string(raw, "sink", "ledger.sink", "internet_archive")
    if sink != "internet_archive":
        raise ConfigError("ledger.sink", f'must be "internet_archive", not {sink!r}')
    node = _string(raw, "node", "ledger.node", node_prefix)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", node):
        raise ConfigError(
            "ledger.node",
            "required (it names this node's ledgers; defaults to node_prefix): 1-64 characters"
            " of [A-Za-z0-9._-]",
        )
    return LedgerConfig(
        period=period,
        delay=_duration(raw, "delay", "ledger.delay", "168h"),
        node=node,
        sink=sink,
        credentials=(base_dir / _string(raw, "credentials", "ledger.credentials")).resolve(),
        identifier=_string(raw, "identifier", "ledger.identifier", "canner-ledger-{node}-{period}"),
        s3_url=_http_url(
            _string(raw, "s3_url", "ledger.s3_url", "https://s3.us.archive.org"), "ledger.s3_url"
        ),
        metadata_url=_http_url(
            _string(raw, "metadata_url", "ledger.metadata_url", "https://archive.org"),
            "ledger.metadata_url",
        ),
        metadata=_metadata_table(raw.get("metadata", {}), "ledger.metadata"),
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


def _endpoint_parts(text: str) -> list[str]:
    """Split a Twisted endpoint string at unescaped colons, unescaping ``\\:``."""
    parts, current, escaped = [], "", False
    for ch in text:
        if escaped:
            current, escaped = current + ch, False
        elif ch == "\\":
            escaped = True
        elif ch == ":":
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def loopback_endpoint(text: str, name: str) -> str:
    """Accept a ``tcp``/``tcp6`` endpoint whose ``interface`` is a loopback address, or ``unix``.

    Operator surfaces (deliver metrics, the SSH manhole) must never listen on a public address.
    """
    parts = _endpoint_parts(text)
    kind = parts[0]
    if kind == "unix" and len(parts) > 1 and parts[1]:
        return text
    if kind not in ("tcp", "tcp6") or len(parts) < 2:
        raise ConfigError(
            name, f'must be "tcp:PORT:interface=127.0.0.1" (loopback) or "unix:PATH", not {text!r}'
        )
    options = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
    interface = options.get("interface")
    try:
        loopback = interface is not None and ipaddress.ip_address(interface).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(name, f"must listen on loopback only (interface=127.0.0.1), not {text!r}")
    return text


def _optional_string(mapping: Mapping[str, Any], key: str, name: str) -> str | None:
    if key not in mapping:
        return None
    return _string(mapping, key, name)


def _parse_metrics(raw: Any) -> MetricsConfig:
    if raw is None:
        return MetricsConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError("metrics", "must be a table")
    _unknown(raw, _METRICS_KEYS, "metrics.")
    listen = _optional_string(raw, "deliver_listen", "metrics.deliver_listen")
    if listen is not None:
        listen = loopback_endpoint(listen, "metrics.deliver_listen")
    refresh = _duration(raw, "refresh", "metrics.refresh", "15s")
    if refresh < 1.0:
        raise ConfigError("metrics.refresh", "must be at least 1s")
    return MetricsConfig(deliver_listen=listen, refresh=refresh)


def _parse_manhole(raw: Any, base_dir: Path, data_dir: Path) -> ManholeConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("manhole", "must be a table")
    _unknown(raw, _MANHOLE_KEYS, "manhole.")
    keys = _string(raw, "authorized_keys", "manhole.authorized_keys")
    host_key = _optional_string(raw, "host_key", "manhole.host_key")
    sockets: dict[str, Path | None] = {}
    ssh: dict[str, str | None] = {}
    for role, default in DEFAULT_SOCKETS.items():
        path = _string(raw, f"{role}_socket", f"manhole.{role}_socket", default)
        resolved = (base_dir / path).resolve() if path else None
        if resolved is not None and len(str(resolved).encode()) > SOCKET_PATH_MAX:
            raise ConfigError(
                f"manhole.{role}_socket", f"must be at most {SOCKET_PATH_MAX} bytes long"
            )
        sockets[role] = resolved
        listen = _optional_string(raw, f"{role}_ssh", f"manhole.{role}_ssh")
        if listen is not None:
            listen = loopback_endpoint(listen, f"manhole.{role}_ssh")
        ssh[role] = listen
    return ManholeConfig(
        authorized_keys=(base_dir / keys).resolve(),
        host_key=(base_dir / host_key).resolve() if host_key else data_dir / "manhole_host_key",
        receiver_socket=sockets["receiver"],
        deliver_socket=sockets["deliver"],
        receiver_ssh=ssh["receiver"],
        deliver_ssh=ssh["deliver"],
    )


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
    access_log = raw.get("access_log", True)
    if not isinstance(access_log, bool):
        raise ConfigError("access_log", "must be true or false")
    retention = _duration(raw, "partial_upload_retention", "partial_upload_retention", "30m")
    if retention <= 0:
        raise ConfigError("partial_upload_retention", "must be positive")
    resolved_data_dir = (base_dir / data_dir).resolve()
    return Config(
        issuer=issuer,
        data_dir=resolved_data_dir,
        listen=listen,
        public_url=public_url,
        max_upload_bytes=_positive_int(raw, "max_upload_bytes", 107374182400, "max_upload_bytes"),
        min_free_bytes=_positive_int(raw, "min_free_bytes", None, "min_free_bytes"),
        partial_upload_retention=retention,
        delivery_concurrency=_positive_int(raw, "delivery_concurrency", 2, "delivery_concurrency"),
        node_prefix=node_prefix,
        trust_forwarded_headers=trust,
        projects=_parse_projects(raw.get("projects"), base_dir),
        metrics=_parse_metrics(raw.get("metrics")),
        manhole=_parse_manhole(raw.get("manhole"), base_dir, resolved_data_dir),
        access_log=access_log,
        hq=_parse_hq(raw.get("hq"), base_dir),
        ledger=_parse_ledger(raw.get("ledger"), base_dir, node_prefix),
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
