"""The configuration tree shared by both daemons.

``parse_config(mapping, base_dir)`` is pure: it turns the TOML mapping (docs/architecture.md,
"Configuration") into a frozen :class:`Config` or raises :class:`ConfigError` naming the key
and the problem.
``load_config(path)`` reads the file.  Everything after this module trusts the values it returns.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from attrs import field, frozen

from canner import templates
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


# The issuer of the shipped example config (/etc/canner/canner.toml): parse_config refuses it,
# so the daemons never start with it and ``canner check-config`` fails until it is edited.
PLACEHOLDER_ISSUER = "https://canner.example"


class ConfigError(ValueError):
    """The configuration is unusable; ``str()`` names the key and the problem."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key {key!r}: {problem}")
        self.key = key
        self.problem = problem


class MissingKey(ConfigError):
    """A required key is absent (``problem`` says what it must be)."""

    def __init__(self, key: str, problem: str = "required") -> None:
        super().__init__(key, problem)


class UnknownKey(ConfigError):
    """``prefix + name``, a key its table does not have; ``meant`` is the nearest known key of
    the table (dotted, like ``key``), if any: a typo of a required key, which then is missing."""

    def __init__(self, prefix: str, name: str, nearest: str | None) -> None:
        hint = "" if nearest is None else f" (did you mean {nearest!r}?)"
        super().__init__(prefix + name, "unknown key" + hint)
        self.meant = None if nearest is None else prefix + nearest


class ConfigErrors(ConfigError):
    """Several problems in one file, all reported at once; ``errors`` lists them, unknown keys
    first.  ``key`` and ``problem`` are the first one's."""

    def __init__(self, errors: list[ConfigError]) -> None:
        super().__init__(errors[0].key, errors[0].problem)
        self.errors = errors
        lines = [f"{len(errors)} config errors:", *(f"  {e}" for e in errors)]
        self.args = ("\n".join(lines),)

    def __str__(self) -> str:
        return str(self.args[0])


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


@frozen(kw_only=True)
class DeliveryTable:
    """``[projects.<id>.delivery]``: the keys every sink reads.  Each sink's table type (see
    :mod:`canner.sinks.registry`) adds its own keys, so a table holds only what its sink reads."""

    sink: str
    identifier: str
    remote_name: str
    local_artifact_retention: float
    # How long a delivered object may stay unlisted at its destination before it is delivered
    # again.
    verify_timeout: float = 6 * 3600.0

    def metadata_templates(self) -> Mapping[str, tuple[str, ...]]:
        """The item metadata templates a plan expands (none: the sink keeps no metadata)."""
        return {}

    def item_limit(self) -> int | None:
        """The most bytes one item may hold (None: the destination has no such limit)."""
        return None


IDENTITY = "identity"
MEGAWARC = "megawarc"
DEFAULT_TARGET_BYTES = 50 * 10**9
DEFAULT_MAX_WAIT = 24 * 3600.0


@frozen
class PackagingConfig:
    """``[projects.<id>.packaging]``: one item per artifact (identity) or megawarc batches."""

    mode: str = IDENTITY
    # Close a batch once its members reach this many bytes ...
    target_bytes: int = DEFAULT_TARGET_BYTES
    # ... or once its oldest member has waited this long since acceptance (seconds).
    max_wait: float = DEFAULT_MAX_WAIT
    # The dictionary API (megawarc's ``--server``) of members that name their zstd dictionary
    # (``.<project>.<10-digit dict id>.warc.zst``) instead of holding it; None: no such API.
    zstd_dictionary_url: str | None = None

    @property
    def megawarc(self) -> bool:
        return self.mode == MEGAWARC


@frozen
class DeliveryContext:
    """Where a delivery table stands, for its sink's parser: ``name`` is its dotted key
    (``projects.<id>.delivery``), ``common`` the parsed keys of :class:`DeliveryTable` (pass them
    on to the table type)."""

    project_id: str
    name: str
    base_dir: Path
    packaging: PackagingConfig
    common: Mapping[str, Any]


@frozen
class SinkTable:
    """How one sink's delivery table is read.  ``keys``: the keys only this sink reads, beside
    the common ones; ``parse`` reads them into the sink's table type; ``check`` refuses a table
    whose templates could ever produce a destination the sink cannot write; ``check_ledger``,
    for a sink that can hold the ledger, refuses a ``[ledger]`` it could not write.  All raise
    :class:`ConfigError` naming the key."""

    name: str
    keys: frozenset[str]
    parse: Callable[[Mapping[str, Any], DeliveryContext], DeliveryTable]
    check: Callable[[DeliveryTable, DeliveryContext], None]
    check_ledger: Callable[[LedgerConfig], None] | None = None


# The sinks parse_config knows, by name.  This module may not import sinks/: the sink registry
# (canner.sinks.registry, which every entry point imports) registers each sink's table here.
_SINK_TABLES: dict[str, SinkTable] = {}


def register_sink_table(table: SinkTable) -> None:
    """Let ``[projects.<id>.delivery]`` tables name ``sink = table.name``."""
    _SINK_TABLES[table.name] = table


def unregister_sink_table(name: str) -> None:
    _SINK_TABLES.pop(name, None)


@frozen
class ProjectConfig:
    """``[projects.<id>]``: a project workers may upload for."""

    project_id: str
    delivery: DeliveryTable | None = None
    packaging: PackagingConfig = PackagingConfig()


@frozen
class MetricsConfig:
    """``[metrics]``: Prometheus metrics (the receiver always serves ``/metrics`` on ``listen``)."""

    # Where canner-deliver serves /metrics: a loopback TCP or a unix endpoint; None: not served.
    deliver_listen: str | None = None
    # How often the gauges that need I/O (free space, index counts) are recomputed, in seconds.
    refresh: float = 15.0


@frozen
class ConnectionsConfig:
    """``[connections]``: what one receiver lets clients hold open."""

    # Open client connections in total; kept below the open-file limit whatever is set here.
    max: int = 4096
    # Per client address; 0: no per-address cap (behind a proxy that limits clients itself).
    max_per_client: int = 256
    # A request head (request line and headers) must arrive whole within this many seconds.
    header_timeout: float = 30.0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    return max(1, len(os.sched_getaffinity(0)))


@frozen
class ReceiverConfig:
    """``[receiver]``: how canner-receiver runs on the node."""

    # Worker processes serving the listening socket; 1 is one process doing everything.
    workers: int = 1


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

    def template_values(self, period: str) -> dict[str, str]:
        """What the identifier and metadata templates expand with for ``period``'s ledger."""
        return {"node": self.node, "period": period}

    def identifier_for(self, period: str) -> str:
        """The IA item of ``period``'s ledgers."""
        return templates.expand(self.identifier, self.template_values(period))


@frozen
class RsyncConfig:
    """``[rsync]``: the rsync intake (absent: no rsync intake).  A stock rsync daemon writes into
    ``incoming/<project>/<downloader>/`` and canner-receiver adopts what it finishes
    (:mod:`canner.doors.rsync`); ``incoming`` must be on the data directory's filesystem."""

    incoming: Path
    # How often the whole incoming tree is scanned for what inotify missed.
    scan_interval: float = 10.0
    # The rsync daemon's ``max connections`` per module (``canner rsyncd-conf`` writes it).
    max_connections: int = 64


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
    connections: ConnectionsConfig = ConnectionsConfig()
    receiver: ReceiverConfig = ReceiverConfig()
    # Where megawarc packages are built and kept until delivered (default: <data_dir>/packages).
    packages_dir: Path | None = None
    # Package builds running at once (a bounded pool of their own, beside delivery_concurrency).
    packaging_concurrency: int = 1

    @property
    def packages_path(self) -> Path:
        return self.packages_dir if self.packages_dir is not None else self.data_dir / "packages"

    hq: HQConfig | None = None
    ledger: LedgerConfig | None = None
    rsync: RsyncConfig | None = None

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
    "connections",
    "receiver",
    "packages_dir",
    "packaging_concurrency",
    "hq",
    "ledger",
    "rsync",
}
_HQ_KEYS = {"tokens"}
_RSYNC_KEYS = {"incoming", "scan_interval", "max_connections"}
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
_CONNECTIONS_KEYS = {"max", "max_per_client", "header_timeout"}
_RECEIVER_KEYS = {"workers"}
_PACKAGING_KEYS = {"mode", "target_bytes", "max_wait", "zstd_dictionary_url"}
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
# The keys of every delivery table; each sink adds its own (SinkTable.keys).
DELIVERY_KEYS = frozenset(
    {"sink", "identifier", "remote_name", "local_artifact_retention", "verify_timeout"}
)


# The keys of each table, by its path in the file (``<id>`` stands for any project id).  The
# metadata tables are free-form.
_TABLES: Final[dict[str, set[str]]] = {
    "": _TOP_KEYS,
    "projects.<id>": {"delivery", "packaging"},
    "projects.<id>.packaging": _PACKAGING_KEYS,
    "metrics": _METRICS_KEYS,
    "manhole": _MANHOLE_KEYS,
    "connections": _CONNECTIONS_KEYS,
    "receiver": _RECEIVER_KEYS,
    "hq": _HQ_KEYS,
    "ledger": _LEDGER_KEYS,
    "rsync": _RSYNC_KEYS,
}


def _delivery_keys() -> set[str]:
    """The keys of a delivery table of any registered sink."""
    return set(DELIVERY_KEYS).union(*(table.keys for table in _SINK_TABLES.values()))


def known_keys(table: str) -> frozenset[str]:
    """The keys parse_config accepts in ``table`` (``""`` for the top level,
    ``"projects.<id>.delivery"``...); KeyError for a table it does not know."""
    if table == "projects.<id>.delivery":
        return frozenset(_delivery_keys())
    return frozenset(_TABLES[table])


def _nearest(key: str, allowed: set[str]) -> str | None:
    near = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
    return near[0] if near else None


def unknown_keys(raw: Mapping[str, Any]) -> list[UnknownKey]:
    """Every unknown key of the file, each with the nearest known key of its table, if any."""
    errors: list[UnknownKey] = []

    def check(table: Any, schema: str, prefix: str) -> None:
        if isinstance(table, Mapping):
            allowed = set(known_keys(schema))
            for key in table:
                if key not in allowed:
                    errors.append(UnknownKey(prefix, key, _nearest(key, allowed)))

    check(raw, "", "")
    for section in ("metrics", "manhole", "connections", "hq", "ledger", "rsync"):
        check(raw.get(section), section, section + ".")
    projects = raw.get("projects")
    if isinstance(projects, Mapping):
        for project_id, table in projects.items():
            check(table, "projects.<id>", f"projects.{project_id}.")
            if isinstance(table, Mapping):
                for sub in ("packaging", "delivery"):
                    check(table.get(sub), f"projects.<id>.{sub}", f"projects.{project_id}.{sub}.")
    return errors


def positive_int(mapping: Mapping[str, Any], key: str, default: int | None, name: str) -> int:
    value = mapping.get(key, default)
    if value is None:
        raise MissingKey(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, not {value!r}")
    if value <= 0:
        raise ConfigError(name, f"must be positive, not {value}")
    return value


def string_key(mapping: Mapping[str, Any], key: str, name: str, default: str | None = None) -> str:
    value = mapping.get(key, default)
    if value is None:
        raise MissingKey(name)
    if not isinstance(value, str):
        raise ConfigError(name, f"must be a string, not {value!r}")
    return value


def duration_key(mapping: Mapping[str, Any], key: str, name: str, default: str | None) -> float:
    value = mapping.get(key, default)
    if value is None:
        raise MissingKey(name)
    try:
        return parse_duration(value)
    except ValueError as e:
        raise ConfigError(name, str(e)) from None


_SIZE = re.compile(r"([0-9]+)\s*([KMGTP]i?B|B)?")
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_SIZE_UNITS.update({"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50})


def parse_size(value: Any) -> int:
    """A byte count: an integer, or a string such as ``"50GB"`` (10^9) or ``"2GiB"`` (2^30).

    Raises ``ValueError`` for anything else, and for sizes below one byte.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value.strip())):
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"]
    else:
        raise ValueError(f'{value!r} is not a size (such as 1048576, "50GB" or "2GiB")')
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte, not {size}")
    return size


def _parse_packaging(raw: Any, name: str) -> PackagingConfig:
    if raw is None:
        return PackagingConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError(name, "must be a table")
    mode = string_key(raw, "mode", name + ".mode", IDENTITY)
    if mode not in (IDENTITY, MEGAWARC):
        raise ConfigError(name + ".mode", f'must be "identity" or "megawarc", not {mode!r}')
    try:
        target = parse_size(raw.get("target_bytes", DEFAULT_TARGET_BYTES))
    except ValueError as e:
        raise ConfigError(name + ".target_bytes", str(e)) from None
    max_wait = duration_key(raw, "max_wait", name + ".max_wait", "24h")
    if max_wait < 1.0:
        raise ConfigError(name + ".max_wait", "must be at least 1s")
    url = None
    if "zstd_dictionary_url" in raw:
        key = name + ".zstd_dictionary_url"
        url = http_url(string_key(raw, "zstd_dictionary_url", key), key)
        if mode != MEGAWARC:
            raise ConfigError(key, 'only for mode = "megawarc" (dictionaries are for packing)')
    return PackagingConfig(
        mode=mode, target_bytes=target, max_wait=max_wait, zstd_dictionary_url=url
    )


def check_template(template: str, allowed: Collection[str], key: str) -> frozenset[str]:
    """The fields of the template set at ``key`` (:func:`canner.templates.check`), or a
    :class:`ConfigError` naming ``key`` for a malformed template or a field ``allowed`` lacks."""
    try:
        return templates.check(template, allowed)
    except templates.TemplateError as e:
        raise ConfigError(key, str(e)) from None


# The fields of a delivery's identifier, remote-name and metadata templates: those that name
# one object, and those that name one package (megawarc projects only).
OBJECT_FIELDS = frozenset({"object_id", "filename", "date"})
PACKAGE_FIELDS = frozenset({"package", "batch_date"})
DELIVERY_FIELDS = ("project", "object_id", "filename", "date", "package", "batch_date")
# The fields of the ledger's identifier and metadata templates.
LEDGER_FIELDS = ("node", "period")


def _check_delivery_templates(
    packaging: PackagingConfig, delivery: DeliveryTable, name: str
) -> None:
    """The identifier and remote name are templates of :data:`DELIVERY_FIELDS`; a megawarc
    item is one package: its templates name the package, never one object."""
    used: dict[str, frozenset[str]] = {}
    for key in ("identifier", "remote_name"):
        used[key] = check_template(getattr(delivery, key), DELIVERY_FIELDS, f"{name}.{key}")
    for key, names in used.items():
        if packaging.megawarc and names & OBJECT_FIELDS:
            raise ConfigError(
                f"{name}.{key}",
                "a megawarc project's item holds many objects: use {project}, {package} or"
                " {batch_date}, not "
                + ", ".join(f"{{{f}}}" for f in sorted(names & OBJECT_FIELDS)),
            )
        if not packaging.megawarc and names & PACKAGE_FIELDS:
            raise ConfigError(
                f"{name}.{key}",
                "{package} and {batch_date} are only for projects with packaging mode = megawarc",
            )
    if packaging.megawarc and not used["identifier"] & PACKAGE_FIELDS:
        raise ConfigError(
            f"{name}.identifier",
            "a megawarc project's identifier must contain {package} or {batch_date}, so two"
            " batches never share an item",
        )


def http_url(value: str, name: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(name, f"must be an absolute http(s) URL, not {value!r}")
    return value


def _parse_delivery(
    raw: Any, name: str, base_dir: Path, project_id: str, packaging: PackagingConfig
) -> DeliveryTable:
    """The keys every sink reads, then the sink's own table (:class:`SinkTable`)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(name, "must be a table")
    if not _SINK_TABLES:
        raise RuntimeError("no sink is registered: import canner.sinks.registry first")
    sink = string_key(raw, "sink", name + ".sink")
    table = _SINK_TABLES.get(sink)
    if table is None:
        known = ", ".join(sorted(_SINK_TABLES))
        raise ConfigError(name + ".sink", f"unknown sink {sink!r} (known: {known})")
    for other in sorted(_SINK_TABLES.values(), key=lambda t: t.name):
        for key in sorted(other.keys - table.keys - DELIVERY_KEYS):
            if key in raw:
                raise ConfigError(f"{name}.{key}", f"only for sink = {other.name!r}, not {sink!r}")
    retention = duration_key(
        raw, "local_artifact_retention", name + ".local_artifact_retention", None
    )
    if retention < 1.0:
        raise ConfigError(name + ".local_artifact_retention", "must be at least 1s")
    verify_timeout = duration_key(raw, "verify_timeout", name + ".verify_timeout", "6h")
    if verify_timeout < 1.0:
        raise ConfigError(name + ".verify_timeout", "must be at least 1s")
    # A megawarc item's files are named "<remote_name>.megawarc.warc.gz" and so on.
    default_remote = "{package}" if packaging.megawarc else "{filename}"
    common = {
        "sink": sink,
        "identifier": string_key(raw, "identifier", name + ".identifier"),
        "remote_name": string_key(raw, "remote_name", name + ".remote_name", default_remote),
        "local_artifact_retention": retention,
        "verify_timeout": verify_timeout,
    }
    where = DeliveryContext(project_id, name, base_dir, packaging, common)
    delivery = table.parse(raw, where)
    _check_delivery_templates(packaging, delivery, name)
    table.check(delivery, where)
    return delivery


def metadata_table(raw: Any, name: str) -> dict[str, tuple[str, ...]]:
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
    return HQConfig(tokens=(base_dir / string_key(raw, "tokens", "hq.tokens")).resolve())


def _parse_rsync(raw: Any, base_dir: Path, data_dir: Path) -> RsyncConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("rsync", "must be a table")
    incoming = string_key(raw, "incoming", "rsync.incoming", str(data_dir / "incoming"))
    if not incoming:
        raise ConfigError("rsync.incoming", "must not be empty")
    interval = duration_key(raw, "scan_interval", "rsync.scan_interval", "10s")
    if interval <= 0:
        raise ConfigError("rsync.scan_interval", "must be positive")
    return RsyncConfig(
        incoming=(base_dir / incoming).resolve(),
        scan_interval=interval,
        max_connections=positive_int(raw, "max_connections", 64, "rsync.max_connections"),
    )


def _parse_ledger(raw: Any, base_dir: Path, node_prefix: str) -> LedgerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("ledger", "must be a table")
    period = string_key(raw, "period", "ledger.period", "day")
    if period not in LEDGER_PERIODS:
        raise ConfigError("ledger.period", f'must be "day" or "month", not {period!r}')
    sink = string_key(raw, "sink", "ledger.sink", "internet_archive")
    if sink != "internet_archive":
        raise ConfigError("ledger.sink", f'must be "internet_archive", not {sink!r}')
    node = string_key(raw, "node", "ledger.node", node_prefix)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", node):
        raise ConfigError(
            "ledger.node",
            "required (it names this node's ledgers; defaults to node_prefix): 1-64 characters"
            " of [A-Za-z0-9._-]",
        )
    identifier = string_key(raw, "identifier", "ledger.identifier", "canner-ledger-{node}-{period}")
    if "period" not in check_template(identifier, LEDGER_FIELDS, "ledger.identifier"):
        raise ConfigError("ledger.identifier", "must contain {period}: one item per period")
    metadata = metadata_table(raw.get("metadata", {}), "ledger.metadata")
    for key, values in metadata.items():
        for value in values:
            check_template(value, LEDGER_FIELDS, f"ledger.metadata.{key}")
    ledger = LedgerConfig(
        period=period,
        delay=duration_key(raw, "delay", "ledger.delay", "168h"),
        node=node,
        sink=sink,
        credentials=(base_dir / string_key(raw, "credentials", "ledger.credentials")).resolve(),
        identifier=identifier,
        s3_url=http_url(
            string_key(raw, "s3_url", "ledger.s3_url", "https://s3.us.archive.org"), "ledger.s3_url"
        ),
        metadata_url=http_url(
            string_key(raw, "metadata_url", "ledger.metadata_url", "https://archive.org"),
            "ledger.metadata_url",
        ),
        metadata=metadata,
    )
    table = _SINK_TABLES.get(sink)
    if table is None or table.check_ledger is None:
        raise RuntimeError(f"no sink {sink!r} holds ledgers: import canner.sinks.registry first")
    table.check_ledger(ledger)
    return ledger


def _parse_projects(
    raw: Any, base_dir: Path, errors: list[ConfigError]
) -> dict[str, ProjectConfig]:
    """The projects that parse; each one that does not adds its error to ``errors``."""
    if raw is None:
        raise MissingKey("projects", "at least one [projects.<id>] table is required")
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("projects", "at least one [projects.<id>] table is required")
    projects: dict[str, ProjectConfig] = {}
    for project_id, table in raw.items():
        try:
            projects[project_id] = _parse_project(project_id, table, base_dir)
        except ConfigError as e:
            errors.append(e)
    return projects


def _parse_project(project_id: str, table: Any, base_dir: Path) -> ProjectConfig:
    name = f"projects.{project_id}"
    if not PROJECT_ID.fullmatch(project_id):
        raise ConfigError(name, "project ids are 1-128 characters of [A-Za-z0-9._:-]")
    if not isinstance(table, Mapping):
        raise ConfigError(name, "must be a table")
    packaging = _parse_packaging(table.get("packaging"), name + ".packaging")
    delivery = None
    if "delivery" in table:
        delivery = _parse_delivery(
            table["delivery"], name + ".delivery", base_dir, project_id, packaging
        )
    return ProjectConfig(project_id=project_id, delivery=delivery, packaging=packaging)


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


def listen_url(text: str) -> str | None:
    """The ``http://`` base a ``tcp``/``tcp6`` listen endpoint serves (``tcp:8080`` without an
    interface listens everywhere: its URL names localhost), or None for other endpoints."""
    parts = _endpoint_parts(text)
    if parts[0] not in ("tcp", "tcp6") or len(parts) < 2 or not parts[1].isdigit():
        return None
    options = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
    host = options.get("interface", "localhost")
    if host in ("0.0.0.0", "::"):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{parts[1]}/"


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
    return string_key(mapping, key, name)


def _parse_connections(raw: Any) -> ConnectionsConfig:
    if raw is None:
        return ConnectionsConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError("connections", "must be a table")
    defaults = ConnectionsConfig()
    total = positive_int(raw, "max", defaults.max, "connections.max")
    per_client = raw.get("max_per_client", defaults.max_per_client)
    if isinstance(per_client, bool) or not isinstance(per_client, int) or per_client < 0:
        raise ConfigError(
            "connections.max_per_client",
            f"must be 0 (no cap) or a positive integer, not {per_client!r}",
        )
    header_timeout = duration_key(raw, "header_timeout", "connections.header_timeout", "30s")
    if not 1.0 <= header_timeout <= 3600.0:
        raise ConfigError("connections.header_timeout", "must be between 1s and 1h")
    return ConnectionsConfig(max=total, max_per_client=per_client, header_timeout=header_timeout)


def _parse_receiver(raw: Any) -> ReceiverConfig:
    """``[receiver]``; ``workers`` defaults to the cores this process may use."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("receiver", "must be a table")
    return ReceiverConfig(workers=positive_int(raw, "workers", usable_cores(), "receiver.workers"))


def _parse_metrics(raw: Any) -> MetricsConfig:
    if raw is None:
        return MetricsConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError("metrics", "must be a table")
    listen = _optional_string(raw, "deliver_listen", "metrics.deliver_listen")
    if listen is not None:
        listen = loopback_endpoint(listen, "metrics.deliver_listen")
    refresh = duration_key(raw, "refresh", "metrics.refresh", "15s")
    if refresh < 1.0:
        raise ConfigError("metrics.refresh", "must be at least 1s")
    return MetricsConfig(deliver_listen=listen, refresh=refresh)


def _parse_manhole(raw: Any, base_dir: Path, data_dir: Path) -> ManholeConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError("manhole", "must be a table")
    keys = string_key(raw, "authorized_keys", "manhole.authorized_keys")
    host_key = _optional_string(raw, "host_key", "manhole.host_key")
    sockets: dict[str, Path | None] = {}
    ssh: dict[str, str | None] = {}
    for role, default in DEFAULT_SOCKETS.items():
        path = string_key(raw, f"{role}_socket", f"manhole.{role}_socket", default)
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


def _issuer(raw: Mapping[str, Any]) -> str:
    issuer = string_key(raw, "issuer", "issuer")
    if not issuer:
        raise ConfigError("issuer", "must not be empty")
    if len(issuer.encode("utf-8")) > ISSUER_MAX_BYTES:
        raise ConfigError("issuer", f"must be at most {ISSUER_MAX_BYTES} bytes")
    if issuer == PLACEHOLDER_ISSUER:
        # The shipped config: never serve (or sign receipts) as the example issuer.
        raise ConfigError(
            "issuer",
            f"is still the placeholder {PLACEHOLDER_ISSUER!r} of the example config: set this"
            " node's real issuer before starting canner",
        )
    return issuer


def _public_url(raw: Mapping[str, Any]) -> str | None:
    if raw.get("public_url") is None:
        return None
    return http_url(string_key(raw, "public_url", "public_url"), "public_url").rstrip("/") + "/"


def _non_empty(raw: Mapping[str, Any], key: str, default: str | None, problem: str) -> str:
    value = string_key(raw, key, key, default)
    if not value:
        raise ConfigError(key, problem)
    return value


def _node_prefix(raw: Mapping[str, Any]) -> str:
    node_prefix = string_key(raw, "node_prefix", "node_prefix", "")
    try:
        validate_node_prefix(node_prefix)
    except ValueError as e:
        raise ConfigError("node_prefix", str(e)) from None
    return node_prefix


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(key, "must be true or false")
    return value


def _retention(raw: Mapping[str, Any]) -> float:
    retention = duration_key(raw, "partial_upload_retention", "partial_upload_retention", "30m")
    if retention <= 0:
        raise ConfigError("partial_upload_retention", "must be positive")
    return retention


def _packages_dir(raw: Mapping[str, Any], base_dir: Path) -> Path | None:
    packages_dir = _optional_string(raw, "packages_dir", "packages_dir")
    if packages_dir == "":
        raise ConfigError("packages_dir", "must not be empty")
    return (base_dir / packages_dir).resolve() if packages_dir else None


def parse_config(raw: Mapping[str, Any], base_dir: Path) -> Config:
    """Validate a parsed TOML mapping; relative paths are resolved against ``base_dir`` once.

    Every problem of the file is reported in one go: one :class:`ConfigError`, or a
    :class:`ConfigErrors` listing them all (unknown keys first, each with the nearest known key).
    """
    unknown = unknown_keys(raw)
    errors: list[ConfigError] = list(unknown)

    def attempt(parse: Any, fallback: Any, *args: Any) -> Any:
        try:
            return parse(*args)
        except ConfigError as e:
            errors.append(e)
            return fallback

    data_dir = attempt(
        _non_empty, "/var/lib/canner", raw, "data_dir", "/var/lib/canner", "must not be empty"
    )
    resolved_data_dir = (base_dir / data_dir).resolve()
    node_prefix = attempt(_node_prefix, "", raw)
    values = {
        "issuer": attempt(_issuer, "", raw),
        "data_dir": resolved_data_dir,
        "listen": attempt(
            _non_empty,
            "",
            raw,
            "listen",
            "tcp:8080:interface=127.0.0.1",
            "must be a Twisted endpoint string",
        ),
        "public_url": attempt(_public_url, None, raw),
        "max_upload_bytes": attempt(
            positive_int, 1, raw, "max_upload_bytes", 107374182400, "max_upload_bytes"
        ),
        "min_free_bytes": attempt(positive_int, 1, raw, "min_free_bytes", None, "min_free_bytes"),
        "partial_upload_retention": attempt(_retention, 1.0, raw),
        "delivery_concurrency": attempt(
            positive_int, 1, raw, "delivery_concurrency", 2, "delivery_concurrency"
        ),
        "node_prefix": node_prefix,
        "trust_forwarded_headers": attempt(_bool, False, raw, "trust_forwarded_headers", False),
        "projects": attempt(_parse_projects, {}, raw.get("projects"), base_dir, errors),
        "metrics": attempt(_parse_metrics, None, raw.get("metrics")),
        "manhole": attempt(_parse_manhole, None, raw.get("manhole"), base_dir, resolved_data_dir),
        "access_log": attempt(_bool, True, raw, "access_log", True),
        "connections": attempt(_parse_connections, None, raw.get("connections")),
        "receiver": attempt(_parse_receiver, None, raw.get("receiver")),
        "packages_dir": attempt(_packages_dir, None, raw, base_dir),
        "packaging_concurrency": attempt(
            positive_int, 1, raw, "packaging_concurrency", 1, "packaging_concurrency"
        ),
        "hq": attempt(_parse_hq, None, raw.get("hq"), base_dir),
        "ledger": attempt(_parse_ledger, None, raw.get("ledger"), base_dir, node_prefix),
        "rsync": attempt(_parse_rsync, None, raw.get("rsync"), base_dir, resolved_data_dir),
    }
    errors = _without_misspelt(errors, unknown)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)
    return Config(**values)


def _without_misspelt(errors: list[ConfigError], unknown: list[UnknownKey]) -> list[ConfigError]:
    """``errors`` less each missing key that an unknown key of its table names as the nearest:
    that is one typo, already reported (with the key it meant) by the unknown key's line."""
    meant = {u.meant for u in unknown if u.meant is not None}
    return [e for e in errors if not (isinstance(e, MissingKey) and e.key in meant)]


def check_data_dir(config: Config) -> Path:
    """``data_dir``, which must exist: a missing one is most likely a volume that is not mounted,
    and creating it would fill the root filesystem (:class:`ConfigError` otherwise)."""
    if not config.data_dir.is_dir():
        raise ConfigError(
            "data_dir",
            f"{config.data_dir} does not exist (create it, or mount its volume: canner never"
            " creates it, so a missing mount cannot fill the root filesystem)",
        )
    return config.data_dir


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
