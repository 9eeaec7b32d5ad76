"""The Internet Archive sink: where an accepted object leaves canner.

Two halves, following ``reference/internet-archive.md``:

* the **plan** half is pure.  :func:`validate_delivery` checks a project's templates at config load
  with worst-case values; :func:`plan_upload` expands them for one object into an :class:`ItemPlan`
  (identifier, remote name, every non-secret PUT header); :func:`classify` turns an S3 answer into
  an :class:`Outcome`; :func:`parse_metadata` reads the metadata API's JSON.
* the **shell** half does I/O.  :func:`load_credentials` reads a file (call it
  at start-up or through the blocking runner); :class:`IASink` talks HTTP through an injected treq
  ``HTTPClient`` and clock: it looks the remote file up, probes ``check_limit``, and PUTs the file
  streaming from disk, cancellable, with a no-progress watchdog and bounded response reads.

The scheduler calls :meth:`IASink.deliver` once per attempt and records the :class:`DeliveryResult`;
the purge path calls :meth:`IASink.remote_file` and :meth:`RemoteFile.matches` to verify.
"""

from __future__ import annotations

import configparser
import html
import json
import os
import re
import string
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import IO, Any, TypeVar, cast
from urllib.parse import quote, urljoin, urlsplit

from attrs import define, field, frozen
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError, ConnectionClosed, DNSLookupError
from twisted.internet.interfaces import IConsumer, IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from canner.config import ConfigError, DeliveryConfig

log = Logger()

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Plan half (pure)
# --------------------------------------------------------------------------------------------

PLACEHOLDERS = frozenset({"project", "object_id", "filename", "date"})
IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{4,99}")
METADATA_KEY = re.compile(r"[a-z][a-z0-9_.-]*")
# Names IA writes into every item itself (reference §3).
RESERVED_SUFFIXES = ("_meta.xml", "_files.xml")
# A sanitised filename is at most this many UTF-8 bytes, so "{filename}.manifest.jsonl" and the
# like stay under the 255-byte name limit of the filesystems IA stores files on.
FILENAME_MAX_BYTES = 200
# Conservative bound for one remote-name segment (a file or directory name on IA's disks).
SEGMENT_MAX_BYTES = 255
# Two-digit header index (x-archive-meta01-...): at most 99 values per key.
METADATA_MAX_VALUES = 99
HEX_MD5 = re.compile(r"[0-9a-f]{32}")

# Worst-case sample values for validate_delivery.  Object ids are 32 hex, or a node prefix of up
# to 16 [a-z0-9] plus "-" plus 32 hex (canner.ids).
_SAMPLE_OBJECT_IDS = ("0" * 32, "z" * 16 + "-" + "f" * 32)
_SAMPLE_DATES = ("19700101000000", "99991231235959")
# Sanitised filenames as long as they get (ASCII and 2-byte characters), one that is a special
# top-level directory name, and a short one.
_SAMPLE_FILENAMES = ("x" * FILENAME_MAX_BYTES, "é" * (FILENAME_MAX_BYTES // 2), "history", "a")


class PlanError(ValueError):
    """An object's expanded destination breaks IA's rules (config validation should prevent it)."""


class Verdict(Enum):
    """What an attempt's result means for the delivery row."""

    SUCCESS = "success"  # the remote file is there: record ``delivered``
    TRANSIENT = "transient"  # retry with the normal backoff
    OPERATOR = "operator"  # retry at the 1 h cap and flag the row: a human must act


@frozen
class Outcome:
    """A verdict with a short, secret-free reason (fit for ``last_error``) and IA's retry hint."""

    verdict: Verdict
    reason: str
    retry_after: float | None = None

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.SUCCESS

    @property
    def needs_operator(self) -> bool:
        return self.verdict is Verdict.OPERATOR


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


def _template_fields(template: str) -> list[tuple[str, str | None]]:
    """Split a template into (literal, field) pairs; ``ValueError`` for anything but ``{name}``."""
    parts: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        if name is not None:
            if name not in PLACEHOLDERS:
                raise ValueError(
                    f"unknown placeholder {{{name}}} (known: {{project}} {{object_id}} "
                    "{filename} {date})"
                )
            if spec or conversion:
                raise ValueError(f"placeholder {{{name}}} takes no format spec or conversion")
        parts.append((literal, name))
    return parts


def expand_template(template: str, values: Mapping[str, str]) -> str:
    """Expand ``{project}``, ``{object_id}``, ``{filename}``, ``{date}`` (``{{``/``}}`` escape).

    Raises ``ValueError`` for an unknown placeholder, a format spec, or unbalanced braces.
    """
    return "".join(
        literal + (values[name] if name is not None else "")
        for literal, name in _template_fields(template)
    )


def _placeholders(template: str) -> set[str]:
    return {name for _, name in _template_fields(template) if name is not None}


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


def metadata_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be sent as an ``x-archive-meta`` header, or ``None``."""
    if not METADATA_KEY.fullmatch(key):
        return "a metadata key is lowercase [a-z][a-z0-9_.-]*"
    if key.startswith("xml"):
        return "a metadata key must not start with 'xml'"
    # Headers write "_" as "--"; a key that already holds "--" (or "-_"/"_-") cannot round-trip.
    for bad in ("--", "-_", "_-"):
        if bad in key:
            return f"a metadata key containing {bad!r} cannot be expressed as a header"
    return None


def _strip_xml_forbidden(value: str) -> str:
    # XML 1.0 allows tab, LF, CR and everything from U+0020 except surrogates and U+FFFE/U+FFFF.
    return "".join(
        ch
        for ch in value
        if ch in "\t\n\r"
        or (ch >= " " and not ("\ud800" <= ch <= "\udfff") and ch not in "\ufffe\uffff")
    )


def encode_metadata_value(value: str) -> str | None:
    """A metadata value as a header value, or ``None`` when nothing is left to send.

    Strips characters XML forbids; a value with non-ASCII, whitespace or control characters is
    sent as ``uri(<percent-encoded UTF-8>)``.
    """
    value = _strip_xml_forbidden(value)
    if not value.strip():
        return None
    if any(ord(ch) > 0x7E or ord(ch) < 0x21 for ch in value):
        return "uri(" + quote(value, safe="") + ")"
    return value


def metadata_headers(metadata: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """``x-archive-meta`` headers for already-expanded values (one value: no index).

    Raises ``ValueError`` for a key :func:`metadata_key_problem` refuses.
    """
    headers: list[tuple[str, str]] = []
    for key, raw_values in metadata.items():
        problem = metadata_key_problem(key)
        if problem is not None:
            raise ValueError(f"{key!r}: {problem}")
        values = [v for v in (encode_metadata_value(r) for r in raw_values) if v is not None]
        header_key = key.replace("_", "--")
        if len(values) == 1:
            headers.append((f"x-archive-meta-{header_key}", values[0]))
        else:
            for index, value in enumerate(values[:METADATA_MAX_VALUES], start=1):
                headers.append((f"x-archive-meta{index:02d}-{header_key}", value))
    return headers


def _values(project: str, object_id: str, filename: str, date: str) -> dict[str, str]:
    return {"project": project, "object_id": object_id, "filename": filename, "date": date}


def _is_loopback(host: str | None) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or bool(host and host.startswith("127."))


def validate_delivery(project_id: str, delivery: DeliveryConfig) -> None:
    """Refuse templates that could ever produce an invalid destination (call at config load).

    Every template is expanded with worst-case values (shortest and longest object ids, the
    longest sanitised filenames, special names such as ``history``) and checked against IA's
    identifier, remote-name and metadata-key rules.  Raises :class:`ConfigError` whose key names
    the offending setting, e.g. ``projects.example.delivery.identifier``.
    """
    base = f"projects.{project_id}.delivery"
    templates = {"identifier": delivery.identifier, "remote_name": delivery.remote_name}
    used: dict[str, set[str]] = {}
    for key, template in templates.items():
        try:
            used[key] = _placeholders(template)
        except ValueError as e:
            raise ConfigError(f"{base}.{key}", str(e)) from None
    if "filename" in used["identifier"]:
        raise ConfigError(
            f"{base}.identifier",
            "must not use {filename}: a worker's filename can break IA's identifier rules",
        )
    if "object_id" not in used["identifier"] | used["remote_name"]:
        raise ConfigError(
            f"{base}.identifier",
            "identifier or remote_name must contain {object_id}, so that every object gets its "
            "own stable destination",
        )
    for scheme_key, url in (("s3_url", delivery.s3_url), ("metadata_url", delivery.metadata_url)):
        parts = urlsplit(url)
        if parts.scheme != "https" and not _is_loopback(parts.hostname):
            raise ConfigError(
                f"{base}.{scheme_key}",
                "must be https (the LOW authorization header carries the secret as-is); "
                "plain http is allowed only for loopback test servers",
            )
    for object_id in _SAMPLE_OBJECT_IDS:
        for date in _SAMPLE_DATES:
            for filename in _SAMPLE_FILENAMES:
                values = _values(project_id, object_id, filename, date)
                identifier = expand_template(delivery.identifier, values)
                problem = identifier_problem(identifier)
                if problem is not None:
                    raise ConfigError(f"{base}.identifier", problem)
                remote = expand_template(delivery.remote_name, values)
                problem = remote_name_problem(remote, identifier)
                if problem is not None:
                    raise ConfigError(f"{base}.remote_name", problem)
    for key, value_templates in delivery.metadata.items():
        name = f"{base}.metadata.{key}"
        problem = metadata_key_problem(key)
        if problem is not None:
            raise ConfigError(name, problem)
        if len(value_templates) > METADATA_MAX_VALUES:
            raise ConfigError(name, f"at most {METADATA_MAX_VALUES} values")
        for template in value_templates:
            try:
                placeholders = _placeholders(template)
            except ValueError as e:
                raise ConfigError(name, str(e)) from None
            if not placeholders and encode_metadata_value(template) is None:
                raise ConfigError(name, f"the value {template!r} is empty once expanded")


def plan_upload(
    delivery: DeliveryConfig,
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
    :class:`PlanError` when the result breaks IA's rules, which :func:`validate_delivery` rules
    out for a validated config.
    """
    if not HEX_MD5.fullmatch(content_md5):
        raise PlanError(f"content_md5 must be 32 lowercase hex digits, not {content_md5!r}")
    if size < 0:
        raise PlanError(f"size must not be negative, not {size}")
    values = _values(
        project, object_id, sanitize_filename(filename, object_id), format_date(accepted_at)
    )
    try:
        identifier = expand_template(delivery.identifier, values)
        remote_name = expand_template(delivery.remote_name, values)
        metadata = {
            key: [expand_template(t, values) for t in templates]
            for key, templates in delivery.metadata.items()
        }
        meta_headers = metadata_headers(metadata)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if remote_name in (identifier + suffix for suffix in RESERVED_SUFFIXES):
        # Only a worker's filename can land here; rename deterministically rather than refuse.
        remote_name = f"{object_id}-{remote_name}"
    problem = identifier_problem(identifier) or remote_name_problem(remote_name, identifier)
    if problem is not None:
        raise PlanError(problem)
    size_hint = size
    headers = [
        ("content-md5", content_md5),
        ("x-archive-auto-make-bucket", "1"),
        ("x-archive-size-hint", str(size_hint)),
        ("x-archive-filemeta-canner-object-id", object_id),
        *meta_headers,
    ]
    return ItemPlan(
        project=project,
        object_id=object_id,
        identifier=identifier,
        remote_name=remote_name,
        size=size,
        content_md5=content_md5,
        size_hint=size_hint,
        headers=tuple(headers),
    )


# --- classification ---------------------------------------------------------------------------

_TRANSIENT_400 = frozenset({"RequestTimeout", "IncompleteBody", "BadDigest"})
_OPERATOR_400 = frozenset(
    {
        "InvalidBucketName",
        "InvalidURI",
        "InvalidArgument",
        "MetadataTooLarge",
        "EntityTooLarge",
        "InvalidDigest",
    }
)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REASON_MAX = 300


def _xml_field(body: str, tag: str) -> str | None:
    match = re.search(rf"<{tag}>(.*?)</{tag}>", body, re.DOTALL)
    if match is None:
        return None
    return " ".join(html.unescape(match.group(1)).split())


def _short(text: str, limit: int = REASON_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds when given as delta-seconds, else ``None``."""
    if value is None or not value.strip().isdigit():
        return None
    return float(int(value.strip()))


def classify(status: int, headers: Mapping[str, str], body_excerpt: bytes) -> Outcome:
    """Decide what an S3 answer means (reference §6).

    ``headers`` maps lowercase header names to values; ``body_excerpt`` is the start of the
    response body.  The reason is ``"<status> <Code>: <Message>"`` (or the start of a non-XML
    body), short and made only of what IA sent.  Unknown answers are transient.
    """
    text = body_excerpt.decode("utf-8", "replace")
    code = _xml_field(text, "Code")
    message = _xml_field(text, "Message")
    if code is not None:
        reason = f"{status} {code}" + (f": {message}" if message else "")
    else:
        reason = f"{status}" + (f": {_short(text, 120)}" if text.strip() else "")
    reason = _short(reason)
    retry_after = parse_retry_after(headers.get("retry-after"))

    def outcome(verdict: Verdict) -> Outcome:
        return Outcome(verdict, reason, retry_after)

    if 200 <= status < 300:
        return Outcome(Verdict.SUCCESS, f"{status} stored")
    if status == 403:
        return outcome(Verdict.OPERATOR)
    if status == 400:
        if code in _OPERATOR_400:
            return outcome(Verdict.OPERATOR)
        return outcome(Verdict.TRANSIENT)
    if status == 404 and code == "NoSuchBucket":
        return outcome(Verdict.OPERATOR)
    if status == 409 and code == "BucketAlreadyExists":
        return outcome(Verdict.OPERATOR)
    if status in (411, 501):
        return outcome(Verdict.OPERATOR)
    if status == 503 and "appears to be spam" in text.lower():
        return outcome(Verdict.OPERATOR)
    return outcome(Verdict.TRANSIENT)


# --- the metadata API -------------------------------------------------------------------------


@frozen
class RemoteFile:
    """One entry of an item's ``files`` list in the metadata API."""

    name: str
    size: int | None
    md5: str | None
    sha1: str | None = None

    def matches(self, size: int, md5: str, sha1: str | None = None) -> bool:
        """True when this is the same content: size and MD5 equal (and SHA-1 when both known)."""
        if self.size != size or self.md5 is None or self.md5.lower() != md5.lower():
            return False
        return sha1 is None or self.sha1 is None or self.sha1.lower() == sha1.lower()


@frozen
class Unknown:
    """The lookup failed: the remote file may or may not exist.  Never read this as absent."""

    reason: str
    needs_operator: bool = False


Lookup = RemoteFile | None | Unknown


def parse_metadata(body: bytes, remote_name: str) -> Lookup:
    """Read a ``GET /metadata/{identifier}`` body (status 200) for one remote name.

    ``{}`` (no such item, or not visible yet) and an item without that file give ``None``; a
    darked item gives ``Unknown(needs_operator=True)``; anything unparsable gives ``Unknown``.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Unknown("metadata API answered with something other than JSON")
    if not isinstance(doc, dict):
        return Unknown("metadata API answered with JSON that is not an object")
    if doc.get("is_dark"):
        return Unknown("the item is dark (taken down); IA staff must act", needs_operator=True)
    files = doc.get("files", [])
    if not isinstance(files, list):
        return Unknown("metadata API 'files' is not a list")
    for entry in files:
        if not isinstance(entry, dict) or entry.get("name") != remote_name:
            continue
        raw_size = entry.get("size")
        try:
            size: int | None = int(str(raw_size)) if raw_size is not None else None
        except ValueError:
            size = None
        md5, sha1 = entry.get("md5"), entry.get("sha1")
        return RemoteFile(
            name=remote_name,
            size=size,
            md5=md5 if isinstance(md5, str) else None,
            sha1=sha1 if isinstance(sha1, str) else None,
        )
    return None


# --------------------------------------------------------------------------------------------
# Shell half (I/O)
# --------------------------------------------------------------------------------------------


class CredentialsError(ValueError):
    """The credentials file is unreadable or malformed; the message never holds the secret."""


@frozen
class Credentials:
    """An IA-S3 key pair.  ``repr`` leaves the secret out."""

    access: str
    secret: str = field(repr=False)

    @property
    def authorization(self) -> str:
        return f"LOW {self.access}:{self.secret}"


_KEY_TOKEN = re.compile(r"[\x21-\x7e]+")


def load_credentials(path: Path) -> Credentials:
    """Read IA-S3 keys (blocking; call at start-up).

    ``path`` is either an ``ia.ini`` (``[s3]`` with ``access`` and ``secret``), read with the
    ``internetarchive`` library's config reader (so ``IA_ACCESS_KEY_ID`` and
    ``IA_SECRET_ACCESS_KEY`` override it, as for the ``ia`` tool), or a two-line file: access key,
    then secret.  Raises :class:`CredentialsError`; its text never contains the secret.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CredentialsError(f"cannot read credentials {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise CredentialsError(f"credentials {path} are not UTF-8 text") from None
    if re.search(r"^\s*\[", text, re.MULTILINE):
        # Imported here: the library pulls in requests, which only this start-up step needs.
        from internetarchive.config import get_config

        try:
            config = get_config(config_file=str(path))
        except configparser.Error as e:
            # configparser quotes offending lines, which may hold the secret: say where only.
            line = getattr(e, "lineno", None)
            where = f" (line {line})" if line else ""
            raise CredentialsError(f"credentials {path} are not a valid ia.ini{where}") from None
        except ValueError as e:
            raise CredentialsError(f"credentials {path}: {e}") from None
        s3 = config.get("s3", {})
        access, secret = s3.get("access"), s3.get("secret")
        if not access or not secret:
            raise CredentialsError(f"credentials {path}: [s3] needs both 'access' and 'secret'")
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) != 2:
            raise CredentialsError(
                f"credentials {path}: expected an ia.ini with an [s3] section, or two lines "
                f"(access key, then secret), found {len(lines)} non-empty lines"
            )
        access, secret = lines
    if not _KEY_TOKEN.fullmatch(access) or ":" in access:
        raise CredentialsError(f"credentials {path}: the access key must be printable ASCII")
    if not _KEY_TOKEN.fullmatch(secret):
        raise CredentialsError(f"credentials {path}: the secret must be printable ASCII")
    return Credentials(access, secret)


def redact(text: str, secret: str) -> str:
    """``text`` with every form of ``secret`` (raw, percent-encoded) replaced by ``***``."""
    if not secret:
        return text
    for form in {secret, quote(secret, safe=""), quote(secret)}:
        text = text.replace(form, "***")
    return text


def make_http_client(reactor: Any, connect_timeout: float = 60.0) -> HTTPClient:
    """The production client: a connect timeout, and no persistent connections (a PUT's
    connection is never reused)."""
    pool = _QuietPool(reactor, persistent=False)
    return HTTPClient(Agent(reactor, connectTimeout=connect_timeout, pool=pool))


class _QuietPool(HTTPConnectionPool):
    """A pool whose per-connection factories do not log "Starting factory" for every request."""

    class _factory(HTTPConnectionPool._factory):  # type: ignore[valid-type,misc]  # noqa: N801
        noisy = False


def _user_agent() -> str:
    try:
        version = importlib_metadata.version("canner")
    except importlib_metadata.PackageNotFoundError:
        version = "0"
    return f"canner/{version}"


class LocalFileError(Exception):
    """The local artifact is missing, unreadable, or not the size its receipt says."""


@implementer(IBodyProducer)
class FileProducer:
    """Streams exactly ``length`` bytes of an open file, ``read_size`` at a time.

    Reads are scheduled on ``clock`` (one chunk per turn while the consumer wants more), so only
    one chunk is in memory.  ``on_progress(n)`` is told about every chunk handed to the consumer.
    A short file fails the ``startProducing`` Deferred with :class:`LocalFileError`.
    """

    def __init__(
        self,
        stream: IO[bytes],
        length: int,
        clock: IReactorTime,
        on_progress: Callable[[int], None],
        read_size: int = 1 << 20,
    ) -> None:
        self.length = length
        self._stream = stream
        self._clock = clock
        self._on_progress = on_progress
        self._read_size = read_size
        self._consumer: IConsumer | None = None
        self._done: Deferred[None] | None = None
        self._call: IDelayedCall | None = None
        self._paused = False
        self._stopped = False
        self._sent = 0

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        self._consumer = consumer
        self._done = Deferred()
        self._schedule()
        return self._done

    def pauseProducing(self) -> None:
        self._paused = True
        self._unschedule()

    def resumeProducing(self) -> None:
        self._paused = False
        self._schedule()

    def stopProducing(self) -> None:
        # IBodyProducer: after stopProducing the startProducing Deferred need not fire.
        self._stopped = True
        self._unschedule()

    def _schedule(self) -> None:
        if self._call is None and not self._paused and not self._stopped and self._done:
            self._call = self._clock.callLater(0, self._step)

    def _unschedule(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _step(self) -> None:
        self._call = None
        if self._paused or self._stopped or self._done is None or self._done.called:
            return
        assert self._consumer is not None
        want = min(self._read_size, self.length - self._sent)
        try:
            data = self._stream.read(want) if want > 0 else b""
        except (OSError, ValueError) as e:
            self._stopped = True
            self._done.errback(LocalFileError(f"reading the local file failed: {e}"))
            return
        if want > 0 and not data:
            self._stopped = True
            self._done.errback(
                LocalFileError(f"the local file ended at {self._sent} of {self.length} bytes")
            )
            return
        if data:
            self._sent += len(data)
            self._consumer.write(data)
            self._on_progress(len(data))
        if self._sent >= self.length:
            self._stopped = True
            self._done.callback(None)
            return
        self._schedule()


_RESPONSE_DONE = Failure(ResponseDone())


class _BoundedCollector(TwistedProtocol):
    """Collects at most ``limit`` bytes of a response body; more is cut off (``truncated``)."""

    def __init__(self, limit: int, done: Deferred[tuple[bytes, bool]]) -> None:
        self._limit = limit
        self._done = done
        self._chunks: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        if self._done.called:
            return
        room = self._limit - self._size
        if len(data) > room:
            self._chunks.append(data[:room])
            self._done.callback((b"".join(self._chunks), True))
            if self.transport is not None:
                self.transport.stopProducing()  # type: ignore[attr-defined]
            return
        self._chunks.append(data)
        self._size += len(data)

    def connectionLost(self, reason: Failure = _RESPONSE_DONE) -> None:
        if self._done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback((b"".join(self._chunks), False))
        else:
            self._done.errback(reason)


def read_bounded(
    response: IResponse, limit: int, timeout: float, clock: IReactorTime
) -> Deferred[tuple[bytes, bool]]:
    """Read at most ``limit`` bytes of ``response``'s body within ``timeout`` seconds.

    Fires with ``(body, truncated)``; fails with ``TimeoutError`` when the body is too slow.
    """
    collector: _BoundedCollector

    def cancel(d: Deferred[tuple[bytes, bool]]) -> None:
        transport = collector.transport
        if transport is not None:
            transport.stopProducing()  # type: ignore[attr-defined]

    done: Deferred[tuple[bytes, bool]] = Deferred(cancel)
    collector = _BoundedCollector(limit, done)
    response.deliverBody(collector)
    return done.addTimeout(timeout, clock)


def _first_headers(headers: Headers) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): values[0].decode("latin-1")
        for name, values in headers.getAllRawHeaders()
        if values
    }


@frozen
class DeliveryResult:
    """What one :meth:`IASink.deliver` attempt came to.

    ``outcome.ok`` means the file is at IA (``already_present``: found by the metadata lookup, no
    PUT sent).  Otherwise ``outcome`` says whether to retry normally or flag for an operator.
    """

    outcome: Outcome
    already_present: bool = False
    bytes_sent: int = 0
    duration_s: float = 0.0
    status: int | None = None

    @property
    def delivered(self) -> bool:
        return self.outcome.ok


_REDIRECTS = frozenset({301, 302, 303, 307, 308})
METADATA_BODY_MAX = 32 << 20
ERROR_BODY_MAX = 64 << 10


@define(eq=False)
class IASink:
    """Delivers planned objects to one IA account over an injected treq ``HTTPClient``.

    ``s3_url`` and ``metadata_url`` are the base URLs of a project's delivery config.  Times are
    seconds on ``clock``.  The sink holds no per-object state; attempts may run concurrently.
    """

    _http: HTTPClient
    _clock: IReactorTime
    _credentials: Credentials
    _s3_url: str
    _metadata_url: str
    check_limit: bool = True
    no_progress_timeout: float = 900.0
    answer_timeout: float = 1800.0
    attempt_timeout: float = 24 * 3600.0
    request_timeout: float = 120.0
    max_redirects: int = 3
    read_size: int = 1 << 20
    user_agent: str = field(factory=_user_agent)

    @classmethod
    def for_delivery(
        cls, delivery: DeliveryConfig, http: HTTPClient, clock: IReactorTime, **kwargs: Any
    ) -> IASink:
        """A sink for one project's delivery config; reads its credentials (blocking)."""
        return cls(
            http,
            clock,
            load_credentials(delivery.credentials),
            delivery.s3_url,
            delivery.metadata_url,
            **kwargs,
        )

    def remote_file(self, plan: ItemPlan) -> Deferred[Lookup]:
        """Look the planned file up in the metadata API (bounded by ``request_timeout``).

        Fires with the :class:`RemoteFile`, ``None`` when the item or the file is absent (or not
        visible yet), or :class:`Unknown` when the lookup failed.  Fails only with
        ``CancelledError`` when cancelled.
        """
        return self.lookup(plan.identifier, plan.remote_name)

    def lookup(self, identifier: str, remote_name: str) -> Deferred[Lookup]:
        """:meth:`remote_file` by name, e.g. for a delivered row's recorded destination."""
        return Deferred.fromCoroutine(self._lookup(identifier, remote_name))

    def deliver(
        self, plan: ItemPlan, path: Path, on_progress: Callable[[int], None] | None = None
    ) -> Deferred[DeliveryResult]:
        """One delivery attempt of the file at ``path`` to ``plan``'s destination.

        Skips the upload when the metadata API already shows the file with the plan's size and
        MD5; probes ``check_limit`` (when enabled); then PUTs the file, streaming, following a few
        redirects.  Fires with a :class:`DeliveryResult` for every I/O outcome, including the
        watchdog, the answer timeout and the ``attempt_timeout`` cap (all transient).
        Cancelling the returned Deferred aborts the transfer; it then fails with
        ``CancelledError`` and nothing is to be recorded but a retry.  ``on_progress(n)`` is
        told about each chunk of payload handed to the connection.
        """
        attempt = _Attempt(self, plan, path, on_progress)
        return attempt.start()

    # -- helpers used by _Attempt ----------------------------------------------------------

    def _redact(self, text: str) -> str:
        return redact(text, self._credentials.secret)

    async def _lookup(self, identifier: str, remote_name: str) -> Lookup:
        url = self._metadata_url.rstrip("/") + "/metadata/" + quote(identifier, safe="")
        started = self._clock.seconds()
        try:
            response = await self._http.get(
                url, headers=self._plain_headers(), unbuffered=True
            ).addTimeout(self.request_timeout, self._clock)
            remaining = max(1.0, self.request_timeout - (self._clock.seconds() - started))
            body, truncated = await read_bounded(
                response, METADATA_BODY_MAX, remaining, self._clock
            )
        except CancelledError:
            raise
        except Exception as e:
            result: Lookup = Unknown(self._redact(_describe(e, "metadata lookup")))
        else:
            if response.code != 200:
                result = Unknown(f"metadata API answered {response.code}")
            elif truncated:
                result = Unknown(f"metadata API answer is larger than {METADATA_BODY_MAX} bytes")
            else:
                result = parse_metadata(body, remote_name)
        if isinstance(result, Unknown):
            log.warn(
                "metadata lookup for {identifier} failed: {error}",
                identifier=identifier,
                error=result.reason,
            )
        return result

    async def _over_limit(self, plan: ItemPlan) -> bool:
        """True only when ``check_limit`` clearly says over the limit; a failed probe is False."""
        query = (
            "?check_limit=1&accesskey="
            + quote(self._credentials.access, safe="")
            + "&bucket="
            + quote(plan.identifier, safe="")
        )
        url = self._s3_url.rstrip("/") + "/" + query
        try:
            response = await self._http.get(
                url, headers=self._plain_headers(), unbuffered=True
            ).addTimeout(self.request_timeout, self._clock)
            body, _ = await read_bounded(
                response, ERROR_BODY_MAX, self.request_timeout, self._clock
            )
            doc = json.loads(body) if response.code == 200 else None
        except CancelledError:
            raise
        except Exception as e:
            log.warn(
                "check_limit for {identifier} failed, uploading anyway: {error}",
                identifier=plan.identifier,
                error=self._redact(_describe(e, "check_limit")),
            )
            return False
        if not isinstance(doc, dict) or "over_limit" not in doc:
            log.warn(
                "check_limit for {identifier} gave no verdict, uploading anyway",
                identifier=plan.identifier,
            )
            return False
        return doc["over_limit"] not in (0, "0", False, None)

    def _plain_headers(self) -> Headers:
        return Headers({b"user-agent": [self.user_agent.encode("ascii")]})

    def _put_headers(self, plan: ItemPlan, with_auth: bool) -> Headers:
        headers = Headers()
        for name, value in plan.headers:
            headers.addRawHeader(name.encode("ascii"), value.encode("ascii"))
        headers.setRawHeaders(b"user-agent", [self.user_agent.encode("ascii")])
        if with_auth:
            headers.setRawHeaders(b"authorization", [self._credentials.authorization.encode()])
        return headers

    def _keeps_auth(self, url: str) -> bool:
        """Send the secret only to the configured S3 host or IA's own hosts, never in clear."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme != "https" and not _is_loopback(host):
            return False
        own = urlsplit(self._s3_url).hostname or ""
        return host == own or host == "archive.org" or host.endswith(".archive.org")


def _describe(error: BaseException, what: str) -> str:
    """A short text for a network failure, naming Twisted's wrapped reasons."""
    reasons = getattr(error, "reasons", None)
    if reasons:
        inner = "; ".join(
            f"{type(r.value).__name__}: {r.value}" if isinstance(r, Failure) else repr(r)
            for r in reasons
        )
        return _short(f"{what}: {type(error).__name__} ({inner})")
    return _short(f"{what}: {type(error).__name__}: {error}")


def _local_failure(error: BaseException) -> LocalFileError | None:
    """The LocalFileError inside a RequestGenerationFailed, if the body producer failed."""
    if isinstance(error, LocalFileError):
        return error
    for reason in getattr(error, "reasons", None) or ():
        if isinstance(reason, Failure) and isinstance(reason.value, LocalFileError):
            return reason.value
    return None


@define(eq=False)
class _Attempt:
    """One run of :meth:`IASink.deliver`: owns the timers and the in-flight Deferred."""

    _sink: IASink
    _plan: ItemPlan
    _path: Path
    _on_progress: Callable[[int], None] | None = None
    _current: Deferred[Any] | None = None
    _abort_reason: str | None = None
    _cancelled: bool = False
    _cap: IDelayedCall | None = None
    _watchdog: IDelayedCall | None = None
    _answer: IDelayedCall | None = None
    _bytes_sent: int = 0
    _put_sent: int = 0
    _started: float = 0.0
    _outer: Deferred[DeliveryResult] | None = None

    def start(self) -> Deferred[DeliveryResult]:
        clock = self._sink._clock
        self._started = clock.seconds()
        self._outer = Deferred(self._cancel)
        self._cap = clock.callLater(
            self._sink.attempt_timeout,
            self._abort,
            f"attempt exceeded {self._sink.attempt_timeout:g}s",
        )
        inner = Deferred.fromCoroutine(self._run())
        inner.addBoth(self._finish)
        return self._outer

    def _finish(self, result: DeliveryResult | Failure) -> None:
        self._stop_timers()
        outer = self._outer
        assert outer is not None
        if outer.called:
            # Cancelled: the caller already got CancelledError.
            if isinstance(result, Failure) and not result.check(CancelledError):
                log.failure("cancelled delivery attempt ended badly", result)
            return
        if isinstance(result, Failure):
            outer.errback(result)
        else:
            outer.callback(result)

    def _stop_timers(self) -> None:
        for call in (self._cap, self._watchdog, self._answer):
            if call is not None and call.active():
                call.cancel()
        self._cap = self._watchdog = self._answer = None

    def _cancel(self, outer: Deferred[DeliveryResult]) -> None:
        self._cancelled = True
        self._stop_timers()
        if self._current is not None:
            self._current.cancel()

    def _abort(self, reason: str) -> None:
        if self._abort_reason is None:
            self._abort_reason = reason
        if self._current is not None:
            self._current.cancel()

    async def _wait(self, d: Deferred[T]) -> T:
        self._current = d
        try:
            return await d
        finally:
            self._current = None

    def _interrupted(self) -> DeliveryResult | None:
        if self._cancelled:
            raise CancelledError()
        if self._abort_reason is not None:
            return self._result(Outcome(Verdict.TRANSIENT, self._abort_reason))
        return None

    def _result(self, outcome: Outcome, **kwargs: Any) -> DeliveryResult:
        return DeliveryResult(
            outcome=Outcome(
                outcome.verdict, self._sink._redact(outcome.reason), outcome.retry_after
            ),
            bytes_sent=self._bytes_sent,
            duration_s=self._sink._clock.seconds() - self._started,
            **kwargs,
        )

    async def _run(self) -> DeliveryResult:
        sink, plan = self._sink, self._plan
        try:
            remote = await self._wait(sink.remote_file(plan))
        except CancelledError:
            remote = Unknown("lookup cancelled")
        if (stop := self._interrupted()) is not None:
            return stop
        if isinstance(remote, RemoteFile) and remote.matches(plan.size, plan.content_md5):
            log.info(
                "{object_id} is already at {identifier}/{remote_name}; no upload needed",
                object_id=plan.object_id,
                identifier=plan.identifier,
                remote_name=plan.remote_name,
            )
            return self._result(Outcome(Verdict.SUCCESS, "already present"), already_present=True)
        if isinstance(remote, Unknown) and remote.needs_operator:
            return self._result(Outcome(Verdict.OPERATOR, remote.reason))
        if sink.check_limit:
            try:
                over = await self._wait(Deferred.fromCoroutine(sink._over_limit(plan)))
            except CancelledError:
                over = False
            if (stop := self._interrupted()) is not None:
                return stop
            if over:
                log.warn(
                    "IA says the account is over its limit; not uploading",
                    identifier=plan.identifier,
                )
                return self._result(
                    Outcome(Verdict.TRANSIENT, "503 SlowDown: check_limit reports over_limit")
                )
        url = sink._s3_url.rstrip("/") + plan.path
        for _hop in range(sink.max_redirects + 1):
            answer = await self._put_once(url)
            if isinstance(answer, DeliveryResult):
                return answer
            status, headers, excerpt = answer
            location = headers.get("location")
            if status in _REDIRECTS and location:
                target = urljoin(url, location)
                if urlsplit(target).scheme not in ("http", "https"):
                    break
                log.info(
                    "PUT for {identifier} redirected ({status})",
                    identifier=plan.identifier,
                    status=status,
                )
                url = target
                continue
            outcome = classify(status, headers, excerpt)
            if outcome.ok:
                log.info(
                    "uploaded {object_id} to {identifier}/{remote_name}",
                    object_id=plan.object_id,
                    identifier=plan.identifier,
                    remote_name=plan.remote_name,
                    size=plan.size,
                    duration_s=sink._clock.seconds() - self._started,
                )
            else:
                log.warn(
                    "PUT of {object_id} to {identifier} failed: {error}",
                    object_id=plan.object_id,
                    identifier=plan.identifier,
                    error=sink._redact(outcome.reason),
                    needs_operator=outcome.needs_operator,
                )
            return self._result(outcome, status=status)
        return self._result(Outcome(Verdict.TRANSIENT, "too many redirects"))

    async def _put_once(self, url: str) -> DeliveryResult | tuple[int, dict[str, str], bytes]:
        sink, plan = self._sink, self._plan
        try:
            stream = open(self._path, "rb", buffering=0)
        except OSError as e:
            return self._result(Outcome(Verdict.OPERATOR, f"local file unreadable: {e.strerror}"))
        producer: FileProducer | None = None
        try:
            actual = os.fstat(stream.fileno()).st_size
            if actual != plan.size:
                return self._result(
                    Outcome(
                        Verdict.OPERATOR,
                        f"local file is {actual} bytes, its receipt says {plan.size}",
                    )
                )
            producer = FileProducer(
                cast(IO[bytes], stream), plan.size, sink._clock, self._progress, sink.read_size
            )
            self._put_sent = 0
            self._arm(watchdog=True)
            request = sink._http.request(
                "PUT",
                url,
                headers=sink._put_headers(plan, sink._keeps_auth(url)),
                data=producer,
                allow_redirects=False,
                unbuffered=True,
            )
            try:
                response = await self._wait(request)
                # Headers are in: from here on only the answer timer runs.
                self._arm(answer=True)
                body, _ = await self._wait(
                    read_bounded(response, ERROR_BODY_MAX, sink.answer_timeout, sink._clock)
                )
            except Exception as e:
                if (stop := self._interrupted()) is not None:
                    return stop
                local = _local_failure(e)
                if local is not None:
                    return self._result(Outcome(Verdict.OPERATOR, str(local)))
                if not isinstance(
                    e, (ConnectError, DNSLookupError, ConnectionClosed, TimeoutError)
                ) and not type(e).__module__.startswith("twisted.web"):
                    log.failure(
                        "unexpected failure uploading {object_id}",
                        Failure(e),
                        object_id=plan.object_id,
                    )
                return self._result(Outcome(Verdict.TRANSIENT, _describe(e, "PUT")))
            finally:
                self._disarm()
            if (stop := self._interrupted()) is not None:
                return stop
            return response.code, _first_headers(response.headers), body
        finally:
            if producer is not None:
                producer.stopProducing()
            stream.close()

    def _progress(self, n: int) -> None:
        self._bytes_sent += n
        self._put_sent += n
        if self._on_progress is not None:
            self._on_progress(n)
        if self._put_sent >= self._plan.size:
            # The last byte is with the transport: wait for the answer, not for progress.
            self._arm(answer=True)
        elif self._watchdog is not None and self._watchdog.active():
            self._watchdog.reset(self._sink.no_progress_timeout)

    def _arm(self, watchdog: bool = False, answer: bool = False) -> None:
        clock = self._sink._clock
        if watchdog:
            self._disarm()
            timeout = self._sink.no_progress_timeout
            self._watchdog = clock.callLater(
                timeout, self._abort, f"no upload progress for {timeout:g}s"
            )
        if answer and self._answer is None:
            self._disarm(answer=False)
            timeout = self._sink.answer_timeout
            self._answer = clock.callLater(
                timeout, self._abort, f"no answer within {timeout:g}s of the last byte"
            )

    def _disarm(self, answer: bool = True) -> None:
        """Cancel the watchdog, and the answer timer too unless ``answer`` is False."""
        if self._watchdog is not None:
            if self._watchdog.active():
                self._watchdog.cancel()
            self._watchdog = None
        if answer and self._answer is not None:
            if self._answer.active():
                self._answer.cancel()
            self._answer = None
