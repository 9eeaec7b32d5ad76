"""Pure tus 1.0.0 header parsing: request headers in, values or :class:`HTTPError` out.

Nothing here does I/O.  Integers are parsed strictly (digits only), ``Upload-Metadata`` strictly
(unique keys, canonical base64, UTF-8 values), and the metadata keys canner needs (``project``,
``checksum``, ``filename``) are checked before an upload is created.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Container, Mapping, Sequence

from attrs import frozen
from twisted.web.http_headers import Headers

from canner.checksum import Checksum, parse_checksum
from canner.web.errors import TUS_VERSION, HTTPError
from canner.web.routing import single_header

TUS_EXTENSIONS = "creation,creation-with-upload"
OFFSET_CONTENT_TYPE = "application/offset+octet-stream"
FILENAME_MAX_BYTES = 1024
_DIGITS = re.compile(r"[0-9]{1,20}")
_METADATA_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_AUTHORITY = re.compile(r"[A-Za-z0-9.:\[\]-]{1,255}")
# 2**63 - 1: the largest offset any filesystem or tus server handles.
_MAX_INT = 9223372036854775807


def parse_strict_int(text: str, name: str) -> int:
    """Digits only (no sign, spaces, underscores), at most 2**63 - 1; else 400 naming the header."""
    if not _DIGITS.fullmatch(text) or int(text) > _MAX_INT:
        raise HTTPError(400, f"{name} must be a non-negative integer in plain digits")
    return int(text)


def check_tus_resumable(headers: Headers) -> None:
    """412 with ``Tus-Version`` unless the client speaks tus 1.0.0."""
    version = single_header(headers, "Tus-Resumable")
    if version != TUS_VERSION:
        raise HTTPError(
            412, "unsupported or missing Tus-Resumable", (("Tus-Version", TUS_VERSION),)
        )


def upload_offset(headers: Headers) -> int:
    """``Upload-Offset`` of a PATCH; 400 when missing or malformed."""
    text = single_header(headers, "Upload-Offset")
    if text is None:
        raise HTTPError(400, "Upload-Offset is required")
    return parse_strict_int(text, "Upload-Offset")


def check_patch_content_type(headers: Headers) -> None:
    """415 unless ``Content-Type`` is ``application/offset+octet-stream``."""
    value = single_header(headers, "Content-Type")
    if value is None or value.split(";")[0].strip().lower() != OFFSET_CONTENT_TYPE:
        raise HTTPError(415, f"Content-Type must be {OFFSET_CONTENT_TYPE}")


def has_upload_body(headers: Headers) -> bool:
    """True when a POST carries creation-with-upload data (by its Content-Type)."""
    value = single_header(headers, "Content-Type")
    return value is not None and value.split(";")[0].strip().lower() == OFFSET_CONTENT_TYPE


def parse_metadata(text: str) -> dict[str, str]:
    """Parse ``Upload-Metadata``: ``key base64,key base64,key``.  400 on any malformed pair.

    Keys must be unique tokens; values canonical base64 (padding optional) of UTF-8 text.
    A key without a value maps to the empty string.
    """
    result: dict[str, str] = {}
    if not text.strip():
        return result
    for pair in text.split(","):
        parts = pair.strip().split(" ")
        if len(parts) > 2 or not _METADATA_KEY.fullmatch(parts[0]):
            raise HTTPError(400, "Upload-Metadata: malformed key/value pair")
        key = parts[0]
        if key in result:
            raise HTTPError(400, f"Upload-Metadata: duplicate key {key!r}")
        value = ""
        if len(parts) == 2:
            encoded = parts[1]
            if not _BASE64.fullmatch(encoded):
                raise HTTPError(400, f"Upload-Metadata: value of {key!r} is not base64")
            try:
                raw = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
                value = raw.decode("utf-8")
            except (binascii.Error, ValueError):
                raise HTTPError(
                    400, f"Upload-Metadata: value of {key!r} is not base64 of UTF-8"
                ) from None
        result[key] = value
    return result


def format_metadata(metadata: Mapping[str, str]) -> str:
    """The ``Upload-Metadata`` header for stored metadata (what HEAD echoes)."""
    return ",".join(
        f"{k} {base64.b64encode(v.encode('utf-8')).decode('ascii')}" if v else k
        for k, v in metadata.items()
    )


@frozen
class Creation:
    """A validated creation request: what a new upload will hold."""

    length: int
    project: str
    checksum: Checksum
    filename: str | None
    metadata: Mapping[str, str]


def parse_creation(headers: Headers, projects: Container[str], max_upload_bytes: int) -> Creation:
    """Validate a creation ``POST``'s headers; raise :class:`HTTPError` before anything is created.

    ``Upload-Length`` is required and positive (400; deferred length is refused), at most
    ``max_upload_bytes`` (413).  Metadata must name a configured ``project`` and a ``checksum``.
    """
    if single_header(headers, "Upload-Defer-Length") is not None:
        raise HTTPError(400, "deferred Upload-Length is not supported")
    length_text = single_header(headers, "Upload-Length")
    if length_text is None:
        raise HTTPError(400, "Upload-Length is required")
    length = parse_strict_int(length_text, "Upload-Length")
    if length == 0:
        raise HTTPError(400, "Upload-Length must be positive: empty artifacts cannot be receipted")
    if length > max_upload_bytes:
        raise HTTPError(413, f"Upload-Length exceeds the maximum of {max_upload_bytes} bytes")
    metadata = parse_metadata(single_header(headers, "Upload-Metadata") or "")
    project = metadata.get("project")
    if not project:
        raise HTTPError(400, "Upload-Metadata must name a project")
    if project not in projects:
        raise HTTPError(400, f"unknown project {project!r}")
    checksum_text = metadata.get("checksum")
    if not checksum_text:
        raise HTTPError(400, "Upload-Metadata must carry checksum blake3:<64 hex>")
    try:
        checksum = parse_checksum(checksum_text)
    except ValueError as e:
        raise HTTPError(400, f"Upload-Metadata checksum: {e}") from None
    filename = metadata.get("filename")
    if filename is not None and len(filename.encode("utf-8")) > FILENAME_MAX_BYTES:
        raise HTTPError(400, f"Upload-Metadata filename exceeds {FILENAME_MAX_BYTES} bytes")
    return Creation(length, project, checksum, filename or None, metadata)


def location(base_url: str | None, forwarded: Sequence[tuple[str, str]], upload_id: str) -> str:
    """The ``Location`` of a new upload.

    ``base_url`` (the configured ``public_url``) wins.  Otherwise ``forwarded`` holds the trusted
    ``X-Forwarded-Proto``/``X-Forwarded-Host`` values (empty unless configured as trusted); with
    both, the Location is absolute.  Otherwise it is path-absolute, ``/files/<id>``: every client
    resolves that to the origin it used, whether it resolves against the creation URL
    (tus-js-client, tuspy) or against its base URL (the Go canner SDK, which turned the relative
    ``./<id>`` into ``/<id>``), so it is right directly, behind a TLS-terminating proxy and on an
    ``ssl:`` listener.  Under a path prefix only ``public_url`` can name the prefix.
    """
    if base_url is not None:
        return f"{base_url}files/{upload_id}"
    values = dict(forwarded)
    scheme, authority = values.get("proto"), values.get("host")
    if scheme and authority:
        if scheme not in ("http", "https") or not _AUTHORITY.fullmatch(authority):
            raise HTTPError(400, "cannot build a Location from the forwarded headers")
        return f"{scheme}://{authority}/files/{upload_id}"
    return f"/files/{upload_id}"
