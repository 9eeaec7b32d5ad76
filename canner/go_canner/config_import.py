"""A Go canner ``config.json`` as canner TOML (``canner import-go-config``), pure.

:func:`convert_config` reads the JSON as Go's ``encoding/json`` did (``docs/reference/go-canner.md``
§1.2: unknown keys ignored, keys matched case-insensitively, the last duplicate winning, a second
object merged into the first) and writes the equivalent canner configuration.  Everything the Go
canner read differently, silently accepted, or that has no canner equivalent becomes a
:class:`Finding` naming its JSON path; nothing is dropped without one.  The result is checked
with canner's own loader (:func:`canner.config.parse_config` and the delivery template rules),
so a conversion either loads or ends in an ``error`` finding.  IA keys are never read: the TOML
names the Go canner's key file, which canner reads as it is (access key, then secret).
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from attrs import frozen

from canner.config import PROJECT_ID, ConfigError, parse_config, parse_duration
from canner.sinks.ia.metadata import metadata_key_problem

GO_TEMPLATE_VARIABLES = (
    "PROJECT",
    "PACKAGE_ID",
    "OBJECT_ID",
    "PACKAGE_ID_SHORT",
    "PACKAGE_FILENAME",
    "FILENAME",
    "DATE",
)
_INT64_MAX = 2**63 - 1


@frozen
class Finding:
    """One thing the conversion changed, dropped or cannot do, at a JSON path (``$.issuer``).

    ``fatal`` findings mean there is no usable TOML.
    """

    path: str
    message: str
    fatal: bool = False

    def line(self) -> str:
        return f"{'error' if self.fatal else 'warning'}: {self.path}: {self.message}"


@frozen
class Conversion:
    """The TOML text (``None`` when a finding is fatal) and every finding, in file order."""

    toml: str | None
    findings: tuple[Finding, ...]


# -- reading JSON as Go's encoding/json does ---------------------------------------------------


class _Object(list[tuple[str, Any]]):
    """A JSON object as its key/value pairs in file order, duplicates kept."""


@frozen
class _Struct:
    fields: Mapping[str, Any]


@frozen
class _Map:
    element: Any


@frozen
class _Slice:
    element: Any


_STRING, _INT64, _UINT64, _INT = "string", "int64", "uint64", "int"
_PACKAGING = _Struct(
    {"type": _STRING, "trigger_bytes": _INT64, "target_package_bytes": _INT64, "max_wait": _STRING}
)
_DELIVERY = _Struct(
    {
        "sink": _STRING,
        "credentials_file": _STRING,
        "identifier": _STRING,
        "remote_name": _STRING,
        "local_artifact_retention": _STRING,
        "metadata": _Map(_Slice(_STRING)),
    }
)
_PROJECT = _Struct({"packaging": _PACKAGING, "delivery": _DELIVERY})
_CONFIG = _Struct(
    {
        "listen_addr": _STRING,
        "issuer": _STRING,
        "data_dir": _STRING,
        "max_upload_bytes": _INT64,
        "min_free_bytes": _UINT64,
        "partial_upload_retention": _STRING,
        "delivery_concurrency": _INT,
        "projects": _Map(_PROJECT),
    }
)
# A value of the wrong JSON type: the Go canner refused to start (already reported).
_INVALID = object()


def child(path: str, key: str) -> str:
    """``path`` extended by one key: ``$.a.b``, or ``$.a["b.c"]`` when the key is not a name."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _go_fold(text: str) -> str:
    # Go folds each rune to the smallest of its simple case-folding orbit (bytes.EqualFold), so
    # the Kelvin sign matches "k" and the long s matches "s", but the dotless i matches nothing.
    # Single-character casefolds give the same classes for the ASCII names matched here.
    return "".join(f if len(f := ch.casefold()) == 1 else ch for ch in text)


class _Node(dict[str, Any]):
    """A decoded struct or map; ``where`` holds the JSON path of the key that set each entry."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.where: dict[str, str] = {}

    def at(self, key: str) -> str:
        return self.where.get(key, child(self.path, key))

    def get_valid(self, key: str) -> Any:
        value = self.get(key)
        return None if value is _INVALID else value


class _Decoder:
    """Go's decoding rules over :class:`_Object` pairs, collecting findings."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings

    def warn(self, path: str, message: str) -> None:
        self.findings.append(Finding(path, message))

    def fail(self, path: str, message: str) -> None:
        self.findings.append(Finding(path, message, fatal=True))

    def value(self, kind: Any, raw: Any, path: str, current: Any) -> Any:
        if isinstance(kind, _Struct | _Map):
            if not isinstance(raw, _Object):
                self.fail(path, "must be a JSON object (the Go canner refuses to start)")
                return _INVALID
            # A second object for the same field is decoded into the first (Go reuses it).
            node = current if isinstance(current, _Node) else _Node(path)
            if isinstance(kind, _Struct):
                self.struct(kind, raw, node, path)
            else:
                self.map(kind, raw, node, path)
            return node
        if isinstance(kind, _Slice):
            if not isinstance(raw, list) or isinstance(raw, _Object):
                self.fail(path, "must be a JSON array (the Go canner refuses to start)")
                return _INVALID
            items = []
            for i, item in enumerate(raw):
                if item is None:
                    self.warn(f"{path}[{i}]", "null: the Go canner sent an empty value; dropped")
                    continue
                decoded = self.value(kind.element, item, f"{path}[{i}]", None)
                if decoded is not _INVALID:
                    items.append(decoded)
            return items
        if kind == _STRING:
            if not isinstance(raw, str):
                self.fail(path, "must be a JSON string (the Go canner refuses to start)")
                return _INVALID
            # Go decodes a lone UTF-16 surrogate escape as U+FFFD.
            return re.sub("[\ud800-\udfff]", "\ufffd", raw)
        low, high = {_INT64: (-(2**63), 2**63 - 1), _INT: (-(2**63), 2**63 - 1)}.get(
            kind, (0, 2**64 - 1)
        )
        if isinstance(raw, bool) or not isinstance(raw, int) or not low <= raw <= high:
            self.fail(path, f"must be an integer ({kind}; the Go canner refuses to start)")
            return _INVALID
        return raw

    def struct(self, kind: _Struct, pairs: _Object, node: _Node, at: str) -> None:
        for key, raw in pairs:
            path = child(at, key)
            name = key if key in kind.fields else None
            if name is None:
                folded = _go_fold(key)
                name = next((f for f in kind.fields if _go_fold(f) == folded), None)
            if name is None:
                self.warn(path, "unknown key: the Go canner ignored it; not carried over")
                continue
            notes = []
            if name != key:
                notes.append(
                    f"read as {name!r} (Go matches keys case-insensitively; canner's are exact)"
                )
            if name in node.where:
                merged = isinstance(kind.fields[name], _Struct | _Map) and isinstance(raw, _Object)
                notes.append(
                    f"{name!r} again after {node.where[name]}: "
                    + ("Go merges this object into that one" if merged else "the last one wins")
                )
            if raw is None:
                if isinstance(kind.fields[name], _Map):
                    notes.append("null: Go empties it")
                    node.pop(name, None)
                else:
                    notes.append("null: Go leaves the value as it was")
            if notes:
                self.warn(path, "; ".join(notes))
            if raw is not None:
                node[name] = self.value(kind.fields[name], raw, path, node.get(name))
            node.where[name] = path

    def map(self, kind: _Map, pairs: _Object, node: _Node, at: str) -> None:
        for key, raw in pairs:
            path = child(at, key)
            if key in node.where:
                self.warn(path, f"repeats the key of {node.where[key]}: the last one wins")
            # Each map element starts from its zero value (no merge), as in Go.
            node[key] = self.value(kind.element, raw, path, None) if raw is not None else None
            node.where[key] = path


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# -- templates ---------------------------------------------------------------------------------

_TOKEN = re.compile(r"\{\{(" + "|".join(GO_TEMPLATE_VARIABLES) + r")\}\}")
_UNKNOWN_TOKEN = re.compile(r"\{\{[^{}]*\}\}")


def translate_template(
    template: str, megawarc: bool, path: str, findings: list[Finding], *, unique_name: bool = False
) -> str:
    """A Go template (``{{PROJECT}}``, one ``strings.Replacer`` pass, unknown tokens literal) as
    a canner one (``{project}``, literal braces doubled).

    ``unique_name``: an identity remote name whose identifier does not hold ``{object_id}``,
    which must then hold it itself (the Go package filename was unique per package).
    """
    out: list[str] = []
    reported: set[str] = set()

    def note(token: str, message: str) -> None:
        if token not in reported:
            reported.add(token)
            findings.append(Finding(path, message))

    pos = 0
    while pos < len(template):
        match = _TOKEN.match(template, pos)
        if match is None:
            unknown = _UNKNOWN_TOKEN.match(template, pos)
            if unknown is not None:
                note(
                    unknown.group(0),
                    f"{unknown.group(0)} is no Go template variable: the Go canner sent it as"
                    " literal text; kept literal",
                )
            ch = template[pos]
            out.append(ch * 2 if ch in "{}" else ch)
            pos += 1
            continue
        out.append(_placeholder(match.group(1), megawarc, unique_name, note))
        pos = match.end()
    return "".join(out)


def _placeholder(
    variable: str, megawarc: bool, unique_name: bool, note: Callable[[str, str], None]
) -> str:
    token = "{{" + variable + "}}"
    if variable == "PROJECT":
        return "{project}"
    if variable == "DATE":
        return "{batch_date}" if megawarc else "{date}"
    if variable in ("PACKAGE_ID", "PACKAGE_ID_SHORT", "OBJECT_ID"):
        written = "{package}" if megawarc else "{object_id}"
        if variable == "OBJECT_ID":
            note(
                token,
                f"{token} is the package id in the Go canner (the artifact's tus id before"
                f" 7410169): written as {written}"
                + ("" if megawarc else " (an identity item holds one object)"),
            )
        return written
    # PACKAGE_FILENAME, FILENAME: "<project>-<package id[:24]><ext>" in the Go canner.
    if megawarc:
        written = "{package}"
        why = "canner names a megawarc item's files <remote_name>.megawarc.warc.gz and so on"
    elif unique_name:
        written = "{object_id}-{filename}"
        why = "canner has no package file name; the object id keeps every name unique"
    else:
        written = "{filename}"
        why = "canner has no package file name; the worker's filename, sanitised"
    note(token, f"{token} (<project>-<package id[:24]><ext>) has no equivalent: {written} ({why})")
    return written


# -- conversion --------------------------------------------------------------------------------


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


class _Converter:
    """The decoded Go config as TOML lines, checking what the Go canner checked at load."""

    def __init__(self, workdir: Path, findings: list[Finding]) -> None:
        self.workdir = workdir
        self.findings = findings

    def warn(self, path: str, message: str) -> None:
        self.findings.append(Finding(path, message))

    def fail(self, path: str, message: str) -> None:
        self.findings.append(Finding(path, message, fatal=True))

    def required(self, node: _Node, key: str, check: Any = None) -> Any:
        """``node[key]``, reported when absent (Go refuses to start without it)."""
        if key not in node:
            self.fail(node.at(key), "required (the Go canner refuses to start without it)")
            return None
        value = node.get_valid(key)
        if value is not None and check is not None and not check(value):
            self.fail(node.at(key), f"{value!r} is refused by the Go canner too")
            return None
        return value

    def duration(self, node: _Node, key: str, default: str | None) -> str | None:
        """A Go duration of at least 1s, as canner writes it (no sign)."""
        text = node.get_valid(key) if key in node else default
        if text is None:
            if key not in node:
                self.fail(node.at(key), "required (the Go canner refuses to start without it)")
            return None
        written = text[1:] if text.startswith("+") else text
        try:
            seconds = parse_duration(written)
        except ValueError:
            seconds = -1.0
        if seconds < 1.0:
            self.fail(
                node.at(key),
                f"{text!r} is no duration of at least 1s (the Go canner refuses it too)",
            )
            return None
        if written != text:
            self.warn(node.at(key), f"{text!r}: canner takes no sign: written {written!r}")
        return written

    def path(self, node: _Node, key: str, what: str) -> str | None:
        text = self.required(node, key, lambda v: v != "")
        if text is None:
            return None
        if PurePosixPath(text).is_absolute():
            return str(text)
        absolute = str(self.workdir / text)
        self.warn(
            node.at(key),
            f"{text!r} is relative: the Go canner read it from its working directory, canner"
            f" from the config file's directory; written as {absolute!r} ({what}; check it is"
            " where the Go canner ran)",
        )
        return absolute

    def listen(self, node: _Node) -> str | None:
        addr = self.required(node, "listen_addr", lambda v: v != "")
        if addr is None:
            return None
        where = node.at("listen_addr")
        match = re.fullmatch(r"(?:\[([^\]]*)\]|([^:]*)):([^:]*)", addr)
        if match is None:
            self.fail(where, f"{addr!r} is no host:port address")
            return None
        host, port = match.group(1) if match.group(1) is not None else match.group(2), match[3]
        if not port.isdigit() or int(port) > 65535:
            self.fail(
                where, f"{addr!r}: canner listens on a port number, write it instead of {port!r}"
            )
            return None
        port = str(int(port))
        if host in ("", "0.0.0.0"):
            if host == "":
                self.warn(
                    where,
                    f"{addr!r} listens on every IPv4 and IPv6 address in Go: written as"
                    f" tcp:{port} (IPv4 only; tcp6:{port}:interface=\\:\\: takes both)",
                )
            return f"tcp:{port}"
        if host == "localhost":
            self.warn(where, f"{addr!r}: written as the address localhost names, 127.0.0.1")
            host = "127.0.0.1"
        try:
            ip = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            self.warn(where, f"{addr!r}: canner binds the address {host!r} resolves to at start")
            return f"tcp:{port}:interface={host}"
        if ip.version == 6:
            # Colons inside a Twisted endpoint string are escaped.
            return f"tcp6:{port}:interface=" + host.replace(":", "\\:")
        return f"tcp:{port}:interface={host}"

    def convert(self, config: _Node) -> tuple[list[str], list[tuple[str, bool]], bool] | None:
        """The top-level lines, the project lines (each with whether it belongs to a delivery
        table) and whether delivery tables are in force (``None``: a fatal finding)."""
        top: list[str] = []
        listen = self.listen(config)
        issuer = self.required(config, "issuer")
        if issuer is not None:
            parts = urlsplit(issuer)
            if not parts.scheme or not parts.netloc:
                self.fail(
                    config.at("issuer"),
                    f"{issuer!r} has no scheme and host (the Go canner refuses it too)",
                )
        data_dir = self.path(config, "data_dir", "the data directory")
        max_upload = self.required(config, "max_upload_bytes", lambda v: v >= 1)
        min_free = self.required(config, "min_free_bytes", lambda v: v >= 1)
        if min_free is not None and min_free > _INT64_MAX:
            self.fail(
                config.at("min_free_bytes"),
                f"{min_free} is above 2^63-1, canner's limit"
                " (and more free space than any disk has)",
            )
        retention = self.duration(config, "partial_upload_retention", "30m")
        concurrency = config.get_valid("delivery_concurrency")
        delivering = bool(concurrency)
        if concurrency is not None and concurrency < 0:
            self.fail(
                config.at("delivery_concurrency"),
                "must be at least 0 (the Go canner refuses it too)",
            )
        elif not concurrency:
            said = (
                "0: the Go canner delivered nothing"
                if "delivery_concurrency" in config
                else "absent, which is 0: the Go canner delivered nothing (its design.md says"
                " the default is 2, hazard H2)"
            )
            self.warn(
                config.at("delivery_concurrency"),
                f"{said}; every delivery table is written commented out: uncomment them and set"
                " delivery_concurrency to deliver",
            )
        top.append(f"issuer = {_toml_value(issuer)}")
        top.append(f"data_dir = {_toml_value(data_dir)}")
        top.append(f"listen = {_toml_value(listen)}")
        top.append(f"max_upload_bytes = {max_upload}")
        top.append(f"min_free_bytes = {min_free}")
        top.append(f"partial_upload_retention = {_toml_value(retention)}")
        if delivering:
            top.append(f"delivery_concurrency = {concurrency}")
        projects = config.get_valid("projects")
        if not projects:
            if config.get("projects") is not _INVALID:
                self.fail(
                    config.at("projects"),
                    "at least one project is required (the Go canner refuses to start without one)",
                )
            return None
        lines: list[tuple[str, bool]] = []
        for project_id, project in projects.items():
            lines.extend(self.project(project_id, project, projects.at(project_id)))
        if any(f.fatal for f in self.findings):
            return None
        return top, lines, delivering

    def project(self, project_id: str, node: _Node | None, path: str) -> list[tuple[str, bool]]:
        if not PROJECT_ID.fullmatch(project_id):
            self.fail(
                path,
                "a project id is 1-128 characters of [A-Za-z0-9._:-] (the Go canner"
                " refuses it too)",
            )
            return []
        if node is None or node is _INVALID:
            if node is None:
                self.fail(path, "null: the Go canner refuses a project without packaging")
            return []
        base = f"projects.{_toml_key(project_id)}"
        lines = [(f"[{base}]", False), ("", False)]
        megawarc = False
        packaging = node.get_valid("packaging")
        if packaging is None:
            if "packaging" not in node:
                self.fail(
                    node.at("packaging"), "required (the Go canner refuses to start without it)"
                )
        else:
            megawarc, table = self.packaging(packaging)
            if table:
                lines += [(line, False) for line in [f"[{base}.packaging]", *table, ""]]
        delivery = node.get_valid("delivery")
        if delivery is None:
            if node.get("delivery") is not _INVALID:
                self.warn(
                    node.at("delivery"),
                    "absent (optional in the Go canner's first version, required since): no"
                    " delivery table, this project's artifacts stay local",
                )
            return lines
        keys, metadata = self.delivery(delivery, megawarc)
        table = [f"[{base}.delivery]", *keys]
        if metadata:
            table += ["", f"[{base}.delivery.metadata]", *metadata]
        return lines + [(line, True) for line in table] + [("", False)]

    def packaging(self, node: _Node) -> tuple[bool, list[str]]:
        kind = self.required(node, "type", lambda v: v in ("identity", "mergewarc"))
        if kind == "identity":
            for key in ("trigger_bytes", "target_package_bytes", "max_wait"):
                if key in node:
                    self.warn(
                        node.at(key),
                        "ignored by the Go canner for identity packaging; not carried over",
                    )
            return False, []
        if kind != "mergewarc":
            return False, []
        self.warn(
            node.at("type"),
            "mergewarc packages (<project>-<package id[:24]>.warc.zst) become canner megawarc"
            " items (<remote_name>.megawarc.warc.gz or .warc.zst, .megawarc.json.gz, ...)",
        )
        target = self.required(node, "target_package_bytes", lambda v: v >= 1)
        trigger = self.required(node, "trigger_bytes")
        if trigger is not None and target is not None and trigger < target:
            self.fail(
                node.at("trigger_bytes"),
                "must be at least target_package_bytes (the Go canner refuses it too)",
            )
        elif trigger is not None:
            self.warn(
                node.at("trigger_bytes"),
                "no equivalent: canner does not wait for this many bytes before packing; a"
                " batch closes at target_bytes or max_wait",
            )
        max_wait = self.duration(node, "max_wait", None)
        return True, [
            'mode = "megawarc"',
            f"target_bytes = {target}",
            f"max_wait = {_toml_value(max_wait)}",
        ]

    def delivery(self, node: _Node, megawarc: bool) -> tuple[list[str], list[str]]:
        """The delivery table's lines and its metadata table's."""
        self.required(node, "sink", lambda v: v == "internet_archive")
        credentials = self.path(node, "credentials_file", "the IA key file")
        identifier = self.required(node, "identifier", lambda v: v != "")
        retention = self.duration(node, "local_artifact_retention", None)
        lines = [
            'sink = "internet_archive"',
            "# The Go canner's key file (access key, then secret): canner reads it as it is;"
            " the keys are never copied here.",
            f"credentials = {_toml_value(credentials)}",
        ]
        written_id = ""
        if identifier is not None:
            written_id = translate_template(
                identifier, megawarc, node.at("identifier"), self.findings
            )
            lines.append(f"identifier = {_toml_value(written_id)}")
        remote = node.get_valid("remote_name")
        if remote is None:
            remote = "{{PACKAGE_FILENAME}}"
        unique = not megawarc and "{object_id}" not in written_id
        remote_path = node.at("remote_name") + ("" if "remote_name" in node else " (default)")
        written = translate_template(
            remote, megawarc, remote_path, self.findings, unique_name=unique
        )
        lines.append(f"remote_name = {_toml_value(written)}")
        lines.append(f"local_artifact_retention = {_toml_value(retention)}")
        metadata = node.get_valid("metadata")
        return lines, self.metadata(metadata, megawarc) if metadata else []

    def metadata(self, node: _Node, megawarc: bool) -> list[str]:
        entries: dict[str, list[str]] = {}
        for key, values in node.items():
            path = node.at(key)
            if values is None or values is _INVALID:
                if values is None:
                    self.warn(path, "null: the Go canner sent no value; dropped")
                continue
            if not values:
                self.warn(path, "no values: the Go canner sent nothing; dropped")
                continue
            name = key
            problem = metadata_key_problem(key)
            if problem is not None:
                lower = key.lower()
                if metadata_key_problem(lower) is None and lower not in node | entries:
                    name = lower
                    self.warn(
                        path,
                        f"{problem}: go2internetarchive refused it at every upload;"
                        f" written as {lower!r}",
                    )
                else:
                    self.warn(
                        path, f"{problem}: go2internetarchive refused it at every upload; dropped"
                    )
                    continue
            written = []
            for i, value in enumerate(values):
                if not value.strip():
                    self.warn(f"{path}[{i}]", "empty: canner sends no empty value; dropped")
                    continue
                written.append(translate_template(value, megawarc, f"{path}[{i}]", self.findings))
            if written:
                entries[name] = written
        return [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in entries.items()]


# -- the whole conversion ----------------------------------------------------------------------

# canner's key -> the Go canner's, where they differ (for errors of the loader).
_GO_NAMES = {
    "listen": "listen_addr",
    "credentials": "credentials_file",
    "mode": "type",
    "target_bytes": "target_package_bytes",
}


def _json_path(key: str, project_ids: list[str]) -> str:
    """The JSON path of a canner config key (``projects.a.b.delivery.identifier``)."""
    path, rest = "$", key
    for project_id in sorted(project_ids, key=len, reverse=True):
        if key.startswith(f"projects.{project_id}.") or key == f"projects.{project_id}":
            path = child(child(path, "projects"), project_id)
            rest = key[len(f"projects.{project_id}.") :]
            break
    for part in rest.split(".") if rest else []:
        path = child(path, _GO_NAMES.get(part, part))
    return path


def _loader_findings(text: str, project_ids: list[str]) -> list[Finding]:
    """What canner's loader says about ``text``, with every delivery table in force."""
    try:
        parse_config(tomllib.loads(text), Path("/"))
    except ConfigError as e:
        path = _json_path(e.key, project_ids)
        return [Finding(path, f"canner refuses the converted value: {e.problem}", fatal=True)]
    return []


def convert_config(text: str, source: Path, workdir: Path) -> Conversion:
    """Convert a Go canner ``config.json`` (``text``, read from ``source``) to canner TOML.

    Relative paths are resolved against ``workdir`` (where the Go canner ran).  Pure: reads no
    file, never the IA key file.  The TOML loads with canner's loader whenever no finding is
    fatal; with a fatal finding ``toml`` is ``None``.
    """
    findings: list[Finding] = []
    try:
        raw = json.loads(text, object_pairs_hook=_Object, parse_constant=_reject_constant)
    except ValueError as e:
        return Conversion(None, (Finding("$", f"not JSON: {e}", fatal=True),))
    decoded = _Decoder(findings).value(_CONFIG, raw, "$", None)
    if decoded is _INVALID:
        return Conversion(None, tuple(findings))
    converter = _Converter(workdir, findings)
    parts = converter.convert(decoded)
    if parts is None or any(f.fatal for f in findings):
        return Conversion(None, tuple(findings))
    top, projects, delivering = parts
    header = [
        f"# Converted from the Go canner's {source.name} by `canner import-go-config`; every",
        '# change is reported on its standard error (docs/operator-guide.md, "Switching from',
        '# the Go canner").',
    ]

    def render(commented: bool) -> str:
        lines = [
            ("# " + line if line else "#") if delivery and commented else line
            for line, delivery in projects
        ]
        return "\n".join([*header, *top, "", *lines]).rstrip("\n") + "\n"

    toml = render(commented=not delivering)
    # Checked with every delivery table in force, so uncommenting them gives a config that loads.
    findings += _loader_findings(render(commented=False), list(decoded.get_valid("projects")))
    fatal = any(f.fatal for f in findings)
    return Conversion(None if fatal else toml, tuple(findings))
