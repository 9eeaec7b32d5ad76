"""IA item metadata as ``x-archive-meta`` PUT headers (pure).

The rules are ``docs/reference/internet-archive.md``'s.

Keys are checked against what a header can express; values are stripped of what XML forbids and
sent as ``uri(...)`` when they hold anything but printable ASCII.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from urllib.parse import quote

METADATA_KEY = re.compile(r"[a-z][a-z0-9_.-]*")
# Two-digit header index (x-archive-meta01-...): at most 99 values per key.
METADATA_MAX_VALUES = 99


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
