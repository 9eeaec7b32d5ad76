"""The delivery table of ``sink = "internet_archive"``: :class:`IADelivery` and how it is read.

:data:`IA_TABLE` is what :mod:`canner.sinks.registry` registers with the config: the IA-only
keys, their parser and the check of the table against IA's naming rules (``parse_config`` runs
both, so an ``IADelivery`` that exists is valid).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from attrs import field, frozen

from canner.config import (
    ConfigError,
    DeliveryContext,
    DeliveryTable,
    SinkTable,
    http_url,
    metadata_table,
    parse_size,
    string_key,
)
from canner.sinks.plan import check_destination, is_loopback

NAME = "internet_archive"
DEFAULT_MAX_ITEM_BYTES = 10**12
DEFAULT_READBACK_BYTES = 3 * 64 * 1024
# A read-back bigger than this would be a download, not a spot check.
MAX_READBACK_BYTES = 64 << 20
# ``readback_bytes = "all"``: download the whole remote file and compare its MD5.  Kept as the
# string itself, so the resolved config (``canner check-config``) shows what the file says.
READBACK_ALL: Final = "all"
# S3's smallest multipart part (all but the last); IA's S3-like API is assumed to share it.
MIN_PART_SIZE = 5 << 20
DEFAULT_PART_SIZE = 512 << 20
# S3 allows at most this many parts; a bigger file gets bigger parts than configured.
MAX_PARTS = 10_000


@frozen(kw_only=True)
class IADelivery(DeliveryTable):
    """``[projects.<id>.delivery]`` with ``sink = "internet_archive"``: the IA-S3 keys."""

    credentials: Path
    s3_url: str = "https://s3.us.archive.org"
    metadata_url: str = "https://archive.org"
    metadata: Mapping[str, tuple[str, ...]] = field(factory=dict)
    # Payload bytes read back through the download URL before a purge (a few random ranges;
    # 0: none; READBACK_ALL, "all": the whole file, its MD5 compared), and that URL's base.
    readback_bytes: int | Literal["all"] = DEFAULT_READBACK_BYTES
    download_url: str = "https://archive.org"
    # Files of at least this many bytes go up as S3 multipart uploads that resume at the first
    # missing part (None: off, one PUT per file), in parts of multipart_part_size bytes (at
    # least MIN_PART_SIZE, S3's floor for every part but the last).
    multipart_threshold: int | None = None
    multipart_part_size: int = DEFAULT_PART_SIZE
    # The most bytes one item may hold (IA refuses files with a 403 near 1 TiB); a plan that
    # would pass it is refused for an operator, never sent.
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES

    def metadata_templates(self) -> Mapping[str, tuple[str, ...]]:
        return self.metadata

    def item_limit(self) -> int | None:
        return self.max_item_bytes


def parse_ia_delivery(raw: Mapping[str, Any], where: DeliveryContext) -> IADelivery:
    """The IA keys of a delivery table (:class:`ConfigError` naming the key)."""
    name = where.name
    readback = raw.get("readback_bytes", DEFAULT_READBACK_BYTES)
    if readback != READBACK_ALL:
        if isinstance(readback, bool) or not isinstance(readback, int):
            raise ConfigError(
                name + ".readback_bytes", f'must be an integer or "all", not {readback!r}'
            )
        if not 0 <= readback <= MAX_READBACK_BYTES:
            raise ConfigError(
                name + ".readback_bytes",
                f"must be between 0 (no read-back) and {MAX_READBACK_BYTES}, or"
                f' "all", not {readback}',
            )
    threshold = raw.get("multipart_threshold")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1
    ):
        raise ConfigError(
            name + ".multipart_threshold",
            f"must be a positive number of bytes (leave it out: no multipart), not {threshold!r}",
        )
    part_size = raw.get("multipart_part_size", DEFAULT_PART_SIZE)
    if isinstance(part_size, bool) or not isinstance(part_size, int) or part_size < MIN_PART_SIZE:
        raise ConfigError(
            name + ".multipart_part_size",
            f"must be a number of bytes, at least {MIN_PART_SIZE} (5 MiB), not {part_size!r}",
        )
    try:
        max_item_bytes = parse_size(raw.get("max_item_bytes", DEFAULT_MAX_ITEM_BYTES))
    except ValueError as e:
        raise ConfigError(name + ".max_item_bytes", str(e)) from None
    metadata = metadata_table(raw.get("metadata", {}), name + ".metadata")
    credentials = string_key(raw, "credentials", name + ".credentials")
    metadata_url = http_url(
        string_key(raw, "metadata_url", name + ".metadata_url", "https://archive.org"),
        name + ".metadata_url",
    )
    return IADelivery(
        **where.common,
        credentials=(where.base_dir / credentials).resolve(),
        s3_url=http_url(
            string_key(raw, "s3_url", name + ".s3_url", "https://s3.us.archive.org"),
            name + ".s3_url",
        ),
        metadata_url=metadata_url,
        metadata=metadata,
        readback_bytes=readback,
        # archive.org serves both the metadata API and downloads: one base for both by default.
        download_url=http_url(
            string_key(raw, "download_url", name + ".download_url", metadata_url),
            name + ".download_url",
        ),
        multipart_threshold=threshold,
        multipart_part_size=part_size,
        max_item_bytes=max_item_bytes,
    )


def validate_delivery(project_id: str, delivery: IADelivery, mode: str = "identity") -> None:
    """Refuse an IA table whose templates could ever produce an invalid destination
    (:func:`~canner.sinks.plan.check_destination`) or whose URLs would send the secret in the
    clear.  Raises :class:`ConfigError` whose key names the setting."""
    check_destination(project_id, delivery, mode)
    check_urls(project_id, delivery)


def check_urls(project_id: str, delivery: IADelivery) -> None:
    """The secret travels as-is: every IA URL is https, but for loopback test servers."""
    base = f"projects.{project_id}.delivery"
    urls = (
        ("s3_url", delivery.s3_url),
        ("metadata_url", delivery.metadata_url),
        ("download_url", delivery.download_url),
    )
    for key, url in urls:
        parts = urlsplit(url)
        if parts.scheme != "https" and not is_loopback(parts.hostname):
            raise ConfigError(
                f"{base}.{key}",
                "must be https (the LOW authorization header carries the secret as-is); "
                "plain http is allowed only for loopback test servers",
            )


def _check(delivery: DeliveryTable, where: DeliveryContext) -> None:
    # The templates are every sink's (canner.sinks.registry checks them): here, what only IA has.
    assert isinstance(delivery, IADelivery)
    check_urls(where.project_id, delivery)


IA_TABLE = SinkTable(
    name=NAME,
    keys=frozenset(
        {
            "credentials",
            "s3_url",
            "metadata_url",
            "metadata",
            "readback_bytes",
            "download_url",
            "multipart_threshold",
            "multipart_part_size",
            "max_item_bytes",
        }
    ),
    parse=parse_ia_delivery,
    check=_check,
)
