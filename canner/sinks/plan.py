"""Where an object goes (pure): templates, identifier and remote-name rules, the item plan.

:func:`check_destination` checks a project's templates at config load with worst-case values;
:func:`plan_upload` expands them for one object into an :class:`ItemPlan` (identifier, remote
name, every non-secret PUT header).  The rules are IA's (``docs/reference/internet-archive.md`` §3).
"""

from __future__ import annotations

import re
import time
import unicodedata
from collections.abc import Mapping
from urllib.parse import quote

from attrs import frozen

from canner import templates
from canner.config import (
    DELIVERY_FIELDS,
    ConfigError,
    DeliveryTable,
    LedgerConfig,
    check_template,
)
from canner.sinks.ia.metadata import (
    METADATA_MAX_VALUES,
    encode_metadata_value,
    metadata_headers,
    metadata_key_problem,
)

# The files of a megawarc package are "<basename><suffix>"; the longest suffix names a zstd
# dictionary id (a 32-bit number).
PACKAGE_SUFFIX_SAMPLES = (".megawarc.json.gz", ".4294967295.megawarc.warc.zst")
_SAMPLE_PACKAGES = ("0" * 32,)
IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{4,99}")
# Names IA writes into every item itself (reference §3).
RESERVED_SUFFIXES = ("_meta.xml", "_files.xml")
# A sanitised filename is at most this many UTF-8 bytes, so "{filename}.manifest.jsonl" and the
# like stay under the 255-byte name limit of the filesystems IA stores files on.
FILENAME_MAX_BYTES = 200
# Conservative bound for one remote-name segment (a file or directory name on IA's disks).
SEGMENT_MAX_BYTES = 255
HEX_MD5 = re.compile(r"[0-9a-f]{32}")

# Worst-case sample values for check_destination.  Object ids are 32 hex, or a node prefix of up
# to 16 [a-z0-9] plus "-" plus 32 hex (canner.ids).
_SAMPLE_OBJECT_IDS = ("0" * 32, "z" * 16 + "-" + "f" * 32)
_SAMPLE_DATES = ("19700101000000", "99991231235959")
# Sanitised filenames as long as they get (ASCII and 2-byte characters), one that is a special
# top-level directory name, and a short one.
_SAMPLE_FILENAMES = ("x" * FILENAME_MAX_BYTES, "é" * (FILENAME_MAX_BYTES // 2), "history", "a")


class PlanError(ValueError):
    """An object's expanded destination breaks IA's rules (config validation should prevent it)."""


class ItemTooBig(PlanError):
    """The plan would push its item past ``max_item_bytes``: an operator decides (a smaller
    ``target_bytes``, another identifier template, a larger limit); nothing is sent."""


def item_too_big(delivery: DeliveryTable, identifier: str, item_bytes: int) -> ItemTooBig | None:
    """The refusal of a plan that would put ``item_bytes`` into IA item ``identifier`` (None: it
    fits, or the sink has no item limit)."""
    limit = delivery.item_limit()
    if limit is None or item_bytes <= limit:
        return None
    return ItemTooBig(
        f"item {identifier} would hold {item_bytes} bytes, more than max_item_bytes"
        f" ({limit}): IA refuses files to an item near 1 TiB; not sent"
    )


@frozen
class ItemPlan:
    """Where one object goes and how, resolved once from config and stable inputs.

    ``headers`` are every PUT header except ``authorization`` (the secret is added by the sink)
    and ``Content-Length`` (set from the body producer).  It is built from stable inputs only,
    so every attempt of an object resolves to the same destination.
    """

    project: str
    object_id: str
    identifier: str
    remote_name: str
    size: int
    content_md5: str
    size_hint: int
    headers: tuple[tuple[str, str], ...]
    # The file's BLAKE3 as its receipt states it ("blake3:<hex>"), when the sender knows it: a
    # directory sink compares what it finds in place against it.
    checksum: str = ""

    @property
    def path(self) -> str:
        """The percent-encoded S3 path: ``/{identifier}/{remote name, encoded per segment}``."""
        return "/" + quote(self.identifier, safe="") + "/" + quote(self.remote_name, safe="/")


def format_date(accepted_at: int) -> str:
    """Receipt time as ``{date}`` expands it: UTC ``YYYYMMDDhhmmss``."""
    return time.strftime("%Y%m%d%H%M%S", time.gmtime(accepted_at))


def _is_unsafe_char(ch: str) -> bool:
    # Control characters (C0, DEL, C1), line/paragraph separators, lone surrogates (which cannot
    # be encoded as UTF-8), and the noncharacters XML 1.0 forbids.
    return unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") or ch in "\ufffe\uffff"


def _truncate_utf8(text: str, max_bytes: int) -> str:
    out, used = [], 0
    for ch in text:
        n = len(ch.encode("utf-8"))
        if used + n > max_bytes:
            break
        out.append(ch)
        used += n
    return "".join(out)


_EXTENSION = re.compile(r"(?:\.[A-Za-z0-9]{1,10}){1,3}$")


def sanitize_filename(name: str | None, object_id: str) -> str:
    """The worker's filename made safe as one remote-name segment.

    Keeps the part after the last ``/`` or ``\\``, drops control characters, strips leading dots
    and surrounding whitespace, and bounds the result to :data:`FILENAME_MAX_BYTES` UTF-8 bytes
    (keeping a short extension such as ``.warc.gz``).  Returns ``object_id`` when nothing usable
    is left.  Pure, deterministic and idempotent.
    """
    if not name:
        return object_id
    text = "".join(ch for ch in name if not _is_unsafe_char(ch))
    text = _trim(re.split(r"[/\\]", text)[-1])
    if len(text.encode("utf-8")) > FILENAME_MAX_BYTES:
        match = _EXTENSION.search(text)
        ext = match.group(0) if match and len(match.group(0)) < len(text) else ""
        stem = _truncate_utf8(text[: len(text) - len(ext)], FILENAME_MAX_BYTES - len(ext))
        text = _trim(stem.rstrip() + ext)
    return text or object_id


def _trim(text: str) -> str:
    """Strip surrounding whitespace and every leading dot."""
    text = text.strip()
    while text.startswith("."):
        text = text[1:].lstrip()
    return text


def identifier_problem(identifier: str) -> str | None:
    """Why ``identifier`` breaks IA's rules, or ``None`` when it is valid."""
    if not IDENTIFIER.fullmatch(identifier):
        return (
            f"expands to {identifier!r}, but an identifier is 5-100 characters of "
            "[A-Za-z0-9._-] starting with a letter or digit"
        )
    return None


def remote_name_problem(remote_name: str, identifier: str) -> str | None:
    """Why ``remote_name`` breaks IA's rules for a file in ``identifier``, or ``None``."""
    if not remote_name:
        return "expands to an empty name"
    if any(_is_unsafe_char(ch) for ch in remote_name):
        return f"expands to {remote_name!r}, which contains control characters"
    if remote_name.startswith("/") or remote_name.endswith("/"):
        return f"expands to {remote_name!r}, which starts or ends with '/'"
    segments = remote_name.split("/")
    for segment in segments:
        if segment in ("", ".", ".."):
            return f"expands to {remote_name!r}, which has an empty, '.' or '..' segment"
        if len(segment.encode("utf-8")) > SEGMENT_MAX_BYTES:
            return (
                f"a segment can expand to {len(segment.encode('utf-8'))} bytes "
                f"(at most {SEGMENT_MAX_BYTES})"
            )
    if segments[0] == "history" and len(segments) > 1:
        return f"expands to {remote_name!r}, under history/, which IA keeps for old versions"
    if remote_name in (identifier + suffix for suffix in RESERVED_SUFFIXES):
        return f"expands to {remote_name!r}, one of IA's own files in the item"
    return None


def _values(project: str, object_id: str, filename: str, date: str) -> dict[str, str]:
    return {"project": project, "object_id": object_id, "filename": filename, "date": date}


def is_loopback(host: str | None) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or bool(host and host.startswith("127."))


def check_destination(project_id: str, delivery: DeliveryTable, mode: str = "identity") -> None:
    """Refuse templates that could ever produce an invalid destination (run by parse_config).

    Every template is expanded with worst-case values (shortest and longest object ids, the
    longest sanitised filenames, special names such as ``history``) and checked against IA's
    identifier, remote-name and metadata-key rules.  Raises :class:`ConfigError` whose key names
    the offending setting, e.g. ``projects.example.delivery.identifier``.
    """
    base = f"projects.{project_id}.delivery"
    destination = {"identifier": delivery.identifier, "remote_name": delivery.remote_name}
    used: dict[str, frozenset[str]] = {}
    for key, template in destination.items():
        used[key] = check_template(template, DELIVERY_FIELDS, f"{base}.{key}")
    if "filename" in used["identifier"]:
        raise ConfigError(
            f"{base}.identifier",
            "must not use {filename}: a worker's filename can break IA's identifier rules",
        )
    if mode == "megawarc":
        _validate_package_templates(base, project_id, delivery)
    elif "object_id" not in used["identifier"] | used["remote_name"]:
        raise ConfigError(
            f"{base}.identifier",
            "identifier or remote_name must contain {object_id}, so that every object gets its "
            "own stable destination",
        )
    for object_id in _SAMPLE_OBJECT_IDS if mode != "megawarc" else ():
        for date in _SAMPLE_DATES:
            for filename in _SAMPLE_FILENAMES:
                values = _values(project_id, object_id, filename, date)
                identifier = templates.expand(delivery.identifier, values)
                problem = identifier_problem(identifier)
                if problem is not None:
                    raise ConfigError(f"{base}.identifier", problem)
                remote = templates.expand(delivery.remote_name, values)
                problem = remote_name_problem(remote, identifier)
                if problem is not None:
                    raise ConfigError(f"{base}.remote_name", problem)
    for key, value_templates in delivery.metadata_templates().items():
        name = f"{base}.metadata.{key}"
        problem = metadata_key_problem(key)
        if problem is not None:
            raise ConfigError(name, problem)
        if len(value_templates) > METADATA_MAX_VALUES:
            raise ConfigError(name, f"at most {METADATA_MAX_VALUES} values")
        for template in value_templates:
            placeholders = check_template(template, DELIVERY_FIELDS, name)
            if not placeholders and encode_metadata_value(template) is None:
                raise ConfigError(name, f"the value {template!r} is empty once expanded")


# Worst-case periods for check_ledger: a day's and a month's.
_SAMPLE_PERIODS = ("2026-11-30", "2026-11")


def check_ledger(ledger: LedgerConfig) -> None:
    """Refuse a ``[ledger]`` whose identifier or metadata keys could break IA's rules (run by
    parse_config through the IA sink's table, once the ledger's own rules passed)."""
    for period in _SAMPLE_PERIODS:
        problem = identifier_problem(ledger.identifier_for(period))
        if problem is not None:
            raise ConfigError("ledger.identifier", problem)
    for key in ledger.metadata:
        problem = metadata_key_problem(key)
        if problem is not None:
            raise ConfigError(f"ledger.metadata.{key}", problem)


def _package_values(project: str, package: str, batch_date: str) -> dict[str, str]:
    return {"project": project, "package": package, "batch_date": batch_date}


def _validate_package_templates(base: str, project_id: str, delivery: DeliveryTable) -> None:
    """A megawarc item: worst-case package ids and batch dates, the longest file suffixes."""
    for key, value_templates in delivery.metadata_templates().items():
        for template in value_templates:
            try:
                extra = templates.fields(template) - {"project", "package", "batch_date"}
            except templates.TemplateError:
                continue  # reported with the other metadata checks
            if extra:
                raise ConfigError(
                    f"{base}.metadata.{key}",
                    "a megawarc item's metadata may use {project}, {package} and {batch_date}"
                    " only, not " + ", ".join(f"{{{name}}}" for name in sorted(extra)),
                )
    for package in _SAMPLE_PACKAGES:
        for date in _SAMPLE_DATES:
            values = _package_values(project_id, package, date)
            try:
                identifier = templates.expand(delivery.identifier, values)
                basename = templates.expand(delivery.remote_name, values)
            except templates.TemplateError as e:
                raise ConfigError(f"{base}.identifier", f"cannot expand: {e}") from None
            problem = identifier_problem(identifier)
            if problem is not None:
                raise ConfigError(f"{base}.identifier", problem)
            for suffix in PACKAGE_SUFFIX_SAMPLES:
                problem = remote_name_problem(basename + suffix, identifier)
                if problem is not None:
                    raise ConfigError(f"{base}.remote_name", problem)


def plan_package_file(
    delivery: DeliveryTable,
    project: str,
    package: str,
    batch_date: str,
    suffix: str,
    size: int,
    content_md5: str,
    item_bytes: int | None = None,
) -> ItemPlan:
    """Where one file of a megawarc package goes: the item of the package, named
    ``<remote_name expanded><suffix>``; metadata templates see ``{package}``/``{batch_date}``.
    ``item_bytes`` (all the package's files) is the size hint IA picks a server by.

    Stable inputs only, so every attempt resolves to the same destination.  Raises
    :class:`PlanError` like :func:`plan_upload`, :class:`ItemTooBig` when the package's files
    would pass ``max_item_bytes``.
    """
    if not HEX_MD5.fullmatch(content_md5):
        raise PlanError(f"content_md5 must be 32 lowercase hex digits, not {content_md5!r}")
    values = _package_values(project, package, batch_date)
    identifier, remote_name, meta_headers = _expand(delivery, values)
    # Every file of the package goes to its item: the package's bytes are the item's.
    hint = max(size, item_bytes or 0)
    return _item_plan(
        delivery,
        project,
        ("package", package),
        identifier,
        remote_name + suffix,
        size,
        content_md5,
        hint,
        meta_headers,
    )


def plan_upload(
    delivery: DeliveryTable,
    project: str,
    object_id: str,
    filename: str | None,
    accepted_at: int,
    size: int,
    content_md5: str,
) -> ItemPlan:
    """Resolve one object's destination and PUT headers from stable inputs only.

    ``filename`` is the worker's (sanitised here), ``accepted_at`` the receipt time,
    ``content_md5`` 32 lowercase hex digits (:func:`canner.checksum.delivery_digests`).  Raises
    :class:`PlanError` when the result breaks IA's rules, which :func:`check_destination` rules
    out for a validated config, and :class:`ItemTooBig` when the object alone would pass
    ``max_item_bytes``.
    """
    if not HEX_MD5.fullmatch(content_md5):
        raise PlanError(f"content_md5 must be 32 lowercase hex digits, not {content_md5!r}")
    if size < 0:
        raise PlanError(f"size must not be negative, not {size}")
    values = _values(
        project, object_id, sanitize_filename(filename, object_id), format_date(accepted_at)
    )
    identifier, remote_name, meta_headers = _expand(delivery, values)
    if remote_name in (identifier + suffix for suffix in RESERVED_SUFFIXES):
        # Only a worker's filename can land here; rename deterministically rather than refuse.
        remote_name = f"{object_id}-{remote_name}"
    return _item_plan(
        delivery,
        project,
        ("object-id", object_id),
        identifier,
        remote_name,
        size,
        content_md5,
        size,
        meta_headers,
    )


def _expand(
    delivery: DeliveryTable, values: Mapping[str, str]
) -> tuple[str, str, list[tuple[str, str]]]:
    """The identifier, remote name and metadata headers ``delivery``'s templates expand to;
    :class:`PlanError` for a template or metadata value the config should have refused."""
    try:
        identifier = templates.expand(delivery.identifier, values)
        remote_name = templates.expand(delivery.remote_name, values)
        metadata = {
            key: [templates.expand(t, values) for t in value_templates]
            for key, value_templates in delivery.metadata_templates().items()
        }
        return identifier, remote_name, metadata_headers(metadata)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _item_plan(
    delivery: DeliveryTable,
    project: str,
    key: tuple[str, str],
    identifier: str,
    remote_name: str,
    size: int,
    content_md5: str,
    size_hint: int,
    meta_headers: list[tuple[str, str]],
) -> ItemPlan:
    """The plan and its PUT headers; ``key`` is the file-level metadata that names what the
    file holds (``("object-id", id)`` or ``("package", id)``).  :class:`PlanError` for a
    destination IA's rules refuse, :class:`ItemTooBig` for ``size_hint`` past the item limit."""
    problem = identifier_problem(identifier) or remote_name_problem(remote_name, identifier)
    if problem is not None:
        raise PlanError(problem)
    if (too_big := item_too_big(delivery, identifier, size_hint)) is not None:
        raise too_big
    name, value = key
    headers = [
        ("content-md5", content_md5),
        ("x-archive-auto-make-bucket", "1"),
        ("x-archive-size-hint", str(size_hint)),
        (f"x-archive-filemeta-canner-{name}", value),
        *meta_headers,
    ]
    return ItemPlan(
        project=project,
        object_id=value,
        identifier=identifier,
        remote_name=remote_name,
        size=size,
        content_md5=content_md5,
        size_hint=size_hint,
        headers=tuple(headers),
    )
