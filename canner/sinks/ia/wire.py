"""Reading IA's answers (pure): an S3 answer becomes an :class:`Outcome`, a metadata API body a
:class:`Lookup` (``docs/reference/internet-archive.md`` §6 and §7)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping

from attrs import frozen

from canner.sinks.base import Outcome, Verdict

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


def short(text: str, limit: int = REASON_MAX) -> str:
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
        reason = f"{status}" + (f": {short(text, 120)}" if text.strip() else "")
    reason = short(reason)
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


def failure_class(status: int | None, reason: str) -> str:
    """The class of a failed IA attempt, for metrics and alerts (pure).

    ``forbidden`` (credentials or permissions: an operator must act), ``rate_limited``,
    ``server_error``, ``client_error``, ``local_payload`` or ``network`` (no HTTP answer:
    connection, DNS, timeouts)."""
    if status is None:
        if reason.startswith("local file"):
            return "local_payload"
        if reason.startswith(("503 SlowDown", "429")):
            return "rate_limited"
        if reason.startswith(("401", "403")):
            return "forbidden"
        return "network"
    if status in (401, 403):
        return "forbidden"
    if status in (429, 503):
        return "rate_limited"
    if status >= 500:
        return "server_error"
    if status >= 400:
        return "client_error"
    return "other"
